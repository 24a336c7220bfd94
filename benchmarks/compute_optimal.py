"""Which knob for which bottleneck: the paper's Section 4 (Figures 7 and 8) on the tiny world, with async_dpo.py.

- Generation-bound (the learner waits for the generator): T updates on each batch (`--num_epochs T`, T in {1, 2, 3},
  N = 1, the same episodes). The paper: T > 1 reaches a win rate in fewer episodes, at a higher KL.
- Training-bound (the generator waits for the learner): K = 4 samples per prompt, best against worst, with half the
  learning rate and half the episodes (so as many completions as K = 2), against K = 2; async_dpo.py and
  sync_baseline.py. The paper: the reward margin roughly doubles, and async K = 4 reaches K = 2's final win rate in
  about half the time (~2.5x faster than sync), at a higher KL. The paper's pair changes K and the schedule at once;
  the control pair (async K = 2 at half the learning rate and episodes, K = 4 at the full ones) crosses them, at a
  learning rate where K = 2 is still climbing half-way, and every run has as many evaluations.

On 2 cores the bottleneck is set by the batch: a round's generation costs nearly the same for 1 prompt as for 32 (its
few decoding steps' overhead dominates), its training grows with the prompts: 1 prompt a step is generation-bound,
the demo's 32 training-bound. Each setting is shown to be what it claims by its own runs' `time/generation` against
`time/training` (rounds after the first; printed with each run's regime line). Evaluations (128 prompts, greedy)
count in the wall clock: generation-bound runs evaluate at the same episodes, training-bound runs as many times each.
The KL at a matched win rate (where each curve first reaches a level) is printed beside the finals, on two axes: the
perplexity of the greedy summaries under the SFT model (the paper's axis; on this world it falls as win rate rises, so
it is no divergence) and the sampled KL(pi || SFT) the scripts log (`objective/kl`, on the training samples).
The speed-up is one number per run: the wall-clock time at which its weights first reached a gold win rate of
--threshold (generation-bound, 0.6: fixed before any run, between the SFT policy's ~0.35 and the demo's final ~0.8)
or --training_bound_threshold (0.5, fixed after the pilot that chose the training-bound learning rate).

  compute_optimal_generation_bound.png   gold win rate against episodes and wall-clock time; final against perplexity
  compute_optimal_training_bound.png     the same for K = 2 and K = 4, async and sync

    python benchmarks/compute_optimal.py            # 3 T values + 6 (K, schedule) rows, x 3 seeds: ~45 min on 2 cores
    python benchmarks/compute_optimal.py --quick    # one short run: checks that it runs, for CI
    python benchmarks/compute_optimal.py --confirm_power   # the confirmation's power analysis (archived seeds 1-5)
    python benchmarks/compute_optimal.py --confirm         # T = 2 > T = 1 and K = 4 > K = 2 on fresh seeds alone
"""
import json
import math
import os
import shutil
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Optional

import tyro

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]
from off_policy import sweep_folder, train  # noqa: E402
from stats import fmt, gap, holm, holm_line, mean_and_stderr, p_value, power, two_stage  # noqa: E402

import tiny_world  # noqa: E402
from plumbing import metrics  # noqa: E402


@dataclass
class Args:
    t_values: list[int] = field(default_factory=lambda: [1, 2, 3])
    """generation-bound: updates per batch (--num_epochs), the paper's Figure 7"""
    generation_bound_batch: int = 1
    """generation-bound: prompts per step (one: a round's training is short against its generation)"""
    generation_bound_episodes: int = 256
    """generation-bound: training prompts per run, the same at every T"""
    generation_bound_lr: float = 1.77e-5
    """generation-bound: the learning rate, the demo's 1e-4 at 32 prompts scaled by the square root of the batch
    (Adam's usual rule): at 1e-4, one-prompt steps reach a gold win rate of 0.82 in 16 steps, and every curve is flat
    from its first point"""
    generation_bound_eval_every: int = 16
    """generation-bound: evaluate every this many training prompts (the curves' points)"""
    training_bound_batch: int = 32
    """training-bound: prompts per step (the demo's)"""
    training_bound_episodes: int = 1920
    """training-bound: training prompts of the K = 2 runs (the demo's); K = 4 runs take half, at half the lr"""
    training_bound_lr: float = 2.5e-5
    """training-bound: the K = 2 runs' learning rate (K = 4: half). A quarter of the demo's 1e-4, at which K = 2
    plateaus within its first 300 episodes, so that halving the steps can cost something: in a pilot (K = 2, seed 1)
    the gold win rate was still climbing half-way (0.54 at 960 episodes, 0.59 from 1,250 on); at 5e-5 it was not
    (0.59 at half-way, 0.62 at the end)"""
    training_bound_threshold: float = 0.5
    """training-bound: the gold win rate whose first crossing times a run, fixed after the pilot (whose K = 2 curve
    tops out at 0.59, under the generation-bound 0.6) and before the sweep"""
    training_bound_evaluations: int = 15
    """training-bound: evaluations during every run, whatever its length (equal evaluation costs in its clock)"""
    k_control: bool = True
    """training-bound: also the control pair, async K = 2 at half the learning rate and episodes and K = 4 at the
    full ones, so that K and the schedule are crossed (2 x 2)"""
    threshold: float = 0.6
    """generation-bound: the gold win rate whose first crossing times a run (fixed before the runs)"""
    seeds: list[int] = field(default_factory=lambda: [1, 2, 3])
    """seeds per row"""
    first_stage: int = 3
    """with more seeds than this, T = 2 - T = 1 and K = 4 - K = 2 (full schedule), extended past their first
    `first_stage` seeds because they were inconclusive there (docs/results.md), are also judged by the two-stage
    combination (`stats.two_stage`), which the pooled t of every seed is not"""
    tiny_dir: str = tiny_world.SHIPPED["tldr"]
    """the tiny world (built there if missing)"""
    plot_dir: str = HERE
    """where the two plots go"""
    runs_dir: Optional[str] = None
    """where each run's folder goes, kept so that a figure can be recomputed and a sweep resumed (a run already
    finished there is read back, not run again); default: benchmarks/runs/compute_optimal (--quick: a temporary
    folder, deleted after)"""
    confirm: bool = False
    """the confirmation registered in docs/results.md before its runs: T = 2 against T = 1 and K = 4 against K = 2
    at the full schedule (the two comparisons seeds 1-5 left undecided) on fresh seeds alone, the registered 11-18,
    each paired by seed (two-sided t), Holm over the two; only those four rows run, in
    benchmarks/runs/compute_optimal_confirm, and no plot is drawn"""
    confirm_power: bool = False
    """the confirmation's power analysis, from the archived seeds 1-5 (in benchmarks/runs/compute_optimal): runs
    nothing"""
    quick: bool = False
    """one short run, one seed: T = 2 (32 episodes), evaluations on 64 prompts: checks that it runs, measures nothing
    (the tables, on the archived sweep: docs/runs/compute_optimal.tar.xz)"""


def read_curve(output_dir: str) -> dict:
    """A run's evaluations (episode, wall-clock seconds at which its weights existed, gold win rate, perplexity),
    its rounds' mean generation and training seconds (the regime line's sums, rounds after the first), the median
    of its steps' median pair margins (NaN: a step with no pair, left out) and its first step's (the SFT policy's
    samples: the margin K alone makes), and its regime line."""
    records = [json.loads(line) for line in open(os.path.join(output_dir, "metrics.jsonl"))]
    steps = {r["step"]: r for r in records if "staleness" in r}
    evals = [r for r in records if "eval/gold_win_rate" in r]
    means = metrics.round_means(records)
    return dict(
        episodes=[e["episode"] for e in evals], win_rate=[e["eval/gold_win_rate"] for e in evals],
        seconds=[steps[e["step"]]["time/elapsed"] if e["step"] else 0.0 for e in evals],
        perplexities=[e["eval/perplexity"] for e in evals], kls=sampled_kls(list(steps.values()), evals),
        perplexity=evals[-1]["eval/perplexity"], final=evals[-1]["eval/gold_win_rate"],
        generation=means["generating"], training=means["training"],
        margin=statistics.median(m for m in (r["reward/margin_median"] for r in steps.values()) if not math.isnan(m)),
        first_margin=steps[min(steps)]["reward/margin_median"],
        total=evals[-1]["time/elapsed"], regime=metrics.regime(records))


def sampled_kls(steps: list, evals: list) -> list:
    """Each evaluation's sampled KL(pi || SFT): the mean `objective/kl` of the steps whose batches the weights
    between the midpoints to its neighbouring evaluations generated (a round's few prompts make one step's value
    noisy); the SFT policy's (step 0), of the batches version 0 generated. None: no such step (or a run from before
    the metric was logged)."""
    versions = [e["step"] for e in evals]
    bounds = ([0, 1] + [(a + b) / 2 for a, b in zip(versions[1:], versions[2:])] + [math.inf])[: len(evals) + 1]
    kls = []
    for low, high in zip(bounds, bounds[1:]):
        window = [r["objective/kl"] for r in steps if low <= r["generation_version"] < high and "objective/kl" in r]
        kls.append(statistics.mean(window) if window else None)
    return kls


def first_reach(curve: dict, threshold: float, key: str) -> Optional[float]:
    """The episodes (or seconds) at the first evaluation at or above the threshold; None: never reached."""
    return next((x for x, w in zip(curve[key], curve["win_rate"]) if w >= threshold), None)


def at_level(curve: dict, level: float, axis: str) -> Optional[float]:
    """The `axis` value (perplexities or kls) where the win-rate curve first reaches `level`, interpolated linearly
    between the two evaluations around the crossing (the KL axis at a matched win rate); None: never reached."""
    points = list(zip(curve["win_rate"], curve[axis]))
    for (w0, p0), (w1, p1) in zip(points, points[1:]):
        if w0 < level <= w1:
            return None if None in (p0, p1) else p0 + (p1 - p0) * (level - w0) / (w1 - w0)
    return points[0][1] if points[0][0] >= level else None


def fmt_reach(curves: list[dict], threshold: float, key: str, unit: str = "") -> str:
    reached = [x for x in (first_reach(c, threshold, key) for c in curves) if x is not None]
    if not reached:
        return "never"
    return fmt(reached, 0) + unit + ("" if len(reached) == len(curves) else f" ({len(reached)}/{len(curves)} seeds)")


def threshold_of(setting: str, args: Args) -> float:
    return {"generation-bound": args.threshold, "training-bound": args.training_bound_threshold}[setting]


def report_matched_kl(curves: dict, rows: dict, args: Args) -> None:
    """The KL axes (perplexity under the SFT model, sampled KL(pi || SFT)) where each run first reaches the same win
    rates (final points sit at different win rates, so only a matched level shows a trade-off): every multiple of
    0.05 above the SFT policy's win rate up to the highest that two rows reach on every seed, and the threshold."""
    for setting in dict.fromkeys(s for s, _ in rows):
        labels = [label for s, label in rows if s == setting]
        peaks = {label: min(max(curves[setting, label, s]["win_rate"][1:]) for s in args.seeds) for label in labels}
        start = max(curves[setting, label, s]["win_rate"][0] for label in labels for s in args.seeds)
        top = sorted(peaks.values())[-2] if len(peaks) > 1 else 0.0
        levels = sorted({threshold_of(setting, args)} | {i / 20 for i in range(21) if start + 0.05 <= i / 20 <= top})
        levels = [level for level in levels if level <= max(peaks.values())]
        if not levels:
            continue
        for axis, name in (("perplexities", "perplexity under the SFT model"), ("kls", "sampled KL(pi || SFT)")):
            print(f"\n{setting}: the {name} where the gold win rate first reaches each level (interpolated between "
                  "evaluations; -: not reached on every seed, or not logged), mean ± s.e. over seeds\n\n| run | "
                  + " | ".join(f"at {w:.2f}" for w in levels) + " |\n|---|" + "---|" * len(levels))
            for label in labels:
                values = [[at_level(curves[setting, label, s], w, axis) for s in args.seeds] for w in levels]
                cells = ["-" if peaks[label] < w or None in v else fmt(v, 3) for w, v in zip(levels, values)]
                print(f"| {label} | " + " | ".join(cells) + " |")


def contrast_cell(label: str, x: list, y: list, judgements: list, construction: str = "", **options) -> str:
    """A contrast table's cell: x - y paired by seed (`gap`'s options), kept in `judgements` for the table's Holm
    line; or, where a seed never reached the threshold, saying so; or, where the two sides are the same numbers by
    construction (`construction` says why) and are so on every seed, saying that, outside the Holm family."""
    if None in x + y:
        return "not reached by every seed"
    if construction and x == y:
        return f"0 (identical by construction: {construction}; not judged)"
    judgements.append((label, gap(x, y, **options)))
    return judgements[-1][1]["text"]


def report_t_contrasts(curves: dict, args: Args) -> None:
    """Generation-bound: each T > 1 against T = 1, paired by seed on the t threshold: the final win rate, the seconds
    and the episodes to the threshold, and the run's whole wall clock."""
    def values(t: int, key: str) -> list:
        runs = [curves["generation-bound", f"T = {t}", s] for s in args.seeds]
        if key in ("seconds", "episodes"):
            return [first_reach(r, args.threshold, key) for r in runs]
        return [r[key] for r in runs]

    keys = {"final": 3, "seconds": 1, "episodes": 0, "total": 1}  # (digits)
    print(f"\nThe T contrasts (generation-bound, paired by seed; to {args.threshold}: the first evaluation at or "
          "above it):\n\n| contrast | final gold win rate | seconds to threshold | episodes to threshold | whole run, "
          "seconds |\n|---|---|---|---|---|")
    judgements = []
    for t in [t for t in args.t_values if t != 1]:
        cells = [contrast_cell(f"T = {t} - T = 1, {key}", values(t, key), values(1, key), judgements, digits=digits,
                               interval=True) for key, digits in keys.items()]
        print(f"| T = {t} - T = 1 | " + " | ".join(cells) + " |")
    print(f"\n{holm_line(judgements)}")


def report_k_control(curves: dict, args: Args) -> None:
    """The 2 x 2 of K and the schedule (async), each contrast paired by seed on the t threshold: K's effect at each
    schedule, the schedule's at each K, and the paper's pair."""
    def values(label: str, key: str) -> list:
        runs = [curves["training-bound", label, s] for s in args.seeds]
        if key == "time to threshold":
            return [first_reach(r, args.training_bound_threshold, "seconds") for r in runs]
        return [r[key] for r in runs]

    contrasts = [("K = 4 - K = 2, full lr and episodes", "async K = 4, full", "async K = 2"),
                 ("K = 4 - K = 2, half lr and episodes", "async K = 4", "async K = 2, halved"),
                 ("halved - full, K = 2", "async K = 2, halved", "async K = 2"),
                 ("halved - full, K = 4", "async K = 4", "async K = 4, full"),
                 ("the paper's pair: K = 4 halved - K = 2 full", "async K = 4", "async K = 2")]
    keys = ["final", "time to threshold", "perplexity", "first_margin", "margin"]
    print(f"\nThe K control (async, paired by seed; time to {args.training_bound_threshold} in seconds):\n\n"
          "| contrast | final gold win rate | time to threshold | perplexity | first step's margin | median margin |\n"
          "|---|---|---|---|---|---|")
    judgements = []
    for name, a, b in contrasts:
        same_k = name.startswith("halved - full")  # (the first step samples the SFT policy at either schedule)
        cells = [contrast_cell(f"{name}, {key}", values(a, key), values(b, key), judgements,
                               construction="the same SFT samples at either schedule"
                               if same_k and key == "first_margin" else "") for key in keys]
        print(f"| {name} | " + " | ".join(cells) + " |")
    print(f"\n{holm_line(judgements)}")


# The two comparisons the first three seeds left undecided (extended to five, then confirmed on fresh seeds):
# {name: (row, baseline row)}, each row (setting, label)
UNDECIDED = {"T = 2 - T = 1": (("generation-bound", "T = 2"), ("generation-bound", "T = 1")),
             "K = 4 - K = 2, full lr and episodes": (("training-bound", "async K = 4, full"),
                                                     ("training-bound", "async K = 2"))}
CONFIRMATION_SEEDS = list(range(11, 19))  # registered in docs/results.md from --confirm_power's analysis


def run_name(setting: str, label: str, seed: int) -> str:
    return f"{setting}_{label.replace(' = ', '').replace(',', '').replace(' ', '_')}_seed{seed}"


def finals(curves: dict, row: tuple, seeds: list) -> list:
    return [curves[(*row, s)]["final"] for s in seeds]


def report_two_stage(curves: dict, args: Args) -> None:
    """T = 2 - T = 1 and K = 4 - K = 2 at the full schedule on the final gold win rate, extended past the first stage
    because they were inconclusive there: the two-stage combination of each, and Holm over the two."""
    if any((*row, args.seeds[0]) not in curves for pair in UNDECIDED.values() for row in pair):
        return
    print(f"\nExtended past seeds {args.seeds[0]}-{args.seeds[args.first_stage - 1]} because inconclusive there, "
          "the final gold win rate judged by the two-stage combination:")
    results = {}
    for name, (a, b) in UNDECIDED.items():
        x, y = finals(curves, a, args.seeds), finals(curves, b, args.seeds)
        results[name] = two_stage(x, y, args.first_stage)
        print(f"  {name}: {results[name]['text']}")
    kept = [name for name, ok in zip(results, holm([r["p"] for r in results.values()])) if ok]
    print("  Holm over the two (5% family-wise): " + ("; ".join(kept) + " survive" if kept else "none survives"))


def report_power(args: Args) -> None:
    """The confirmation's power analysis: each undecided pair's per-seed differences on the archived seeds 1-5 (their
    mean and SD: the effect to confirm, overestimated if anything, as the pairs were extended because of it), and
    the power of n fresh seeds to show it at level 0.025 (Holm's first step over two: passing there survives Holm
    whatever the other does, so this is a lower bound on the power under Holm), at the archived effect and at half."""
    runs_dir = args.runs_dir or os.path.join(HERE, "runs", "compute_optimal")
    seeds, curves = [1, 2, 3, 4, 5], {}
    for name, pair in UNDECIDED.items():
        for setting, label in pair:
            for seed in seeds:
                folder = os.path.join(runs_dir, run_name(setting, label, seed))
                if not os.path.exists(os.path.join(folder, "metrics.jsonl")):
                    sys.exit(f"no {folder}: unpack docs/runs/compute_optimal.tar.xz into benchmarks/runs")
                curves[setting, label, seed] = read_curve(folder)
    print("The confirmation's power (differences of the final gold win rate, paired by seed, archived seeds 1-5; "
          "power at level 0.025, two-sided):")
    for name, (a, b) in UNDECIDED.items():
        differences = [x - y for x, y in zip(finals(curves, a, seeds), finals(curves, b, seeds))]
        mean, sd = statistics.mean(differences), statistics.stdev(differences)
        print(f"  {name}: per seed {', '.join(f'{d:+.4f}' for d in differences)}; mean {mean:+.4f}, SD {sd:.4f}")
        for effect, words in ((mean, "the archived effect"), (mean / 2, "half of it")):
            print(f"    at {words} ({effect:+.4f}): " + ", ".join(
                f"n = {n}: {power(effect, sd, n, level=0.025):.2f}" for n in range(4, 13, 2)))


def report_confirmation(curves: dict, args: Args) -> None:
    """The confirmation on fresh seeds: each undecided pair paired by seed (two-sided t, its 95% interval and p),
    Holm over the two; a pair is confirmed when it survives Holm above 0 (the sign both were predicted with)."""
    print(f"\nThe confirmation on fresh seeds {args.seeds[0]}-{args.seeds[-1]} alone (registered before its runs: "
          "the final gold win rate, paired by seed, two-sided t; Holm over the two, 5% family-wise):")
    results = {name: gap(finals(curves, a, args.seeds), finals(curves, b, args.seeds), interval=True)
               for name, (a, b) in UNDECIDED.items()}
    p_values = [p_value(r["t"], r["df"]) for r in results.values()]
    for (name, result), p, kept in zip(results.items(), p_values, holm(p_values)):
        verdict = "confirmed" if kept and result["mean"] > 0 else "not confirmed"
        print(f"  {name}: {result['text']}; p = {p:.4f}; Holm: {'survives' if kept else 'does not survive'}: "
              f"{verdict}")


def design(args: Args) -> dict:
    """The sweep's rows, {(setting, label): (script, batch, episodes, evaluate every (episodes), T, K, lr)}; --quick:
    the generation-bound ones alone."""
    rows = {("generation-bound", f"T = {t}"): ("async_dpo.py", args.generation_bound_batch,
                                                 args.generation_bound_episodes, args.generation_bound_eval_every, t,
                                                 2, args.generation_bound_lr) for t in args.t_values}
    # The paper's pair: K = 2 at the full learning rate and episodes, K = 4 at half of both; the control pair crosses
    # K with the schedule (K = 2 halved, K = 4 full), async only
    training_bound = [("async", 2, 1, ""), ("async", 4, 2, ""), ("sync", 2, 1, ""), ("sync", 4, 2, "")]
    if args.k_control:
        training_bound[2:2] = [("async", 2, 2, ", halved"), ("async", 4, 1, ", full")]
    scripts = {"async": "async_dpo.py", "sync": "sync_baseline.py"}
    for schedule, k, scale, control in [] if args.quick else training_bound:
        episodes = args.training_bound_episodes // scale
        rows["training-bound", f"{schedule} K = {k}{control}"] = (
            scripts[schedule], args.training_bound_batch, episodes, episodes // args.training_bound_evaluations, 1,
            k, args.training_bound_lr / scale)
    if args.confirm:
        return {row: rows[row] for pair in UNDECIDED.values() for row in pair}
    return rows


if __name__ == "__main__":
    args = tyro.cli(Args)
    os.makedirs(args.plot_dir, exist_ok=True)  # before the sweep, so a path that cannot be made fails at once
    if args.confirm_power:
        report_power(args)
        sys.exit(0)
    if args.confirm:
        args.t_values, args.k_control = [1, 2], True
        args.seeds = args.seeds if "--seeds" in sys.argv else CONFIRMATION_SEEDS
    extra = ["--num_final_eval_prompts", "512"]
    if args.quick:
        args.seeds, args.t_values, args.generation_bound_episodes, args.k_control = args.seeds[:1], [2], 32, False
        extra = ["--num_eval_prompts", "64", "--num_final_eval_prompts", "64"]
    rows = design(args)
    for script, batch, episodes, eval_every, t, k, row_lr in rows.values():
        if episodes % batch or eval_every % batch:
            sys.exit(f"the episodes ({episodes}) and the evaluation interval ({eval_every}) must be multiples of the "
                     f"batch ({batch})")

    runs_dir, keep_runs = sweep_folder(args.runs_dir, "compute_optimal_confirm" if args.confirm else "compute_optimal",
                                       args.quick)
    curves, sweep_start = {}, time.time()
    try:
        for index, ((setting, label), (script, batch, episodes, eval_every, t, k, row_lr)) in enumerate(rows.items()):
            for seed in args.seeds:
                name = run_name(setting, label, seed)
                output_dir = os.path.join(runs_dir, name)
                train(script, [
                    "--tiny_dir", args.tiny_dir, "--seed", str(seed), "--batch_size", str(batch),
                    "--per_device_train_batch_size", str(min(batch, 16)), "--total_episodes", str(episodes),
                    "--num_epochs", str(t), "--num_samples", str(k), "--learning_rate", str(row_lr),
                    "--eval_every", str(eval_every // batch * t), *extra], output_dir,
                    episodes // batch * t, f"[{index + 1}/{len(rows)}] {name} ({time.time() - sweep_start:.0f} s)")
                curves[setting, label, seed] = read_curve(output_dir)
    finally:
        if not keep_runs:
            shutil.rmtree(runs_dir, ignore_errors=True)

    # Each setting's regime, then the table: one row per (setting, label), mean ± standard error over seeds
    print(f"\n{len(args.seeds)} seed(s) per row, mean ± standard error over seeds; time to the threshold "
          f"({args.threshold} generation-bound, {args.training_bound_threshold} training-bound): the wall-clock "
          "seconds (and the episodes) at the first evaluation whose gold win rate reached it\n")
    for setting, label in rows:
        runs = [curves[setting, label, s] for s in args.seeds]
        ratio = [r["generation"] / r["training"] for r in runs]
        print(f"{setting}, {label}: a round's generation {fmt([r['generation'] for r in runs], 2)} s, training "
              f"{fmt([r['training'] for r in runs], 2)} s, generation / training {fmt(ratio, 2)}\n  seed "
              f"{args.seeds[0]}'s {runs[0]['regime']}")
    print("\n| setting | run | gold win rate | perplexity | median pair margin | first step's margin | time | time to "
          "threshold | episodes to threshold |\n|---|---|---|---|---|---|---|---|---|")
    for setting, label in rows:
        runs, threshold = [curves[setting, label, s] for s in args.seeds], threshold_of(setting, args)
        print(f"| {setting} | {label} | {fmt([r['final'] for r in runs])} | {fmt([r['perplexity'] for r in runs], 3)}"
              f" | {fmt([r['margin'] for r in runs])} | {fmt([r['first_margin'] for r in runs])} | "
              f"{fmt([r['total'] for r in runs], 0)} s | {fmt_reach(runs, threshold, 'seconds', ' s')} | "
              f"{fmt_reach(runs, threshold, 'episodes')} |")
    report_matched_kl(curves, rows, args)
    if 1 in args.t_values and len(args.t_values) > 1:
        report_t_contrasts(curves, args)
    if args.confirm:
        report_confirmation(curves, args)
        print(f"\nwhole sweep: {(time.time() - sweep_start) / 60:.1f} min (no plots: the confirmation is its lines)")
        sys.exit(0)
    if args.k_control:
        report_k_control(curves, args)
    if len(args.seeds) > args.first_stage >= 2 and len(args.seeds) - args.first_stage >= 2:
        report_two_stage(curves, args)
    print(f"\nwhole sweep: {(time.time() - sweep_start) / 60:.1f} min")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = list(dict.fromkeys(setting for setting, _ in rows))
    for setting in settings:
        labels = [label for s, label in rows if s == setting]
        fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
        for i, label in enumerate(labels):
            runs = [curves[setting, label, s] for s in args.seeds]
            style = dict(color=f"C{i}", marker="o", markersize=4, capsize=2, label=label)
            for ax, key in zip(axes, ("episodes", "seconds")):  # (the seeds evaluate at the same episodes)
                x = [statistics.mean(values) for values in zip(*(r[key] for r in runs))]
                y = [mean_and_stderr(list(values)) for values in zip(*(r["win_rate"] for r in runs))]
                ax.errorbar(x, [m for m, _ in y], yerr=[e for _, e in y], **style)
            (x, x_err), (y, y_err) = (mean_and_stderr([r[key] for r in runs]) for key in ("perplexity", "final"))
            axes[2].errorbar(x, y, xerr=x_err, yerr=y_err, **style)
        for ax, xlabel in zip(axes, ("episodes (training prompts)", "wall-clock seconds of training",
                                     "perplexity under the SFT model (final)")):
            ax.axhline(threshold_of(setting, args), color="gray", linestyle=":")
            ax.set(xlabel=xlabel, ylabel="gold win rate")
        axes[0].legend(fontsize=8)
        fig.suptitle(f"Online DPO on the tiny world, {setting} ({len(args.seeds)} seeds, mean ± s.e.; dotted: the "
                     "threshold)")
        fig.tight_layout()
        fig.savefig(os.path.join(args.plot_dir, f"compute_optimal_{setting.replace('-', '_')}.png"), dpi=90)
    print(f"plots saved to {args.plot_dir}: " + " and ".join(
        f"compute_optimal_{setting.replace('-', '_')}.png" for setting in settings))
