"""What a run reports: metrics.jsonl (and wandb with --track), the console's evaluations, and the
timings that benchmarks/timeline.py draws (a step's statistics: core.step_stats)."""
import json
import os
import sys
import time
from dataclasses import asdict
from typing import Optional

from tqdm import tqdm


# --- metrics.jsonl and wandb ----------------------------------------------------------------------
def open_metrics(args, wandb_id: Optional[str] = None):
    """Rank 0's metrics.jsonl (appended to) and, with --track, the wandb run (a resumed run's own,
    by its id)."""
    if args.rank != 0:
        return None
    os.makedirs(args.output_dir, exist_ok=True)
    if args.track:
        import wandb

        wandb.init(project=args.wandb_project, entity=args.wandb_entity, name=args.run_name,
                   config=asdict(args), dir=args.output_dir, save_code=True, id=wandb_id,
                   resume="allow" if wandb_id else None)
        wandb.define_metric("step")
        wandb.define_metric("*", step_metric="step")
    return open(os.path.join(args.output_dir, "metrics.jsonl"), "a")


def close_metrics(metrics_file, track: bool) -> None:
    if metrics_file is not None:
        metrics_file.close()
        if track:
            import wandb

            wandb.finish()


def keep_metrics_covered(metrics_file, run_folder: str, covered: int) -> None:
    """metrics.jsonl as a checkpoint of the run in `run_folder` left it: cut back to the bytes it
    covered, or, resumed into another --output_dir, those bytes copied from that run's file."""
    source = os.path.join(run_folder, "metrics.jsonl")
    if os.path.exists(source) and os.path.samefile(source, metrics_file.name):
        metrics_file.truncate(covered)
        return
    metrics_file.truncate(0)
    if os.path.exists(source):
        with open(source) as run_so_far:
            metrics_file.write(run_so_far.read(covered))  # (JSON lines: ASCII, a byte a character)
    else:
        print(f"{source} is missing: {metrics_file.name} starts empty at the checkpoint",
              file=sys.stderr)
    metrics_file.flush()


def wandb_run_id(track: bool) -> Optional[str]:
    if not track:
        return None
    import wandb

    return wandb.run.id if wandb.run is not None else None


def log(record: dict, metrics_file, track: bool) -> None:
    if metrics_file is None:
        return
    if "first step" not in STARTUP:  # (the start-up's last phases: the SFT policy's evaluation, the first step)
        if record.get("step", 0) >= 1 and not any(key.startswith("eval/") for key in record):
            startup_mark("first step")
            tqdm.write(startup_line())
        elif record.get("step") == 0 and any(key.startswith("eval/") for key in record):
            startup_mark("step-0 evaluation")
    metrics_file.write(json.dumps(record) + "\n")
    metrics_file.flush()
    if track:
        import wandb

        tables = {k: wandb.Table(columns=["prompt", "response"], data=[list(s.values()) for s in v])
                  for k, v in record.items() if k == "eval/samples"}
        wandb.log({**record, **tables})


def print_evaluation(record: dict, reward_names) -> None:
    win_rates = ", ".join(f"{name} win rate {record[f'eval/{name}_win_rate']:.3f} ± "
                          f"{record[f'eval/{name}_win_rate_stderr']:.3f}" for name in reward_names)
    tqdm.write(f"eval @ step {record['step']} ({record['eval/num_prompts']} prompts): {win_rates}, "
               f"perplexity {record['eval/perplexity']:.3f} "
               f"(paper's: {record['eval/perplexity_paper']:.3f})")
    for sample in record["eval/samples"]:
        tqdm.write(f"  ...{sample['prompt'][-60:]!r} -> {sample['response']!r}")


def save_completions(output_dir: str, eval_data, responses: list, tokenizer) -> None:
    """{output_dir}/final_completions.jsonl, what benchmarks/judge.py reads: per evaluation prompt, the
    prompt (a chat's turns, or its text), the policy's completion and the reference, as text and
    their lengths in tokens (the end token included)."""
    plain = dict(skip_special_tokens=True)
    with open(os.path.join(output_dir, "final_completions.jsonl"), "w") as file:
        for row, response in zip(eval_data, responses):
            reference = tokenizer(row["reference_response"], add_special_tokens=False)["input_ids"]
            file.write(json.dumps(dict(
                prompt=row["messages"][:-1] if "messages" in row else row["query"],
                response=tokenizer.decode(response, **plain), reference=tokenizer.decode(reference, **plain),
                response_tokens=len(response), reference_tokens=len(reference))) + "\n")


# --- Start-up: where a run's first seconds go, printed once at its first step ---------------------
STARTUP = {}  # phase: when it ended (this process's clock)
STARTUP_DETAILS = {}  # phase: what its parentheses say (the generator's own seconds; the evaluation's sampling)


def startup_mark(phase: str) -> None:
    """Note when a start-up phase ended (its first time): the imports (launch.parse_args), the flags and
    the world's check (launch.run), the data (launch.start_run), the models (core.shard_or_replicate),
    vLLM ready (startup_message), the SFT policy's evaluation and the first step (log)."""
    STARTUP.setdefault(phase, time.time())


def startup_message(message: dict) -> None:
    """A message from the generator, as every rank takes it (generator_io.raise_error): its "ready",
    with its process's own seconds (several engines: the last one ready), and the first evaluation's
    sampling seconds."""
    if message["kind"] == "ready":
        startup_mark("vLLM ready")
        if message.get("startup"):  # (a generator of the benchmarks' may send none)
            STARTUP_DETAILS["vLLM ready"] = "its process: " + ", ".join(
                f"{name} {seconds:.1f} s" for name, seconds in message["startup"].items())
    elif message["kind"] == "eval" and "generation_end" in message:
        STARTUP_DETAILS.setdefault("step-0 evaluation", f"sampling "
                                   f"{message['generation_end'] - message['generation_start']:.1f} s")


def startup_line() -> str:
    """One line: the seconds from the process's start to its first step, phase by phase."""
    parts, previous = [], process_started()
    for t, phase in sorted((t, phase) for phase, t in STARTUP.items()):
        parts.append(f"{phase} {t - previous:.1f} s" + (f" ({STARTUP_DETAILS[phase]})" if phase in STARTUP_DETAILS
                                                          else ""))
        previous = t
    return f"start-up: the first step {previous - process_started():.1f} s after the start: " + ", ".join(parts)


def process_started() -> float:
    """When this process started, on the clock's time, to 10 ms: its start in clock ticks since boot
    (/proc) against the uptime (psutil's is as coarse as the boot time /proc gives: whole seconds)."""
    with open("/proc/self/stat") as stat, open("/proc/uptime") as uptime:
        ticks = int(stat.read().rsplit(")", 1)[1].split()[19])
        up = float(uptime.read().split()[0])
    return time.time() - up + ticks / os.sysconf("SC_CLK_TCK")


# --- Episodes and timings -------------------------------------------------------------------------
def episodes_at(step: int, args) -> int:
    """Training prompts consumed after `step` steps (epochs after the first revisit a round)."""
    rounds, step_in_round = divmod(step, args.num_mini_batches * args.num_epochs)
    mini_batches = rounds * args.num_mini_batches + min(step_in_round, args.num_mini_batches)
    return mini_batches * args.batch_size


def timeline(origin: float, **phases: tuple[float, float]) -> dict:
    """`timeline/{phase}_start` and `_end`: seconds since training began (for timeline.py)."""
    return {f"timeline/{phase}_{edge}": t - origin for phase, span in phases.items()
            for edge, t in zip(("start", "end"), span)}


def eval_times(message: dict, start: float, training_start: Optional[float]) -> dict:
    """An evaluation's `time/` seconds and, during training, its `timeline/` spans."""
    record = {"time/eval": time.time() - start,
              "time/elapsed": time.time() - training_start if training_start else 0.0}
    if training_start:
        record.update(timeline(training_start, evaluation=(start, time.time()),
                               eval_queued=(message["requested"], message["weight_load_start"]),
                               eval_generation=(message["generation_start"],
                                                message["generation_end"])))
    return record


def round_times(origin: float, round_start: float, eval_seconds: float, **phases: tuple) -> dict:
    """A round's `time/` and `timeline/` phases (the wait leaves out evaluations scored then)."""
    record = {f"time/{phase}": end - start for phase, (start, end) in phases.items()}
    record.update(timeline(origin, **phases))
    record["time/learner_wait"] -= eval_seconds
    record["time/step"] = time.time() - round_start
    return record


# --- Which side waited: the regime of the paper's Section 4 ---------------------------------------
def round_means(records: list[dict]) -> Optional[dict]:
    """A run's mean seconds a round spends generating (weight load + generation), training (weight sync +
    training), with the learner waiting and (None under three rounds) with the generator waiting, over its
    rounds after the first (nothing overlaps the first); None with fewer than two rounds."""
    rounds = [r for r in records if "time/training" in r][1:]
    if not rounds:
        return None
    mean = {phase: sum(r[f"time/{phase}"] for r in rounds) / len(rounds)
            for phase in ("weight_load", "generation", "weight_sync", "training", "learner_wait")}
    # the generator's wait: from a batch's end to the next batch's weight load, less evaluations
    # sampled in between (from the second batch on, as the means: the learner awaits the first)
    evals = [(r["timeline/eval_generation_start"], r["timeline/eval_generation_end"])
             for r in records if "timeline/eval_generation_start" in r]
    gaps = []
    for done, following in zip(rounds, rounds[1:]):
        start, end = done["timeline/generation_end"], following["timeline/weight_load_start"]
        gaps.append(end - start - sum(max(0.0, min(end, b) - max(start, a)) for a, b in evals))
    return dict(generating=mean["weight_load"] + mean["generation"],
                training=mean["weight_sync"] + mean["training"], learner_wait=mean["learner_wait"],
                generator_wait=sum(gaps) / len(gaps) if gaps else None)


def regime(records: list[dict], balanced: float = 1.2) -> str:
    """One line: which side of the pipeline waited for the other over a run's rounds (`round_means`), by how
    much, and the knob the paper's Section 4 suggests for it."""
    means = round_means(records)
    if means is None:
        return "regime: too few rounds to tell which side waited (it needs two)"
    generating, training = means["generating"], means["training"]
    times = (f"a round's generation {generating:.2f} s against its training {training:.2f} s; the learner "
             f"waited {means['learner_wait']:.2f} s a round"
             + (f", the generator {means['generator_wait']:.2f} s" if means["generator_wait"] is not None else ""))
    if generating > balanced * training:
        return (f"regime: generation-bound ({generating / training:.1f}x): {times}. The paper's knob: more "
                "updates on each batch (--num_epochs 2 or 3), fewer episodes to a win rate, at some KL")
    if training > balanced * generating:
        return (f"regime: training-bound ({training / generating:.1f}x): {times}. The paper's knob: more "
                "samples per prompt (--num_samples 4, best against worst, with half the learning rate "
                "and steps)")
    return f"regime: balanced (within {balanced}x): {times}. Neither knob is called for"


def print_regime(metrics_file) -> None:
    """Rank 0 prints the run's regime line (`regime`) from its metrics.jsonl."""
    if metrics_file is not None:
        with open(metrics_file.name) as lines:
            tqdm.write(regime([json.loads(line) for line in lines]))


def idle_regime(learner_idle: float, generator_idle: float, elapsed: float, balanced: float = 1.2) -> str:
    """The regime line of a streaming run (fully_async_grpo.py): the share of its training time each side waited
    for the other, and what to change."""
    learner, generator = learner_idle / max(elapsed, 1e-9), generator_idle / max(elapsed, 1e-9)
    times = f"the learner waited {learner:.0%} of the run's {elapsed:.0f} s, the generator {generator:.0%}"
    if learner > balanced * max(generator, 0.02):
        return (f"regime: generation-bound: {times}. More engines (--num_generators, --generator_nodes) or fewer "
                "learners, a larger --max_staleness, or in-flight weight updates would keep the learner busy")
    if generator > balanced * max(learner, 0.02):
        return (f"regime: training-bound: {times}. More learners (or fewer engines), or larger groups "
                "(--num_samples) for the same steps, would keep the generator busy")
    return f"regime: balanced (within {balanced}x): {times}"


# --- The streaming twins' metrics: the stream, in-flight loads, episodes ---------------------------
def quantile(values: list, q: float) -> float:
    """The q-quantile of sorted values (the lower one: no interpolation)."""
    return float(values[min(int(q * len(values)), len(values) - 1)])


def stream_stats(batch: list, discarded: int, ledger: dict, engines: list, num_engines: int) -> dict:
    """What a user must see of the stream: the staleness (mean, max, histogram), the groups accepted and discarded
    (this step and in all), the queue (groups finished and waiting, the oldest one's wait), the completion lengths
    (p50, p90, p99) and truncations, the rollouts' durations (admitted to finished), the generator's loads of the
    published versions (how long after publishing, and under `recompute` in flight the engine step after the load,
    which re-reads the preempted sequences), each side's idle fraction since training began and each token's
    staleness; and per engine, its loaded version, its publish-to-load time, its groups and its idle share
    (`engine{e}/...`). fully_async_grpo.py adds the versions a completion spans (inflight_stats), agentic_grpo.py
    the episodes' (episode_stats)."""
    staleness = [g["staleness"] for g in batch]
    token_staleness = [s for g in batch for s in g["token_staleness"]]
    lengths = sorted(len(r) for g in batch for r in g["responses"])
    durations = sorted(g["finished"] - g["admitted"] for g in batch)
    loads = [load for g in batch for load in g["loads"]]  # (version, load seconds, since published): a node's own
    reprefills = [seconds for g in batch for seconds in g["reprefills"]]
    elapsed = max(time.time() - ledger["start"], 1e-9)
    waiting = len(ledger["arrived"]) + (engines[0].results.qsize() if engines else 0)  # (this node's)
    per_engine = {}  # (every engine's version and idle seconds as it last wrote them in the record: rank 0's)
    for e, (loaded, idle) in sorted(ledger["reports"].items()):
        per_engine.update({f"engine{e}/version": loaded, f"engine{e}/idle_fraction": idle / elapsed})
    for e, engine in sorted(ledger["engines"].items()):
        per_engine[f"engine{e}/groups"] = engine["groups"]
        if engine["lags"]:  # (its loads reported since the last step)
            per_engine[f"engine{e}/publish_to_load_seconds"] = sum(engine["lags"]) / len(engine["lags"])
        engine["lags"] = []

    return {"staleness/mean": sum(staleness) / len(staleness), "staleness/max": max(staleness),
            "staleness/histogram": {str(s): staleness.count(s) for s in sorted(set(staleness))},
            "rollouts/accepted": len(batch), "rollouts/discarded": discarded,
            "rollouts/accepted_total": ledger["accepted"], "rollouts/discarded_total": ledger["discarded"],
            "queue/depth": waiting,
            "queue/oldest_age": max(g["queued"] + g["taken_at"] - g["arrived_at"] for g in batch),
            "length/p50": quantile(lengths, 0.5), "length/p90": quantile(lengths, 0.9),
            "length/p99": quantile(lengths, 0.99), "length/max": lengths[-1],
            "length/truncated_fraction": sum(not g["ended"][i] for g in batch for i in range(len(g["ended"])))
            / len(lengths),
            "rollout/seconds_p50": quantile(durations, 0.5), "rollout/seconds_p90": quantile(durations, 0.9),
            "rollout/seconds_max": durations[-1], "generator/version": batch[-1]["loaded"],
            **({"weights/load_seconds": sum(seconds for _, seconds, _ in loads) / len(loads),
                "weights/publish_to_load_seconds": sum(lag for _, _, lag in loads) / len(loads)} if loads else {}),
            **({"weights/reprefill_seconds": sum(reprefills) / len(reprefills)} if reprefills else {}),
            "staleness/token_mean": sum(token_staleness) / max(len(token_staleness), 1),
            "idle/learner_fraction": ledger["learner_idle"] / elapsed,
            "idle/generator_fraction": sum(i for _, i in ledger["reports"].values()) / elapsed / num_engines,
            **per_engine}


def inflight_stats(batch: list) -> dict:
    """The versions a completion spans (more than one only with --inflight_updates): fully_async_grpo.py's."""
    spans = [completion for g in batch for completion in g["spans"]]
    return {"inflight/multi_version_fraction": sum(len(s) > 1 for s in spans) / len(spans),
            "inflight/versions_per_completion": sum(map(len, spans)) / len(spans)}


def episode_stats(batch: list, ledger: dict) -> dict:
    """What a user must see of the episodes: their turns (p50, p90, p99), the versions that sampled each one and
    its within-episode staleness (newest minus oldest token version; the learner's minus the oldest is
    staleness/max, as for a group), its histogram, the tools' calls (those it could not read included), seconds and
    errors (calls it could not read: parse_failures; unknown tools, bad arguments, raising tools and timeouts:
    errors; the two together: malformed; wrong on purpose), how much of the tools' time the engine spent sampling
    other episodes (its overlap), and the engine's occupancy (turns a step advances, the mean over engine steps
    since training began and over engines)."""
    turns = sorted(t for g in batch for t in g["turns"])
    within = [s for g in batch for s in g["within_episode"]]
    versions = [n for g in batch for n in g["episode_versions"]]
    calls = sum(sum(g["calls"]) for g in batch)
    failures, errors = (sum(sum(g[key]) for g in batch) for key in ("parse_failures", "errors"))
    pending = sum(e["tool_pending"] for e in ledger["engines"].values())  # (each engine's since training began)

    return {"episode/turns_p50": quantile(turns, 0.5), "episode/turns_p90": quantile(turns, 0.9),
            "episode/turns_p99": quantile(turns, 0.99), "episode/turns_mean": sum(turns) / len(turns),
            "episode/versions_mean": sum(versions) / len(versions),
            "episode/multi_version_fraction": sum(n > 1 for n in versions) / len(versions),
            "staleness/within_episode_mean": sum(within) / len(within), "staleness/within_episode_max": max(within),
            "staleness/within_episode_histogram": {str(s): within.count(s) for s in sorted(set(within))},
            "tools/calls": calls, "tools/seconds_mean": sum(t for g in batch for t in g["tool_seconds"])
            / max(calls, 1), "tools/malformed": failures + errors, "tools/parse_failures": failures,
            "tools/errors": errors, "tools/wrong": sum(sum(g["wrong"]) for g in batch),
            "tools/overlap_fraction": sum(e["tool_overlap"] for e in ledger["engines"].values()) / pending
            if pending else 0.0,
            "generator/turns_per_step": sum(e["turns_per_step"] for e in ledger["engines"].values())
            / len(ledger["engines"])}
