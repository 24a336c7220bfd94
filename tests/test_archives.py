"""The archived sweeps (docs/runs/*.tar.xz) reprinted by the benchmarks' own commands, as the docs tell a reader to:
each command reads every run back and starts none, and every figure the docs quote from a sweep (a mean ± its
standard error, a share with its interval) is one the command prints today. What a sweep can only show by running
(a benchmark's run path, its flags reaching the scripts) is checked by one short run each, in test_benchmarks.py and
test_stream_benchmarks.py; three seeds read back check the tables more thoroughly than one quick seed could."""
import functools
import os
import re
import subprocess
import sys
import tarfile

import pytest
from conftest import REPO

# A benchmark run under this guard starts no process (but matplotlib's font lookup): a reprint that would run a
# configuration (a run missing from the archive, a command that names another sweep) fails instead of training.
GUARD = """
import runpy, sys
def refuse(event, args):
    if event == "subprocess.Popen" and "fc-list" not in str(args[1]):
        raise RuntimeError(f"a reprint started a process: {args[1]}")
sys.addaudithook(refuse)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""

# name: (archive, benchmark, flags): each the command the docs give for the sweep's tables
REPRINTS = {
    "off_policy": ("off_policy", "off_policy.py", ("--algorithms", "dpo", "ppo", "rloo")),
    "off_policy, five seeds": ("off_policy", "off_policy.py", (
        "--algorithms", "dpo", "ppo", "rloo", "--n_values", "1", "64", "--correction_n_values",
        "--no-recompute_at_largest_n", "--seeds", "1", "2", "3", "4", "5")),
    "DPO's controls": ("off_policy", "off_policy.py", (
        "--algorithms", "dpo", "bo2_sft", "dpo_no_reference", "dpo_linear", "--n_values", "1", "16", "64",
        "--correction_n_values", "--no-recompute_at_largest_n")),
    **{f"CoPG at lr {lr}": ("copg", "off_policy.py", (
        "--algorithms", "rloo", "copg", "--n_values", "1", "16", "--copg_n_values", "1", "16", "--correction_n_values",
        "--no-recompute_at_largest_n", "--total_episodes", "8192", "--learning_rate", lr)) for lr in ("3e-4", "1e-3")},
    "compute_optimal": ("compute_optimal", "compute_optimal.py", ()),
    "compute_optimal, five seeds": ("compute_optimal", "compute_optimal.py", ("--seeds", "1", "2", "3", "4", "5")),
    "scaling": ("scaling", "scaling.py", ("--reprint",)),
    "gsm8k": ("gsm8k_async_vs_sync", "gsm8k_async_vs_sync.py", ()),
    "gsm8k, five seeds": ("gsm8k_async_vs_sync", "gsm8k_async_vs_sync.py", ("--seeds", "1", "2", "3", "4", "5")),
    "lora": ("lora", "lora.py", ("--tables", "learning")),
    "fully_async, table 1": ("fully_async_schedules", "fully_async.py", ("--tables", "1")),
    "fully_async, tables 2-4": ("fully_async", "fully_async.py", ("--tables", "2", "3", "4")),
    "agentic": ("agentic", "agentic.py", ()),
    "agentic, the demo": ("agentic", "agentic.py", ("--demo",)),
}
# (doc, heading): the reprints whose figures its section quotes
SECTIONS = {
    ("results.md", "The five-seed results"): ["off_policy, five seeds", "compute_optimal, five seeds",
                                              "gsm8k, five seeds", "fully_async, table 1"],
    ("results.md", "Off-policy tolerance"): ["off_policy"],
    ("results.md", "Why Online DPO tolerates stale data"): ["DPO's controls", "CoPG at lr 3e-4", "CoPG at lr 1e-3"],
    ("results.md", "Sizes against stale data"): ["scaling"],
    ("results.md", "Which knob for which bottleneck"): ["compute_optimal", "compute_optimal, five seeds"],
    ("results.md", "Fully asynchronous schedules"): ["fully_async, table 1", "fully_async, tables 2-4"],
    ("fully_async.md", "The schedules measured"): ["fully_async, table 1", "fully_async, tables 2-4"],
    ("agentic.md", "Results"): ["agentic", "agentic, the demo"],
    ("gsm8k.md", "GSM8k"): ["gsm8k", "gsm8k, five seeds"],
    ("lora.md", "Measured"): ["lora"],
}
# Figures these sections quote from sweeps whose runs were not kept (said so beside each)
NOT_ARCHIVED = {"0.017 ± 0.002", "0.030 ± 0.013", "0.035 ± 0.004", "0.329 ± 0.010", "0.331 ± 0.015"}
FIGURE = re.compile(r"\d+(?:\.\d+)?(?:e[-+]?\d+)? ± \d+(?:\.\d+)?(?:e[-+]?\d+)?|-?\d+% \(-?\d+% to -?\d+%\)")


@functools.cache
def unpacked(archive: str, folder: str) -> str:
    """The archive's sweep folder, unpacked once per test worker."""
    with tarfile.open(os.path.join(REPO, "docs", "runs", f"{archive}.tar.xz")) as tar:
        tar.extractall(folder, filter="data")
    return os.path.join(folder, archive)


@functools.cache
def reprint(name: str, folder: str) -> str:
    """What the reprint `name` prints, its runs read from the unpacked archive; it must start nothing."""
    archive, benchmark, flags = REPRINTS[name]
    plots = ("--plot_path", os.path.join(folder, "plot.png")) if benchmark == "gsm8k_async_vs_sync.py" else (
        () if benchmark == "lora.py" else ("--plot_dir", folder))
    result = subprocess.run([sys.executable, "-c", GUARD, os.path.join(REPO, "benchmarks", benchmark), *flags,
                             "--runs_dir", unpacked(archive, folder), *plots], capture_output=True, text=True,
                            cwd=REPO, timeout=600)
    assert result.returncode == 0, f"{name}: {result.stderr[-3000:]}"
    return result.stdout


def section(doc: str, heading: str) -> str:
    """A doc's section: from its heading to the next heading of the same level or above."""
    lines = open(os.path.join(REPO, "docs", doc)).read().splitlines()
    start = next(i for i, line in enumerate(lines) if line.lstrip("#").strip().startswith(heading)
                 and line.startswith("#"))
    level = len(lines[start]) - len(lines[start].lstrip("#"))
    end = next((i for i in range(start + 1, len(lines))
                if lines[i].startswith("#") and len(lines[i]) - len(lines[i].lstrip("#")) <= level), len(lines))
    return "\n".join(lines[start:end])


def figures(text: str) -> list[str]:
    """Its means ± standard errors and shares with their intervals, without their signs (prose says "by 0.016")."""
    return FIGURE.findall(text)


@pytest.mark.parametrize("doc, heading", list(SECTIONS))
def test_every_figure_a_section_quotes_is_what_its_archived_sweep_reprints(doc, heading, tmp_path_factory):
    folder = str(tmp_path_factory.getbasetemp() / "reprints")
    printed = set(figure for name in SECTIONS[doc, heading] for figure in figures(reprint(name, folder)))
    quoted = figures(section(doc, heading))
    assert quoted, f"{doc}, {heading}: no figure found (a heading renamed?)"
    missing = [figure for figure in quoted if figure not in printed | NOT_ARCHIVED]
    assert not missing, f"{doc}, {heading}: quoted but not printed by {SECTIONS[doc, heading]}: {missing}"
