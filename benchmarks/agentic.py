"""Does staleness compound across turns? The experiment of docs/agentic.md (pre-registered there before the runs).

`agentic_grpo.py --model tiny` on the tool world at group staleness k in {0, 2, 4, 8} (`pace`: every episode's
oldest token at most k versions behind the learner), three arms at each k > 0, the same seeds, the same prompts:
  turns       a version loads between any two turns (an episode's turns may be sampled by different versions), each
              token corrected by its own sampler's log-prob (the script's default);
  atomic      --episode_atomic: a version loads only between episodes (no episode spans two versions: the
              single-version data of a single-turn experiment, on the same problems, policy and tool);
  first_turn  loads between turns as `turns`, mu from each episode's first turn's version for every token
              (--behaviour_version first_turn: what a system that tags episodes, not tokens, would compute).
At k = 0 the three are one run (nothing loads while an episode runs). Every run has the same tool latency
(long-tailed), so that an episode spans versions as it would with a slow environment.

Prints, per arm and k, the final greedy pass@1 on the 400 test problems (mean ± s.e. over seeds), its gain over
the SFT policy, the within-episode staleness, the share of episodes that span versions and the lag (`lag/kl_token`,
the sampler's distance from the learner per token, the run's mean); then the pre-registered
comparisons, paired by seed and judged on the t-distribution (Q1: turns - atomic at each k, and each arm's drop from
k = 0; Q2: turns - first_turn at each k), with a Holm line over the table's comparisons. Saves agentic.png (pass@1
against k, an arm a line). A run whose folder holds its final evaluation is read, not run again (resumable).

    python benchmarks/agentic.py            # 30 runs, about an hour on 2 cores
    python benchmarks/agentic.py --quick    # one short run (first_turn, k = 2): checks it, measures nothing
    python benchmarks/agentic.py --demo     # the README's demo over three seeds, and its gain (about 8 minutes)
"""
import json
import math
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass, field

import tyro

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from stats import bound_against_margin, fmt, gap, holm_line, mean_and_stderr  # noqa: E402

ARMS = {"turns": (), "atomic": ("--episode_atomic",), "first_turn": ("--behaviour_version", "first_turn")}
TOOL = ("--tool_latency", "0.05", "--tool_latency_distribution", "lognormal")  # (the same in every run)
Q1_MARGIN = -0.02  # the pre-registered prediction (docs/agentic.md): turns - atomic >= -0.02 at every k


@dataclass
class Args:
    seeds: list[int] = field(default_factory=lambda: [1, 2, 3])
    """seeds, each run by every arm at every k (paired by seed)"""
    staleness: list[int] = field(default_factory=lambda: [0, 2, 4, 8])
    """the k values (--max_staleness); k = 0 is one run per seed, every arm's"""
    runs_dir: str = os.path.join(HERE, "runs", "agentic")
    """where every run keeps its folder (a finished run is read, not run again)"""
    plot_dir: str = HERE
    """where the PNG goes"""
    quick: bool = False
    """one short run, one seed: the first_turn arm at k = 2 (mu recomputed under each episode's first turn's version
    while episodes span versions): checks that the benchmark runs, measures nothing (the tables, on the archived
    sweep: docs/runs/agentic.tar.xz)"""
    demo: bool = False
    """instead of the experiment: the demo as the README gives it (`agentic_grpo.py --model tiny`, its defaults, no
    tool latency) over the seeds, and its gain over the SFT policy"""


def run(name: str, args: Args, *flags: str) -> dict:
    """A run's steps and evaluations, running it unless its folder holds a finished one."""
    folder = os.path.join(args.runs_dir, name)
    done = os.path.join(folder, "done")
    if not os.path.exists(done):
        print(f"{name} ...", flush=True)
        quick = ("--total_episodes", "192", "--batch_size", "32", "--per_device_train_batch_size", "32",
                 "--num_eval_prompts", "32", "--num_final_eval_prompts", "32") if args.quick else ()
        result = subprocess.run([sys.executable, os.path.join(REPO, "agentic_grpo.py"), "--model", "tiny",
                                 "--output_dir", folder, *flags, *quick], cwd=REPO, capture_output=True, text=True)
        if result.returncode:
            raise SystemExit(f"{name} failed (exit code {result.returncode}):\n{result.stderr[-3000:]}")
        open(done, "w").close()
    records = [json.loads(line) for line in open(os.path.join(folder, "metrics.jsonl"))]
    steps = [r for r in records if "staleness/mean" in r]
    evals = [r for r in records if "eval/pass_at_1" in r]
    return dict(sft=evals[0]["eval/pass_at_1"], final=evals[-1]["eval/pass_at_1"],
                within=statistics.mean(r["staleness/within_episode_mean"] for r in steps),
                spanning=statistics.mean(r["episode/multi_version_fraction"] for r in steps),
                turns=statistics.mean(r["episode/turns_mean"] for r in steps),
                lag=statistics.mean(r["lag/kl_token"] for r in steps),
                token_staleness=statistics.mean(r.get("staleness/token_mean", math.nan) for r in steps),
                seconds=steps[-1]["time/elapsed"])


def sweep(args: Args) -> dict:
    """{(arm, k): {seed: run}} over the design (k = 0: one run per seed, every arm's)."""
    results = {}
    for seed in args.seeds:
        for k in args.staleness:
            for arm, flags in ({"first_turn": ARMS["first_turn"]} if args.quick else ARMS).items():
                name = f"k{k}_seed{seed}" if k == 0 else f"{arm}_k{k}_seed{seed}"
                command = ("--eval_every", "0", *TOOL, "--seed", str(seed), "--max_staleness", str(k),
                           *(flags if k else ()))
                results.setdefault((arm, k), {})[seed] = run(name, args, *command)
    return results


def report(results: dict, args: Args) -> None:
    seeds, ks = args.seeds, args.staleness
    any_run = next(iter(results.values()))  # (every run's step 0 is the SFT policy's, on the same problems)
    print(f"\nfinal greedy pass@1 on the tool world's test problems (mean ± s.e. over seeds {seeds}); SFT "
          f"{fmt([any_run[s]['sft'] for s in seeds])}")
    print(f"{'arm':>11} {'k':>3}  {'pass@1':>15}  {'gain over SFT':>15}  {'within-episode':>15}  "
          f"{'spanning':>9}  {'turns':>5}  {'seconds':>7}  {'lag/kl_token':>12}")
    for (arm, k), runs in results.items():
        if k == 0 and arm != "turns":
            continue
        values = [runs[s] for s in seeds]
        print(f"{arm if k else 'all arms':>11} {k:>3}  {fmt([v['final'] for v in values]):>15}  "
              f"{fmt([v['final'] - v['sft'] for v in values]):>15}  {fmt([v['within'] for v in values]):>15}  "
              f"{statistics.mean(v['spanning'] for v in values):>9.3f}  "
              f"{statistics.mean(v['turns'] for v in values):>5.2f}  "
              f"{statistics.mean(v['seconds'] for v in values):>7.0f}  "
              f"{statistics.mean(v['lag'] for v in values):>12.5f}")
    if len(seeds) < 2:
        print("(one seed: no comparison is judged)")
        return

    def final(arm: str, k: int) -> list:
        return [results[(arm, k)][s]["final"] for s in seeds]

    sft = [results[("turns", 0)][s]["sft"] for s in seeds]
    print("\ndoes RL learn on this world (final - SFT, paired by seed; not in the pre-registered family)?")
    for k in ks:  # (the gain each arm makes: does RL learn on this world at all?)
        for arm in ARMS if k else ("turns",):
            print(f"  gain over SFT, {arm if k else 'all arms'} at k = {k}: {gap(final(arm, k), sft)['text']}")
    comparisons = []
    for k in ks[1:]:
        comparisons.append((f"Q1  turns - atomic at k = {k}", gap(final("turns", k), final("atomic", k),
                                                                      interval=True)))
    for k in ks[1:]:
        for arm in ("turns", "atomic"):
            comparisons.append((f"Q1  {arm} at k = {k} - k = 0", gap(final(arm, k), final("turns", 0),
                                                                      interval=True)))
    for k in ks[1:]:
        comparisons.append((f"Q2  turns - first_turn at k = {k}", gap(final("turns", k), final("first_turn", k),
                                                                      interval=True)))
    print("\nthe pre-registered comparisons (paired by seed; t-distribution, two-sided 95%):")
    for label, result in comparisons:
        print(f"  {label:<34} {result['text']}")
    print(f"  {holm_line([(label.strip(), result) for label, result in comparisons])}")
    # The prediction is a margin, so it is judged by a one-sided bound against it (not by a gap that is merely not
    # significant); "at every k" holds when it holds at each k (an intersection of tests: no correction needed)
    bounds = [bound_against_margin(final("turns", k), final("atomic", k), Q1_MARGIN) for k in ks[1:]]
    print(f"\nQ1's prediction, turns - atomic >= {Q1_MARGIN} at every k (paired by seed): "
          + "; ".join(f"k = {k}: {b['text']}" for k, b in zip(ks[1:], bounds))
          + f"; at every k: {'holds' if all(b['holds'] for b in bounds) else 'not shown'}")


def plot(results: dict, args: Args, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for arm in ARMS:
        ks = [k for k in args.staleness if ("turns" if k == 0 else arm, k) in results]  # (--quick: one)
        points = [mean_and_stderr([results[("turns" if k == 0 else arm, k)][s]["final"] for s in args.seeds])
                  for k in ks]
        ax.errorbar(ks, [m for m, _ in points], yerr=[e for _, e in points], marker="o", capsize=3, label=arm)
    ax.axhline(statistics.mean(next(iter(results.values()))[s]["sft"] for s in args.seeds), color="grey", ls=":",
               label="SFT")
    ax.set(xlabel="k (--max_staleness, pace)", ylabel="final greedy pass@1 (± s.e. over seeds)")
    ax.legend(fontsize=8)
    fig.suptitle("python benchmarks/agentic.py (the tool world)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    print(f"plot saved to {path}")


if __name__ == "__main__":
    args = tyro.cli(Args)
    os.makedirs(args.plot_dir, exist_ok=True)  # before the sweep, so a path that cannot be made fails at once
    if args.quick:
        args.seeds, args.staleness = args.seeds[:1], [2]
    if args.demo:
        demo = {seed: run(f"demo_seed{seed}", args, "--seed", str(seed)) for seed in args.seeds}
        print(f"\nthe demo (python agentic_grpo.py --model tiny), final greedy pass@1 over seeds {args.seeds}: "
              f"{fmt([r['final'] for r in demo.values()])} (SFT {fmt([r['sft'] for r in demo.values()])}); "
              f"episodes over two versions or more: {fmt([r['spanning'] for r in demo.values()])}; seconds of "
              f"training {fmt([r['seconds'] for r in demo.values()], 0)}")
        if len(args.seeds) > 1:
            print(f"  gain over SFT, paired by seed: "
                  f"{gap([r['final'] for r in demo.values()], [r['sft'] for r in demo.values()])['text']}")
    else:
        results = sweep(args)
        report(results, args)
        plot(results, args, os.path.join(args.plot_dir, "agentic.png"))
