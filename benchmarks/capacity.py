"""A capacity model of the stream, run before the job: from a short pilot's measured rates it predicts, for a grid of
k, batch size and generator share, the seconds a step, each side's idle fraction, the mean staleness, the discard
rate and the queue; then it runs a few of those settings for real and prints predicted against measured.

The pilot is a synchronous run (k = 0: the generator and the learner take turns, so each side's rate is measured
alone) of `fully_async_grpo.py --record_rollouts`. From it:
  - the generator: each step's wait for its batch is the engine's work on B groups admitted at once; an engine step
    advances every running sequence one token and costs a + b n (n: sequences running), so the batch costs
    c + a max(length) + b sum(lengths) (c: the load and the prefill). a, b, c are fitted by least squares over the
    pilot's steps, with each step's lengths from its rollouts;
  - the learner: a step costs d + e (prompt and completion tokens in the batch), fitted the same way;
  - the completion lengths: the pilot's, drawn with replacement (the long tail is the point).
The simulation then runs the stream engine step by engine step, with the script's own admission rule (`can_admit`):
admission under `pace`, `head` or `drop`, drain-then-reload or in-flight loads, the learner taking groups in the
order they finish and discarding (drop) what is staler than k. A generator share s scales the pilot's rates
linearly (the pilot: one core each, s = 1/2; a sampler with s of the devices works s / (1/2) as fast, the learner
(1 - s) / (1/2)): how a user picks the split of GPUs between sampling and training (docs/fully_async.md).
What it cannot tell: learning. The lengths are the pilot's policy's; a policy that learns to write longer or
shorter changes them, and nothing here says whether a staleness hurts the objective (benchmarks/fully_async.py).

    python benchmarks/capacity.py            # the pilot, the grid, five runs checked: about 7 minutes on 2 cores
    python benchmarks/capacity.py --quick    # a short pilot and one run checked: checks the tool, measures little
"""
import bisect
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
from dataclasses import dataclass

import numpy as np
import tyro

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
from fully_async_grpo import can_admit  # noqa: E402  (the stream's own admission rule)

PILOT_SHARE = 0.5  # one core for the generator, one for the learner


@dataclass
class Args:
    groups: int = 16
    """B of the pilot and of the runs checked: groups a step"""
    num_samples: int = 4
    """K: completions a group"""
    pilot_steps: int = 24
    """steps of the synchronous pilot (the first is left out of the fits: it warms up)"""
    check_steps: int = 24
    """steps of each run checked against its prediction"""
    runs_dir: str = os.path.join(HERE, "runs", "capacity")
    """where the pilot and the runs keep their folders (a finished run is read, not run again)"""
    plot_dir: str = HERE
    """where the PNG goes"""
    script_flags: str = ""
    """more flags for every fully_async_grpo.py run, after its own (on GPUs: --script_flags="--model rho-1b")"""
    quick: bool = False
    """a 6-step pilot and one 6-step run checked: checks the tool, measures little"""


# --- The pilot and the runs: fully_async_grpo.py as a user runs it -------------------------------------------------
def run(name: str, args: Args, steps: int, groups: int, *flags: str) -> list[dict]:
    """A run's step records (running it unless its folder holds a finished one)."""
    folder = os.path.join(args.runs_dir, name)
    if not os.path.exists(os.path.join(folder, "done")):
        print(f"{name} ...", flush=True)
        command = [sys.executable, os.path.join(REPO, "fully_async_grpo.py"), "--model", "tiny", "--output_dir",
                   folder, "--num_samples", str(args.num_samples), "--total_episodes",
                   str(steps * groups * args.num_samples), "--batch_size", str(groups * args.num_samples),
                   "--per_device_train_batch_size", str(groups * args.num_samples), "--eval_every", "0",
                   "--num_eval_prompts", "32",
                   "--num_final_eval_prompts", "32", *flags, *shlex.split(args.script_flags)]
        result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
        if result.returncode:
            raise SystemExit(f"{name} failed (exit code {result.returncode}):\n{result.stderr[-3000:]}")
        open(os.path.join(folder, "done"), "w").close()
    return [r for r in map(json.loads, open(os.path.join(folder, "metrics.jsonl"))) if "staleness/mean" in r]


def measure_rates(folder: str, steps: list[dict], groups: int) -> dict:
    """The generator's a, b, c and the learner's d, e (seconds), fitted on the pilot's steps 2.., and its lengths."""
    rows = [json.loads(line) for line in open(os.path.join(folder, "rollouts.jsonl"))]
    batches = [rows[i: i + groups] for i in range(0, len(rows), groups)]
    lengths = [[len(r) for g in batch for r in g["responses"]] for batch in batches]
    tokens = [sum(len(r) + len(g["prompt"]) for g in batch for r in g["responses"]) for batch in batches]
    wait = [s["time/learner_wait"] for s in steps]
    train = [s["time/training"] for s in steps]
    generator = np.array([[1.0, max(ls), sum(ls)] for ls in lengths[1:]])
    c, a, b = nonnegative_fit(generator, np.array(wait[1:]))
    d, e = nonnegative_fit(np.array([[1.0, t] for t in tokens[1:]]), np.array(train[1:]))
    fitted = generator @ np.array([c, a, b])
    error = float(np.mean(np.abs(fitted - np.array(wait[1:])) / np.array(wait[1:])))
    return dict(a=a, b=b, c=c, d=d, e=e, lengths=[n for ls in lengths for n in ls], fit_error=error,
                prompt_tokens=statistics.mean(len(r["prompt"]) for r in rows), num_samples=len(rows[0]["responses"]),
                mean_load=statistics.mean(sum(ls) / max(ls) for ls in lengths))  # (sequences an engine step)


def nonnegative_fit(x: np.ndarray, y: np.ndarray) -> list[float]:
    """Least squares with every coefficient at least 0 (a negative cost is noise): the negative ones are dropped."""
    keep = list(range(x.shape[1]))
    while True:
        coefficients = np.linalg.lstsq(x[:, keep], y, rcond=None)[0]
        if (coefficients >= 0).all():
            full = [0.0] * x.shape[1]
            for i, value in zip(keep, coefficients):
                full[i] = float(value)
            return full
        keep.pop(int(np.argmin(coefficients)))


# --- The simulation: the stream, engine step by engine step ---------------------------------------------------------
def simulate(rates: dict, k: int, groups: int, policy: str = "pace", room: int = 0, inflight: bool = False,
             share: float = PILOT_SHARE, steps: int = 48, seed: int = 0) -> dict:
    """The stream at these settings with these rates: seconds a step, idle fractions, staleness, discards, the queue
    (groups finished and not yet taken when a version is published: where the script logs `queue/depth`)."""
    rng, speed, learner_speed = random.Random(seed), share / PILOT_SHARE, (1 - share) / PILOT_SHARE
    go = dict(max_staleness=k, groups_per_step=groups, stale_policy=policy, max_in_flight=room or (k + 1) * groups,
              inflight_updates=inflight)
    clock, loaded, next_group, running, finished, published = 0.0, 0, 0, {}, [], [(0.0, 0, 0)]
    learner = dict(version=0, free_at=0.0, idle=0.0, batch=[], staleness=[], discarded=0, policy=policy)
    finish_times = []  # (every group's, in order: the queue's depth when each version is published)
    generator_idle, multi_version = 0.0, []
    while learner["version"] < steps:
        learner_takes(learner, finished, clock, groups, k, rates, learner_speed, published)
        if learner["version"] >= steps:
            break
        newest, taken = max((v, n) for t, v, n in published if t <= clock)
        if newest > loaded and (not running or inflight):  # a load: its cost is in c, charged per batch below
            loaded = newest
            for group in running.values():
                group["versions"].add(loaded)
        oldest = min([loaded, *(g["version"] for g in running.values())])
        while can_admit(go, next_group, next_group - taken, loaded, oldest, newest > loaded):
            lengths = [rng.choice(rates["lengths"]) for _ in range(rates["num_samples"])]
            running[next_group] = dict(version=loaded, lengths=lengths, left=lengths, versions={loaded})
            next_group += 1
            if next_group % groups == 0:  # (the load and prefill cost of a batch's worth of groups)
                clock += rates["c"] / speed
        if not running:  # idle until the learner publishes
            upcoming = [t for t, _, _ in published if t > clock]
            if not upcoming:
                raise RuntimeError(f"the stream deadlocks at k = {k}, B = {groups}, {policy}")
            generator_idle += min(upcoming) - clock
            clock = min(upcoming)
            continue
        sequences = sum(sum(n > 0 for n in g["left"]) for g in running.values())
        clock += (rates["a"] + rates["b"] * sequences) / speed  # one engine step
        for index in list(running):
            group = running[index]
            group["left"] = [n - 1 for n in group["left"]]
            if max(group["left"]) <= 0:
                finished.append((clock, running.pop(index)))
                finish_times.append(clock)
                multi_version.append(len(group["versions"]) > 1)
    total = learner["free_at"]
    accepted = len(learner["staleness"])
    return dict(seconds_a_step=total / steps, learner_idle=learner["idle"] / total,
                generator_idle=min(generator_idle / total, 1.0), staleness=statistics.mean(learner["staleness"]),
                discarded=learner["discarded"] / (learner["discarded"] + accepted),
                queue=statistics.mean(bisect.bisect_right(finish_times, t) - taken for t, _, taken in published[1:]),
                multi_version=statistics.mean(multi_version or [0.0]))


def learner_takes(learner: dict, finished: list, clock: float, groups: int, k: int, rates: dict, speed: float,
                  published: list) -> None:
    """Every learner step whose groups have finished by the generator's clock: take them in the order they finished
    (a group staler than k discarded), train (d + e tokens), publish the next version."""
    while finished and finished[0][0] <= clock:
        finish, group = finished.pop(0)
        too_stale = learner["version"] - group["version"] > k  # (head: kept, as the script keeps it)
        if too_stale and learner["policy"] == "pace":
            raise RuntimeError("a group staler than k under pace: the simulation broke the bound")
        if too_stale and learner["policy"] == "drop":
            learner["discarded"] += 1
            continue
        learner["batch"].append((finish, group))
        if len(learner["batch"]) < groups:
            continue
        start = max(learner["free_at"], learner["batch"][-1][0])
        learner["idle"] += start - learner["free_at"]
        tokens = sum(n + rates["prompt_tokens"] for _, g in learner["batch"] for n in g["lengths"])
        learner["free_at"] = start + (rates["d"] + rates["e"] * tokens) / speed
        learner["staleness"] += [learner["version"] - g["version"] for _, g in learner["batch"]]
        learner["version"] += 1
        learner["batch"] = []
        published.append((learner["free_at"], learner["version"], learner["version"] * groups + learner["discarded"]))


# --- The report ---------------------------------------------------------------------------------------------------
def predicted(rates: dict, seeds: int = 5, **settings) -> dict:
    """The simulation's mean over draws of the lengths."""
    runs = [simulate(rates, seed=seed, **settings) for seed in range(seeds)]
    return {key: statistics.mean(r[key] for r in runs) for key in runs[0]}


def measured(steps: list[dict]) -> dict:
    """The same figures from a real run's logs (its last step's running totals; means over its steps)."""
    last = steps[-1]
    discarded, accepted = last["rollouts/discarded_total"], last["rollouts/accepted_total"]
    return dict(seconds_a_step=last["time/elapsed"] / len(steps), learner_idle=last["idle/learner_fraction"],
                generator_idle=last["idle/generator_fraction"],
                staleness=statistics.mean(s["staleness/mean"] for s in steps),
                discarded=discarded / (discarded + accepted), queue=statistics.mean(s["queue/depth"] for s in steps),
                multi_version=statistics.mean(s["inflight/multi_version_fraction"] for s in steps))


COLUMNS = ("seconds_a_step", "learner_idle", "generator_idle", "staleness", "discarded", "queue", "multi_version")


def line(figures: dict) -> str:
    return "  ".join(f"{figures[c]:>7.3f}" if c == "seconds_a_step" else f"{figures[c]:>7.2f}" for c in COLUMNS)


def report_grid(rates: dict, args: Args) -> None:
    header = "  ".join(f"{c[:7]:>7}" for c in COLUMNS)
    print("\npredicted, pace, drain then reload, the pilot's split (one core each), 48 steps:")
    print(f"  {'B':>3} {'k':>2}  {header}")
    for groups in (4, 16, 64):
        for k in (0, 1, 2, 4, 8):
            print(f"  {groups:>3} {k:>2}  {line(predicted(rates, k=k, groups=groups))}")
    print(f"\npredicted seconds a step, k = 2, B = {args.groups}, by the generator's share of the machine:")
    for share in (0.25, 0.5, 0.75):
        drain = predicted(rates, k=2, groups=args.groups, share=share)
        inflight = predicted(rates, k=2, groups=args.groups, share=share, policy="head", inflight=True)
        print(f"  share {share:.2f}: drain then reload {drain['seconds_a_step']:.3f} s (learner idle "
              f"{drain['learner_idle']:.2f}, generator idle {drain['generator_idle']:.2f}); head, in flight "
              f"{inflight['seconds_a_step']:.3f} s (learner idle {inflight['learner_idle']:.2f})")


def report_flat_steps(rates: dict) -> None:
    """A what-if, no measurement: the engine's step cost flat in its sequences (b = 0, a step costing what the
    pilot's did with its mean number of sequences), as GPU decoding is until memory bandwidth runs out. Where a
    drained tail leaves the engine nearly empty but each step as dear, in-flight loads pay."""
    flat = {**rates, "a": rates["a"] + rates["b"] * rates["mean_load"], "b": 0.0}
    print(f"\nwhat if an engine step cost the same with 1 sequence or many (a = {flat['a'] * 1e3:.1f} ms, b = 0; a "
          "model, not a measurement), k = 2:")
    for groups in (4, 16):
        drain = predicted(flat, k=2, groups=groups)
        inflight = predicted(flat, k=2, groups=groups, policy="head", inflight=True)
        print(f"  B = {groups:>2}: drain then reload {drain['seconds_a_step']:.3f} s a step, head in flight "
              f"{inflight['seconds_a_step']:.3f} s: {drain['seconds_a_step'] / inflight['seconds_a_step']:.2f}x")


CHECKED = {  # name: (groups a step: the pilot's or 4, flags, the simulation's settings)
    "k = 2, pace": (None, ("--max_staleness", "2"), dict(k=2)),
    "k = 8, pace": (None, ("--max_staleness", "8"), dict(k=8)),
    "k = 2, drop, room 2(k+1)B": (None, ("--max_staleness", "2", "--stale_policy", "drop", "--max_in_flight", "ROOM"),
                                  dict(k=2, policy="drop", room="ROOM")),
    "B = 4, k = 2, drain then reload": (4, ("--max_staleness", "2"), dict(k=2)),
    "B = 4, k = 2, head, in flight": (4, ("--max_staleness", "2", "--stale_policy", "head", "--inflight_updates"),
                                      dict(k=2, policy="head", inflight=True)),
}


def check(rates: dict, args: Args) -> dict:
    """Each setting run for real beside its prediction: {name: (model, real)}."""
    names = list(CHECKED)[:1] if args.quick else list(CHECKED)
    pairs = {}
    steps = 6 if args.quick else args.check_steps
    header = "  ".join(f"{c[:7]:>7}" for c in COLUMNS)
    print(f"\npredicted against measured ({steps} steps each; error: measured - predicted; seconds: relative):")
    print(f"  {'':<34}        {header}")
    for name in names:
        groups, flags, settings = CHECKED[name]
        groups = groups or args.groups
        room = str(2 * (settings["k"] + 1) * groups)
        flags = tuple(room if f == "ROOM" else f for f in flags)
        settings = {key: int(room) if value == "ROOM" else value for key, value in settings.items()}
        real = measured(run(folder(name), args, steps, groups, *flags))
        model = predicted(rates, groups=groups, steps=steps, **settings)
        error = {c: real[c] - model[c] for c in COLUMNS}
        error["seconds_a_step"] = error["seconds_a_step"] / model["seconds_a_step"]
        print(f"  {name:<34} model  {line(model)}\n  {'':<34} real   {line(real)}\n  {'':<34} error  {line(error)}")
        pairs[name] = (model, real)
    return pairs


def plot(pairs: dict, path: str) -> None:
    """Measured against predicted: seconds a step, and each side's idle fraction."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for ax, key in zip(axes, ("seconds_a_step", "learner_idle", "generator_idle")):
        for name, (model, real) in pairs.items():
            ax.plot(model[key], real[key], "o", label=name)
        top = max(max(m[key], r[key]) for m, r in pairs.values()) * 1.1 or 1.0
        ax.plot([0, top], [0, top], "k:", linewidth=1)
        ax.set(xlabel=f"predicted {key}", ylabel=f"measured {key}", xlim=(0, top), ylim=(0, top))
    axes[0].legend(fontsize=7)
    fig.suptitle("python benchmarks/capacity.py: the model against real runs (2 CPU cores)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    print(f"plot saved to {path}")


def folder(name: str) -> str:
    return "_".join("".join(c if c.isalnum() else " " for c in name).split())


if __name__ == "__main__":
    args = tyro.cli(Args)
    os.makedirs(args.plot_dir, exist_ok=True)  # before the sweep, so a path that cannot be made fails at once
    pilot_steps = 6 if args.quick else args.pilot_steps
    pilot = run("pilot_k0", args, pilot_steps, args.groups, "--max_staleness", "0", "--record_rollouts")
    rates = measure_rates(os.path.join(args.runs_dir, "pilot_k0"), pilot, args.groups)
    lengths = sorted(rates["lengths"])
    print(f"the pilot (k = 0, B = {args.groups}, {pilot_steps} steps): an engine step a + b n = "
          f"{rates['a'] * 1e3:.2f} + {rates['b'] * 1e3:.3f} n ms, c = {rates['c']:.3f} s a batch (the fit's mean "
          f"error {rates['fit_error']:.0%}); a learner step d + e tokens = {rates['d']:.3f} s + "
          f"{rates['e'] * 1e3:.4f} ms a token; completion lengths p50/p90/p99 {lengths[len(lengths) // 2]}/"
          f"{lengths[int(0.9 * len(lengths))]}/{lengths[int(0.99 * len(lengths))]} ({len(lengths)} completions)")
    report_grid(rates, args)
    report_flat_steps(rates)
    plot(check(rates, args), os.path.join(args.plot_dir, "capacity.png"))
