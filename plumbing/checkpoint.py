"""--save_every N and --resume_from DIR: checkpoints at a round's end, written so that an
interrupted save leaves the last one whole, and an exact resume (docs/invariants.md, section 8)."""
import os
import random
import shutil
import signal
import sys
import threading
import time
import warnings
from dataclasses import asdict
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from tqdm import tqdm

from plumbing.core import fail, reduce_max
from plumbing.metrics import keep_metrics_covered, wandb_run_id

# What trains, not the frozen weights (LoRA's base: the SFT checkpoint's, read from it again on resume). Loading,
# strict=False lets the frozen keys be absent: every trained one is there, or DCP's load has already refused it
TRAINED = StateDictOptions(ignore_frozen_params=True)
TRAINED_LOAD = StateDictOptions(ignore_frozen_params=True, strict=False)

LOOP = ("round", "version", "buffer_version", "last_eval", "pending_evals")  # the loop's state
TERM = threading.Event()  # SIGTERM arrived (see launch.run)


def due(args, version: int, steps: int) -> bool:
    """At a round's end (a round of `steps` optimizer steps): a multiple of --save_every steps passed in it,
    or SIGTERM arrived (on any rank: all ranks agree)."""
    if not args.save_every:
        return False
    is_due = version // args.save_every > (version - steps) // args.save_every or TERM.is_set()
    return reduce_max(float(is_due), args.world_size) > 0


def save(args, loop: tuple, score_next_evaluation: Callable, learner, optimizer, scheduler,
         weight_buffer, metrics_file, batch_in_flight: bool = True) -> list:
    """{output_dir}/checkpoint of the loop's state (LOOP, in order) at a round's end. The batch in
    flight is not saved: a resumed run requests it again with the weights in the buffer, which the
    checkpoint holds; so are the evaluations queued behind it (their version is the buffer's), while
    those queued before it, whose weights have left the buffer, are scored first (each by one call of
    `score_next_evaluation`, which collects and scores the generator's next evaluation). Then the
    learner and optimizer (torch.distributed.checkpoint: under FSDP2 each rank writes its shards),
    the scheduler, every rank's RNG states, the flags, the wandb run's id and how much of
    metrics.jsonl is written, beside the last checkpoint, then renamed into place. After SIGTERM,
    exit. Returns the evaluations still pending (their versions)."""
    *counters, pending = loop
    behind = pending[-1:] if batch_in_flight and pending and pending[-1] == counters[2] else []
    for _ in pending[: len(pending) - len(behind)]:
        score_next_evaluation()
    start, folder = time.time(), os.path.join(args.output_dir, "checkpoint")
    if args.rank == 0:
        shutil.rmtree(folder + ".new", ignore_errors=True)
        os.makedirs(folder + ".new")
    if args.world_size > 1:
        dist.barrier()
    model_state, optim_state = get_state_dict(learner, optimizer, options=TRAINED)
    with warnings.catch_warnings():  # (one learner: "torch.distributed is disabled", as it is)
        warnings.simplefilter("ignore")
        dcp.save({"model": model_state, "optim": optim_state}, no_dist=args.world_size == 1,
                 checkpoint_id=os.path.join(folder + ".new", "learner"))
    rng = [rng_states()] * args.world_size  # every rank's own (its GPU's only), gathered on rank 0
    if args.world_size > 1:
        dist.gather_object(rng[0], rng if args.rank == 0 else None, dst=0)
    if args.rank == 0:
        metrics_file.flush()
        torch.save(dict(loop=dict(zip(LOOP, (*counters, behind))), scheduler=scheduler.state_dict(),
                        weight_buffer=weight_buffer, rng=rng, args=asdict(args),
                        metrics_bytes=metrics_file.tell(), wandb_id=wandb_run_id(args.track)),
                   os.path.join(folder + ".new", "state.pt"))
        if os.path.exists(folder):  # (a save killed while deleting .old left it: never a valid one)
            shutil.rmtree(folder + ".old", ignore_errors=True)
            os.replace(folder, folder + ".old")
        os.replace(folder + ".new", folder)
        shutil.rmtree(folder + ".old", ignore_errors=True)
        size = sum(f.stat().st_size for f in os.scandir(folder) if f.is_file()) + sum(
            f.stat().st_size for f in os.scandir(os.path.join(folder, "learner")))
        tqdm.write(f"checkpoint at step {counters[1]}: {size / 2**20:.1f} MiB in "
                   f"{time.time() - start:.2f} s")
    if reduce_max(float(TERM.is_set()), args.world_size):  # (one decision: a rank may see it late)
        tqdm.write("stopped by SIGTERM after the checkpoint; continue with --resume_from "
                   f"{args.output_dir}", file=sys.stderr)
        raise SystemExit(128 + signal.SIGTERM)
    return behind


def resume(args, learner, optimizer, scheduler, weight_buffer, metrics_file) -> tuple:
    """--resume_from: the learner, optimizer, scheduler, generator weights and this rank's RNG
    states of a checkpoint, and metrics.jsonl as far as it covers. Returns the loop's state."""
    saved, folder = read(args.resume_from), checkpoint_folder(args.resume_from)
    allocate_optimizer_state(optimizer)
    model_state, optim_state = get_state_dict(learner, optimizer, options=TRAINED)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load({"model": model_state, "optim": optim_state}, no_dist=args.world_size == 1,
                     checkpoint_id=os.path.join(folder, "learner"))
    except (Exception, dcp.api.CheckpointException) as e:  # (the latter is a BaseException)
        cause = next(iter(getattr(e, "failures", {}).values()), (e, None))[0]  # (DCP wraps them)
        detail = (str(cause).strip().splitlines() or [""])[0][:200]
        fail(f"--resume_from {args.resume_from}: damaged checkpoint ({type(cause).__name__}"
             f"{': ' + detail if detail else ''})")
    set_state_dict(learner, optimizer, model_state_dict=model_state, optim_state_dict=optim_state,
                   options=TRAINED_LOAD)
    scheduler.load_state_dict(saved["scheduler"])
    if weight_buffer is not None:
        weight_buffer.copy_(saved["weight_buffer"])
    states = saved["rng"][args.rank]  # this rank's own; the GPU's, on this process's GPU
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if states["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])
    if metrics_file is not None:
        keep_metrics_covered(metrics_file, os.path.dirname(folder), saved["metrics_bytes"])
    if args.rank == 0:
        rounds = f" (round {saved['loop']['round']})" if hasattr(args, "num_rounds") else ""  # (a stream: none)
        print(f"resumed at step {saved['loop']['version']}{rounds}", flush=True)
    return tuple(saved["loop"][key] for key in LOOP)


def rng_states() -> dict:
    """This process's RNG states: Python's, NumPy's, torch's CPU one and its own GPU's."""
    return dict(python=random.getstate(), numpy=np.random.get_state(), torch=torch.get_rng_state(),
                cuda=torch.cuda.get_rng_state() if torch.cuda.is_available() else None)


def allocate_optimizer_state(optimizer) -> None:
    """AdamW's moments, allocated for a checkpoint to load into by a step at lr 0 on zero gradients,
    as DCP's get_state_dict does, but with every plain (DDP) parameter's gradient a view of one
    shared zero buffer: DCP's way zero-fills a full float32 gradient set beside DDP's buckets (+4
    bytes a parameter at the resume's peak). FSDP2's gradients are shards (DTensors), cheap."""
    from torch.distributed.tensor import DTensor

    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    plain = [p for p in params if not isinstance(p, DTensor)]
    shared = torch.zeros(max((p.numel() for p in plain), default=0), dtype=params[0].dtype,
                         device=plain[0].device if plain else "cpu")
    for p in params:
        p.grad = torch.zeros_like(p) if isinstance(p, DTensor) else shared[: p.numel()].view_as(p)
    lrs = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)


def check_same_run(args, may_differ: set):
    """Refuse a checkpoint of another run before anything is written: any flag not in `may_differ` (the
    script's own set) that differs, a model compared by what it is (`model_identity`). Returns the wandb run's
    id."""
    saved = read(args.resume_from)
    here, there = getattr(args, "tiny_dir", None), saved["args"].get("tiny_dir")
    differ = [k for k, v in saved["args"].items() if k not in may_differ
              and model_identity(getattr(args, k, v), here) != model_identity(v, there)]
    if differ:
        fail(f"--resume_from {args.resume_from}: its run had --{differ[0]} "
             f"{saved['args'][differ[0]]}, this one has {getattr(args, differ[0])}")
    return saved.get("wandb_id")


def model_identity(value, tiny_dir=None):
    """A flag's value as a resume compares it: a model fetched into the Hugging Face cache by its repository and
    commit (`models--{org}--{name}/snapshots/{commit}`), and a tiny world's model or data by its place in the world
    (the world itself by `world_hash`), not by where the cache or the world lies on each machine."""
    if isinstance(value, str) and "/snapshots/" in value and "models--" in value:
        return value[value.rindex("models--"):].rstrip("/")
    if isinstance(value, str) and tiny_dir and os.path.isabs(value):
        inside = os.path.relpath(value, os.path.expanduser(tiny_dir))
        return value if inside.startswith("..") else ("in the tiny world", inside)
    return value


def checkpoint_folder(path: str) -> str:
    """--resume_from: a run's folder or its checkpoint folder (or what an interrupted save left)."""
    for folder in (path, os.path.join(path, "checkpoint"), os.path.join(path, "checkpoint.old")):
        if os.path.isfile(os.path.join(folder, "state.pt")):
            return os.path.abspath(folder)
    fail(f"--resume_from {path}: no checkpoint there (a run's folder, or its checkpoint folder, "
         f"written with --save_every)")


def run_folder(path: str) -> str:
    """The folder of the run whose checkpoint --resume_from names (a resumed run logs there)."""
    return os.path.dirname(checkpoint_folder(path))


def read(path: str) -> dict:
    try:
        return torch.load(os.path.join(checkpoint_folder(path), "state.pt"), map_location="cpu",
                          weights_only=False, mmap=True)
    except Exception as e:
        fail(f"--resume_from {path}: damaged checkpoint "
             f"({type(e).__name__}: {str(e).splitlines()[0][:200]})")
