"""Which knob for which bottleneck: the paper's Section 4 (Figures 7 and 8) on the tiny world, with async_dpo.py.

- Generation-bound (the learner waits for the generator): T updates on each batch (`--num_epochs T`, T in {1, 2, 3},
  N = 1, the same episodes). The paper: T > 1 reaches a win rate in fewer episodes, at a higher KL.
- Training-bound (the generator waits for the learner): K = 4 samples per prompt, best against worst, with half the
  learning rate and half the episodes (so as many completions as K = 2), against K = 2; async_dpo.py and
  sync_baseline.py. The paper: the reward margin roughly doubles, and async K = 4 reaches K = 2's final win rate in
  about half the time (~2.5x faster than sync), at a higher KL.

On 2 cores the bottleneck is set by the batch: a round's generation costs nearly the same for 1 prompt as for 32 (its
few decoding steps' overhead dominates), its training grows with the prompts: 1 prompt a step is generation-bound,
the demo's 32 training-bound. Each setting is shown to be what it claims by its own runs' `time/generation` against
`time/training` (rounds after the first; printed with each run's regime line). Evaluations (128 prompts, greedy) fall
at the same episodes in every run of a setting, and count in the wall clock.
The speed-up is one number per run: the wall-clock time at which its weights first reached a gold win rate of
--threshold (0.6: fixed before any run, between the SFT policy's ~0.35 and the demo's final ~0.8).

  compute_optimal_generation_bound.png   gold win rate against episodes and wall-clock time; final against perplexity
  compute_optimal_training_bound.png     the same for K = 2 and K = 4, async and sync

    python benchmarks/compute_optimal.py            # 3 T values + 4 (K, schedule) rows, x 3 seeds: ~40 min on 2 cores
    python benchmarks/compute_optimal.py --quick    # one seed, short runs: checks that it works, for CI
"""
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Optional

import tyro

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from off_policy import fmt, mean_and_stderr, train  # noqa: E402

import tiny_world  # noqa: E402
from async_dpo import TINY_DEFAULTS  # noqa: E402
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
    training_bound_eval_every: int = 96
    """training-bound: evaluate every this many training prompts (the curves' points)"""
    threshold: float = 0.6
    """the gold win rate whose first crossing times a run (fixed before the runs)"""
    seeds: list[int] = field(default_factory=lambda: [1, 2, 3])
    """seeds per row"""
    tiny_dir: str = tiny_world.SHIPPED["tldr"]
    """the tiny world (built there if missing)"""
    plot_dir: str = HERE
    """where the two plots go"""
    runs_dir: Optional[str] = None
    """where each run's folder goes, kept (a run already finished there is read back, not run again); default: a
    temporary folder, deleted after"""
    quick: bool = False
    """two short runs, one seed: T = 2 (32 episodes) and async K = 4 (64), evaluations on 64 prompts: checks that
    it works, measures nothing"""


def read_curve(output_dir: str) -> dict:
    """A run's evaluations (episode, wall-clock seconds at which its weights existed, gold win rate, perplexity),
    its rounds' mean generation and training seconds (the regime line's sums, rounds after the first), the median
    of its steps' median pair margins (NaN: a step with no pair, left out), and its regime line."""
    records = [json.loads(line) for line in open(os.path.join(output_dir, "metrics.jsonl"))]
    steps = {r["step"]: r for r in records if "staleness" in r}
    evals = [r for r in records if "eval/gold_win_rate" in r]
    means = metrics.round_means(records)
    return dict(
        episodes=[e["episode"] for e in evals], win_rate=[e["eval/gold_win_rate"] for e in evals],
        seconds=[steps[e["step"]]["time/elapsed"] if e["step"] else 0.0 for e in evals],
        perplexity=evals[-1]["eval/perplexity"], final=evals[-1]["eval/gold_win_rate"],
        generation=means["generating"], training=means["training"],
        margin=statistics.median(m for m in (r["reward/margin_median"] for r in steps.values()) if not math.isnan(m)),
        total=evals[-1]["time/elapsed"], regime=metrics.regime(records))


def first_reach(curve: dict, threshold: float, key: str) -> Optional[float]:
    """The episodes (or seconds) at the first evaluation at or above the threshold; None: never reached."""
    return next((x for x, w in zip(curve[key], curve["win_rate"]) if w >= threshold), None)


def fmt_reach(curves: list[dict], threshold: float, key: str, unit: str = "") -> str:
    reached = [x for x in (first_reach(c, threshold, key) for c in curves) if x is not None]
    if not reached:
        return "never"
    return fmt(reached, 0) + unit + ("" if len(reached) == len(curves) else f" ({len(reached)}/{len(curves)} seeds)")


if __name__ == "__main__":
    args = tyro.cli(Args)
    extra = ["--num_final_eval_prompts", "512"]
    if args.quick:
        args.seeds, args.t_values, args.training_bound_eval_every = args.seeds[:1], [2], 32
        args.generation_bound_episodes, args.training_bound_episodes = 32, 128
        extra = ["--num_eval_prompts", "64", "--num_final_eval_prompts", "64"]
    lr = TINY_DEFAULTS["learning_rate"]
    # (setting, label): (script, batch, episodes, evaluate every (episodes), T, K, lr)
    rows = {("generation-bound", f"T = {t}"): ("async_dpo.py", args.generation_bound_batch,
                                                 args.generation_bound_episodes, args.generation_bound_eval_every, t,
                                                 2, args.generation_bound_lr) for t in args.t_values}
    for schedule, script in [("async", "async_dpo.py"), ("sync", "sync_baseline.py")][: 1 if args.quick else 2]:
        for k, scale in ((2, 1), (4, 2))[args.quick:]:  # K = 4: half the learning rate and half the episodes
            rows["training-bound", f"{schedule} K = {k}"] = (
                script, args.training_bound_batch, args.training_bound_episodes // scale,
                args.training_bound_eval_every, 1, k, lr / scale)
    for script, batch, episodes, eval_every, t, k, row_lr in rows.values():
        if episodes % batch or eval_every % batch:
            sys.exit(f"the episodes ({episodes}) and the evaluation interval ({eval_every}) must be multiples of the "
                     f"batch ({batch})")

    runs_dir = args.runs_dir or tempfile.mkdtemp(prefix="compute_optimal_")
    curves, sweep_start = {}, time.time()
    try:
        for index, ((setting, label), (script, batch, episodes, eval_every, t, k, row_lr)) in enumerate(rows.items()):
            for seed in args.seeds:
                name = f"{setting}_{label.replace(' = ', '').replace(' ', '_')}_seed{seed}"
                output_dir = os.path.join(runs_dir, name)
                train(script, [
                    "--tiny_dir", args.tiny_dir, "--seed", str(seed), "--batch_size", str(batch),
                    "--per_device_train_batch_size", str(min(batch, 16)), "--total_episodes", str(episodes),
                    "--num_epochs", str(t), "--num_samples", str(k), "--learning_rate", str(row_lr),
                    "--eval_every", str(eval_every // batch * t), *extra], output_dir,
                    episodes // batch * t, f"[{index + 1}/{len(rows)}] {name} ({time.time() - sweep_start:.0f} s)")
                curves[setting, label, seed] = read_curve(output_dir)
    finally:
        if args.runs_dir is None:
            shutil.rmtree(runs_dir, ignore_errors=True)

    # Each setting's regime, then the table: one row per (setting, label), mean ± standard error over seeds
    print(f"\n{len(args.seeds)} seed(s) per row, mean ± standard error over seeds; time to {args.threshold}: the "
          "wall-clock seconds (and the episodes) at the first evaluation whose gold win rate reached it\n")
    for setting, label in rows:
        runs = [curves[setting, label, s] for s in args.seeds]
        ratio = [r["generation"] / r["training"] for r in runs]
        print(f"{setting}, {label}: a round's generation {fmt([r['generation'] for r in runs], 2)} s, training "
              f"{fmt([r['training'] for r in runs], 2)} s, generation / training {fmt(ratio, 2)}\n  seed "
              f"{args.seeds[0]}'s {runs[0]['regime']}")
    print("\n| setting | run | gold win rate | perplexity | median pair margin | time | time to "
          f"{args.threshold} | episodes to {args.threshold} |\n|---|---|---|---|---|---|---|---|")
    for setting, label in rows:
        runs = [curves[setting, label, s] for s in args.seeds]
        print(f"| {setting} | {label} | {fmt([r['final'] for r in runs])} | {fmt([r['perplexity'] for r in runs], 3)}"
              f" | {fmt([r['margin'] for r in runs])} | {fmt([r['total'] for r in runs], 0)} s | "
              f"{fmt_reach(runs, args.threshold, 'seconds', ' s')} | {fmt_reach(runs, args.threshold, 'episodes')} |")
    print(f"\nwhole sweep: {(time.time() - sweep_start) / 60:.1f} min")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for setting in ("generation-bound", "training-bound"):
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
            ax.axhline(args.threshold, color="gray", linestyle=":")
            ax.set(xlabel=xlabel, ylabel="gold win rate")
        axes[0].legend(fontsize=8)
        fig.suptitle(f"Online DPO on the tiny world, {setting} ({len(args.seeds)} seeds, mean ± s.e.; dotted: the "
                     "threshold)")
        fig.tight_layout()
        fig.savefig(os.path.join(args.plot_dir, f"compute_optimal_{setting.replace('-', '_')}.png"), dpi=90)
    print(f"plots saved to {args.plot_dir}/compute_optimal_generation_bound.png and "
          "compute_optimal_training_bound.png")
