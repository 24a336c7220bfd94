"""The fully asynchronous twin's benchmarks in their reduced modes (a file of their own, so that the two test
workers can balance it against test_benchmarks.py): they run, produce their tables and plots, and the capacity
model's simulation gives the answers worked by hand."""
import json
import os
import random
import shutil
import signal
import tarfile

import pytest
from conftest import REPO, run_script

from benchmarks import capacity


@pytest.mark.slow
def test_fully_async_demo_quick(chains_dir, tmp_path):
    """The demo benchmark's short run, read from its folder: no group trained on is staler than k = 2, none
    discarded; a second invocation reads the finished run instead of running it again."""
    command = ("--quick", "--runs_dir", str(tmp_path / "runs"), "--plot_dir", str(tmp_path))
    result = run_script(*command, script=os.path.join("benchmarks", "fully_async_demo.py"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "gain from SFT" not in result.stdout and "staleness {" in result.stdout  # (one seed: no t-statistic)
    steps = [r for r in map(json.loads, open(tmp_path / "runs" / "demo_seed1" / "metrics.jsonl"))
             if "staleness/max" in r]
    assert len(steps) == 6 and max(r["staleness/max"] for r in steps) <= 2
    assert steps[-1]["rollouts/discarded_total"] == 0
    assert (tmp_path / "fully_async_demo.png").stat().st_size > 1000
    again = run_script(*command, script=os.path.join("benchmarks", "fully_async_demo.py"))
    assert again.returncode == 0 and " ..." not in again.stdout, again.stdout


@pytest.mark.slow
def test_fully_async_one_run(chains_dir, tmp_path):
    """The schedules benchmark's short run (the tables, on the archived sweeps: test_archives.py), the one
    configuration no archive holds: `drop` at the default room discards nothing (the room is the bound:
    docs/fully_async.md), no group trained on is staler than k = 2, and with one optimizer step a batch the clip never
    acts (recompute: the ratio to the batch's start is 1); table 1 and the plot come out."""
    result = run_script("--quick", "--tables", "1", "--runs_dir", str(tmp_path), "--plot_dir", str(tmp_path),
                        script=os.path.join("benchmarks", "fully_async.py"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "1. The schedules" in result.stdout and "k = 2, drop (default room)" in result.stdout, result.stdout
    steps = [r for r in map(json.loads, open(tmp_path / "k_2_drop_default_room__seed1" / "metrics.jsonl"))
             if "staleness/max" in r]
    assert len(steps) == 4 and all(r["staleness/max"] <= 2 for r in steps)
    assert steps[-1]["rollouts/discarded_total"] == 0 and steps[-1]["rollouts/accepted_total"] == 4 * 16
    assert all(r["policy/clipfrac"] == 0 for r in steps)  # (m = 1, recompute)
    assert (tmp_path / "fully_async.png").stat().st_size > 1000


def test_the_capacity_model_worked_by_hand():
    """The simulation on rates chosen so that its answer is known: k = 0 with every completion 10 tokens long and an
    engine step of a constant 10 ms, a batch costs c (its load: none for the first, the SFT weights are in place) +
    10 a to sample and d + e x padded tokens to train (64 completions at 20 + 10 tokens), taken in turn (nothing
    overlaps), so a step takes their sum, each side idle while the other works. With k = 2 the two overlap: a step
    takes the slower side's time, the faster side idles, and under `pace` staleness never passes 2 (the simulation
    raises if it does). The proximal pass costs p a padded token under `recompute` only; m = 2 adds a d."""
    rates = dict(a=0.01, b=0.0, c=0.05, f=0.0, d=0.1, e=0.001, p=0.0005, groups=[(20, [10] * 4)], num_samples=4)
    padded = 16 * 4 * (20 + 10)
    train = 0.1 + (0.001 + 0.0005) * padded
    synchronous = capacity.simulate(rates, capacity.Setting(k=0, groups=16, steps=10))
    sampling = 10 * 0.01 + 9 * (0.05 + 10 * 0.01)  # (the first batch without a load)
    assert synchronous["seconds_a_step"] == pytest.approx((sampling + 10 * train) / 10)
    assert synchronous["learner_idle"] == pytest.approx(sampling / (sampling + 10 * train))
    assert synchronous["staleness"] == 0 and synchronous["discarded"] == 0
    overlapped = capacity.simulate(rates, capacity.Setting(k=2, groups=16, steps=40))
    assert overlapped["seconds_a_step"] == pytest.approx(train, rel=0.05)  # (training is the slower side)
    assert overlapped["generator_idle"] > 0.5 and overlapped["learner_idle"] < 0.1
    assert 1.5 < overlapped["staleness"] <= 2
    behaviour = capacity.simulate(rates, capacity.Setting(k=2, groups=16, steps=40, proximal="behaviour",
                                                          mini_batches=2))
    assert behaviour["seconds_a_step"] == pytest.approx(0.2 + 0.001 * padded, rel=0.05)


def test_the_capacity_model_with_two_engines_worked_by_hand():
    """Generation the slower side, an engine step costing 1 ms a running sequence (b) and nothing else: a step's 64
    completions of 10 tokens cost 0.64 s on one engine. Two engines of the same speed (each a GPU of its own),
    each holding at most half the stream's room: under `drop` each samples half, 0.32 s a step (within 10%: a
    version's load waits for the engine's own groups only, and the two engines' waves do not align exactly). Under
    `pace` no: an engine that has loaded a newer version may not admit while the other's older groups run (the
    bound counts the oldest version running anywhere), so it idles, and two engines do not halve the step (the
    simulation raises if a group passes k)."""
    rates = dict(a=0.0, b=0.001, c=0.0, f=0.0, d=0.001, e=0.0, p=0.0, groups=[(20, [10] * 4)], num_samples=4)

    def simulate(engines: int, policy: str) -> dict:
        return capacity.simulate(rates, capacity.Setting(k=2, groups=16, steps=40, engines=engines, policy=policy,
                                                         engine_speed=1.0, learner_speed=1.0))

    assert simulate(1, "pace")["seconds_a_step"] == pytest.approx(0.64, rel=0.02)
    assert simulate(1, "drop")["seconds_a_step"] == pytest.approx(0.64, rel=0.02)
    drop, pace = simulate(2, "drop"), simulate(2, "pace")
    assert drop["seconds_a_step"] == pytest.approx(0.32, rel=0.1) and drop["generator_idle"] < 0.05
    assert pace["seconds_a_step"] > 1.5 * drop["seconds_a_step"] and pace["generator_idle"] > 0.3
    assert pace["staleness"] <= 2


@pytest.mark.parametrize("case", ["idle engines", "long load"])
def test_the_capacity_model_ends_whatever_the_fitted_rates(case):
    """Rates a noisy pilot fit can give (a coefficient fitted to 0, a load of seconds) with several engines: the
    simulation ends with the bound kept. Before the fix, two idle engines woke each other a nanosecond apart forever
    (`idle engines`: capacity.py --quick hung in CI this way), and an engine that spent 24 s loading admitted by the
    versions published before its load and reported a deadlock (`long load`)."""
    rates, engines, learner_speed = {
        "idle engines": (dict(a=0.01, b=0.0005, c=0.1, f=0.0, d=0.0, e=0.0, p=0.0003), 6, 2.0),
        "long load": (dict(a=0.015, b=0.0, c=24.0, f=0.035, d=0.0, e=0.001, p=0.0), 2, 6.0)}[case]
    draw = random.Random(1)
    groups = [(draw.randint(10, 30), [draw.choice([3, 8, 15, 20, 40, 80]) for _ in range(4)]) for _ in range(50)]
    def hang(*_):
        raise TimeoutError(f"the simulation ({case}) has not ended in 60 s")

    signal.signal(signal.SIGALRM, hang)
    signal.alarm(60)  # (a hang fails the test, not the suite)
    try:
        for seed in range(3):
            result = capacity.simulate({**rates, "groups": groups, "num_samples": 4}, capacity.Setting(
                2, 16, engines=engines, engine_speed=1.0, learner_speed=learner_speed), seed=seed)
            assert result["staleness"] <= 2 and result["seconds_a_step"] > 0
    finally:
        signal.alarm(0)


def test_padded_tokens_are_what_the_learner_computes():
    """Each micro-batch runs at its longest prompt plus its longest completion: two groups of two completions, a
    short group (prompt 10, completions 1 and 3) and a long one (prompt 20, completions 5 and 9): one micro-batch of
    4 is 4 x (20 + 9) = 116 tokens; micro-batches of 2, 2 x (10 + 3) + 2 x (20 + 9) = 84."""
    groups = [(10, [1, 3]), (20, [5, 9])]
    assert capacity.padded_tokens(groups, 4) == 116 and capacity.padded_tokens(groups, 2) == 84


@pytest.mark.slow
def test_capacity_one_run(chains_dir, tmp_path):
    """The capacity model on its archived pilots (the tables, every run read back: test_archives.py), one setting
    run for real and predicted beside measured: its folder taken out of the unpacked archive, the benchmark runs it
    again and reads the rest; the pilots' fit, the grid, the design search, the split table and the plot come out.
    A folder is read back only at the steps it took (its `done` says: a --quick run's 6 is not the sweep's 24)."""
    with tarfile.open(os.path.join(REPO, "docs", "runs", "capacity.tar.xz")) as tar:
        tar.extractall(tmp_path, filter="data")
    runs = tmp_path / "capacity"
    assert capacity.finished(str(runs / "k_8_pace"), 24) and not capacity.finished(str(runs / "k_8_pace"), 6)
    assert not capacity.finished(str(runs / "nothing"), 24)
    shutil.rmtree(runs / "B_4_k_2_drain_then_reload")  # (the cheapest checked: 4 groups a step)
    result = run_script("--runs_dir", str(runs), "--plot_dir", str(tmp_path), "--engine_seeds", "0",
                        script=os.path.join("benchmarks", "capacity.py"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert [line for line in result.stdout.splitlines() if line.endswith(" ...")] == ["B_4_k_2_drain_then_reload ..."]
    for line in ("the pilots (k = 0, B = 4, 16, 24 steps each): an engine step a + b n",
                 "predicted, pace, drain then reload", "by the generator's share of the machine",
                 "where in-flight loads should pay most", "predicted against measured", "model", "real", "error",
                 "the split of 8 GPUs (k = 2, pace", "the model's split: G ="):
        assert line in result.stdout, result.stdout
    assert (tmp_path / "capacity.png").stat().st_size > 1000


@pytest.mark.slow
def test_agentic_one_run(tools_dir, tmp_path):
    """The agentic experiment's short run (the tables, on the archived 30 runs: test_archives.py), its first_turn arm
    at k = 2: mu recomputed under each episode's first turn's version while its turns span versions (the path no
    other test runs: with --episode_atomic it is every token's own), the weights 1 at the first step (every episode
    sampled by the learner's own weights), every group within k = 2; the table, the one-seed line (no comparison
    judged) and the plot; a second invocation reads the run back."""
    command = ("--quick", "--runs_dir", str(tmp_path / "runs"), "--plot_dir", str(tmp_path))
    result = run_script(*command, script=os.path.join("benchmarks", "agentic.py"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "within-episode" in result.stdout and "(one seed: no comparison is judged)" in result.stdout
    assert result.stdout.count(" ...") == 1 and "first_turn_k2_seed1 ..." in result.stdout  # (one run)
    steps = [r for r in map(json.loads, open(tmp_path / "runs" / "first_turn_k2_seed1" / "metrics.jsonl"))
             if "staleness/max" in r]
    assert all(r["staleness/max"] <= 2 for r in steps) and max(r["staleness/within_episode_max"] for r in steps) >= 1
    assert abs(steps[0]["is/weight_mean"] - 1) < 1e-4 and abs(steps[0]["is/weight_max"] - 1) < 1e-3
    assert (tmp_path / "agentic.png").stat().st_size > 1000
    again = run_script(*command, script=os.path.join("benchmarks", "agentic.py"))
    assert again.returncode == 0 and " ..." not in again.stdout, again.stdout


def test_p_values_and_holm_worked_by_hand():
    """Two-sided p of t at the tabled 95% thresholds is 0.05 (df 1, 2, 4); at df 2 it has a closed form,
    1 - t / sqrt(t^2 + 2); zero spread (t infinite) is p 0 and no t is p 1. Holm: p = 0.001, 0.04, 0.01, 0.5 against
    0.05 / 4, / 3, / 2: the first and third survive, then 0.04 > 0.025 stops it."""
    from benchmarks import stats

    for df, t in ((1, 12.706), (2, 4.303), (4, 2.776)):
        assert abs(stats.p_value(t, df) - 0.05) < 1e-4
    assert abs(stats.p_value(1.0, 2) - (1 - 1 / 3 ** 0.5)) < 1e-9
    assert stats.p_value(float("inf"), 2) == 0.0 and stats.p_value(None, 2) == 1.0
    assert stats.holm([0.001, 0.04, 0.01, 0.5]) == [True, False, True, False]
