"""The benchmark scripts in their reduced modes: they run and produce their tables and plots (the figures they
measure are in the README, from full runs)."""
import os

from conftest import run_script
from test_end_to_end import read_metrics


def test_async_vs_sync_benchmark_reduced(tmp_path):
    plot = tmp_path / "plot.png"
    result = run_script("--steps", "4", "--warmup_steps", "1", "--cache_dir", str(tmp_path / "model"), "--plot_path",
                        str(plot), script=os.path.join("benchmarks", "async_vs_sync.py"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "speedup=" in result.stdout and "ideal=" in result.stdout and "speedup_vs_sync_hf=" in result.stdout
    assert plot.stat().st_size > 1000


def test_tiny_curves_quick(tiny_dir, tmp_path):
    result = run_script("--quick", "--tiny_dir", tiny_dir, "--plot_dir", str(tmp_path),
                        script=os.path.join("benchmarks", "tiny_curves.py"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "gold win rate" in result.stdout and "perplexity (paper's)" in result.stdout
    for name in ("tiny_demo.png", "tiny_overoptimisation.png"):
        assert (tmp_path / name).stat().st_size > 1000


def test_gpu_check_runs_on_the_cpu():
    """benchmarks/gpu_check.py checks the GPU code paths through the scripts' own functions; without a GPU it runs
    them on the CPU, which keeps it working until a GPU runs it."""
    result = run_script(script=os.path.join("benchmarks", "gpu_check.py"), timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    for check in ("(a) step 1", "(b) reduce_sums and share over gloo: ok", "(c) version 5", "all checks passed"):
        assert check in result.stdout, result.stdout


def test_gpu_check_prints_the_memory_table():
    result = run_script("--estimate_only", script=os.path.join("benchmarks", "gpu_check.py"), timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith("| pythia-")]
    assert [row.split(" | ")[0] for row in rows] == ["| pythia-410m", "| pythia-1b", "| pythia-2.8b"] * 2  # DPO, PPO
    # PPO trains a value model too: each preset needs more than under DPO
    totals = [float(row.split("**")[1].split()[0]) for row in rows]
    assert all(ppo > dpo for dpo, ppo in zip(totals[:3], totals[3:]))


def test_gsm8k_async_vs_sync_quick(gsm8k_dir, tmp_path):
    plot = tmp_path / "plot.png"
    result = run_script("--quick", "--tiny_dir", gsm8k_dir, "--plot_path", str(plot),
                        script=os.path.join("benchmarks", "gsm8k_async_vs_sync.py"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "| async | 1 |" in result.stdout and "| sync | 1 |" in result.stdout and "speed-up" in result.stdout
    assert "| [0, 1] |" in result.stdout and "| [0] |" in result.stdout  # the staleness each schedule produced
    assert plot.stat().st_size > 1000


def test_off_policy_quick(tiny_dir, tmp_path):
    """Two N values for async_dpo.py: the table and both plots come out, every run logged its final gold win rate,
    and N mini-batches per round give the staleness they should (0..N-1 in the first round, N..2N-1 after): N
    mini-batches share one set of generating weights, so staleness climbs within a round."""
    runs = tmp_path / "runs"
    result = run_script("--quick", "--tiny_dir", tiny_dir, "--plot_dir", str(tmp_path), "--runs_dir", str(runs),
                        script=os.path.join("benchmarks", "off_policy.py"))
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith("| dpo |")]
    assert [row.split(" | ")[1:3] for row in rows] == [["1", "0..1"], ["2", "0..3"]], result.stdout
    for name in ("off_policy_frontier.png", "off_policy_by_n.png"):
        assert (tmp_path / name).stat().st_size > 1000
    for n in (1, 2):
        steps, evals = read_metrics(runs / f"dpo_n{n}_seed1", eval_metric="eval/gold_win_rate")
        assert 0 <= evals[-1]["eval/gold_win_rate"] <= 1
        assert len(steps) == 256 // 32
        assert [r["staleness"] for r in steps] == ([0] + [1] * 7 if n == 1 else [0, 1, 2, 3, 2, 3, 2, 3])
        for r in steps:
            position = (r["step"] - 1) % n  # the mini-batch's place in its round
            assert r["staleness"] == (position if r["round"] == 0 else n + position), r
