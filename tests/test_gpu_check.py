"""benchmarks/gpu_check.py runs the GPU code paths' checks through the scripts' own functions; on a machine without
a GPU it runs them on the CPU, which keeps it working until a GPU runs it."""
import os

from conftest import run_script


def test_gpu_check_runs_on_the_cpu():
    result = run_script(script=os.path.join("benchmarks", "gpu_check.py"), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    for check in ("(a) step 1", "(b) reduce_sums and share over gloo: ok", "(c) version 5", "all checks passed"):
        assert check in result.stdout, result.stdout


def test_gpu_check_prints_the_memory_table():
    result = run_script("--estimate_only", script=os.path.join("benchmarks", "gpu_check.py"), timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith("| pythia-")]
    assert [row.split(" | ")[0] for row in rows] == ["| pythia-410m", "| pythia-1b", "| pythia-2.8b"]
