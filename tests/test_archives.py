"""The archived sweeps (docs/runs/*.tar.xz) reprinted by the benchmarks' own commands, as the docs tell a reader to:
each command reads every run back and starts none, and every figure the docs quote from a sweep (a mean ± its
standard error, a share with its interval) is one the command prints today. What a sweep can only show by running
(a benchmark's run path, its flags reaching the scripts) is checked by one short run each, in test_benchmarks.py and
test_stream_benchmarks.py; three seeds read back check the tables more thoroughly than one quick seed could."""
import functools
import json
import os
import re
import subprocess
import sys
import tarfile

import pytest
from conftest import REPO

# The reprints, all in one process (one import of torch, transformers and matplotlib instead of one each: ~30 s less
# on one core), each benchmark run as its command runs it (its own __main__, its flags in sys.argv), its output and
# exit code kept apart. A benchmark run under this guard starts no process (but matplotlib's font lookup): a reprint
# that would run a configuration (a run missing from the archive, a command that names another sweep) fails instead
# of training.
GUARD = """
import contextlib, io, json, runpy, sys, traceback
def refuse(event, args):
    if event == "subprocess.Popen" and "fc-list" not in str(args[1]):
        raise RuntimeError(f"a reprint started a process: {args[1]}")
sys.addaudithook(refuse)
commands, results = json.load(open(sys.argv[1])), {}
for name, argv in commands.items():
    out, err, code = io.StringIO(), io.StringIO(), 0
    sys.argv = argv
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(argv[0], run_name="__main__")
        except SystemExit as stop:  # (as the interpreter ends: None is 0, a message goes to stderr with code 1)
            code = stop.code if isinstance(stop.code, int) else 0 if stop.code is None else 1
            if not isinstance(stop.code, (int, type(None))):
                print(stop.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
            code = 1
    results[name] = [code, out.getvalue(), err.getvalue()]
print(json.dumps(results))
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
    "compute_optimal, the confirmation": ("compute_optimal_confirm", "compute_optimal.py", ("--confirm",)),
    "scaling": ("scaling", "scaling.py", ("--reprint",)),
    "gsm8k": ("gsm8k_async_vs_sync", "gsm8k_async_vs_sync.py", ()),
    "gsm8k, five seeds": ("gsm8k_async_vs_sync", "gsm8k_async_vs_sync.py", ("--seeds", "1", "2", "3", "4", "5")),
    "lora": ("lora", "lora.py", ("--tables", "learning")),
    "fully_async, table 1": ("fully_async_schedules", "fully_async.py", ("--tables", "1")),
    "fully_async, tables 2-4": ("fully_async", "fully_async.py", ("--tables", "2", "3", "4")),
    "fully_async, the speed rerun": ("fully_async_speed", "fully_async.py", ("--tables", "5")),
    "agentic": ("agentic", "agentic.py", ()),
    "agentic, the demo": ("agentic", "agentic.py", ("--demo",)),
    "capacity": ("capacity", "capacity.py", ()),
    "drop_bias": ("drop_bias", "drop_bias.py", ()),
    "drop_bias, the pilot": ("drop_bias", "drop_bias.py", ("--pilot",)),
    "staleness_by_calls, the pilot": ("staleness_by_calls", "staleness_by_calls.py", ("--pilot",)),
    "compute_optimal, the confirmation's power": ("compute_optimal", "compute_optimal.py", ("--confirm_power",)),
    "fully_async, the speed's precision": ("fully_async_schedules", "fully_async.py", ("--speed_precision",)),
}
# (doc, heading): the reprints whose figures its section quotes
SECTIONS = {
    ("results.md", "The five-seed results"): ["off_policy, five seeds", "compute_optimal, five seeds",
                                              "compute_optimal, the confirmation", "gsm8k, five seeds",
                                              "fully_async, table 1"],
    ("results.md", "Off-policy tolerance"): ["off_policy"],
    ("results.md", "Why Online DPO tolerates stale data"): ["DPO's controls", "CoPG at lr 3e-4", "CoPG at lr 1e-3"],
    ("results.md", "Sizes against stale data"): ["scaling"],
    ("results.md", "Which knob for which bottleneck"): ["compute_optimal", "compute_optimal, five seeds"],
    ("results.md", "Fully asynchronous schedules"): ["fully_async, table 1", "fully_async, tables 2-4"],
    ("fully_async.md", "The schedules measured"): ["fully_async, table 1", "fully_async, tables 2-4", "drop_bias",
                                                   "fully_async, the speed rerun"],
    ("agentic.md", "Results"): ["agentic", "agentic, the demo"],
    ("gsm8k.md", "GSM8k"): ["gsm8k", "gsm8k, five seeds"],
    ("lora.md", "Measured"): ["lora"],
    ("drop_bias.md", "The result"): ["drop_bias", "drop_bias, the pilot"],
    ("results.md", "What was found"): ["off_policy, five seeds", "off_policy", "DPO's controls"],
    ("../README.md", "What it found"): ["off_policy, five seeds"],
}
# Figures these sections quote from sweeps whose runs were not kept (said so beside each)
NOT_ARCHIVED = {"0.017 ± 0.002", "0.030 ± 0.013", "0.035 ± 0.004", "0.329 ± 0.010", "0.331 ± 0.015"}
FIGURE = re.compile(r"\d+(?:\.\d+)?(?:e[-+]?\d+)? ± \d+(?:\.\d+)?(?:e[-+]?\d+)?|-?\d+% \(-?\d+% to -?\d+%\)"
                    r"|\d+\.\d+x, 95% interval \d+\.\d+x to \d+\.\d+x|combined p = \d\.\d+"
                    r"|one-sided 95% lower bound [-+]\d\.\d+|pooled over the \d+ \(k, m\) cells")


@functools.cache
def unpacked(archive: str, folder: str) -> str:
    """The archive's sweep folder, unpacked once per test worker."""
    with tarfile.open(os.path.join(REPO, "docs", "runs", f"{archive}.tar.xz")) as tar:
        tar.extractall(folder, filter="data")
    return os.path.join(folder, archive)


@functools.cache
def reprints(folder: str) -> dict:
    """{name: (exit code, stdout, stderr)} of every reprint, its runs read from the unpacked archives; none may start
    a process."""
    commands = {}
    for name, (archive, benchmark, flags) in REPRINTS.items():
        plots = ("--plot_path", os.path.join(folder, "plot.png")) if benchmark == "gsm8k_async_vs_sync.py" else (
            () if benchmark in ("lora.py", "staleness_by_calls.py") else ("--plot_dir", folder))
        commands[name] = [os.path.join(REPO, "benchmarks", benchmark), *flags, "--runs_dir",
                          unpacked(archive, folder), *plots]
    listed = os.path.join(folder, "reprints.json")
    with open(listed, "w") as f:
        json.dump(commands, f)
    result = subprocess.run([sys.executable, "-c", GUARD, listed], capture_output=True, text=True, cwd=REPO,
                            timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])


def reprint(name: str, folder: str) -> str:
    """What the reprint `name` prints; it must succeed."""
    code, stdout, stderr = reprints(folder)[name]
    assert code == 0, f"{name}: {stderr[-3000:]}"
    return stdout


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
    """Its means ± standard errors and shares with their intervals, without their signs (prose says "by 0.016"); a
    speed-up's factor with its interval (on log seconds), a two-stage combined p, a one-sided bound against a
    margin."""
    return FIGURE.findall(text)


@pytest.mark.parametrize("doc, heading", list(SECTIONS))
def test_every_figure_a_section_quotes_is_what_its_archived_sweep_reprints(doc, heading, tmp_path_factory):
    folder = str(tmp_path_factory.getbasetemp() / "reprints")
    printed = set(figure for name in SECTIONS[doc, heading] for figure in figures(reprint(name, folder)))
    quoted = figures(section(doc, heading))
    assert quoted, f"{doc}, {heading}: no figure found (a heading renamed?)"
    missing = [figure for figure in quoted if figure not in printed | NOT_ARCHIVED]
    assert not missing, f"{doc}, {heading}: quoted but not printed by {SECTIONS[doc, heading]}: {missing}"


def table_rows(printed: str, first_cells: tuple) -> dict:
    """The printed table rows starting with these cells (`| a | b |`), by their first cells, their other cells."""
    rows = {}
    for line in printed.splitlines():
        cells = [cell.strip() for cell in line.strip("| ").split(" | ")]
        if line.startswith("| ") and tuple(cells[: len(first_cells[0])]) in first_cells:
            rows.setdefault(tuple(cells[: len(first_cells[0])]), cells[len(first_cells[0]):])
    return rows


def mean_se(values: list[float]) -> str:
    """mean ± standard error over seeds, as the tables print it, worked here from the values."""
    mean = sum(values) / len(values)
    se = (sum((v - mean) ** 2 for v in values) / (len(values) - 1) / len(values)) ** 0.5
    return f"{mean:.3f} ± {se:.3f}"


def test_the_off_policy_tables_say_what_their_runs_did(tmp_path_factory):
    """The Figure 3 sweep's tables against its 81 runs' own metrics, recomputed here: each DPO row's staleness range
    (N mini-batches on one round's weights, a round behind: 0..2N-1), each rule's drop in final gold win rate from
    N = 1 to 64 paired by seed, and the training reward's eighths of a run (first, lowest, last: the lowest
    eighth is where a collapse recovered from before the final evaluation would show); the correction's weights
    summarised; DPO's controls with a lag and their tied prompts' share, CoPG with a lag and no ties."""
    import json

    folder = str(tmp_path_factory.getbasetemp() / "reprints")
    printed, runs = reprint("off_policy", folder), unpacked("off_policy", folder)

    def steps(name: str) -> list:
        return [r for r in map(json.loads, open(os.path.join(runs, name, "metrics.jsonl"))) if "staleness" in r]

    def final(name: str) -> float:
        return [r for r in map(json.loads, open(os.path.join(runs, name, "metrics.jsonl")))
                if "eval/gold_win_rate" in r][-1]["eval/gold_win_rate"]

    main = table_rows(printed, tuple(("dpo", str(n)) for n in (1, 2, 4, 8, 16, 32, 64)))
    for (_, n), cells in main.items():
        staleness = [r["staleness"] for s in (1, 2, 3) for r in steps(f"dpo_n{n}_seed{s}")]
        assert cells[0] == f"{min(staleness)}..{max(staleness)}" == f"0..{2 * int(n) - 1}", (n, cells)
    drops = table_rows(printed.split("The drop in gold win rate")[1], (("dpo",), ("ppo",), ("rloo",)))
    for rule in ("dpo", "ppo", "rloo"):
        drop = [final(f"{rule}_n64_seed{s}") - final(f"{rule}_n1_seed{s}") for s in (1, 2, 3)]
        assert drops[rule,][0].startswith(("+" if sum(drop) >= 0 else "-") + mean_se(drop).lstrip("-")), drops
    eighths = table_rows(printed.split("each eighth of its steps")[1], (("dpo", "1"), ("dpo", "64")))
    for (_, n), cells in eighths.items():
        by_seed = []
        for seed in (1, 2, 3):
            rewards = [r["reward/mean"] for r in steps(f"dpo_n{n}_seed{seed}")]
            cuts = [i * len(rewards) // 8 for i in range(9)]
            by_seed.append([sum(rewards[a:b]) / (b - a) for a, b in zip(cuts, cuts[1:])])
        expected = [mean_se([e[0] for e in by_seed]), mean_se([min(e) for e in by_seed]),
                    mean_se([e[-1] for e in by_seed])]
        assert cells == expected, (n, cells, expected)
    assert "rloo N = 16: w from " in printed and "ppo N = 64: w from " in printed
    controls = reprint("DPO's controls", folder) + reprint("CoPG at lr 3e-4", folder)
    for name in ("bo2_sft", "dpo_no_reference", "dpo_linear", "copg"):
        cells = table_rows(controls, ((name, "16"),))[name, "16"]
        lag_kl, update = (float(cell.split(" ± ")[0]) for cell in cells[6:8])
        assert lag_kl > 0 and update > 0 and cells[8].endswith("%") == (name != "copg"), (name, cells)


def test_every_number_of_the_capacity_models_rerun_is_what_its_archive_reprints(tmp_path_factory):
    """The capacity model's archived pilots, checks and engine runs (docs/fully_async.md, its rerun): every number
    its list of results states (a coefficient, a prediction, a measurement with its spread) is one the command prints
    from the archive (the simulation is seeded: the same pilots give the same predictions)."""
    printed = reprint("capacity", str(tmp_path_factory.getbasetemp() / "reprints"))
    stated = "\n".join(line for line in section("fully_async.md", "The pilots rerun and archived").split("\n- ")[1:])
    stated = stated.split("\n\n")[0]  # (the list; the comparisons with the earlier, unarchived run follow it)
    numbers = re.findall(r"\d+\.\d+", stated)
    assert len(numbers) > 30, stated
    assert [n for n in numbers if n not in printed] == [], stated


# What each reprint prints besides its figures: its tables and statistics (a table dropped or renamed fails here)
PRINTED = {
    "fully_async, table 1": ["1. The schedules", "k = 2, drop (room 2(k+1)B)", "against k = 0: pass@1",
                             "without the learner's wait", "the factor on log seconds: ",
                             "Holm over the three pre-registered speed comparisons (3 comparisons"],
    "fully_async, tables 2-4": ["2. Naive", "k = 2, m = 2: naive", "decoupled, m = 2 - m = 1",
                                "naive - decoupled, pooled over the 6 (k, m) cells",
                                "3. In flight against drain-then-reload", "speed-up over drain-then-reload",
                                "the factor on log seconds a step: ",
                                "4. Time to the one-step run's final pass@1", "speed-up to the target"],
    "agentic": ["within-episode", "Q1  turns - atomic at k = 2", "Q2  turns - first_turn at k = 8", "Holm within",
                "Q1's prediction, turns - atomic >= -0.02 at every k"],
    "scaling": ["d_large - d_small on the win rate (proxy-small, tuned; the hypothesis predicts > 0): ",
                "Holm within this table", "KL(pi || pi_SFT) at the last step", "lag-matched learning rates"],
    "gsm8k": ["| async | 1 | new problems, seen facts |", "| async | 1 | unseen facts |", "| [0, 1] |", "| [0] |",
              "async - sync, pass@1 after, unseen facts (paired by seed)", "speed-up", "Phase times",
              "on log seconds"],
    "lora": ["Table 3a", "<- picked", "LoRA - full: "],
    "drop_bias": ["| k = 2, drop |", "The bias against `pace`'s, paired by seed (primary: k = 2, drop",
                  "Holm over the four registered bias comparisons (4 comparisons", "k = 2, drop / pace: ",
                  "3+ against pace: "],
    "drop_bias, the pilot": ["drop - pace, paired: mean -0.0841, SD 0.0103"],
    "fully_async, the speed rerun": ["5. The speed rerun on fresh seeds [11, 12, 13, 14, 15, 16]",
                                     "Holm over the same three on log seconds (3 comparisons, 5% family-wise): 3 "
                                     "survive"],
    "staleness_by_calls, the pilot": [
        "learning rate 0.0001, k = 0, seed 101: pass@1 0.583 (gain +0.035)",
        "learning rate 0.0003, k = 0, seed 101: pass@1 0.545 (gain -0.002)",
        "learning rate 0.001, k = 0, seed 101: pass@1 0.043 (gain -0.505)",
        "greedy pass@1 every 48 steps: 0: 0.547, 48: 0.552, 96: 0.583, 144: 0.570, 192: 0.610, 240: 0.585, 288: "
        "0.583, 336: 0.605, 384: 0.595; the best gain +0.062",
        "K = 8 at 0.0001 for 96 steps of 16 groups (k = 0, seed 101): pass@1 0.595 (gain +0.047); by calls 1 / 2 / "
        "4: 0.814 / 0.720 / 0.295",
        "K = 8 at 0.0001 for 384 steps of 16 groups (k = 0, seed 101), greedy pass@1 every 48 steps: 0: 0.547, 48: "
        "0.575, 96: 0.595, 144: 0.568, 192: 0.580, 240: 0.600, 288: 0.585, 336: 0.603, 384: 0.603; the best gain "
        "+0.055",
        "K = 8 at 0.0002 for 384 steps of 16 groups (k = 0, seed 101), greedy pass@1 every 48 steps: 0: 0.547, 48: "
        "0.580, 96: 0.573, 144: 0.613, 192: 0.603, 240: 0.588, 288: 0.585, 336: 0.542, 384: 0.573; the best gain "
        "+0.065",
        "the design is not registered"],
    "compute_optimal": ["| generation-bound | T = 2 |", "| training-bound | async K = 4 |",
                        "generation / training ", "'s regime: ", "the sampled KL(pi || SFT) where the gold win rate",
                        "0 (identical by construction: the same SFT samples at either schedule; not judged)"],
    "compute_optimal, the confirmation": [
        "T = 2 - T = 1: +0.076 ± 0.018 (t = 4.3, threshold 2.37: passes; 95% interval +0.035 to +0.118); p = 0.0034; "
        "Holm: survives: confirmed", "K = 4 - K = 2, full lr and episodes: +0.014 ± 0.006 (t = 2.3, threshold 2.37: "
        "inconclusive; 95% interval -0.000 to +0.029); p = 0.0549; Holm: does not survive: not confirmed"],
    "compute_optimal, five seeds": ["judged by the two-stage combination", "Holm over the two (5% family-wise)",
                                    "K = 4 - K = 2, full lr and episodes: seeds"],
}


# (doc, heading, the command a design's analysis quotes: its per-seed figures and each n's figure, printed today)
ANALYSES = {("results.md", "The five-seed results", "--confirm_power"): "compute_optimal, the confirmation's power",
            ("fully_async.md", "5. The speed-ups rerun", "--speed_precision"): "fully_async, the speed's precision"}
ANALYSIS_FIGURE = re.compile(r"per seed [^;]+|SD \d\.\d+|n = \d+: \d\.\d+")


@pytest.mark.parametrize("doc, heading, command", list(ANALYSES))
def test_a_power_or_precision_analysis_the_docs_quote_is_what_its_command_prints(doc, heading, command,
                                                                                 tmp_path_factory):
    """The block a registration quotes below its command (the figures that sized its seeds) reprints: every per-seed
    list, SD and figure for each n in it is in what the command prints from the archive."""
    lines = section(doc, heading).splitlines()
    start = next(i for i, line in enumerate(lines) if command in line)
    end = next(i for i in range(start + 2, len(lines)) if lines[i].startswith(("- ", "  **")))
    quoted = ANALYSIS_FIGURE.findall(" ".join(" ".join(lines[start + 1: end]).split()))
    folder = str(tmp_path_factory.getbasetemp() / "reprints")
    printed = " ".join(reprint(ANALYSES[doc, heading, command], folder).split())
    assert len(quoted) > 10 and not [figure for figure in quoted if figure not in printed], (quoted, printed[-2000:])


@pytest.mark.parametrize("name", list(PRINTED))
def test_each_reprint_prints_its_tables(name, tmp_path_factory):
    printed = reprint(name, str(tmp_path_factory.getbasetemp() / "reprints"))
    missing = [line for line in PRINTED[name] if line not in printed]
    assert not missing, f"{name}: {missing}\n{printed[-3000:]}"


def archived_steps(tmp_path_factory, archive: str, run: str, key: str = "staleness/max") -> list:
    """Every step record of the archived runs named `run` (each seed's), as lists."""
    import json

    folder = unpacked(archive, str(tmp_path_factory.getbasetemp() / "reprints"))
    names = sorted(name for name in os.listdir(folder) if name.rsplit("seed", 1)[0].rstrip("_") == run)
    assert names, f"{archive}: no run {run}"
    return [[r for r in map(json.loads, open(os.path.join(folder, name, "metrics.jsonl"))) if key in r]
            for name in names]


def test_the_archived_streams_did_what_their_configurations_say(tmp_path_factory):
    """Across the seeds of the streaming sweeps (what each configuration is for, as its runs logged it): `drop`
    with twice the bound's room discards, and trains on nothing staler than k; the naive objective's importance
    weight is 1 at every token (its proximal policy is the sampler); with two optimizer steps a batch the ratio to the
    batch's start departs from 1 (the clip can act); draining, no completion spans two versions, in flight they do.
    The agentic runs: episode-atomic loads never let an episode span two versions (nor does k = 0), turn-by-turn loads
    do, and every arm keeps the bound from each episode's oldest token."""
    for runs in archived_steps(tmp_path_factory, "fully_async_schedules", "k_2_drop_room_2_k_1_B"):
        assert runs[-1]["rollouts/discarded_total"] > 0 and all(r["staleness/max"] <= 2 for r in runs)
    for runs in archived_steps(tmp_path_factory, "fully_async", "k_2_pace_naive"):
        assert all(r["is/weight_mean"] == 1.0 for r in runs)
    for runs in archived_steps(tmp_path_factory, "fully_async", "k_2_pace_m_2"):
        assert max(r["policy/ratio_max"] for r in runs) > 1 + 1e-4
    for runs in archived_steps(tmp_path_factory, "fully_async", "designed_drain_then_reload"):
        assert all(r["inflight/multi_version_fraction"] == 0 for r in runs)
    for runs in archived_steps(tmp_path_factory, "fully_async", "designed_head_in_flight_recompute"):
        assert max(r["inflight/multi_version_fraction"] for r in runs) > 0
    for arm, k in (("k0", 0), ("atomic_k2", 2), ("atomic_k8", 8)):
        for runs in archived_steps(tmp_path_factory, "agentic", arm):
            assert all(r["staleness/within_episode_max"] == 0 and r["staleness/max"] <= k for r in runs), arm
    for arm, k in (("turns_k2", 2), ("turns_k8", 8), ("first_turn_k2", 2)):
        for runs in archived_steps(tmp_path_factory, "agentic", arm):
            assert max(r["staleness/within_episode_max"] for r in runs) >= 1, arm
            assert all(r["staleness/max"] <= k for r in runs), arm



def test_the_archived_compute_optimal_runs_did_what_their_rows_say(tmp_path_factory):
    """The compute-optimal sweep's runs, every seed: K = 4 (best against worst of four) has a pair at every step, its
    median margin positive; K = 2 may tie (a step with no pair logs NaN), but its pairs' margins are positive too;
    T = 2 takes two optimizer steps on each round's batch."""
    import math

    for runs in archived_steps(tmp_path_factory, "compute_optimal", "training-bound_async_K4", "reward/margin_median"):
        assert all(r["reward/margin_median"] > 0 for r in runs)  # (NaN fails it)
    for runs in archived_steps(tmp_path_factory, "compute_optimal", "training-bound_async_K2", "reward/margin_median"):
        assert all(r["reward/margin_median"] > 0 for r in runs if not math.isnan(r["reward/margin_median"]))
    for runs in archived_steps(tmp_path_factory, "compute_optimal", "generation-bound_T2", "round"):
        assert [r["round"] for r in runs] == [i // 2 for i in range(len(runs))]
