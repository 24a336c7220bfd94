"""A capacity model of the stream, run before the job: from short pilots' measured rates it predicts, for a grid of
k, batch size and generator share, the seconds a step, each side's idle fraction, the mean staleness, the discard
rate and the queue; it searches the settings where in-flight weight updates should pay most against draining; then
it runs a few settings for real and prints predicted against measured, every error relative to the measured figure.

The pilots are synchronous runs (k = 0: the generator and the learner take turns, so each side's rate is measured
alone) of `fully_async_grpo.py --record_rollouts`, at more than one batch size (--pilot_groups), so that the engine's
step cost is seen at more than one number of sequences. From them:
  - the generator: an engine step advances every running sequence one token and costs a + b n (n: sequences
    running); a group's prompt is read once (f a prompt token); a weight load costs c. A batch admitted at once then
    costs c + f (its prompts' tokens) + a max(length) + b sum(lengths): a, b, c, f fitted by least squares (every
    coefficient at least 0) over every pilot's steps but its first, each with its own lengths from `rollouts.jsonl`;
  - the learner: what it computes is padded: each micro-batch (--per_device_train_batch_size completions) runs at
    its longest prompt plus its longest completion, so a step costs d + e x (padded tokens) for the update, and,
    under `recompute`, p x the same for the proximal policy's forward pass (timed apart: `time/proximal`);
  - the groups: the pilots' own (a prompt's length with its K completions' lengths), drawn with replacement.
The simulation then runs the stream engine step by engine step, with the script's own admission rule (`can_admit`):
admission under `pace`, `head` or `drop`, drain-then-reload or in-flight loads (under `recompute` a load in flight
re-reads every running sequence's prefix: f a token), the learner taking groups in the order they finish,
discarding (drop) what is staler than k, and taking --num_mini_batches m optimizer steps a batch (d each). A
generator share s scales the pilots' rates linearly (the pilots: one core each, s = 1/2). G engines
(--num_generators) act in the order of their clocks under the shared bound, each at its share of the machine.
Then, beside the checks: G = 1 against G = 2 on this machine, seeds back to back (predicted and measured), and the
split of --gpus GPUs between engines and learners for a step whose scale --generation_seconds and
--training_seconds give (default: rho-1b on GSM8k, the paper's step), the pilots giving its shape.
What it cannot tell: learning. The lengths are the pilots' policy's; a policy that learns to write longer or
shorter changes them, and nothing here says whether a staleness hurts the objective (benchmarks/fully_async.py).

    python benchmarks/capacity.py            # the pilots, the grid, the design search, the runs checked: ~15 min
    python benchmarks/capacity.py --quick    # short pilots and one run checked: checks the tool, measures little
"""
import bisect
import json
import math
import os
import random
import shlex
import shutil
import statistics
import subprocess
import sys
from dataclasses import dataclass, field

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
    """B of the runs checked: groups a step"""
    pilot_groups: list[int] = field(default_factory=lambda: [4, 16])
    """B of each synchronous pilot (the fits pool them: more than one batch size shows how an engine step's cost
    grows with its sequences)"""
    num_samples: int = 4
    """K: completions a group"""
    pilot_steps: int = 24
    """steps of each synchronous pilot (the first is left out of the fits: it warms up)"""
    check_steps: int = 24
    """steps of each run checked against its prediction"""
    runs_dir: str = os.path.join(HERE, "runs", "capacity")
    """where the pilots and the runs keep their folders (a finished run is read, not run again)"""
    plot_dir: str = HERE
    """where the PNG goes"""
    script_flags: str = ""
    """more flags for every fully_async_grpo.py run, after its own (on GPUs: --script_flags="--model rho-1b")"""
    quick: bool = False
    """6-step pilots and one 6-step run checked: checks the tool, measures little"""
    engine_seeds: int = 3
    """seeds of the G = 1 against G = 2 runs (0: skip them; --quick skips them)"""
    gpus: int = 8
    """the split table: GPUs to share between engines and learners"""
    generation_seconds: float = 12.2
    """the split table: one engine's seconds to sample a step's batch (default: rho-1b on GSM8k, the paper's
    synchronous step, generation on one GPU)"""
    training_seconds: float = 89.6
    """the split table: one GPU's seconds to train on a step's batch (default: the paper's 12.8 s on 7 GPUs, x 7)"""


# --- The pilots and the runs: fully_async_grpo.py as a user runs it -------------------------------------------------
def run(name: str, args: Args, steps: int, groups: int, *flags: str) -> list[dict]:
    """A run's step records (running it unless its folder holds a finished one of as many steps)."""
    folder = os.path.join(args.runs_dir, name)
    if not finished(folder, steps):
        print(f"{name} ...", flush=True)
        shutil.rmtree(folder, ignore_errors=True)
        command = [sys.executable, os.path.join(REPO, "fully_async_grpo.py"), "--model", "tiny", "--output_dir",
                   folder, "--num_samples", str(args.num_samples), "--total_episodes",
                   str(steps * groups * args.num_samples), "--batch_size", str(groups * args.num_samples),
                   "--per_device_train_batch_size", str(groups * args.num_samples), "--eval_every", "0",
                   "--num_eval_prompts", "32",
                   "--num_final_eval_prompts", "32", *flags, *shlex.split(args.script_flags)]
        result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
        if result.returncode:
            raise SystemExit(f"{name} failed (exit code {result.returncode}):\n{result.stderr[-3000:]}")
        with open(os.path.join(folder, "done"), "w") as f:
            f.write(str(steps))
    return [r for r in map(json.loads, open(os.path.join(folder, "metrics.jsonl"))) if "staleness/mean" in r]


def finished(folder: str, steps: int) -> bool:
    """Whether `folder` holds a finished run of `steps` steps: its `done` says how many (a --quick run's 6 is not a
    sweep's 24); an empty one is from before it did, and is taken as it is."""
    done = os.path.join(folder, "done")
    return os.path.exists(done) and open(done).read() in ("", str(steps))


def padded_tokens(groups: list, chunk: int) -> int:
    """Tokens the learner computes for these groups ((prompt length, completion lengths), in order): every chunk of
    `chunk` completions runs at its longest prompt plus its longest completion (collate pads each micro-batch)."""
    rows = [(prompt, n) for prompt, lengths in groups for n in lengths]
    return sum(len(part) * (max(p for p, _ in part) + max(n for _, n in part))
               for part in (rows[i: i + chunk] for i in range(0, len(rows), chunk)))


def measure_rates(pilots: list) -> dict:
    """The generator's a, b, c, f and the learner's d, e, p (seconds), fitted over the pilots' steps 2.. (pilots:
    (folder, step records, B) each, one micro-batch a step), each fit's mean error relative to the measured
    seconds, and the pilots' groups."""
    generator_x, generator_y, update_x, update_y, proximal_x, proximal_y, all_groups = [], [], [], [], [], [], []
    for folder, steps, groups in pilots:
        rows = [json.loads(line) for line in open(os.path.join(folder, "rollouts.jsonl"))]
        batches = [[(len(r["prompt"]), [len(c) for c in r["responses"]]) for r in rows[i: i + groups]]
                   for i in range(0, len(rows), groups)]
        all_groups += [g for batch in batches for g in batch]
        for batch, step in list(zip(batches, steps))[1:]:
            lengths = [n for _, ls in batch for n in ls]
            generator_x.append([1.0, sum(p for p, _ in batch), max(lengths), sum(lengths)])
            generator_y.append(step["time/learner_wait"])  # (k = 0: the learner waits for the whole batch)
            padded = padded_tokens(batch, len(lengths))
            update_x.append([1.0, padded])
            update_y.append(step["time/training"] - step.get("time/proximal", 0.0))
            proximal_x.append([0.0, padded])
            proximal_y.append(step.get("time/proximal", 0.0))
    c, f, a, b = nonnegative_fit(np.array(generator_x), np.array(generator_y))
    d, e = nonnegative_fit(np.array(update_x), np.array(update_y))
    _, p = nonnegative_fit(np.array(proximal_x), np.array(proximal_y))
    if not (a or b) or not (d or e):  # (the split table divides by each side's time)
        raise SystemExit(f"the pilots in {os.path.dirname(pilots[0][0])} fit no cost a token for the "
                         f"{'generator' if not (a or b) else 'learner'}: too few or too noisy steps; remove the "
                         "pilot_* folders and run again, with more --pilot_steps")

    def error(x: list, y: list, coefficients: list) -> float:  # mean |fit - measured| / measured
        return float(np.mean(np.abs(np.array(x) @ np.array(coefficients) - np.array(y)) / np.array(y)))

    return dict(a=a, b=b, c=c, f=f, d=d, e=e, p=p, groups=all_groups, num_samples=len(all_groups[0][1]),
                generator_error=error(generator_x, generator_y, [c, f, a, b]),
                learner_error=error(update_x, [u + q for u, q in zip(update_y, proximal_y)], [d, e + p]),
                mean_load=statistics.mean(x[3] / x[2] for x in generator_x))  # (sequences an engine step)


def nonnegative_fit(x: np.ndarray, y: np.ndarray) -> list[float]:
    """Least squares with every coefficient at least 0 (a negative cost is noise): the negative ones are dropped."""
    keep = [i for i in range(x.shape[1]) if x[:, i].any()]
    while True:
        coefficients = np.linalg.lstsq(x[:, keep], y, rcond=None)[0]
        if (coefficients >= 0).all():
            full = [0.0] * x.shape[1]
            for i, value in zip(keep, coefficients):
                full[i] = float(value)
            return full
        keep.pop(int(np.argmin(coefficients)))


# --- The simulation: the stream, engine step by engine step ---------------------------------------------------------
@dataclass
class Setting:
    """What a run would do: the stream's bound and schedule, and what the learner computes."""
    k: int
    groups: int  # B
    policy: str = "pace"
    room: int = 0  # --max_in_flight (0: the default, (k + 1) B)
    inflight: bool = False
    proximal: str = "recompute"
    mini_batches: int = 1  # m
    chunk: int = 0  # --per_device_train_batch_size (0: a mini-batch's completions)
    max_length: int = 128  # --response_length: completions cut there
    kv: str = "recompute"  # --kv_on_update: in flight, `recompute` re-reads the running sequences' prefixes
    share: float = PILOT_SHARE  # the generators' share of the machine, split evenly among them
    steps: int = 48
    engines: int = 1  # G
    engine_speed: float = 0.0  # each engine's, relative to the pilots' (0: from the share)
    learner_speed: float = 0.0  # the learners', relative to the pilots' (0: from the share)


def simulate(rates: dict, setting: Setting, seed: int = 0) -> dict:
    """The stream at this setting with these rates: seconds a step, idle fractions (the engines': their mean),
    staleness, discards, the queue (groups finished and not yet taken when a version is published: where the script
    logs `queue/depth`). G engines (setting.engines) act in the order of their clocks, each loading, admitting under
    the shared bound (the oldest version any engine's group still running at its clock holds), stepping, or idle
    until the learner publishes or another engine's group ends."""
    rng, speed = random.Random(seed), setting.engine_speed or setting.share / setting.engines / PILOT_SHARE
    k, groups, inflight = setting.k, setting.groups, setting.inflight
    go = dict(max_staleness=k, groups_per_step=groups, stale_policy=setting.policy,
              max_in_flight=setting.room or (k + 1) * groups, inflight_updates=inflight)
    engines = [dict(index=i, clock=0.0, loaded=0, running={}, idle=0.0, claimed=0, waiting=False)
               for i in range(setting.engines)]
    engine_room = -(-go["max_in_flight"] // setting.engines)  # (each engine's share of the room, as the script's)
    next_group, finished, published = 0, [], [(0.0, 0, 0)]
    learner = dict(version=0, free_at=0.0, idle=0.0, batch=[], staleness=[], discarded=0, taken_from={},
                   taken_from_at={0: {}})  # (each engine's groups taken, as the learner sends them with a version)
    finish_times, multi_version = [], []  # (every group's, in order: the queue's depth when each version is published)
    while learner["version"] < setting.steps:
        engine = min(engines, key=lambda e: e["clock"])
        clock, running, engine["waiting"] = engine["clock"], engine["running"], False
        learner_takes(learner, finished, clock, rates, setting, published)
        if learner["version"] >= setting.steps:
            break
        # (versions are published in time order: the newest out by this clock is the last one out by it)
        newest, taken = published[bisect.bisect_right(published, clock, key=lambda p: p[0]) - 1][1:]
        if newest > engine["loaded"] and (not running or inflight):  # a load; in flight under recompute, every
            engine["loaded"], clock = newest, clock + rates["c"] / speed  # running sequence re-reads its prefix
            if setting.kv == "recompute" and running:
                reread = sum(g["prompt"] + len(g["lengths"]) * g["done"]  # (every sequence's tokens so far)
                             for g in running.values())
                clock += rates["f"] * reread / speed
            for group in running.values():
                group["versions"].add(engine["loaded"])
            engine["clock"] = clock  # (the load took time: the engine acts again at its new clock, in clock order,
            continue  # seeing what was published and taken meanwhile)
        still_running = [g["version"] for e in engines for g in e["running"].values()]
        still_running += [g["version"] for t, _, g in finished if t > clock]  # (ended at a later clock)
        oldest = min([engine["loaded"], *still_running])
        mine = engine["claimed"] - learner["taken_from_at"][newest].get(engine["index"], 0)  # (its groups waiting)
        while mine < engine_room and can_admit(go, next_group, next_group - taken, engine["loaded"], oldest,
                                               newest > engine["loaded"]):
            prompt, lengths = rng.choice(rates["groups"])
            lengths = [min(n, setting.max_length) for n in lengths]
            running[next_group] = dict(version=engine["loaded"], prompt=prompt, lengths=lengths, done=0,
                                       ordered=sorted(lengths),  # (done: engine steps taken; ordered: to count)
                                       versions={engine["loaded"]}, engine=engine["index"])
            engine["claimed"], mine = engine["claimed"] + 1, mine + 1
            clock += rates["f"] * prompt / speed  # (its prompt read once)
            next_group += 1
        if not running:  # idle until the learner publishes, or another engine's group ends (the bound may move)
            upcoming = [t for t, _, _ in published if t > clock] + [t for t, _, _ in finished if t > clock]
            upcoming += [e["clock"] for e in engines if e is not engine and (e["running"] or not e["waiting"])]
            if not upcoming:
                raise RuntimeError(f"the stream deadlocks at {setting}")
            wake = max(min(upcoming), math.nextafter(clock, math.inf))  # (past a tie with a running one)
            engine["idle"] += wake - clock  # (an engine waiting is no event for another: two would wake each other)
            engine["clock"], engine["waiting"] = wake, True
            continue
        sequences = sum(len(g["ordered"]) - bisect.bisect_right(g["ordered"], g["done"]) for g in running.values())
        clock += (rates["a"] + rates["b"] * sequences) / speed  # one engine step
        for index in list(running):
            group = running[index]
            group["done"] += 1
            if group["done"] >= group["ordered"][-1]:  # (its longest completion ended)
                bisect.insort(finished, (clock, index, running.pop(index)), key=lambda f: f[:2])
                bisect.insort(finish_times, clock)
                multi_version.append(len(group["versions"]) > 1)
        engine["clock"] = clock
    total = learner["free_at"]
    accepted = len(learner["staleness"])
    generator_idle = sum(min(e["idle"], total) for e in engines) / len(engines)
    return dict(seconds_a_step=total / setting.steps, learner_idle=learner["idle"] / total,
                generator_idle=min(generator_idle / total, 1.0), staleness=statistics.mean(learner["staleness"]),
                discarded=learner["discarded"] / (learner["discarded"] + accepted),
                queue=statistics.mean(bisect.bisect_right(finish_times, t) - taken for t, _, taken in published[1:]),
                multi_version=statistics.mean(multi_version or [0.0]))


def learner_seconds(batch: list, rates: dict, setting: Setting) -> float:
    """A batch's training (its groups in the order they finished): m optimizer steps (d each), the update over its
    padded tokens (e a token) and, under `recompute`, the proximal pass over the same (p a token)."""
    chunk = setting.chunk or setting.groups * rates["num_samples"] // setting.mini_batches
    padded = padded_tokens([(g["prompt"], g["lengths"]) for _, g in batch], chunk)
    return (setting.mini_batches * rates["d"] + rates["e"] * padded
            + (rates["p"] * padded if setting.proximal == "recompute" else 0.0))


def learner_takes(learner: dict, finished: list, clock: float, rates: dict, setting: Setting,
                  published: list) -> None:
    """Every learner step whose groups have finished by the generator's clock: take them in the order they finished
    (a group staler than k discarded), train, publish the next version."""
    while finished and finished[0][0] <= clock:
        finish, _, group = finished.pop(0)
        learner["taken_from"][group["engine"]] = learner["taken_from"].get(group["engine"], 0) + 1
        too_stale = learner["version"] - group["version"] > setting.k  # (head: kept, as the script keeps it)
        if too_stale and setting.policy == "pace":
            raise RuntimeError("a group staler than k under pace: the simulation broke the bound")
        if too_stale and setting.policy == "drop":
            learner["discarded"] += 1
            continue
        learner["batch"].append((finish, group))
        if len(learner["batch"]) < setting.groups:
            continue
        start = max(learner["free_at"], learner["batch"][-1][0])
        learner["idle"] += start - learner["free_at"]
        learner_speed = setting.learner_speed or (1 - setting.share) / PILOT_SHARE
        learner["free_at"] = start + learner_seconds(learner["batch"], rates, setting) / learner_speed
        learner["staleness"] += [learner["version"] - g["version"] for _, g in learner["batch"]]
        learner["version"] += 1
        learner["batch"] = []
        learner["taken_from_at"][learner["version"]] = dict(learner["taken_from"])
        published.append((learner["free_at"], learner["version"],
                          learner["version"] * setting.groups + learner["discarded"]))


# --- The report ---------------------------------------------------------------------------------------------------
def predicted(rates: dict, setting: Setting, seeds: int = 5) -> dict:
    """The simulation's mean over draws of the groups."""
    runs = [simulate(rates, setting, seed=seed) for seed in range(seeds)]
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
    print("\npredicted, pace, drain then reload, the pilots' split (one core each), 48 steps:")
    print(f"  {'B':>3} {'k':>2}  {header}")
    for groups in (4, 16, 64):
        for k in (0, 1, 2, 4, 8):
            print(f"  {groups:>3} {k:>2}  {line(predicted(rates, Setting(k, groups)))}")
    print(f"\npredicted seconds a step, k = 2, B = {args.groups}, by the generator's share of the machine:")
    for share in (0.25, 0.5, 0.75):
        drain = predicted(rates, Setting(2, args.groups, share=share))
        inflight = predicted(rates, Setting(2, args.groups, "head", inflight=True, share=share))
        print(f"  share {share:.2f}: drain then reload {drain['seconds_a_step']:.3f} s (learner idle "
              f"{drain['learner_idle']:.2f}, generator idle {drain['generator_idle']:.2f}); head, in flight "
              f"{inflight['seconds_a_step']:.3f} s (learner idle {inflight['learner_idle']:.2f})")


def design(rates: dict, top: int = 10) -> list:
    """Where should in-flight loads pay most on this machine? Over a grid (B from 2: a step of one group is too small
    a batch for GRPO's statistics, and leaves the per-step work the model does not count; `--proximal`; m;
    --response_length; k = 2, one core each), the predicted seconds a step draining and in flight under `pace` and
    `head`, with the KV cache recomputed (every running sequence re-reads its prefix at a load) or kept. Printed
    best first by the best in-flight speed-up; returns the rows. What it prices from pilots that did not run it:
    m (a second optimizer step costs d, fitted from pilots at m = 1: measured at B = 2, m = 2 cost 19 ms a step more
    than that) and `keep` (prefix caching off, so a group's K samples each read the prompt: not charged). Pilot at
    the m and --kv_on_update you mean to run (--script_flags) before trusting the search's top row."""
    rows = []
    for groups in (2, 4, 8, 16):
        for proximal in ("recompute", "behaviour"):
            for mini_batches in (1, 2):
                for max_length in (64, 128):
                    base = dict(k=2, groups=groups, proximal=proximal, mini_batches=mini_batches,
                                max_length=max_length, steps=max(24, 192 // groups))
                    drain = predicted(rates, Setting(**base), seeds=3)
                    speedups = {f"{policy} {kv}": drain["seconds_a_step"] / predicted(rates, Setting(
                        **base, policy=policy, inflight=True, kv=kv), seeds=3)["seconds_a_step"]
                        for policy in ("pace", "head") for kv in ("recompute", "keep")}
                    rows.append((base, drain, speedups))
    rows.sort(key=lambda row: -max(row[2].values()))
    print("\nwhere in-flight loads should pay most (predicted, k = 2, one core each; speed-up: draining's seconds a "
          "step over in flight's, by rule and KV cache):")
    print("   B  proximal   m  length  drain s  (learner idle, generator idle)  "
          + "  ".join(f"{name:>14}" for name in rows[0][2]))
    for base, drain, speedups in rows[:top]:
        print(f"  {base['groups']:>2}  {base['proximal']:<9} {base['mini_batches']:>2} {base['max_length']:>6}  "
              f"{drain['seconds_a_step']:7.3f}  ({drain['learner_idle']:.2f}, {drain['generator_idle']:.2f})"
              f"{'':>21}" + "  ".join(f"{value:>13.2f}x" for value in speedups.values()))
    return rows


def report_flat_steps(rates: dict) -> None:
    """A what-if, no measurement: the engine's step cost flat in its sequences (b = 0, a step costing what the
    pilots' did with their mean number of sequences), as GPU decoding is until memory bandwidth runs out."""
    flat = {**rates, "a": rates["a"] + rates["b"] * rates["mean_load"], "b": 0.0}
    print(f"\nwhat if an engine step cost the same with 1 sequence or many (a = {flat['a'] * 1e3:.1f} ms, b = 0; a "
          "model, not a measurement), k = 2:")
    for groups in (4, 16):
        drain = predicted(flat, Setting(2, groups))
        inflight = predicted(flat, Setting(2, groups, "head", inflight=True))
        print(f"  B = {groups:>2}: drain then reload {drain['seconds_a_step']:.3f} s a step, head in flight "
              f"{inflight['seconds_a_step']:.3f} s: {drain['seconds_a_step'] / inflight['seconds_a_step']:.2f}x")


CHECKED = {  # name: (groups a step: the runs' or 4, flags, the simulation's settings)
    "k = 2, pace": (None, ("--max_staleness", "2"), dict(k=2)),
    "k = 8, pace": (None, ("--max_staleness", "8"), dict(k=8)),
    "k = 2, drop, room 2(k+1)B": (None, ("--max_staleness", "2", "--stale_policy", "drop", "--max_in_flight", "ROOM"),
                                  dict(k=2, policy="drop", room="ROOM")),
    "B = 4, k = 2, drain then reload": (4, ("--max_staleness", "2"), dict(k=2)),
    "B = 4, k = 2, head, in flight": (4, ("--max_staleness", "2", "--stale_policy", "head", "--inflight_updates"),
                                      dict(k=2, policy="head", inflight=True)),
}


def check(rates: dict, args: Args) -> dict:
    """Each setting run for real beside its prediction: {name: (model, real)}. Errors are (measured - predicted),
    the seconds' relative to the measured seconds."""
    names = list(CHECKED)[:1] if args.quick else list(CHECKED)
    pairs = {}
    steps = 6 if args.quick else args.check_steps
    header = "  ".join(f"{c[:7]:>7}" for c in COLUMNS)
    print(f"\npredicted against measured ({steps} steps each; error: measured - predicted, the seconds' relative to "
          "the measured seconds):")
    print(f"  {'':<34}        {header}")
    for name in names:
        groups, flags, settings = CHECKED[name]
        groups = groups or args.groups
        room = str(2 * (settings["k"] + 1) * groups)
        flags = tuple(room if f == "ROOM" else f for f in flags)
        settings = {key: int(room) if value == "ROOM" else value for key, value in settings.items()}
        real = measured(run(folder(name), args, steps, groups, *flags))
        model = predicted(rates, Setting(groups=groups, steps=steps, **settings))
        error = {c: real[c] - model[c] for c in COLUMNS}
        error["seconds_a_step"] = error["seconds_a_step"] / real["seconds_a_step"]
        print(f"  {name:<34} model  {line(model)}\n  {'':<34} real   {line(real)}\n  {'':<34} error  {line(error)}")
        pairs[name] = (model, real)
    return pairs


def check_engines(rates: dict, args: Args) -> None:
    """G = 1 against G = 2 on this machine (k = 2, pace, B = --groups), predicted and measured, --engine_seeds seeds
    each, the two run back to back for each seed. One engine: a core each, as the pilots. Two: the engines and the
    learner unpinned on the 2 cores, three processes, modelled as 2/3 of a core each (a static share: while one
    waits the others get more, which the model does not count)."""
    settings = {1: (Setting(2, args.groups, steps=args.check_steps), ()),
                2: (Setting(2, args.groups, steps=args.check_steps, engines=2, share=2 / 3),
                    ("--num_generators", "2"))}
    seconds = {1: [], 2: []}
    for seed in range(1, args.engine_seeds + 1):
        for engines, (_, flags) in settings.items():
            steps = run(f"G{engines}_k2_pace_seed{seed}", args, args.check_steps, args.groups, "--max_staleness",
                        "2", "--seed", str(seed), *flags)
            seconds[engines].append(measured(steps)["seconds_a_step"])
    print(f"\nG engines on this machine (k = 2, pace, B = {args.groups}, {args.check_steps} steps, seeds 1-"
          f"{args.engine_seeds}, back to back; error: (measured - predicted) / measured):")
    for engines, (setting, _) in settings.items():
        model, real = predicted(rates, setting)["seconds_a_step"], seconds[engines]
        mean, spread = statistics.mean(real), statistics.stdev(real) if len(real) > 1 else 0.0
        print(f"  G = {engines}: predicted {model:.3f} s a step, measured {mean:.3f} +- {spread:.3f} "
              f"({', '.join(f'{x:.3f}' for x in real)}), error {(mean - model) / mean:+.1%}")
    ratio = [two / one for one, two in zip(seconds[1], seconds[2])]
    model = [predicted(rates, settings[engines][0])["seconds_a_step"] for engines in (1, 2)]
    spread = statistics.stdev(ratio) if len(ratio) > 1 else float("nan")
    t = (statistics.mean(ratio) - 1) / (spread / len(ratio) ** 0.5)  # (against 1: no difference)
    print(f"  G = 2 / G = 1, seconds a step: predicted {model[1] / model[0]:.2f}, measured "
          f"{statistics.mean(ratio):.2f} +- {spread:.2f} (paired by seed; t = {t:.1f} on {len(ratio) - 1} degrees "
          "of freedom)")


def report_split(rates: dict, args: Args) -> None:
    """The split of --gpus GPUs between G engines and L learners (k = 2, pace): each engine a GPU, the learners'
    step divided among them (data parallel, ideally). The pilots give the shape (the lengths' tail, an engine
    step's cost in its sequences, the learner's in its padded tokens); --generation_seconds and --training_seconds
    the scale: one engine's time to sample a step's batch, one GPU's to train on it."""
    sync = predicted(rates, Setting(0, args.groups, engine_speed=1.0, learner_speed=1.0))
    generation = sync["learner_idle"] * sync["seconds_a_step"]  # (k = 0: the learner waits for the whole batch)
    scale_g, scale_l = args.generation_seconds / generation, args.training_seconds / (sync["seconds_a_step"]
                                                                                      - generation)
    gpu = {**rates, **{key: rates[key] * scale_g for key in "abcf"},
           **{key: rates[key] * scale_l for key in "dep"}}
    print(f"\nthe split of {args.gpus} GPUs (k = 2, pace, B = {args.groups}; a step's batch sampled by one engine in "
          f"{args.generation_seconds} s, trained on one GPU in {args.training_seconds} s; learners scale ideally):")
    print("   G   L  seconds a step  learner idle  engines idle  staleness")
    best = None
    for engines in range(1, args.gpus):
        model = predicted(gpu, Setting(2, args.groups, engines=engines, engine_speed=1.0,
                                       learner_speed=float(args.gpus - engines)), seeds=3)
        print(f"  {engines:>2}  {args.gpus - engines:>2}  {model['seconds_a_step']:>14.2f}  "
              f"{model['learner_idle']:>12.2f}  {model['generator_idle']:>12.2f}  {model['staleness']:>9.2f}")
        best = min(best or (model["seconds_a_step"], engines), (model["seconds_a_step"], engines))
    print(f"  the model's split: G = {best[1]} engines, L = {args.gpus - best[1]} learners "
          f"(--num_generators {best[1]}, torchrun --nproc_per_node {args.gpus - best[1]})")


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


def pilots(args: Args) -> dict:
    """The synchronous pilots at each of --pilot_groups, run (or read) and fitted; their rates printed."""
    steps = 6 if args.quick else args.pilot_steps
    runs = []
    for groups in args.pilot_groups:
        name = f"pilot_k0_B{groups}"
        runs.append((os.path.join(args.runs_dir, name), run(name, args, steps, groups, "--max_staleness", "0",
                                                            "--record_rollouts", "--record_every", str(10**6)),
                     groups))
    rates = measure_rates(runs)
    lengths = sorted(n for _, ls in rates["groups"] for n in ls)
    print(f"the pilots (k = 0, B = {', '.join(map(str, args.pilot_groups))}, {steps} steps each): an engine step "
          f"a + b n = {rates['a'] * 1e3:.2f} + {rates['b'] * 1e3:.3f} n ms, a prompt token {rates['f'] * 1e3:.3f} ms, "
          f"a load c = {rates['c']:.3f} s (the fit's mean error {rates['generator_error']:.0%} of the measured); a "
          f"learner step d + e x padded tokens = {rates['d']:.3f} s + {rates['e'] * 1e3:.4f} ms a token, the "
          f"proximal pass {rates['p'] * 1e3:.4f} ms a token (mean error {rates['learner_error']:.0%}); completion "
          f"lengths p50/p90/p99 {lengths[len(lengths) // 2]}/{lengths[int(0.9 * len(lengths))]}/"
          f"{lengths[int(0.99 * len(lengths))]} ({len(lengths)} completions)")
    return rates


if __name__ == "__main__":
    args = tyro.cli(Args)
    os.makedirs(args.plot_dir, exist_ok=True)  # before the sweep, so a path that cannot be made fails at once
    rates = pilots(args)
    report_grid(rates, args)
    design(rates)
    report_flat_steps(rates)
    if args.engine_seeds and not args.quick:
        check_engines(rates, args)
    report_split(rates, args)
    plot(check(rates, args), os.path.join(args.plot_dir, "capacity.png"))
