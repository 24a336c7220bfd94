"""Plumbing shared by every script: code that is the same in each and that a reader does not need in order to
understand asynchronous RLHF. The lesson (Args, the generator loop, the weight hand-off, the schedule, the reward,
the loss, evaluation and the training loop) stays in each script."""
import contextlib
import json
import os
import queue
import random
import shutil
import sys
from dataclasses import asdict
from typing import NoReturn, Optional

import datasets
import numpy as np
import torch
import torch.distributed as dist
import tyro
from transformers import AutoConfig, AutoModelForSequenceClassification


# ---------------------------------------------------------------------------------------------------------------
# Flags, paths and loading, with errors that name the flag or file
# ---------------------------------------------------------------------------------------------------------------
def parse_args(args_class, tiny_defaults: dict):
    """tyro's parse of the script's Args. `--model tiny` needs its own defaults (small batches, short responses),
    which flags still override; tyro cannot see the preset before parsing, so peek at it."""
    argv = sys.argv[1:]
    tiny = "--model=tiny" in argv or any(a == "--model" and argv[i + 1: i + 2] == ["tiny"] for i, a in enumerate(argv))
    return tyro.cli(args_class, default=args_class(model="tiny", **tiny_defaults) if tiny else args_class())


def fail(message: str) -> NoReturn:
    """Stop early with a one-line error naming the bad flag or file."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def check_model_path(flag: str, path: str) -> None:
    """Fail early, naming the flag, when a model is neither a local folder nor loadable from the hub."""
    if path.startswith((".", "/", "~")) and not os.path.isdir(os.path.expanduser(path)):
        fail(f"--{flag} {path}: no such folder")
    try:
        AutoConfig.from_pretrained(path)
    except Exception as e:
        fail(f"--{flag} {path}: not a local model folder and could not be loaded from the hub "
             f"({type(e).__name__}: {str(e).splitlines()[0][:200]})")


def load_prompt_splits(dataset: str, seed: int):
    """Load train and validation splits from a hub name, a local folder of split files, or a single local file
    (then 5% is held out for evaluation). Rejects data without the `query`/`reference_response` columns."""
    kind = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}.get(os.path.splitext(dataset)[1])
    if os.path.isfile(dataset) and kind is None:
        fail(f"--dataset {dataset}: unsupported file type (use .jsonl, .json, .parquet or .csv)")
    if not os.path.exists(dataset) and ("/" not in dataset or dataset.startswith((".", "/", "~"))):
        fail(f"--dataset {dataset}: no such file or folder")
    try:
        if os.path.isfile(dataset):
            split = datasets.load_dataset(kind, data_files=dataset)["train"].train_test_split(0.05, seed=seed)
            splits = {"train": split["train"], "validation": split["test"]}
        else:
            splits = datasets.load_dataset(dataset)
    except Exception as e:  # offline hub names, unreadable files
        fail(f"--dataset {dataset}: could not be loaded ({type(e).__name__}: {str(e).splitlines()[0][:200]})")
    for split in ("train", "validation"):
        if split not in splits:
            fail(f"--dataset {dataset}: no '{split}' split (found {sorted(splits)})")
        missing = {"query", "reference_response"} - set(splits[split].column_names)
        if missing:
            fail(f"--dataset {dataset}: {split} split lacks column(s) {sorted(missing)}; "
                 f"found {splits[split].column_names}")
    return splits["train"], splits["validation"]


def load_reward_model(flag: str, path: str, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """A frozen 1-label sequence classifier. transformers would silently give a checkpoint without a trained head
    (an SFT model, say) a random one, and we would train against noise: refuse it instead. The score head runs in
    float32: in bfloat16, close scores round to the same value and their pairs are dropped as ties."""
    model, info = AutoModelForSequenceClassification.from_pretrained(path, dtype=dtype, num_labels=1,
                                                                      output_loading_info=True)
    if info["missing_keys"] or not hasattr(model, "score"):
        fail(f"--{flag} {path}: not a reward model: the checkpoint has no trained `score` head (missing "
             f"{sorted(info['missing_keys'])[:4]}); pass a model saved as a sequence classifier")
    model.score.float()
    return model.to(device).eval().requires_grad_(False)


def prepare_policy(policy: torch.nn.Module, gradient_checkpointing: bool) -> torch.nn.Module:
    """Training mode with dropout off (the log-prob ratios of RLHF should not carry dropout noise), and optionally
    activation checkpointing, which transformers applies in training mode only (`GradientCheckpointingLayer`)."""
    for module in policy.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    if gradient_checkpointing:
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return policy.train()


# ---------------------------------------------------------------------------------------------------------------
# Learner processes (torchrun): rank 0 talks to the generator and shares what it hears
# ---------------------------------------------------------------------------------------------------------------
def learner_device(local_rank: int, world_size: int, generator_cores: int) -> tuple[torch.device, Optional[list]]:
    """vLLM owns GPU 0; learner rank i uses GPU i+1 of its node (or shares GPU 0 when there are too few). On CPU the
    generator gets its own cores (the last `generator_cores`; 0: none, it is not used), so that generation and
    training really run side by side, and the learner is pinned to the rest. Returns the learner's device and the
    generator's cores (None on GPU, or when there are not enough cores to split)."""
    if torch.cuda.is_available():
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        device = torch.device("cuda", local_rank + 1 if torch.cuda.device_count() > local_world_size else local_rank)
        torch.cuda.set_device(device)
        return device, None
    all_cores = sorted(os.sched_getaffinity(0))
    generator = all_cores[-generator_cores:] if 0 < generator_cores < len(all_cores) else None
    learner_cores = all_cores[: -generator_cores] if generator else all_cores
    os.sched_setaffinity(0, learner_cores)
    torch.set_num_threads(max(1, len(learner_cores) // world_size))
    return torch.device("cpu"), generator


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def init_learner_group(use_cuda: bool) -> None:
    # One group with a backend per device: DDP/FSDP reduce GPU tensors over NCCL, while reduce_sums and
    # broadcast_object_list work on CPU tensors, which NCCL cannot carry (torch.distributed: "cpu:gloo,cuda:nccl").
    dist.init_process_group("cpu:gloo,cuda:nccl" if use_cuda else "gloo")


def share(obj, rank: int, world_size: int):
    """Rank 0 talks to the generator; the other learner ranks get its messages (and its errors) from here."""
    if world_size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], BaseException):
        raise box[0] if rank == 0 else GeneratorError(f"rank 0 stopped: {box[0]}")
    return box[0]


def reduce_sums(sums: dict, world_size: int) -> dict:
    """Sum scalar statistics over learner ranks (each rank holds an equal shard of the batch)."""
    if world_size == 1:
        return sums
    values = torch.tensor(list(sums.values()), dtype=torch.float64)
    dist.all_reduce(values)
    return dict(zip(sums, values.tolist()))


def reduce_max(value: float, world_size: int) -> float:
    if world_size == 1:
        return value
    values = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return values.item()


# ---------------------------------------------------------------------------------------------------------------
# Metrics: metrics.jsonl (and wandb with --track)
# ---------------------------------------------------------------------------------------------------------------
def open_metrics(args, rank: int):
    """Rank 0's metrics.jsonl (appended to), and a wandb run with --track. Other ranks log nothing (None)."""
    if rank != 0:
        return None
    os.makedirs(args.output_dir, exist_ok=True)
    if args.track:
        import wandb

        wandb.init(project=args.wandb_project, entity=args.wandb_entity, name=args.run_name, config=asdict(args),
                   dir=args.output_dir, save_code=True)
        wandb.define_metric("step")
        wandb.define_metric("*", step_metric="step")
    return open(os.path.join(args.output_dir, "metrics.jsonl"), "a")


def close_metrics(metrics_file, track: bool) -> None:
    if metrics_file is not None:
        metrics_file.close()
        if track:
            import wandb

            wandb.finish()


def episodes_at(step: int, args) -> int:
    """Training prompts consumed after `step` optimizer steps. A round's N mini-batches are consumed by its first
    epoch; further epoches (--num_epochs) revisit them without consuming new prompts."""
    steps_per_round = args.num_mini_batches * args.num_epochs
    rounds, step_in_round = divmod(step, steps_per_round)
    return (rounds * args.num_mini_batches + min(step_in_round, args.num_mini_batches)) * args.batch_size


def timeline(origin: float, **phases: tuple[float, float]) -> dict:
    """`timeline/{phase}_start` and `_end` in seconds since `origin` (when training began): benchmarks/timeline.py
    draws them."""
    return {f"timeline/{phase}_{edge}": t - origin for phase, span in phases.items()
            for edge, t in zip(("start", "end"), span)}


def log(record: dict, metrics_file, track: bool) -> None:
    """One line of metrics.jsonl (and a wandb step with --track). Only rank 0 has a metrics file."""
    if metrics_file is None:
        return
    metrics_file.write(json.dumps(record) + "\n")
    metrics_file.flush()
    if track:
        import wandb

        wandb.log({k: wandb.Table(columns=["prompt", "response"], data=[list(s.values()) for s in v])
                   if k == "eval/samples" else v for k, v in record.items()})


# ---------------------------------------------------------------------------------------------------------------
# Talking to the generator process without ever hanging on it
# ---------------------------------------------------------------------------------------------------------------
class GeneratorError(RuntimeError):
    pass


def check_generator(generator) -> None:
    if not generator.is_alive():
        raise GeneratorError(f"the generator process exited unexpectedly (exit code {generator.exitcode})")


def send(requests, request: dict, generator) -> None:
    """Put on the one-slot request queue, without hanging if the generator has died."""
    while True:
        try:
            return requests.put(request, timeout=0.5)
        except queue.Full:
            check_generator(generator)


def receive(results, generator) -> dict:
    """Take from the one-slot result queue, without hanging if the generator has died; re-raise its error."""
    while True:
        try:
            message = results.get(timeout=0.5)
        except queue.Empty:
            if generator.is_alive():
                continue
            try:  # it may have reported its error just before exiting
                message = results.get(timeout=1.0)
            except queue.Empty:
                check_generator(generator)
                continue
        if message["kind"] == "error":
            raise GeneratorError("the generator process failed:\n" + message["traceback"])
        return message


def quiet_resource_tracker(log_path: Optional[str]) -> None:
    """Start multiprocessing's resource tracker (a helper process that the spawned generator shares) with its
    stderr in the generator's log. vLLM's engine creates a multiprocessing Lock; when the generator is killed or
    stopped, the tracker unlinks it at exit and warns of a "leaked semaphore": the generator's business, which a
    user would read on the console as a second failure. Call it before any queue or lock is created."""
    if log_path is None:  # --verbose: vLLM's log is on the console, and so is this
        return
    from multiprocessing import resource_tracker

    console, log_fd = os.dup(2), os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        os.dup2(log_fd, 2)
        resource_tracker.ensure_running()  # it inherits stderr from us now
    finally:
        os.dup2(console, 2)
        os.close(console)
        os.close(log_fd)


def stop_generator(generator, requests, results, run_tmp_dir: str) -> None:
    """Stop the generator (politely, then less so) and let this process exit whatever is still queued.
    A multiprocessing queue writes each item to its pipe from a feeder thread, which blocks while the pipe is full
    (64 KiB) and is joined when the process exits: a large evaluation request that the dead generator never read
    would hang the learner forever. `cancel_join_thread()` (the multiprocessing docs' way to exit "without waiting
    to flush enqueued data") drops it instead; nobody is left to read it."""
    with contextlib.suppress(queue.Full, ValueError, OSError):
        requests.put_nowait(None)  # a polite stop, seen if the generator is idle
    generator.join(timeout=2)
    for stop in (generator.terminate, generator.kill):
        if generator.is_alive():
            stop()
            generator.join(timeout=3)
    for pending in (requests, results):
        pending.cancel_join_thread()
        pending.close()
    shutil.rmtree(run_tmp_dir, ignore_errors=True)


# ---------------------------------------------------------------------------------------------------------------
# Tokenizers
# ---------------------------------------------------------------------------------------------------------------
def bos_prefix(tokenizer) -> list[int]:
    """[BOS] for a tokenizer that puts one in front of every text (Llama's, rho-1b's: their SFT models were trained
    with it), else [] (Pythia's). Prompts are tokenised without special tokens, so that no EOS is appended."""
    bos = tokenizer.bos_token_id
    with_special, without = tokenizer("x")["input_ids"], tokenizer("x", add_special_tokens=False)["input_ids"]
    return [bos] if bos is not None and with_special[:1] == [bos] and without[:1] != [bos] else []
