"""The tiny world's learning curves: the README demo (`async_dpo.py --model tiny`, or another script's with
--script) and a longer, hotter run that shows reward over-optimisation, each over several seeds.

Prints, per run and as mean +- standard deviation over seeds, the gold and proxy win rates, mean scores and the
perplexity before and after, each demo's wall time and peak memory (the resident memory of the learner and the
generator processes together, sampled every 0.1 s), and saves two plots:
  tiny_demo.png               gold and proxy win rate, mean scores, and gold win rate against perplexity (the
                              paper's KL axis) for the demo (tiny_demo_ppo.png for --script async_ppo.py, ...)
  tiny_overoptimisation.png   proxy and gold mean scores over the long run (4x the episodes at 3x the learning rate)

    python benchmarks/tiny_curves.py            # ~10 minutes on 2 cores
    python benchmarks/tiny_curves.py --quick    # one short run standing for both, for CI
    python benchmarks/tiny_curves.py --script async_ppo.py --no-long_run   # the PPO demo, ~4 minutes
"""
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import psutil
import tyro

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
import tiny_world  # noqa: E402


@dataclass
class Args:
    script: str = "async_dpo.py"
    """the algorithm script whose demo to run"""
    long_run: bool = True
    """also run the long, hotter run (over-optimisation)"""
    seeds: list[int] = field(default_factory=lambda: [1, 2, 3])
    """seeds of the runs (the world itself is the same for all)"""
    long_episodes: int = 7680
    """episodes of the long run (the demo's x4)"""
    long_learning_rate: float = 3e-4
    """learning rate of the long run (the demo's x3)"""
    quick: bool = False
    """one seed, one short run standing for both the demo and the long run: checks that the benchmark works,
    measures nothing"""
    tiny_dir: str = tiny_world.SHIPPED["tldr"]
    """the tiny world (built there if missing)"""
    plot_dir: str = HERE
    """where the PNGs go"""


def run(output_dir: str, args: Args, seed: int, *flags: str) -> list[dict]:
    """Run the demo's command with extra flags; return its evaluation records (the last one with the run's wall
    time and peak memory)."""
    start, peak = time.time(), 0
    process = subprocess.Popen([sys.executable, os.path.join(REPO, args.script), "--model", "tiny", "--tiny_dir",
                                args.tiny_dir, "--seed", str(seed), "--output_dir", output_dir, *flags], cwd=REPO,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while process.poll() is None:
        with contextlib.suppress(psutil.Error):
            tree = [psutil.Process(process.pid), *psutil.Process(process.pid).children(recursive=True)]
            peak = max(peak, sum(p.memory_info().rss for p in tree))
        time.sleep(0.1)
    if process.returncode:
        raise SystemExit(f"{args.script} failed (exit code {process.returncode})")
    records = [json.loads(line) for line in open(os.path.join(output_dir, "metrics.jsonl"))]
    evals = [r for r in records if "eval/gold_win_rate" in r]
    evals[-1].update(wall_seconds=time.time() - start, peak_gib=peak / 2**30)
    return evals


def spread(values: list[float]) -> str:
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f}" if len(values) > 1 else f"{values[0]:.3f}"


KEYS = {"gold win rate": "eval/gold_win_rate", "proxy win rate": "eval/proxy_win_rate",
        "gold mean score": "eval/gold_reward", "proxy mean score": "eval/proxy_reward",
        "perplexity": "eval/perplexity", "perplexity (paper's)": "eval/perplexity_paper"}


def report(name: str, runs: dict) -> None:
    print(f"\n{name}: first -> last evaluation (mean ± std over seeds {list(runs)}; the last evaluation uses the "
          f"whole validation split)")
    for label, key in KEYS.items():
        first, last = [evals[0][key] for evals in runs.values()], [evals[-1][key] for evals in runs.values()]
        print(f"  {label:<22} {spread(first)} -> {spread(last)}   per seed: " +
              ", ".join(f"{a:.2f}->{b:.2f}" for a, b in zip(first, last)))


if __name__ == "__main__":
    args = tyro.cli(Args)
    if args.quick:
        args.seeds, args.long_episodes = args.seeds[:1], 192
    demo_flags = ["--total_episodes", "192", "--eval_every", "3"] if args.quick else []
    long_flags = ["--total_episodes", str(args.long_episodes), "--learning_rate", str(args.long_learning_rate),
                  "--eval_every", "3" if args.quick else "20"]
    demo, long = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            print(f"seed {seed}: demo ...", flush=True)
            demo[seed] = run(os.path.join(tmp, f"demo{seed}"), args, seed, *demo_flags)
            if args.long_run and args.quick:  # (one run for both: the code is checked, nothing measured)
                long[seed] = demo[seed]
            elif args.long_run:
                print(f"seed {seed}: long run ...", flush=True)
                long[seed] = run(os.path.join(tmp, f"long{seed}"), args, seed, *long_flags)
    report(f"demo (python {args.script} --model tiny)", demo)
    print(f"  wall time                {spread([e[-1]['wall_seconds'] for e in demo.values()])} s; peak memory of "
          f"the learner and generator processes {spread([e[-1]['peak_gib'] for e in demo.values()])} GiB")
    if args.long_run:
        report(f"long run (--total_episodes {args.long_episodes} --learning_rate {args.long_learning_rate})", long)
    for seed, evals in long.items():
        peak = max(evals, key=lambda r: r["eval/gold_reward"])
        print(f"  seed {seed}: gold mean score peaks at step {peak['step']} ({peak['eval/gold_reward']:.2f}), ends at "
              f"{evals[-1]['eval/gold_reward']:.2f}; proxy mean score {peak['eval/proxy_reward']:.2f} there, "
              f"{evals[-1]['eval/proxy_reward']:.2f} at the end")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for seed, evals in demo.items():
        steps = [r["step"] for r in evals]
        for key, style in (("eval/gold_win_rate", "-"), ("eval/proxy_win_rate", ":")):
            axes[0].plot(steps, [r[key] for r in evals], style, color=f"C{seed}",
                         label=f"seed {seed}, {key.split('/')[1].split('_')[0]}")
        for key, style in (("eval/gold_reward", "-"), ("eval/proxy_reward", ":")):
            axes[1].plot(steps, [r[key] for r in evals], style, color=f"C{seed}")
        axes[2].plot([r["eval/perplexity"] for r in evals], [r["eval/gold_win_rate"] for r in evals], "o-",
                     color=f"C{seed}", label=f"seed {seed}")
    axes[0].set(xlabel="step", ylabel="win rate against the references", title="gold (solid) and proxy (dotted)")
    axes[1].set(xlabel="step", ylabel="mean score (normalised)", title="gold (solid) and proxy (dotted) mean score")
    axes[2].set(xlabel="perplexity of the summaries under the SFT model", ylabel="gold win rate",
                title="gold win rate against the KL proxy")
    axes[0].legend(fontsize=7)
    axes[2].legend(fontsize=7)
    fig.suptitle(f"python {args.script} --model tiny")
    fig.tight_layout()
    algorithm = os.path.splitext(args.script)[0].split("_")[-1]
    os.makedirs(args.plot_dir, exist_ok=True)
    demo_plot = os.path.join(args.plot_dir, "tiny_demo.png" if algorithm == "dpo" else f"tiny_demo_{algorithm}.png")
    fig.savefig(demo_plot, dpi=90)
    print(f"plot saved to {demo_plot}")
    if not args.long_run:
        sys.exit(0)

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for seed, evals in long.items():
        steps = [r["step"] for r in evals]
        axes[0].plot(steps, [r["eval/proxy_reward"] for r in evals], ":", color=f"C{seed}")
        axes[0].plot(steps, [r["eval/gold_reward"] for r in evals], "-", color=f"C{seed}", label=f"seed {seed}")
        axes[1].plot(steps, [r["eval/gold_win_rate"] for r in evals], "-", color=f"C{seed}", label=f"seed {seed}")
    axes[0].set(xlabel="step", ylabel="mean score (normalised)", title="mean scores: proxy (dotted), gold (solid)")
    axes[1].set(xlabel="step", ylabel="gold win rate against the references")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{args.script} --model tiny --total_episodes {args.long_episodes} "
                 f"--learning_rate {args.long_learning_rate}")
    fig.tight_layout()
    fig.savefig(os.path.join(args.plot_dir, "tiny_overoptimisation.png"), dpi=90)
    print(f"plot saved to {args.plot_dir}/tiny_overoptimisation.png")
