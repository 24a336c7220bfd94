"""The fully asynchronous schedules measured on the long-tailed chains world: `fully_async_grpo.py --model tiny`.

Four tables, every run at the demo's hyperparameters (K = 4, learning rate 1e-4) for the completions of --steps
steps of B = 16 groups, evaluated (greedy pass@1) on all 400 test problems at the start, half-way and at the end, so
that every gain is paired on the same problems:
  1. the schedules (B = 16, three seeds): synchronous (k = 0); k in {1, 2, 4, 8} with `pace` (k = 1 is the paper's
     one-step schedule, streamed: groups are taken as they finish, not as one batch); k in {2, 4, 8} with `drop` and
     twice the bound's room (at the default room `drop` is `pace`: docs/fully_async.md, and the quick mode's run at
     that room shows it); k = 2 with in-flight weight updates under `head` (`recompute`). Pass@1 against steps
     (samples) and seconds, each side's idle fraction, staleness histograms, discards.
  2. naive against decoupled (AReaL's staleness table in miniature, three seeds): `--proximal behaviour` (the ratio
     against the sampler) and `recompute` (decoupled PPO) at k in {2, 4, 8}, with one optimizer step a batch (the
     `pace` runs of table 1: the ratio to the proximal policy is 1, only the truncated weight acts) and with two
     (`--num_mini_batches 2`, AReaL's setting: the clip acts from the second on).
  3. in-flight updates against drain-then-reload at the setting the capacity model chose before the runs
     (benchmarks/capacity.py's design search; the prediction is in docs/fully_async.md): five seeds, each seed's
     runs back to back; in flight under `pace` (the bound by the oldest token: a slow group still holds admission
     back) and `head` (AReaL's rule); seconds a step, the speed-up. (What `--kv_on_update keep` costs is measured
     token by token: benchmarks/token_versions.py.)
  4. time to the one-step run's final pass@1 (k = 1, `pace`) for the fastest streaming schedule, both evaluated
     every eighth of the run, seconds of training with the evaluations left out: the figure users compare with the
     published speed-ups.
Gaps are paired by seed (the same seed: the same prompt order and initial weights) and judged on the
t-distribution's two-sided 95% threshold; "inconclusive" where they do not pass it. Runs go seed by seed, every
configuration in turn. Saves fully_async.png (table 1: pass@1 against samples and against seconds). Every run keeps
its folder in --runs_dir; a finished run is read, not run again (the sweep resumes).

    python benchmarks/fully_async.py                # every table: about 3 hours on 2 idle cores
    python benchmarks/fully_async.py --tables 2 3   # some of them
    python benchmarks/fully_async.py --quick        # one short run: checks it, measures nothing
    python benchmarks/fully_async.py --tables 5 --runs_dir benchmarks/runs/fully_async_speed   # 5. the speed rerun
    python benchmarks/fully_async.py --speed_precision --runs_dir benchmarks/runs/fully_async_schedules

  5. the three registered speed-ups rerun on fresh seeds (docs/fully_async.md: registered before its runs): k = 0,
     k = 1 and k = 2 `pace`, k = 2 `drop`, seed by seed; each speed-up a factor on log seconds with its interval,
     Holm over the three. --speed_precision: the interval each n of seeds can expect, from table 1's three seeds.
"""
import math
import os
import statistics
import sys
from dataclasses import dataclass, field

import tyro

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from fully_async_demo import finished, histogram  # noqa: E402
from fully_async_demo import run as run_once  # noqa: E402
from stats import factor, fmt, gap, holm_line, t_95  # noqa: E402

B = 16  # groups a step (the demo's)


@dataclass
class Args:
    seeds: list[int] = field(default_factory=lambda: [1, 2, 3])
    """seeds of every configuration of tables 1, 2 and 4"""
    inflight_seeds: list[int] = field(default_factory=lambda: [1, 2, 3, 4, 5])
    """seeds of table 3 (in flight against draining), each seed's pair run back to back"""
    tables: list[int] = field(default_factory=lambda: [1, 2, 3, 4])
    """which tables to run and print (5: the speed rerun, not in the default)"""
    speed_seeds: list[int] = field(default_factory=lambda: list(range(11, 17)))
    """seeds of table 5, the speed rerun: fresh (the registered 11-16)"""
    speed_precision: bool = False
    """the speed rerun's precision analysis from table 1's archived seeds (--runs_dir: that sweep's folder): runs
    nothing"""
    steps: int = 48
    """optimizer steps a run at B = 16 (a run at a smaller B takes as many completions: more steps)"""
    runs_dir: str = os.path.join(HERE, "runs", "fully_async")
    """where every run keeps its folder (a finished run is read, not run again)"""
    plot_dir: str = HERE
    """where the PNG goes"""
    quick: bool = False
    """one short run, one seed, `drop` at the default room (at which it discards nothing: it is `pace`): checks that
    the benchmark runs, measures nothing"""


def stream(k: int, policy: str = "pace", *more: str) -> tuple:
    room = ("--max_in_flight", str(2 * (k + 1) * B)) if policy == "drop" else ()
    return ("--max_staleness", str(k), "--stale_policy", policy, *room, *more)


M2 = ("--num_mini_batches", "2", "--per_device_train_batch_size", str(B * 4 // 2))  # two steps a batch
SCHEDULES = {"k = 0 (synchronous)": stream(0), **{f"k = {k}, pace": stream(k) for k in (1, 2, 4, 8)},
             "k = 2, head, in-flight (recompute)": stream(2, "head", "--inflight_updates"),
             **{f"k = {k}, drop (room 2(k+1)B)": stream(k, "drop") for k in (2, 4, 8)}}
DEFAULT_ROOM = {"k = 2, drop (default room)": ("--max_staleness", "2", "--stale_policy", "drop")}  # (quick only)
OBJECTIVES = {**{f"k = {k}, pace, naive": stream(k, "pace", "--proximal", "behaviour") for k in (2, 4, 8)},
              **{f"k = {k}, pace, m = 2": stream(k, "pace", *M2) for k in (2, 4, 8)},
              **{f"k = {k}, pace, naive, m = 2": stream(k, "pace", "--proximal", "behaviour", *M2) for k in (2, 4, 8)}}
# Table 3's setting, chosen by the capacity model's design search before it ran (docs/fully_async.md, the
# prediction): B = 2 groups a step, the naive objective (no proximal pass) and two optimizer steps a batch, where
# the drained generator leaves the learner idle most and `head` in flight with the KV cache kept should pay 1.22x
DESIGN_B = 2
DESIGN = ("--batch_size", str(DESIGN_B * 4), "--per_device_train_batch_size", str(DESIGN_B * 2), "--proximal",
          "behaviour", "--num_mini_batches", "2")
DRAIN_OR_INFLIGHT = {"designed, drain then reload": stream(2, "pace", *DESIGN),
                     "designed, head, in-flight (keep)": stream(2, "head", "--inflight_updates", "--kv_on_update",
                                                                "keep", *DESIGN),
                     "designed, head, in-flight (recompute)": stream(2, "head", "--inflight_updates", *DESIGN),
                     "designed, pace, in-flight (recompute)": stream(2, "pace", "--inflight_updates", *DESIGN)}
# Table 4: time to the one-step run's final pass@1, evaluated every eighth of the run
TO_TARGET = {"k = 1, pace, evaluated often": stream(1),
             "k = 2, drop (room 2(k+1)B), evaluated often": stream(2, "drop")}
# Table 5: the three pre-registered speed comparisons against k = 0, rerun on fresh seeds
SPEED = {name: SCHEDULES[name] for name in ("k = 0 (synchronous)", "k = 1, pace", "k = 2, pace",
                                            "k = 2, drop (room 2(k+1)B)")}
QUICK = ("k = 2, drop (default room)",)  # (the tables: on the archived sweeps, docs/runs/fully_async*.tar.xz)


def folder_name(name: str, seed: int) -> str:
    keep = "".join(c if c.isalnum() else "_" for c in name)
    return f"{'_'.join(part for part in keep.split('_') if part)}__seed{seed}"


def sweep(configs: dict, seeds: list, args: Args) -> dict:
    """{name: {seed: (steps, evals, regime)}} for the configurations this mode runs, seed by seed: every configuration
    in turn, so that a seed's runs are minutes apart, not a block of runs apart, and the machine's drifting speed
    does not pass for a difference between configurations. A run takes the completions of `--steps` steps of B = 16
    (at a smaller B, more steps), evaluated at its start, half-way and its end (every eighth: "evaluated often")."""
    names = [name for name in configs if not args.quick or name in QUICK]
    seeds = seeds[:1] if args.quick else seeds
    steps = 4 if args.quick else args.steps
    quick = ("--eval_every", "0", "--num_eval_prompts", "32", "--num_final_eval_prompts", "32") if args.quick \
        else ()
    results = {name: {} for name in names}
    for seed in seeds:
        for name in names:
            per_step = DESIGN_B if name.startswith("designed") else B
            run_steps = steps * B // per_step
            every = run_steps // (8 if "evaluated often" in name else 2)
            length = ("--total_episodes", str(run_steps * 4 * per_step), "--eval_every", str(every))
            results[name][seed] = run_once(folder_name(name, seed), args, "--seed", str(seed), *configs[name],
                                           *length, *quick)
    return results


def paired(values: list[float], baseline: list[float], family: list, label: str, interval: bool = False,
           digits: int = 3) -> str:
    """The per-seed difference, mean ± s.e., its t and the verdict at the two-sided 95% threshold (`interval`: its 95%
    interval too); kept in `family` under `label` for the table's Holm line."""
    family.append((label, gap(values, baseline, digits, interval)))
    return family[-1][1]["text"]


def final(runs: dict) -> list[float]:
    return [evals[-1]["eval/pass_at_1"] for _, evals, _ in runs.values()]


def pooled(runs: dict, key: str) -> float:
    """The mean of a per-step metric over every step of every seed."""
    return statistics.mean(r[key] for steps, _, _ in runs.values() for r in steps)


def whole_run(runs: dict, key: str) -> float:
    """The mean over seeds of a running total at a run's last step (an idle fraction: of the whole run)."""
    return statistics.mean(steps[-1][key] for steps, _, _ in runs.values())


def report_schedules(results: dict, title: str = "1. The schedules") -> None:
    print(f"\n{title} (B = 16 groups of 4; pass@1 greedy on the same test problems at step 0 and at the end; "
          "mean ± s.e. over seeds):")
    base = next(iter(results.values()))
    print(f"   SFT policy: {fmt([evals[0]['eval/pass_at_1'] for _, evals, _ in base.values()])}")
    sync, demo, family, factors = results.get("k = 0 (synchronous)"), results.get("k = 2, pace"), [], {}
    for name, runs in results.items():
        steps = [s for s, _, _ in runs.values()]
        run_seconds = seconds(runs)
        discarded = sum(s[-1]["rollouts/discarded_total"] for s in steps)
        accepted = sum(s[-1]["rollouts/accepted_total"] for s in steps)
        gain = paired(final(runs), [evals[0]["eval/pass_at_1"] for _, evals, _ in runs.values()], family,
                      f"{name}: gain")
        lengths = "/".join(f"{pooled(runs, 'length/' + q):.0f}" for q in ("p50", "p90", "p99"))
        print(f"   {name:<36} pass@1 {fmt(final(runs))}, gain {gain}")
        print(f"   {'':<36} {statistics.mean(run_seconds):.0f} s of training; idle: learner "
              f"{whole_run(runs, 'idle/learner_fraction'):.2f}, generator "
              f"{whole_run(runs, 'idle/generator_fraction'):.2f}; staleness "
              f"{histogram([r for s in steps for r in s])} (tokens' mean "
              f"{pooled(runs, 'staleness/token_mean'):.2f}); discarded {discarded / (discarded + accepted):.0%}; "
              f"completions over 2+ versions {pooled(runs, 'inflight/multi_version_fraction'):.0%}; length "
              f"p50/p90/p99 {lengths}")
        if runs is sync:  # what removing the learner's wait alone would make of k = 0's seconds
            print(f"   {'':<36} without the learner's wait: 1 / (1 - learner idle) = "
                  f"{1 / (1 - whole_run(runs, 'idle/learner_fraction')):.2f}x as fast")
        if sync is not None and runs is not sync:
            sync_seconds = seconds(sync)
            ratios = [k0 / own for k0, own in zip(sync_seconds, run_seconds)]
            factors[f"{name} - k = 0, seconds"] = factor(ratios)
            print(f"   {'':<36} against k = 0: pass@1 "
                  f"{paired(final(runs), final(sync), family, f'{name} - k = 0', interval=True)}"
                  f"; seconds {paired(run_seconds, sync_seconds, family, f'{name} - k = 0, seconds', digits=0)}; "
                  f"{statistics.mean(sync_seconds) / statistics.mean(run_seconds):.2f}x as fast (by seed: "
                  + ", ".join(f"{r:.2f}x" for r in ratios) + "); the factor on log seconds: "
                  + factors[f"{name} - k = 0, seconds"]["text"])
        if demo is not None and runs is not demo and runs is not sync:
            print(f"   {'':<36} against k = 2, pace (the demo's): pass@1 "
                  f"{paired(final(runs), final(demo), family, f'{name} - k = 2, pace')}")
    # The family is the pre-registered one (docs/results.md: the three speed comparisons), not the whole table: its
    # gains over SFT and pass@1 gaps are checks and descriptions, and a family of 32 would make "none survives" the
    # answer whatever the runs said
    registered = [f"{name} - k = 0, seconds" for name in ("k = 1, pace", "k = 2, pace", "k = 2, drop (room 2(k+1)B)")]
    speeds = [(label, result) for label, result in family if label in registered]
    if len(speeds) == len(registered):
        print(f"   {holm_line(speeds, 'over the three pre-registered speed comparisons')}")
        on_logs = [(label, factors[label]) for label in registered]
        print(f"   {holm_line(on_logs, 'over the same three on log seconds')}")


def report_precision(args: Args) -> None:
    """The speed rerun's precision analysis: each registered speed-up's per-seed log ratios in table 1's archived
    seeds, their SD, and the 95% interval of the factor n seeds can expect at that SD (exp(+-t sd / sqrt(n)))."""
    missing = [name for name in SPEED for seed in args.seeds
               if not finished(os.path.join(args.runs_dir, folder_name(name, seed)))]
    if missing:
        sys.exit(f"{args.runs_dir} lacks table 1's runs ({missing[0]}, ...): unpack "
                 "docs/runs/fully_async_schedules.tar.xz into benchmarks/runs and pass its folder")
    results = sweep(SPEED, args.seeds, args)  # (every run finished: read back)
    sync = seconds(results["k = 0 (synchronous)"])
    print(f"The speed-ups' precision (table 1, seeds {args.seeds}: log(k = 0's seconds / the schedule's)):")
    for name in list(SPEED)[1:]:
        logs = [math.log(a / b) for a, b in zip(sync, seconds(results[name]))]
        sd = statistics.stdev(logs)
        print(f"  {name}: per seed {', '.join(f'{x:.3f}' for x in logs)}; SD {sd:.3f}; the factor's 95% interval, "
              "times or divided by: " + ", ".join(f"n = {n}: {math.exp(t_95(n - 1) * sd / math.sqrt(n)):.2f}"
                                                  for n in (3, 4, 6, 8, 10)))


def report_objectives(objectives: dict, schedules: dict) -> None:
    print("\n2. Naive (--proximal behaviour: the clip against the sampler) against decoupled (recompute: the clip "
          "against the learner at the batch's start, the sampler's weight truncated), with one optimizer step a batch "
          "(m = 1) and two (m = 2), final pass@1, mean ± s.e.:")
    family, cells = [], []
    for k in (2, 4, 8):
        runs = {name: {**schedules, **objectives}.get(name) for name in (
            f"k = {k}, pace", f"k = {k}, pace, naive", f"k = {k}, pace, m = 2", f"k = {k}, pace, naive, m = 2")}
        decoupled, naive, decoupled2, naive2 = runs.values()
        for m, pair in ((1, dict(naive=naive, decoupled=decoupled)), (2, dict(naive=naive2, decoupled=decoupled2))):
            parts = [f"{objective} {fmt(final(runs))} (clip fraction {pooled(runs, 'policy/clipfrac'):.1e})"
                     for objective, runs in pair.items() if runs]
            if pair["naive"] and pair["decoupled"]:
                label = f"k = {k}, m = {m}: naive - decoupled"
                naive_gap = paired(final(pair["naive"]), final(pair["decoupled"]), family, label)
                parts.append(f"naive - decoupled {naive_gap}")
                cells.append([a - b for a, b in zip(final(pair["naive"]), final(pair["decoupled"]))])
            if parts:
                print(f"   k = {k}, m = {m}: " + "; ".join(parts))
        if decoupled and decoupled2:
            print(f"   k = {k}, decoupled, m = 2 - m = 1: "
                  f"{paired(final(decoupled2), final(decoupled), family, f'k = {k}: m = 2 - m = 1')}; seconds "
                  f"{paired(seconds(decoupled2), seconds(decoupled), family, f'k = {k}: m = 2 - m = 1, seconds')}")
    print(f"   {holm_line(family)}")
    if len(cells) > 1:  # (one statement over every cell: each seed's mean gap, so the cells' noise averages out)
        print(f"   naive - decoupled, pooled over the {len(cells)} (k, m) cells (each seed's mean gap, paired): "
              f"{gap([statistics.mean(seed) for seed in zip(*cells)], [0.0] * len(cells[0]), interval=True)['text']}")


def seconds(runs: dict) -> list[float]:
    return [steps[-1]["time/elapsed"] for steps, _, _ in runs.values()]


def report_inflight(results: dict) -> None:
    print(f"\n3. In flight against drain-then-reload at the setting the capacity model chose (k = 2, B = {DESIGN_B}; "
          "each seed's runs back to back):")
    drain, family = results.get("designed, drain then reload"), []
    for name, runs in results.items():
        per_step = [s[-1]["time/elapsed"] / len(s) for s, _, _ in runs.values()]
        line = (f"   {name:<40} {statistics.mean(per_step):.3f} s a step; idle: learner "
                f"{whole_run(runs, 'idle/learner_fraction'):.2f}, generator "
                f"{whole_run(runs, 'idle/generator_fraction'):.2f}; completions over 2+ versions "
                f"{pooled(runs, 'inflight/multi_version_fraction'):.0%}, versions a completion "
                f"{pooled(runs, 'inflight/versions_per_completion'):.2f}; tokens' staleness "
                f"{pooled(runs, 'staleness/token_mean'):.2f}; pass@1 {fmt(final(runs))}")
        if drain is not None and runs is not drain:
            drain_per_step = [s[-1]["time/elapsed"] / len(s) for s, _, _ in drain.values()]
            speedups = [d / p for d, p in zip(drain_per_step, per_step)]
            line += f"\n   {'':<40} speed-up over drain-then-reload {fmt(speedups)}x; seconds a step " \
                    f"{paired(per_step, drain_per_step, family, name)}; the factor on log seconds a step: " \
                    f"{factor(speedups, 3)['text']}"
        print(line)
    print(f"   {holm_line(family)}")


def training_seconds(evals: list) -> list[float]:
    """Each evaluation's seconds of training before it: its request's time less the evaluations' before it."""
    spent, out = 0.0, []
    for record in evals:
        start = record.get("timeline/eval_queued_start", 0.0)
        out.append(start - spent)
        spent += record.get("timeline/evaluation_end", start) - start
    return out


def time_to(target: float, evals: list) -> float:
    """Seconds of training until pass@1 first reaches `target` (linear between evaluations; inf if never)."""
    times, scores = training_seconds(evals), [e["eval/pass_at_1"] for e in evals]
    for i in range(1, len(scores)):
        if scores[i] >= target:
            fraction = (target - scores[i - 1]) / (scores[i] - scores[i - 1]) if scores[i] > scores[i - 1] else 1.0
            return times[i - 1] + max(fraction, 0.0) * (times[i] - times[i - 1])
    return math.inf


def report_to_target(results: dict) -> None:
    names = list(results)
    if len(names) < 2:
        return
    one_step, streaming = results[names[0]], results[names[1]]
    print("\n4. Time to the one-step run's final pass@1 (k = 1, pace, drained: its own seconds of training, "
          "evaluations left out) for the fastest streaming schedule, seed by seed:")
    reached = []
    for seed in one_step:
        target, own = final({seed: one_step[seed]})[0], training_seconds(one_step[seed][1])[-1]
        when = time_to(target, streaming[seed][1])
        reached.append(own / when)
        print(f"   seed {seed}: target {target:.3f} at {own:.0f} s; {names[1]} "
              + (f"reaches it at {when:.0f} s: {own / when:.2f}x" if math.isfinite(when) else
                 f"never reaches it (its final pass@1 {final({seed: streaming[seed]})[0]:.3f})"))
    missed = sum(r == 0 for r in reached)
    print(f"   speed-up to the target: {fmt([r for r in reached if r])}x over the seeds that reached it"
          + (f"; {missed} of {len(reached)} never did: inconclusive" if missed else ""))
    own, theirs = ([training_seconds(runs[seed][1])[-1] for seed in one_step] for runs in (one_step, streaming))
    family = []
    print(f"   the same {len(one_step[next(iter(one_step))][0])} steps: seconds of training, streaming - one-step "
          f"{paired(theirs, own, family, 'seconds')} ({statistics.mean(own) / statistics.mean(theirs):.2f}x); final "
          f"pass@1 {paired(final(streaming), final(one_step), family, 'pass@1')}")
    print(f"   {holm_line(family)}")


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
    if args.speed_precision:
        report_precision(args)
        sys.exit(0)
    schedules, objectives, inflight, to_target, speed = {}, {}, {}, {}, {}
    if 1 in args.tables or 2 in args.tables:  # (the schedules, `drop` last; table 2 reads the `pace` ones)
        keep = [*SCHEDULES, *DEFAULT_ROOM] if 1 in args.tables else ["k = 2, pace", "k = 4, pace", "k = 8, pace"]
        order = {name: flags for name, flags in {**SCHEDULES, **(DEFAULT_ROOM if args.quick else {})}.items()
                 if name in keep}
        order = {**{n: f for n, f in order.items() if "drop" not in n}, **order,
                 **(OBJECTIVES if 2 in args.tables else {})}
        results = sweep(order, args.seeds, args)
        schedules = {name: results[name] for name in keep if name in results}
        objectives = {name: results[name] for name in OBJECTIVES if name in results}
    if 3 in args.tables:
        inflight = sweep(DRAIN_OR_INFLIGHT, args.inflight_seeds, args)
    if 4 in args.tables and not args.quick:
        to_target = sweep(TO_TARGET, args.seeds, args)
    if 5 in args.tables and not args.quick:
        speed = sweep(SPEED, args.speed_seeds, args)
    if 1 in args.tables:
        report_schedules(schedules)
        plot(schedules, os.path.join(args.plot_dir, "fully_async.png"))
    if 2 in args.tables:
        report_objectives(objectives, schedules)
    if inflight:
        report_inflight(inflight)
    if to_target:
        report_to_target(to_target)
    if speed:
        report_schedules(speed, f"5. The speed rerun on fresh seeds {args.speed_seeds}")
