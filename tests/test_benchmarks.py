"""The benchmark scripts in their reduced modes: they run and produce their tables and plots (the figures they
measure are in the README, from full runs)."""
import json
import math
import os
import tarfile

import pytest
from conftest import REPO, run_script
from test_end_to_end import read_metrics

from benchmarks import stats


def test_the_derived_figures_worked_by_hand():
    """The benchmarks' statistics: a paired gap judged on the t threshold (4.30 for three seeds, not 2), a gap the
    seeds agree on exactly not judged, and the shares of a gain (kept, recovered): Fieller's interval over the seeds'
    pairs, whose ends are where the paired gap num - r den is exactly at the threshold, which holds 0 exactly when the
    paired gap of the numerator is inconclusive, and is unbounded when the denominator's is."""
    assert stats.t_95(2) == 4.303 and stats.t_95(11) == 2.228 and stats.t_95(40) == 1.96
    # gaps 0.1, 0.2, 0.3: mean 0.2, s.e. 0.1 / sqrt(3), t = 3.46 < 4.30
    result = stats.gap([0.5, 0.6, 0.7], [0.4, 0.4, 0.4])
    assert result["t"] == pytest.approx(2 * math.sqrt(3)) and not result["passes"] and "inconclusive" in result["text"]
    assert stats.gap([0.5, 0.6, 0.7], [0.2, 0.21, 0.2])["passes"]
    same = stats.gap([0.5] * 3, [0.4] * 3)  # (every seed +0.1: no spread, no t)
    assert not same["passes"] and same["t"] is None and "the seeds did not vary" in same["text"]
    # unpaired: 0.6 - 0.4 with standard errors 0.1 / sqrt(3) each: s.e. 0.0816, t = 2.45 at 2 df
    unpaired = stats.unpaired_gap([0.5, 0.6, 0.7], [0.3, 0.4, 0.5])
    assert unpaired["t"] == pytest.approx(0.2 / math.sqrt(2 * 0.01 / 3)) and unpaired["threshold"] == 4.303
    # kept: (0.6 - 0.4) / (0.85 - 0.4) = 0.444; at each end r of the interval, the paired gap (x - b) - r (ref - b)
    # (the baseline's error carried as (1 - r) b) has t exactly 4.303
    values, reference, baseline, baseline_se = [0.5, 0.6, 0.7], [0.75, 0.85, 0.95], 0.4, 0.02
    value, low, high = stats.gain_kept(values, reference, baseline, baseline_se)
    assert value == pytest.approx(0.2 / 0.45) and low < value < high
    for r in (low, high):
        terms = [(x - baseline) - r * (y - baseline) for x, y in zip(values, reference)]
        spread = math.sqrt(stats.mean_and_stderr(terms)[1] ** 2 + ((1 - r) * baseline_se) ** 2)
        assert abs(sum(terms) / 3) / spread == pytest.approx(4.303)
    assert stats.gain_kept([0.6] * 3, [0.4] * 3, 0.4, 0.02) is None  # no gain to keep a share of
    assert stats.gain_kept([0.6] * 3, [0.8] * 3, 0.4, 0.0) == pytest.approx((0.5, 0.5, 0.5))  # (no spread: no width)
    # recovered: the corrected run wins back (0.5 - 0.4) of the loss (0.6 - 0.4): half
    assert stats.recovered([0.5] * 3, [0.4] * 3, [0.6] * 3)[0] == pytest.approx(0.5)
    # wins 0.1, 0.05, 0.15 (t = 3.46: inconclusive) of losses 0.3, 0.35, 0.25: the interval holds 0
    corrected, uncorrected, first = [0.5, 0.55, 0.45], [0.4, 0.5, 0.3], [0.7, 0.85, 0.55]
    assert not stats.gap(corrected, uncorrected)["passes"]
    assert stats.recovered(corrected, uncorrected, first)[1] < 0 < stats.recovered(corrected, uncorrected, first)[2]
    # a loss of 0.01, -0.05, 0.10 (t = 0.6): the share's interval is unbounded
    assert stats.recovered([0.5] * 3, [0.4] * 3, [0.41, 0.35, 0.5])[1:] == (-math.inf, math.inf)
    assert stats.fmt_share(None, "no loss") == "no loss" and stats.fmt_share((0.5, 0.4, 0.6)) == "50% (40% to 60%)"
    assert "unbounded" in stats.fmt_share((0.5, -math.inf, math.inf))
    # Holm within a table: t = 10, 5, 4 and 1 at 2 df (p 0.0099, 0.038, 0.057, 0.42): the first only survives
    rows = [(f"row {t}", stats.judged(t * 0.01, 0.01, 2)) for t in (10, 5, 4, 1)] + [("row x", same)]
    assert stats.holm_line(rows) == "Holm within this table (5 comparisons, 5% family-wise): 1 survives: row 10"


def test_dpo_variants_worked_by_hand():
    """The two losses benchmarks/dpo_variants.py puts in DPO's place: without the reference, the sigmoid of the raw
    log-ratio; without the sigmoid, the margin itself, whose gradient is DPO's at a zero margin twice over, at any
    margin (it never saturates); an unknown variant is refused by name."""
    import torch
    import torch.nn.functional as F

    from async_dpo import dpo_loss
    from benchmarks import dpo_variants

    chosen, rejected, ref = torch.tensor([-1.0]), torch.tensor([-3.0]), torch.tensor([-2.0])
    assert dpo_variants.no_reference_loss(chosen, rejected, ref, ref, 0.5).item() == pytest.approx(
        -F.logsigmoid(torch.tensor(1.0)).item())  # 0.5 * (-1 - -3)
    assert dpo_variants.linear_loss(chosen, rejected, ref, ref, 0.5).item() == pytest.approx(-1.0)  # -0.5 * (1 + 1)
    for margin in (0.0, 20.0):
        x = torch.tensor([margin], requires_grad=True)
        dpo_loss(x, torch.zeros(1), torch.zeros(1), torch.zeros(1), 0.5).backward()
        y = torch.tensor([margin], requires_grad=True)
        dpo_variants.linear_loss(y, torch.zeros(1), torch.zeros(1), torch.zeros(1), 0.5).backward()
        assert y.grad.item() == pytest.approx(-0.5) and abs(x.grad.item()) <= 0.25  # DPO's: 0.25 at 0, ~0 at 20
    with pytest.raises(SystemExit, match="--variant sigmoid: unknown"):
        dpo_variants.pop_variant(["script", "--variant", "sigmoid"])


def test_the_size_statistic_worked_by_hand(capsys):
    """scaling.py's statistic fixed before the runs, on made-up finals: d = win(N = 64) - win(N = 1) per seed for each
    size, its gain kept over the size's own SFT, and d_large - d_small with its t (Welch, 2 df)."""
    from benchmarks import scaling

    def runs(wins: list, sft: float) -> list:  # (the gold score: the win rate plus 0.1, the same d)
        return [dict(final={"eval/gold_win_rate": w, "eval/gold_reward": w + 0.1},
                     sft={"eval/gold_win_rate": sft, "eval/gold_reward": sft + 0.1, "eval/num_prompts": 512})
                for w in wins]
    results = {("small", "small", 1, "default"): runs([0.5, 0.6, 0.7], 0.2),
               ("small", "small", 64, "default"): runs([0.2, 0.3, 0.4], 0.2),  # d = -0.3 each: kept 0.1 / 0.4
               ("large", "small", 1, "default"): runs([0.6, 0.6, 0.6], 0.3),
               ("large", "small", 64, "default"): runs([0.6, 0.5, 0.7], 0.3)}  # d = 0, -0.1, +0.1: kept 100%
    scaling.report_size_statistic(results, "small", "large")
    out = capsys.readouterr().out
    assert "| small | small | default | 0.300 ± 0.000 | -0.300 (the seeds did not vary: not judged) | 25% (" in out
    assert "| large | small | default | 0.400 ± 0.000 | +0.000 ± 0.058 (t = 0.0, threshold 4.30: inconclusive) " \
           "| 100% (" in out
    # d_large - d_small = 0.3, s.e. 0.1 / sqrt(3) (d_small's spread is 0): t = 5.2 > 4.30, on either metric
    for metric in ("win rate", "gold score"):
        assert (f"d_large - d_small on the {metric} (small, default; the hypothesis predicts > 0): +0.300 ± 0.058 "
                "(t = 5.2") in out
    # the lag-matched arm's learning rate: a lag 4x the target's halves the step
    assert scaling.lag_matched_lr(1e-4, 0.04, 0.01) == pytest.approx(5e-5)


def test_the_sampled_kl_at_each_evaluation_worked_by_hand():
    """compute_optimal.py's KL axis: each evaluation's mean `objective/kl` over the steps whose batches the weights
    between the midpoints to its neighbouring evaluations generated; step 0's, version 0's batches alone."""
    from benchmarks import compute_optimal

    steps = [{"generation_version": v, "objective/kl": float(v)} for v in range(11)]
    evals = [{"step": v} for v in (0, 4, 8, 10)]
    # windows [0, 1), [1, 6), [6, 9), [9, inf)
    assert compute_optimal.sampled_kls(steps, evals) == [0.0, 3.0, 7.0, 9.5]
    assert compute_optimal.sampled_kls([{"generation_version": 0}], [{"step": 0}]) == [None]  # not logged
    curve = {"win_rate": [0.3, 0.5, 0.7], "kls": [0.0, 2.0, None]}
    assert compute_optimal.at_level(curve, 0.4, "kls") == pytest.approx(1.0)
    assert compute_optimal.at_level(curve, 0.6, "kls") is None


@pytest.mark.slow
def test_async_vs_sync_benchmark_reduced_and_its_timeline(tmp_path):
    """The async-vs-sync benchmark runs, and benchmarks/timeline.py draws its async and sync runs from the
    `timeline/*` every script logs: the generator's and the learner's phases in order, overlapping only in the
    asynchronous run."""
    plot, runs = tmp_path / "plot.png", tmp_path / "runs"
    # (a smaller model than the benchmark's and shorter completions: the schedule, not the speed, is under test)
    result = run_script("--steps", "4", "--warmup_steps", "1", "--hidden_size", "128", "--num_layers", "2",
                        "--response_length", "32", "--cache_dir", str(tmp_path / "model"), "--plot_path", str(plot),
                        "--runs_dir", str(runs), script=os.path.join("benchmarks", "async_vs_sync.py"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "speedup=" in result.stdout and "ideal=" in result.stdout and "speedup_vs_sync_hf=" in result.stdout
    assert plot.stat().st_size > 1000

    timeline = tmp_path / "timeline.png"
    paths = [str(runs / name / "metrics.jsonl") for name in ("async", "sync-vllm")]
    result = run_script(*paths, "--labels", "async", "sync", "--steps", "2", "4", "--output", str(timeline),
                        script=os.path.join("benchmarks", "timeline.py"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert timeline.stat().st_size > 10000
    regimes = [line for line in result.stdout.splitlines() if ": regime: " in line]
    assert [line.split(":")[0] for line in regimes] == ["async", "sync"], result.stdout
    for path, asynchronous in zip(paths, (True, False)):
        assert_timeline_ordered([json.loads(line) for line in open(path)], asynchronous, num_steps=4)
    # (its --repeats, each configuration run again interleaved, was run by hand: docs/results.md; a bad count stops it
    # before any run, naming the flag)
    result = run_script("--repeats", "0", script=os.path.join("benchmarks", "async_vs_sync.py"))
    assert result.returncode != 0 and "--repeats must be at least 1, got 0" in result.stderr, result.stderr[-3000:]


GENERATOR, LEARNER = ("weight_load", "generation"), ("learner_wait", "weight_sync", "training")


def assert_timeline_ordered(records: list[dict], asynchronous: bool, num_steps: int) -> None:
    rounds = [r for r in records if "timeline/training_start" in r]
    assert [r["step"] for r in rounds] == list(range(1, num_steps + 1))
    for r in rounds:
        span = {phase: (r[f"timeline/{phase}_start"], r[f"timeline/{phase}_end"]) for phase in GENERATOR + LEARNER}
        assert all(0 <= start <= end for start, end in span.values()), span
        assert span["weight_load"][1] <= span["generation"][0]  # the generator loads, then samples
        assert span["weight_sync"][1] <= span["training"][0] and span["learner_wait"][1] <= span["training"][0]
        # the async learner takes the batch, then hands over its weights; the sync one hands them over first
        assert (span["learner_wait"][1] <= span["weight_sync"][0]) == asynchronous
    for previous, current in zip(rounds, rounds[1:]):
        # The next batch's generation starts while this one trains (async), or only after it (sync)
        overlaps = current["timeline/generation_start"] < previous["timeline/training_end"]
        assert overlaps == asynchronous, previous["step"]
    evaluation = [r for r in records if "timeline/evaluation_start" in r]
    assert evaluation and all(r["timeline/eval_generation_start"] <= r["timeline/eval_generation_end"] <=
                              r["timeline/evaluation_start"] <= r["timeline/evaluation_end"] for r in evaluation)


@pytest.mark.slow
def test_tiny_curves_quick(tiny_dir, tmp_path):
    result = run_script("--quick", "--tiny_dir", tiny_dir, "--plot_dir", str(tmp_path),
                        script=os.path.join("benchmarks", "tiny_curves.py"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "gold win rate" in result.stdout and "perplexity (paper's)" in result.stdout
    memory = float(result.stdout.split("generator processes ")[1].split()[0])
    assert 0.3 < memory < 20, result.stdout  # GiB: both processes' models and vLLM, well under the machine's
    for name in ("tiny_demo.png", "tiny_overoptimisation.png"):
        assert (tmp_path / name).stat().st_size > 1000


@pytest.mark.slow
def test_gpu_check_runs_on_the_cpu():
    """benchmarks/gpu_check.py checks the GPU code paths through the scripts' own functions; without a GPU it runs
    them on the CPU, which keeps them working until a GPU runs them: every check in one run (vLLM's first, then the
    learner's, the LoRA preset's learner among them); --learner_only (what a machine without vLLM runs) is the
    learner's checks of that list, read here without a second run. Its (g) times benchmarks/sampling_seeds.py's two
    requests (seed_costs, in an engine built as the scripts build theirs)."""
    import torch

    from benchmarks import gpu_check

    checks = gpu_check.check_list(gpu_check.Args(learner_only=True), torch.device("cpu"))
    assert [name[:3] for name, *_ in checks] == ["(a)", "(i)", "(d)", "(c)", "(c)", "(b,"]
    result = run_script(script=os.path.join("benchmarks", "gpu_check.py"), timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    for check in ("(a) step 1", "(i) step 1", "| (i) the LoRA preset's learner step | pass | cpu-small-llama, ",
                  "(b) the generator's ready taken by every rank", "its error raised on every rank",
                  "reduce_sums over gloo: ok", "(c) version 5", "(e) --fsdp load over 2 ranks: every parameter "
                  "sharded", "lag/kl_token", "(f) the round after the reload", "(g) training round (32 prompts x 2)",
                  "(g) evaluation (128 prompts x 1)", "131,072 bytes handed off",
                  "| (f) in-flight reload, fully_async_grpo.py, (h) two engines | pass | 2 engine(s), ",
                  "| (f) LoRA hand-off between rounds, async_dpo.py --lora_rank 8 | pass |",
                  "gpu_check: 10 of 10 checks passed, 0 skipped"):
        assert check in result.stdout, result.stdout


def test_gpu_check_prints_the_memory_table():
    result = run_script("--estimate_only", script=os.path.join("benchmarks", "gpu_check.py"), timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith("| pythia-")]
    assert [row.split(" | ")[0] for row in rows] == ["| pythia-410m", "| pythia-1b", "| pythia-2.8b"] * 2  # DPO, PPO
    # PPO trains a value model too: each preset needs more than under DPO
    totals = [float(row.split("**")[1].split()[0]) for row in rows]
    assert all(ppo > dpo for dpo, ppo in zip(totals[:3], totals[3:]))
    # the 8B preset's load-time peak on rank 0: every model whole on the GPU first, beside the buffer (the scripts'
    # way before), against sharded as they load
    assert "88.8 GiB if every model went whole to the GPU before sharding" in result.stdout
    assert "12.5 GiB sharded as they load" in result.stdout
    # with LoRA the 8B learner fits one 80 GB GPU beside vLLM's: no reference copy, an adapter's optimizer
    assert "Llama 3.1 8B with LoRA (rank 64 on every linear layer: 168 M parameters" in result.stdout
    assert "micro-batch 2: learner 58.5 GiB" in result.stdout and "saves the reference's 29.9 GiB" in result.stdout


@pytest.mark.slow
def test_lora_benchmark_quick():
    """benchmarks/lora.py --quick: the tiny world's hand-off with and without LoRA, each side's memory."""
    result = run_script("--quick", script=os.path.join("benchmarks", "lora.py"), timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line.split()[2] for line in result.stdout.splitlines() if line.startswith("tiny world ")]
    assert rows == ["all", "LoRA"] * 2, result.stdout  # tables 1 and 2
    assert "tiny world: LoRA's hand-off is 5.96% of the bytes" in result.stdout
    assert "2,199,552" in result.stdout and "131,072" in result.stdout


@pytest.mark.slow
def test_slow_tools_benchmark_quick():
    """benchmarks/slow_tools.py --quick: the tool world's run with a fast calculator and one that sleeps 0.05 s a
    call, its table: tokens per second each, the slow one's overlap (the engine sampled while calls ran)."""
    result = run_script("--quick", script=os.path.join("benchmarks", "slow_tools.py"), timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line.split(" | ") for line in result.stdout.splitlines() if line.startswith("| 0")]
    assert [row[0] for row in rows] == ["| 0", "| 0.05"] and rows[0][2] == "1.00", result.stdout
    assert float(rows[1][3]) > 0.3 and float(rows[1][6].rstrip(" |")) > 0, result.stdout


@pytest.mark.slow
def test_gsm8k_async_vs_sync_one_run(gsm8k_dir, tmp_path):
    """benchmarks/gsm8k_async_vs_sync.py --quick with its asynchronous run read back from the archive (seed 1's, the
    README's demo: its own test, test_gsm8k.py, runs it) and the synchronous one run, short (the tables, on the
    archived sweep: test_archives.py): `gsm8k_async_dpo.py --sync` on-policy at every step, its generator's log-probs
    the learner's, evaluated at the steps asked on both splits; the tables and the plot come out of the two."""
    plot, runs = tmp_path / "plot.png", tmp_path / "runs"
    runs.mkdir()
    with tarfile.open(os.path.join(REPO, "docs", "runs", "gsm8k_async_vs_sync.tar.xz")) as tar:
        tar.extractall(tmp_path, filter="data", members=[m for m in tar.getmembers() if "/async1/" in m.name])
    os.rename(tmp_path / "gsm8k_async_vs_sync" / "async1", runs / "async1")
    result = run_script("--quick", "--tiny_dir", gsm8k_dir, "--plot_path", str(plot), "--runs_dir", str(runs),
                        script=os.path.join("benchmarks", "gsm8k_async_vs_sync.py"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "seed 1: sync ..." in result.stdout and "seed 1: async ..." not in result.stdout  # (one run)
    assert "| async | 1 |" in result.stdout and "| sync | 1 |" in result.stdout and "speed-up" in result.stdout
    assert "| [0, 1] |" in result.stdout and "| [0] |" in result.stdout  # the staleness each schedule produced
    assert "| async | 1 | unseen facts |" in result.stdout  # both evaluation splits
    assert "async - sync, pass@1 after, unseen facts (paired by seed)" in result.stdout
    assert plot.stat().st_size > 1000
    synchronous, evals = read_metrics(runs / "sync1", step_metric="loss/dpo", eval_metric="eval/pass_at_1")
    assert [r["staleness"] for r in synchronous] == [0] * 5
    assert all(abs(r["logps/generator_gap"]) < 1e-4 for r in synchronous)
    assert [r["step"] for r in evals] == [0, 2, 4, 5] and evals[-1]["eval/num_prompts"] == 40
    assert all("eval/test_unseen_facts/pass_at_1" in r for r in evals)


@pytest.mark.slow
def test_off_policy_one_run(tiny_dir, tmp_path):
    """What only a run shows (the tables, on the archived sweep's 81 runs: test_archives.py): the sweep's flags reach
    async_dpo.py. N = 2 mini-batches a round, on one set of generating weights a round behind: staleness 0..1 in the
    first round, 2..3 after, climbing within a round, 16 prompts a step; the final evaluation after the last step,
    its win rate a count of half-wins over its prompts; the table's row and the plots from the run."""
    runs, plots = tmp_path / "runs", tmp_path / "plots" / "new"  # (a plot folder not there yet is made)
    result = run_script("--quick", "--algorithms", "dpo", "--n_values", "2", "--tiny_dir", tiny_dir, "--plot_dir",
                        str(plots), "--runs_dir", str(runs), script=os.path.join("benchmarks", "off_policy.py"))
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith("| dpo |") and ".." in line]
    assert [row.split(" | ")[1:3] for row in rows] == [["2", "0..3"]], result.stdout
    for name in ("off_policy_frontier.png", "off_policy_by_n.png", "off_policy_by_lag.png"):
        assert (plots / name).stat().st_size > 1000
    steps, evals = read_metrics(runs / "dpo_n2_seed1", eval_metric="eval/gold_win_rate")
    assert len(steps) == 128 // 16  # (the sweep's batch: 16 prompts a step)
    final, n_prompts = evals[-1], evals[-1]["eval/num_prompts"]  # the table's figure: the final evaluation's
    assert final["step"] == len(steps) and (2 * final["eval/gold_win_rate"] * n_prompts).is_integer()
    assert [r["staleness"] for r in steps] == [0, 1] + [2, 3] * 3
    for r in steps:
        position = (r["step"] - 1) % 2  # the mini-batch's place in its round
        assert r["staleness"] == (position if r["round"] == 0 else 2 + position), r


def test_a_sweep_reads_finished_runs_back_and_runs_a_stopped_one_again(tmp_path, capsys):
    """off_policy.py's train (every TL;DR sweep's): a run whose metrics end with its final evaluation after its last
    step is read back, not run again; one stopped half-way (its metrics cut short) is not finished, so a sweep run
    again starts it afresh."""
    from benchmarks import off_policy

    out = tmp_path / "run"
    out.mkdir()
    records = [{"staleness": 0, "step": 1, "reward/mean": 0.5, "lag/kl": 0.0, "lag/update": 0.1},
               {"staleness": 1, "step": 2, "reward/mean": 0.6, "lag/kl": 0.1, "lag/update": 0.1}]
    evals = [{"step": s, "eval/gold_win_rate": w, "time/elapsed": 3.0} for s, w in ((0, 0.3), (2, 0.4))]
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [evals[0], *records, evals[1]]))
    assert off_policy.finished(str(out / "metrics.jsonl"), 2)
    run = off_policy.train("async_dpo.py", ["--not_a_flag"], str(out), 2, "running it")
    assert run["final"]["eval/gold_win_rate"] == 0.4 and run["staleness"] == [0, 1]
    assert "running it" not in capsys.readouterr().out  # (read back: the flag would have failed a run)
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [evals[0], records[0]]))
    assert not off_policy.finished(str(out / "metrics.jsonl"), 2)


def table(console: str) -> list[str]:
    """The rows of a printed table without their last cell (a run's time)."""
    return [line.rsplit(" | ", 1)[0] for line in console.splitlines() if line.startswith("| ")]


@pytest.mark.slow
def test_scaling_one_run(tiny_dir, sized_dir, tmp_path):
    """benchmarks/scaling.py --quick on the quick sized world, one run (the tables, on the archived sweep:
    test_archives.py): the sizes' table of the build, with each proxy's agreement on each size's samples; the smallest
    policy, sized apart from the world's, trained against the world's gold reward model (the gold arm) at N = 1: its
    tuning row, its point with its measured lag, the KL table and both plots."""
    result = run_script("--quick", "--sizes", "small", "--n_values", "1", "--tiny_dir", tiny_dir, "--sized_dir",
                        sized_dir, "--plot_dir", str(tmp_path), script=os.path.join("benchmarks", "scaling.py"))
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line.split(" | ") for line in table(result.stdout) if line.startswith(("| small", "| base"))]
    sizes = [row for row in rows if row[0].endswith("layers)")]
    assert [row[0] for row in sizes] == ["| small (64 wide, 2 layers)", "| base (128 wide, 2 layers)"], result.stdout
    assert all(len(row) == 5 for row in sizes)  # agreement on every size's samples, on each size's own (the last cut)
    points = [row for row in rows if row not in sizes and len(row) >= 11]
    assert [row[:4] for row in points] == [["| small", "gold", "tuned", "1"]], result.stdout
    assert all(float(row[9].split(" ± ")[0]) > 0 and float(row[10].split(" ± ")[0]) > 0 for row in points)  # lags
    assert "| small | gold | " in result.stdout.split("Tuning at N = 1")[1]
    assert "KL(pi || pi_SFT) at the last step" in result.stdout
    for name in ("scaling_by_n.png", "scaling_by_lag.png"):
        assert (tmp_path / name).stat().st_size > 1000


def test_reward_tokenizer_cost_prints_both_paths(tiny_dir):
    result = run_script("--tiny_dir", tiny_dir, "--repeats", "2",
                        script=os.path.join("benchmarks", "reward_tokenizer_cost.py"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "direct (the policy's ids)" in result.stdout and "re-tokenised / direct:" in result.stdout, result.stdout


def test_lag_cost_prints_the_tiny_policys_measurement(tiny_dir):
    """benchmarks/lag_cost.py --quick: what measuring lag/update costs on the tiny world's policy."""
    result = run_script("--quick", "--tiny_dir", tiny_dir, script=os.path.join("benchmarks", "lag_cost.py"))
    assert result.returncode == 0, result.stderr[-3000:]
    row = next(line for line in result.stdout.splitlines() if line.startswith("| tiny policy |"))
    assert float(row.split(" | ")[4].split()[0]) > 0


@pytest.mark.slow
def test_compute_optimal_one_run_and_its_archive(tiny_dir, tmp_path):
    """benchmarks/compute_optimal.py --quick, one run (the tables: on the archived sweep, test_archives.py): T = 2
    takes two steps on each round's batch, with evaluations at the episodes asked, its learning rate decayed linearly
    to 0 over its steps; every step logs its pairs' median reward margin (NaN where a step had no pair: T = 2's one
    prompt, its two completions tied); its row, its regime line and its plot. The design's training-bound rows: K = 4
    takes half K = 2's episodes at half its learning rate. Then the run packed into an archive and unpacked elsewhere:
    the same table, recomputed without running anything."""
    from benchmarks import compute_optimal

    rows = compute_optimal.design(compute_optimal.Args())
    k2, k4 = rows["training-bound", "async K = 2"], rows["training-bound", "async K = 4"]
    assert k4[0] == k2[0] == "async_dpo.py" and k4[2] * 2 == k2[2] and k4[5:] == (4, k2[6] / 2)
    assert k4[3] * 15 == k4[2] and k2[3] * 15 == k2[2]  # (as many evaluations, whatever the length)
    runs = tmp_path / "runs"
    command = ("--quick", "--tiny_dir", tiny_dir, "--plot_dir", str(tmp_path), "--runs_dir", str(runs))
    result = run_script(*command, script=os.path.join("benchmarks", "compute_optimal.py"))
    assert result.returncode == 0, result.stderr[-3000:]
    printed = [line.split(" | ")[:2] for line in table(result.stdout) if line.startswith(("| generation", "| train"))]
    assert printed == [["| generation-bound", "T = 2"]], result.stdout
    assert result.stdout.count(", generation / training ") == 1 and result.stdout.count("'s regime: ") == 1
    assert (tmp_path / "compute_optimal_generation_bound.png").stat().st_size > 1000
    t2, t2_evals = read_metrics(runs / "generation-bound_T2_seed1", eval_metric="eval/gold_win_rate")
    margins = [r["reward/margin_median"] for r in t2]  # a pair's best minus its worst
    assert all(m > 0 for m in margins if not math.isnan(m)) and sum(map(math.isnan, margins)) < len(t2) / 2, margins
    # 32 prompts one at a time, two steps on each, evaluated every 16 prompts; the lr linear to 0 over the 64 steps
    assert len(t2) == 2 * 32 and [r["round"] for r in t2] == [r // 2 for r in range(64)]
    assert [e["episode"] for e in t2_evals] == [0, 16, 32]
    lr = rows["generation-bound", "T = 2"][6]
    assert all(math.isclose(r["lr"], lr * (1 - r["step"] / 64), abs_tol=1e-12) for r in t2), [r["lr"] for r in t2]
    # The sweep packed into an archive and unpacked elsewhere: the same table, recomputed without running anything
    archive, unpacked = tmp_path / "sweep.tar.xz", tmp_path / "unpacked"
    packed = run_script(str(runs), str(archive), script=os.path.join("benchmarks", "archive_runs.py"))
    assert packed.returncode == 0 and "1 runs packed" in packed.stdout, packed.stderr[-3000:]
    unpacked.mkdir()
    with tarfile.open(archive) as tar:
        tar.extractall(unpacked, filter="data")
    for folder in (unpacked / "runs").iterdir():  # (the final evaluation's first two summaries kept, no other)
        kept = [r.get("eval/samples") for r in map(json.loads, open(folder / "metrics.jsonl"))]
        assert len(kept[-1]) == 2 and kept[-1][0]["response"] and not any(kept[:-1]), kept
    again = run_script(*command[:-1], str(unpacked / "runs"), script=os.path.join("benchmarks", "compute_optimal.py"))
    assert again.returncode == 0 and "[1/" not in again.stdout, again.stderr[-3000:]  # (nothing ran)
    assert table(again.stdout) == table(result.stdout)
