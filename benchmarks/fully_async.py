"""The fully asynchronous schedules measured on the long-tailed chains world: `fully_async_grpo.py --model tiny`.

Three tables, three seeds each, every run at the demo's hyperparameters (B = 16 groups of K = 4 a step, learning
rate 1e-4) for --steps steps, evaluated (greedy pass@1) on all 400 test problems at the start, half-way and at the
end, so that every gain is paired on the same problems:
  1. the schedules: synchronous (k = 0); k in {1, 2, 4, 8} with `pace` (k = 1 is the paper's one-step schedule,
     streamed: groups are taken as they finish, not as one batch); k in {2, 4, 8} with `drop` and twice the
     bound's room (k = 1 left out of `drop` and of table 2 to fit the sweep in its time; at the default room `drop`
     is `pace`: docs/fully_async.md, and the quick mode's run at that room shows it); k = 2 with in-flight weight
     updates under `head` (`recompute`).
     Pass@1 against steps (samples) and seconds, each side's idle fraction, staleness histograms, discards.
  2. naive against decoupled (AReaL's staleness table in miniature): `--proximal behaviour` (the ratio against the
     sampler) beside the `pace` runs of table 1 (`recompute`, decoupled PPO) at k in {2, 4, 8}.
  3. in-flight updates against drain-then-reload where generation is the bottleneck: k = 2, B = 4 groups a step,
     so that the generator drains its long tail every step; in flight under `pace` (the bound by the oldest token:
     a slow group still holds admission back) and `head` (AReaL's rule); seconds a step, the speed-up. (What
     `--kv_on_update keep` costs is measured token by token: benchmarks/token_versions.py.)
Gaps are paired by seed (the same seed: the same prompt order and initial weights) and judged on the
t-distribution's two-sided 95% threshold; "inconclusive" where they do not pass it. Saves fully_async.png (pass@1
against samples and against seconds, one line per schedule). Every run keeps its folder in --runs_dir; a finished
run is read, not run again (the sweep resumes).

    python benchmarks/fully_async.py            # 45 runs: about 70 minutes on 2 idle cores
    python benchmarks/fully_async.py --quick    # five short runs, one seed: checks the benchmark, measures nothing
"""
import os
import statistics
import sys
from dataclasses import dataclass, field

import tyro

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from fully_async_demo import histogram  # noqa: E402
from fully_async_demo import run as run_once  # noqa: E402
from stats import fmt, gap  # noqa: E402

B = 16  # groups a step (the demo's)


@dataclass
class Args:
    seeds: list[int] = field(default_factory=lambda: [1, 2, 3])
    """seeds of every configuration"""
    steps: int = 48
    """optimizer steps a run (tables 1 and 2: B = 16 groups of 4 a step; table 3: B = 4, twice as many steps)"""
    runs_dir: str = os.path.join(HERE, "runs", "fully_async")
    """where every run keeps its folder (a finished run is read, not run again)"""
    plot_dir: str = HERE
    """where the PNG goes"""
    quick: bool = False
    """one seed, five short runs (each kind): checks that the benchmark works, measures nothing"""


def stream(k: int, policy: str = "pace", *more: str) -> tuple:
    room = ("--max_in_flight", str(2 * (k + 1) * B)) if policy == "drop" else ()
    return ("--max_staleness", str(k), "--stale_policy", policy, *room, *more)


SCHEDULES = {"k = 0 (synchronous)": stream(0), **{f"k = {k}, pace": stream(k) for k in (1, 2, 4, 8)},
             "k = 2, head, in-flight (recompute)": stream(2, "head", "--inflight_updates"),
             **{f"k = {k}, drop (room 2(k+1)B)": stream(k, "drop") for k in (2, 4, 8)}}
DEFAULT_ROOM = {"k = 2, drop (default room)": ("--max_staleness", "2", "--stale_policy", "drop")}  # (quick only)
NAIVE = {f"k = {k}, pace, naive": stream(k, "pace", "--proximal", "behaviour") for k in (2, 4, 8)}
SMALL_BATCH = ("--batch_size", "16", "--per_device_train_batch_size", "16")  # B = 4 groups of 4
DRAIN_OR_INFLIGHT = {"B = 4, drain then reload": stream(2, "pace", *SMALL_BATCH),
                     "B = 4, pace, in-flight (recompute)": stream(2, "pace", "--inflight_updates", *SMALL_BATCH),
                     "B = 4, head, in-flight (recompute)": stream(2, "head", "--inflight_updates", *SMALL_BATCH)}
QUICK = ("k = 2, drop (default room)", "k = 2, drop (room 2(k+1)B)", "k = 2, pace, naive",
         "B = 4, drain then reload", "B = 4, head, in-flight (recompute)")


def folder_name(name: str, seed: int) -> str:
    keep = "".join(c if c.isalnum() else "_" for c in name)
    return f"{'_'.join(part for part in keep.split('_') if part)}__seed{seed}"


def sweep(configs: dict, args: Args) -> dict:
    """{name: {seed: (steps, evals, regime)}} for the configurations this mode runs, in their order."""
    names = [name for name in configs if not args.quick or name in QUICK]
    seeds = args.seeds[:1] if args.quick else args.seeds
    steps = 4 if args.quick else args.steps
    quick = ("--eval_every", "0", "--num_eval_prompts", "32", "--num_final_eval_prompts", "32") if args.quick \
        else ()
    results = {name: {} for name in names}
    # seed by seed, every configuration in turn: a seed's pairs run minutes apart, not a block of runs apart, so the
    # machine's drifting speed does not pass for a difference between configurations
    for seed in seeds:
        for name in names:
            per_step = 4 if "B = 4" in name else B
            length = ("--total_episodes", str(steps * 4 * per_step * (2 if per_step == 4 else 1)),
                      "--eval_every", str(steps // 2 * (2 if per_step == 4 else 1)))
            results[name][seed] = run_once(folder_name(name, seed), args, "--seed", str(seed), *configs[name],
                                           *length, *quick)
    return results


def paired(values: list[float], baseline: list[float]) -> str:
    """The per-seed difference, mean ± s.e., its t and the verdict at the two-sided 95% threshold."""
    return gap(values, baseline)["text"]


def final(runs: dict) -> list[float]:
    return [evals[-1]["eval/pass_at_1"] for _, evals, _ in runs.values()]


def pooled(runs: dict, key: str) -> float:
    """The mean of a per-step metric over every step of every seed."""
    return statistics.mean(r[key] for steps, _, _ in runs.values() for r in steps)


def whole_run(runs: dict, key: str) -> float:
    """The mean over seeds of a running total at a run's last step (an idle fraction: of the whole run)."""
    return statistics.mean(steps[-1][key] for steps, _, _ in runs.values())


def report_schedules(results: dict) -> None:
    print("\n1. The schedules (B = 16 groups of 4; pass@1 greedy on the same test problems at step 0 and at the end; "
          "mean ± s.e. over seeds):")
    base = next(iter(results.values()))
    print(f"   SFT policy: {fmt([evals[0]['eval/pass_at_1'] for _, evals, _ in base.values()])}")
    sync, demo = results.get("k = 0 (synchronous)"), results.get("k = 2, pace")
    for name, runs in results.items():
        steps = [s for s, _, _ in runs.values()]
        seconds = [s[-1]["time/elapsed"] for s in steps]
        discarded = sum(s[-1]["rollouts/discarded_total"] for s in steps)
        accepted = sum(s[-1]["rollouts/accepted_total"] for s in steps)
        gain = paired(final(runs), [evals[0]["eval/pass_at_1"] for _, evals, _ in runs.values()])
        lengths = "/".join(f"{pooled(runs, 'length/' + q):.0f}" for q in ("p50", "p90", "p99"))
        print(f"   {name:<36} pass@1 {fmt(final(runs))}, gain {gain}")
        print(f"   {'':<36} {statistics.mean(seconds):.0f} s of training; idle: learner "
              f"{whole_run(runs, 'idle/learner_fraction'):.2f}, generator "
              f"{whole_run(runs, 'idle/generator_fraction'):.2f}; staleness "
              f"{histogram([r for s in steps for r in s])} (tokens' mean "
              f"{pooled(runs, 'staleness/token_mean'):.2f}); discarded {discarded / (discarded + accepted):.0%}; "
              f"completions over 2+ versions {pooled(runs, 'inflight/multi_version_fraction'):.0%}; length "
              f"p50/p90/p99 {lengths}")
        if sync is not None and runs is not sync:
            print(f"   {'':<36} against k = 0: pass@1 {paired(final(runs), final(sync))}; seconds "
                  f"{paired(seconds, [s[-1]['time/elapsed'] for s, _, _ in sync.values()])}")
        if demo is not None and runs is not demo and runs is not sync:
            print(f"   {'':<36} against k = 2, pace (the demo's): pass@1 {paired(final(runs), final(demo))}")


def report_naive(naive: dict, schedules: dict) -> None:
    print("\n2. Naive (--proximal behaviour) against decoupled (recompute), final pass@1, mean ± s.e.:")
    for name, runs in naive.items():
        decoupled = schedules.get(name.replace(", naive", ""))
        against = (f"; decoupled {fmt(final(decoupled))}; naive - decoupled "
                   f"{paired(final(runs), final(decoupled))}") if decoupled else ""
        print(f"   {name:<24} naive {fmt(final(runs))}{against}")


def report_inflight(results: dict) -> None:
    print("\n3. In-flight updates against drain-then-reload where generation is the bottleneck (k = 2, B = 4):")
    drain = results.get("B = 4, drain then reload")
    for name, runs in results.items():
        per_step = [s[-1]["time/elapsed"] / len(s) for s, _, _ in runs.values()]
        line = (f"   {name:<30} {statistics.mean(per_step):.3f} s a step; idle: learner "
                f"{whole_run(runs, 'idle/learner_fraction'):.2f}, generator "
                f"{whole_run(runs, 'idle/generator_fraction'):.2f}; completions over 2+ versions "
                f"{pooled(runs, 'inflight/multi_version_fraction'):.0%}, versions a completion "
                f"{pooled(runs, 'inflight/versions_per_completion'):.2f}; tokens' staleness "
                f"{pooled(runs, 'staleness/token_mean'):.2f}; pass@1 {fmt(final(runs))}")
        if drain is not None and runs is not drain:
            drain_per_step = [s[-1]["time/elapsed"] / len(s) for s, _, _ in drain.values()]
            speedups = [d / p for d, p in zip(drain_per_step, per_step)]
            line += f"\n   {'':<30} speed-up over drain-then-reload {fmt(speedups)}x; seconds a step " \
                    f"{paired(per_step, drain_per_step)}"
        print(line)


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, runs in results.items():
        evals = [e for _, e, _ in runs.values()]
        mean = [statistics.mean(e[i]["eval/pass_at_1"] for e in evals) for i in range(len(evals[0]))]
        samples = [e["step"] * B * 4 for e in evals[0]]
        seconds = [statistics.mean(e[i]["time/elapsed"] for e in evals) for i in range(len(evals[0]))]
        style = "--" if "drop" in name else ":" if "in-flight" in name else "-"
        axes[0].plot(samples, mean, style, marker="o", label=name)
        axes[1].plot(seconds, mean, style, marker="o")
    axes[0].set(xlabel="completions trained on", ylabel="greedy pass@1 (400 test problems, mean of seeds)")
    axes[1].set(xlabel="seconds of training (mean of seeds)", ylabel="greedy pass@1")
    axes[0].legend(fontsize=7)
    fig.suptitle("python benchmarks/fully_async.py (the chains world, 2 CPU cores)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    print(f"plot saved to {path}")


if __name__ == "__main__":
    args = tyro.cli(Args)
    os.makedirs(args.plot_dir, exist_ok=True)  # before the sweep, so a path that cannot be made fails at once
    # (the order within a seed: the speed-up first, then the schedules and the naive objective, `drop` last)
    order = {**DRAIN_OR_INFLIGHT, **{name: flags for name, flags in SCHEDULES.items() if "drop" not in name},
             **NAIVE, **SCHEDULES, **(DEFAULT_ROOM if args.quick else {})}
    results = sweep(order, args)
    schedules = {name: results[name] for name in [*SCHEDULES, *DEFAULT_ROOM] if name in results}
    naive = {name: results[name] for name in NAIVE if name in results}
    inflight = {name: results[name] for name in DRAIN_OR_INFLIGHT if name in results}
    report_schedules(schedules)
    report_naive(naive, schedules)
    report_inflight(inflight)
    plot(schedules, os.path.join(args.plot_dir, "fully_async.png"))
