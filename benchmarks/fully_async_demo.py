"""The fully asynchronous demo, measured: `fully_async_grpo.py --model tiny` over three seeds (the schedules beside
it, `pace` against `drop`, in-flight updates: benchmarks/fully_async.py).

Prints the demo's greedy pass@1 on the chains world's 400 test problems at every evaluation (mean ± standard error
over seeds), the gain from the SFT policy with its paired t-statistic against the t-distribution's two-sided 95%
threshold, and each seed's staleness histogram and regime line. Saves fully_async_demo.png (pass@1 against step and
against time). Every run keeps its folder in --runs_dir; a run whose folder holds its final evaluation is read, not
run again (the sweep resumes where it stopped).

    python benchmarks/fully_async_demo.py            # ~8 minutes on 2 cores
    python benchmarks/fully_async_demo.py --quick    # one seed, a short run: checks the benchmark, measures nothing
"""
import json
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass, field

import tyro

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from stats import fmt, gap  # noqa: E402


@dataclass
class Args:
    seeds: list[int] = field(default_factory=lambda: [1, 2, 3])
    """seeds of the demo"""
    runs_dir: str = os.path.join(HERE, "runs", "fully_async_demo")
    """where every run keeps its folder (a finished run is read, not run again)"""
    plot_dir: str = HERE
    """where the PNG goes"""
    quick: bool = False
    """one seed and a few steps of each run: checks that the benchmark works, measures nothing"""


def run(name: str, args: Args, *flags: str) -> tuple[list, list, str]:
    """The run's training steps, evaluations and regime line, running it unless its folder holds a finished one."""
    folder = os.path.join(args.runs_dir, name)
    if not finished(folder):
        print(f"{name} ...", flush=True)
        result = subprocess.run([sys.executable, os.path.join(REPO, "fully_async_grpo.py"), "--model", "tiny",
                                 "--output_dir", folder, *flags], cwd=REPO, capture_output=True, text=True)
        if result.returncode:
            raise SystemExit(f"{name} failed (exit code {result.returncode}):\n{result.stderr[-3000:]}")
        with open(os.path.join(folder, "regime.txt"), "w") as f:
            f.write(next(line for line in result.stdout.splitlines()[::-1] if line.startswith("regime:")))
    records = [json.loads(line) for line in open(os.path.join(folder, "metrics.jsonl"))]
    return ([r for r in records if "staleness/mean" in r], [r for r in records if "eval/pass_at_1" in r],
            open(os.path.join(folder, "regime.txt")).read())


def finished(folder: str) -> bool:
    return os.path.exists(os.path.join(folder, "regime.txt"))  # (written once the run has ended)


def report_demo(demo: dict) -> None:
    steps = [r["step"] for r in next(iter(demo.values()))[1]]
    print(f"\ndemo (python fully_async_grpo.py --model tiny), greedy pass@1 on the test problems, mean ± s.e. over "
          f"seeds {list(demo)}:")
    for i, step in enumerate(steps):
        values = [evals[i]["eval/pass_at_1"] for _, evals, _ in demo.values()]
        elapsed = [evals[i]["time/elapsed"] for _, evals, _ in demo.values()]
        print(f"  step {step:>3}: {fmt(values)}   (per seed: {', '.join(f'{v:.3f}' for v in values)}; "
              f"{statistics.mean(elapsed):.0f} s into training)")
    final, sft = ([evals[i]["eval/pass_at_1"] for _, evals, _ in demo.values()] for i in (-1, 0))
    if len(final) > 1:
        print(f"  gain from SFT (paired over seeds, both on the same test problems): {gap(final, sft)['text']}")
    for seed, (steps_, _, regime) in demo.items():
        print(f"  seed {seed}: staleness {histogram(steps_)}, {regime}")


def histogram(steps: list) -> str:
    """The staleness histogram over a run's groups: {staleness: share of the groups trained on}."""
    counts = {}
    for record in steps:
        for staleness, n in record["staleness/histogram"].items():
            counts[int(staleness)] = counts.get(int(staleness), 0) + n
    total = sum(counts.values())
    return "{" + ", ".join(f"{s}: {n / total:.2f}" for s, n in sorted(counts.items())) + "}"


def plot(demo: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for seed, (_, evals, _) in demo.items():
        axes[0].plot([r["step"] for r in evals], [r["eval/pass_at_1"] for r in evals], "o-", label=f"seed {seed}")
        axes[1].plot([r["time/elapsed"] for r in evals], [r["eval/pass_at_1"] for r in evals], "o-")
    axes[0].set(xlabel="step", ylabel="greedy pass@1 (400 test problems)")
    axes[1].set(xlabel="seconds of training", ylabel="greedy pass@1")
    axes[0].legend(fontsize=8)
    fig.suptitle("python fully_async_grpo.py --model tiny (the chains world)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    print(f"plot saved to {path}")


if __name__ == "__main__":
    args = tyro.cli(Args)
    os.makedirs(args.plot_dir, exist_ok=True)  # before the sweep, so a path that cannot be made fails at once
    quick = ("--total_episodes", "96", "--batch_size", "16", "--per_device_train_batch_size", "16",
             "--eval_every", "0", "--num_eval_prompts", "32", "--num_final_eval_prompts", "32") if args.quick else ()
    seeds = args.seeds[:1] if args.quick else args.seeds
    demo = {seed: run(f"demo_seed{seed}", args, "--seed", str(seed), *quick) for seed in seeds}
    report_demo(demo)
    plot(demo, os.path.join(args.plot_dir, "fully_async_demo.png"))
