"""The paper's GSM8k comparison at CPU scale: the GSM8k miniature trained with asynchronous Online DPO and with the
synchronous schedule (`gsm8k_async_dpo.py --sync`), same seed, steps and hyperparameters, over several seeds.

Prints pass@1 before and after (with its standard error) and the training wall-clock time of each run, the speed-up
of async over sync per seed, and saves a plot of pass@1 against wall-clock time.

    python benchmarks/gsm8k_async_vs_sync.py            # 2 seeds x (async, sync): ~8 minutes on 2 cores
    python benchmarks/gsm8k_async_vs_sync.py --quick    # one seed, short runs, for CI
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import tyro

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


@dataclass
class Args:
    seeds: list[int] = field(default_factory=lambda: [1, 2])
    """seeds (each runs async and sync)"""
    tiny_dir: str = "~/.cache/async-rlhf/gsm8k-v1"
    """the GSM8k miniature (built there if missing)"""
    plot_path: str = os.path.join(HERE, "gsm8k_async_vs_sync.png")
    """where the plot of pass@1 against wall-clock time goes"""
    quick: bool = False
    """one seed and short runs: checks that the benchmark works, measures nothing"""


def run(args: Args, seed: int, sync: bool, output_dir: str) -> dict:
    flags = ["--total_episodes", "160", "--eval_every", "2", "--num_eval_prompts", "40",
             "--num_final_eval_prompts", "40"] if args.quick else []
    start = time.time()
    subprocess.run([sys.executable, os.path.join(REPO, "gsm8k_async_dpo.py"), "--model", "tiny", "--tiny_dir",
                    args.tiny_dir, "--seed", str(seed), "--output_dir", output_dir, *(["--sync"] if sync else []),
                    *flags], check=True, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    records = [json.loads(line) for line in open(os.path.join(output_dir, "metrics.jsonl"))]
    steps = [r for r in records if "loss/dpo" in r]
    return dict(evals=[r for r in records if "eval/pass_at_1" in r], train_seconds=steps[-1]["time/elapsed"],
                process_seconds=time.time() - start, staleness=sorted({r["staleness"] for r in steps}))


def spread(values: list[float]) -> str:
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f}" if len(values) > 1 else f"{values[0]:.3f}"


if __name__ == "__main__":
    args = tyro.cli(Args)
    if args.quick:
        args.seeds = args.seeds[:1]
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for schedule in ("async", "sync"):
                print(f"seed {seed}: {schedule} ...", flush=True)
                runs[schedule, seed] = run(args, seed, schedule == "sync", os.path.join(tmp, f"{schedule}{seed}"))

    print("\n| schedule | seed | pass@1 before | pass@1 after | training time | staleness |")
    print("|---|---|---|---|---|---|")
    for (schedule, seed), r in runs.items():
        first, last = r["evals"][0], r["evals"][-1]
        print(f"| {schedule} | {seed} | {first['eval/pass_at_1']:.3f} ± {first['eval/pass_at_1_stderr']:.3f} | "
              f"{last['eval/pass_at_1']:.3f} ± {last['eval/pass_at_1_stderr']:.3f} | {r['train_seconds']:.1f} s | "
              f"{r['staleness']} |")
    for schedule in ("async", "sync"):
        after = [runs[schedule, s]["evals"][-1]["eval/pass_at_1"] for s in args.seeds]
        seconds = [runs[schedule, s]["train_seconds"] for s in args.seeds]
        print(f"{schedule}: pass@1 after {spread(after)}, training time {spread(seconds)} s (mean ± std over seeds)")
    speedups = [runs["sync", s]["train_seconds"] / runs["async", s]["train_seconds"] for s in args.seeds]
    print(f"speed-up of async over sync (sync time / async time): {spread(speedups)}; per seed "
          + ", ".join(f"{x:.2f}" for x in speedups) + " (the paper: 218 / 129 min = 1.69)")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for (schedule, seed), r in runs.items():
        ax.plot([e["time/elapsed"] for e in r["evals"]], [e["eval/pass_at_1"] for e in r["evals"]],
                "-o" if schedule == "async" else "--s", color=f"C{args.seeds.index(seed)}",
                label=f"{schedule}, seed {seed}")
    ax.set(xlabel="wall-clock seconds since training began", ylabel="greedy pass@1 (test split)",
           title="GSM8k miniature: async Online DPO against sync")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.plot_path, dpi=90)
    print(f"plot saved to {args.plot_path}")
