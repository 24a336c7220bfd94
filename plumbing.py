"""Plumbing shared by every script: code that is the same in each and that a reader does not need
in order to understand asynchronous RLHF. The lesson (Args, the generator loop, the weight hand-off,
the schedule, the reward, the loss, evaluation and the training loop) stays in each script."""
import contextlib
import functools
import gc
import json
import os
import queue
import random
import shutil
import signal
import sys
import threading
import time
import warnings
from dataclasses import asdict, dataclass
from typing import Callable, NoReturn, Optional

import datasets
import numpy as np
import torch
import torch.distributed as dist
import tyro
from tqdm import tqdm
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer


# --- Running a script: flags, errors that name the flag or file, a clean exit on every path ------
def run(main: Callable, args_class, tiny_defaults: dict) -> None:
    """main(args, cleanup), with what main puts on `cleanup` undone on every path, and a failed
    generator (exit 1) or Ctrl-C (130) told in one line, not a traceback."""
    args = parse_args(args_class, tiny_defaults)
    args.rank, args.world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    # SIGTERM (a scheduler's notice): with --save_every, a checkpoint at the round's end, then exit
    signal.signal(signal.SIGTERM, lambda *_: TERM.set() if args.save_every else sys.exit(128 + signal.SIGTERM))
    code, message = 0, ""
    with contextlib.ExitStack() as cleanup:
        try:
            main(args, cleanup)
        except GeneratorError as error:  # (every rank has it: collect shares it)
            message = f"error: {error}" + ("\n(the learner shares GPU 0 with vLLM: lower "
                                           "--vllm_gpu_memory_utilization)" if shares_gpu0() else "")
            if args.rank == 0 and not args.verbose:
                message += f"\nvLLM's log: {args.output_dir}/generator.log"
            code = 1
        except KeyboardInterrupt:
            tqdm.write("interrupted: shutting down the generator", file=sys.stderr)
            code = 130
    if message:  # after the clean-up: the last lines the user reads (the progress bar closed above it)
        print(message, file=sys.stderr, flush=True)
    if dist.is_initialized():  # once DDP/FSDP state is freed (else gloo may abort the exit)
        gc.collect()
        dist.destroy_process_group()
    if code:
        raise SystemExit(code)


def parse_args(args_class, tiny_defaults: dict):
    """tyro's parse of Args; `--model tiny` has its own defaults (flags override them)."""
    argv = sys.argv[1:]
    tiny = "--model=tiny" in argv or any(a == "--model" and argv[i + 1: i + 2] == ["tiny"]
                                         for i, a in enumerate(argv))
    return tyro.cli(args_class, default=args_class(model="tiny", **tiny_defaults) if tiny else args_class())


def fail(message: str) -> NoReturn:
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def batch_sizes(args, world_size: int, positive: tuple = ("temperature", "eval_temperature")) -> None:
    """Reject flags that make no sense or do not divide; fill in Args' runtime fields."""
    for name in ("response_length", "max_prompt_length", "total_episodes", "batch_size", "num_epochs",
                 "per_device_train_batch_size", "num_mini_batches", "num_eval_prompts",
                 "eval_response_length", "generator_cores", *positive):
        if getattr(args, name) <= 0:
            fail(f"--{name} must be positive, got {getattr(args, name)}")
    local_batch_size, prompts_per_round = args.batch_size // world_size, args.batch_size * args.num_mini_batches
    hf = getattr(args, "generation_backend", "vllm") == "hf"  # (sync_baseline.py: no generator process)
    for bad, message in [
        (args.dtype == "float16", "--dtype float16: the learner would train under float16 autocast without a "
         "gradient scaler, and small gradients would underflow to 0 silently; use bfloat16 (or float32)"),
        (args.eval_every < 0, f"--eval_every must be 0 (off) or positive, got {args.eval_every}"),
        (args.save_every < 0, f"--save_every must be 0 (off) or positive, got {args.save_every}"),
        (not 0 < args.vllm_gpu_memory_utilization <= 1, "--vllm_gpu_memory_utilization must be in (0, 1]"),
        (min(args.num_eval_prompts, args.num_final_eval_prompts or world_size) < world_size,
         "--num_eval_prompts and --num_final_eval_prompts must give every learner process a prompt"),
        (args.fsdp and world_size == 1, "--fsdp shards over several learner processes: launch with torchrun"),
        (args.fsdp and hf, "--fsdp works with --generation_backend vllm only"),  # hf: ranks sample apart
        (args.batch_size % world_size, f"--batch_size {args.batch_size} must divide over {world_size} processes"),
        (local_batch_size % args.per_device_train_batch_size, f"--per_device_train_batch_size "
         f"{args.per_device_train_batch_size} must divide the per-process batch ({local_batch_size} prompts)"),
        (args.total_episodes < prompts_per_round, f"--total_episodes {args.total_episodes} is smaller than one "
         f"generation round (--batch_size x --num_mini_batches = {prompts_per_round})"),
    ]:
        if bad:
            fail(message)
    args.world_size, args.local_batch_size = world_size, local_batch_size
    args.generator_cores = 0 if hf else args.generator_cores  # (hf: the learner takes every core)
    args.gradient_accumulation_steps = local_batch_size // args.per_device_train_batch_size
    args.num_rounds = args.total_episodes // prompts_per_round
    args.num_steps = args.num_rounds * args.num_mini_batches * args.num_epochs
    if args.gradient_checkpointing is None:
        args.gradient_checkpointing = args.model != "tiny"


# --- Models and data, loaded with checks ---------------------------------------------------------
def resolve_tldr(args, presets: dict, build_tiny: Callable):
    """Fill in and check the preset's models and data (`tiny`: the local world, with a gold reward
    model); return the train and validation prompts."""
    if args.model == "tiny" and None in (args.sft_model_path, args.reward_model_path, args.dataset):
        sft, reward, data, gold = build_tiny(args.tiny_dir)
    else:
        sft, reward, data, gold = *presets.get(args.model, (None, None, None)), None
    args.sft_model_path, args.reward_model_path = args.sft_model_path or sft, args.reward_model_path or reward
    args.dataset, args.gold_reward_model_path = args.dataset or data, args.gold_reward_model_path or gold
    for flag in ("sft_model_path", "reward_model_path", "gold_reward_model_path"):
        if getattr(args, flag):
            check_model_path(flag, getattr(args, flag))
    return load_prompt_splits(args.dataset, args.seed)


def check_model_path(flag: str, path: str) -> None:
    if path.startswith((".", "/", "~")) and not os.path.isdir(os.path.expanduser(path)):
        fail(f"--{flag} {path}: no such folder")
    try:
        AutoConfig.from_pretrained(path)
    except Exception as e:
        fail(f"--{flag} {path}: not a local model folder and could not be loaded from the hub "
             f"({type(e).__name__}: {str(e).splitlines()[0][:200]})")


def load_prompt_splits(dataset: str, seed: int, columns=("query", "reference_response"),
                       names=("train", "validation"), config: Optional[str] = None):
    """The train and evaluation splits (`names`) from a hub name (and `config`), a folder of split
    files or one file (then 5% is held out), with `columns`."""
    kind = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}.get(
        os.path.splitext(dataset)[1])
    if os.path.isfile(dataset) and kind is None:
        fail(f"--dataset {dataset}: unsupported file type (use .jsonl, .json, .parquet or .csv)")
    if not os.path.exists(dataset) and ("/" not in dataset or dataset.startswith((".", "/", "~"))):
        fail(f"--dataset {dataset}: no such file or folder")
    try:
        if os.path.isfile(dataset):
            split = datasets.load_dataset(kind, data_files=dataset)["train"].train_test_split(0.05, seed=seed)
            splits = {names[0]: split["train"], names[1]: split["test"]}
        else:
            splits = datasets.load_dataset(dataset, config)
    except Exception as e:  # offline hub names, unreadable files
        fail(f"--dataset {dataset}: could not be loaded ({type(e).__name__}: {str(e).splitlines()[0][:200]})")
    for split in names:
        if split not in splits:
            fail(f"--dataset {dataset}: no '{split}' split (found {sorted(splits)})")
        missing = set(columns) - set(splits[split].column_names)
        if missing:
            fail(f"--dataset {dataset}: {split} split lacks column(s) {sorted(missing)}; "
                 f"found {splits[split].column_names}")
    return tuple(splits[name] for name in names)


def load_tokenizer(path: str) -> tuple:
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.eos_token_id is None:
        fail(f"--sft_model_path {path}: the tokenizer has no EOS token")
    return tokenizer, *special_ids(tokenizer)


def special_ids(tokenizer) -> tuple[int, int]:
    """EOS, and the id to pad with (EOS if the tokenizer has none: masks say what is padding)."""
    eos_id = tokenizer.eos_token_id
    return eos_id, eos_id if tokenizer.pad_token_id is None else tokenizer.pad_token_id


def load_reward_models(args, tokenizer, train_data, dtype: torch.dtype, device: torch.device) -> dict:
    """The proxy (and gold) reward models, each with `retokenize`: None when it reads the policy's token
    ids as they are, else the function that turns them into its own (reward_tokenizer, which tries the
    first training prompts)."""
    models, probe_texts = {}, train_data["query"][:16]
    for name, flag in (("proxy", "reward_model_path"), ("gold", "gold_reward_model_path")):
        if getattr(args, flag):
            models[name] = load_reward_model(flag, getattr(args, flag), dtype, device)
            models[name].retokenize = reward_tokenizer(flag, getattr(args, flag), models[name], tokenizer,
                                                       probe_texts, args.reward_chat_template, args.rank)
    return models


def load_reward_model(flag: str, path: str, dtype: torch.dtype, device: torch.device):
    """A frozen 1-label classifier with a trained head (transformers would give an SFT checkpoint a
    random one), the head in float32 (in bfloat16, close scores tie)."""
    model, info = AutoModelForSequenceClassification.from_pretrained(path, dtype=dtype, num_labels=1,
                                                                      output_loading_info=True)
    if info["missing_keys"] or not hasattr(model, "score"):
        fail(f"--{flag} {path}: not a reward model: the checkpoint has no trained `score` head (missing "
             f"{sorted(info['missing_keys'])[:4]}); pass a model saved as a sequence classifier")
    model.score.float()
    model.retokenize = None  # reads the policy's token ids (load_reward_models may say otherwise)
    return model.to(device).eval().requires_grad_(False)


def reward_tokenizer(flag: str, path: str, model, tokenizer, probe_texts: list[str], chat_template: bool,
                     rank: int) -> Optional[Callable]:
    """None if the reward model's tokenizer is the policy's (same vocabulary, same ids for the probe
    texts) and no chat template is asked for; else `retokenize` bound to its tokenizer, tried on the
    probe texts first so that a tokenizer that cannot encode them fails here, not mid-run."""
    try:
        own = AutoTokenizer.from_pretrained(path)
    except Exception:  # saved without its tokenizer: the policy's is the only guess
        own = tokenizer
    same = own.get_vocab() == tokenizer.get_vocab()
    same = same and own(probe_texts)["input_ids"] == tokenizer(probe_texts)["input_ids"]
    if chat_template and own.chat_template is None:
        fail(f"--reward_chat_template: the tokenizer of --{flag} {path} has no chat template")
    if same and not chat_template:
        if rank == 0:
            print(f"--{flag}: the policy's tokenizer: scores the policy's token ids as they are")
        return None
    max_length = min(getattr(model.config, "max_position_embeddings", 2**20), own.model_max_length)
    bound = functools.partial(retokenize, tokenizer, own, chat_template, max_length)
    probe = tokenizer(probe_texts, add_special_tokens=False)["input_ids"]
    try:
        ids = bound(probe, [[] for _ in probe], [False] * len(probe))[0]
    except Exception as e:
        fail(f"--{flag} {path}: its tokenizer cannot encode the policy's text ({type(e).__name__}: {e})")
    if own.unk_token_id is not None and any(own.unk_token_id in sequence for sequence in ids):
        fail(f"--{flag} {path}: its tokenizer turns the policy's text into unknown tokens ({own.unk_token})")
    if rank == 0:
        print(f"--{flag}: its own tokenizer ({type(own).__name__}, {len(own)} tokens"
              f"{', chat template' if chat_template else ''}): scores the completions' text, re-tokenised")
    return bound


def retokenize(tokenizer, own, chat_template: bool, max_length: int, prompts: list, responses: list,
               has_eos: list) -> tuple[list, list, int]:
    """The reward model's own ids for each prompt + completion, from the text the policy's ids decode
    to: its BOS if it adds one, the text, and its EOS where the policy's completion ended with EOS (or
    the prompt and completion as a user and an assistant turn of its chat template); cut from the left
    to its maximum length, as prompts are. Returns them as prompts, empty responses, and its pad id."""
    bos, eos, ids = bos_prefix(own), [own.eos_token_id] if own.eos_token_id is not None else [], []
    pad_id = next((i for i in (own.pad_token_id, own.eos_token_id) if i is not None), 0)
    plain = dict(skip_special_tokens=True, clean_up_tokenization_spaces=False)  # the text, as it is
    for prompt, response, ended in zip(prompts, responses, has_eos):
        text = tokenizer.decode(prompt + response, **plain)
        if chat_template:  # the template writes its own special tokens
            question = tokenizer.decode(prompt, **plain)
            turns = [dict(role="user", content=question), dict(role="assistant", content=text.removeprefix(question))]
            text, head, tail = own.apply_chat_template(turns, tokenize=False), [], []
        else:
            head, tail = bos, eos * ended
        body = own(text, add_special_tokens=False)["input_ids"]
        ids.append(head + body[max(len(head) + len(body) + len(tail) - max_length, 0):] + tail)
    return ids, [[] for _ in ids], pad_id


def prepare_policy(policy: torch.nn.Module, gradient_checkpointing: bool) -> torch.nn.Module:
    """Training mode (for checkpointing) with dropout off: log-prob ratios carry no dropout noise."""
    for module in policy.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    if gradient_checkpointing:
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return policy.train()


def save_policy(policy: torch.nn.Module, tokenizer, args) -> None:
    """--save_model: save_pretrained to {output_dir}/model (FSDP2: all ranks gather, rank 0 writes)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full_state = get_model_state_dict(policy, options=StateDictOptions(
        full_state_dict=True, cpu_offload=True)) if args.fsdp else None  # a collective under FSDP2
    if args.rank == 0:
        policy.save_pretrained(os.path.join(args.output_dir, "model"), state_dict=full_state)
        tokenizer.save_pretrained(os.path.join(args.output_dir, "model"))
        print(f"saved the policy to {os.path.join(args.output_dir, 'model')}")


# --- Devices, learner processes (torchrun) and the data each one takes --------------------------
def start_run(args, cleanup: contextlib.ExitStack):
    """Devices, process group, seeds, output folder, metrics sink: (device, generator cores, file)."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    datasets.disable_progress_bars()
    args.run_name = f"{args.model}__{args.exp_name}__{args.seed}__{int(time.time())}"
    args.output_dir = args.output_dir or (os.path.dirname(checkpoint_folder(args.resume_from)) if args.resume_from
                                          else os.path.join("runs", args.run_name))  # resumed: the same folder
    device, generator_cores = learner_device(int(os.environ.get("LOCAL_RANK", 0)), args.world_size,
                                             args.generator_cores)
    args.dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    if args.world_size > 1:
        init_learner_group(device.type == "cuda")
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    wandb_id = None
    if args.resume_from:  # refuse a checkpoint of another run before anything is written
        saved = read_checkpoint(args.resume_from)
        saved_args, wandb_id = saved["args"], saved.get("wandb_id")
        differ = [k for k, v in saved_args.items() if k not in MAY_DIFFER and getattr(args, k, v) != v]
        if differ:
            fail(f"--resume_from {args.resume_from}: its run had --{differ[0]} {saved_args[differ[0]]}, "
                 f"this one has {getattr(args, differ[0])}")
    metrics_file = open_metrics(args, args.rank, wandb_id)
    cleanup.callback(close_metrics, metrics_file, args.track)
    if args.rank == 0:
        print(f"run {args.run_name}: {args.num_steps} optimizer steps in {args.num_rounds} rounds of "
              f"{args.batch_size * args.num_mini_batches} prompts x {args.num_samples} samples; metrics in "
              f"{args.output_dir}/metrics.jsonl", flush=True)
    return device, generator_cores, metrics_file


def shares_gpu0(gpus: Optional[int] = None, learners: Optional[int] = None) -> bool:
    """Whether learner rank 0 shares GPU 0 with vLLM: the node has GPUs but none spare per learner (of
    `gpus` on the node and `learners` on it; default: this machine's). Every rank answers the same,
    so that all take the generator's "ready" message at the same point."""
    gpus = torch.cuda.device_count() if gpus is None else gpus
    learners = int(os.environ.get("LOCAL_WORLD_SIZE", 1)) if learners is None else learners
    return 0 < gpus <= learners


def learner_gpu(local_rank: int, gpus: Optional[int] = None, learners: Optional[int] = None) -> int:
    """vLLM owns GPU 0; learner rank i uses GPU i+1 of its node (GPU i when none is spare: rank 0 then
    shares GPU 0 with vLLM)."""
    return local_rank if shares_gpu0(gpus, learners) else local_rank + 1


def learner_device(local_rank: int, world_size: int, generator_cores: int) -> tuple:
    """The learner's device; on CPU the generator gets cores of its own (the last ones)."""
    if torch.cuda.is_available():
        device = torch.device("cuda", learner_gpu(local_rank))
        torch.cuda.set_device(device)
        return device, None
    all_cores = sorted(os.sched_getaffinity(0))
    generator = all_cores[-generator_cores:] if 0 < generator_cores < len(all_cores) else None
    learner_cores = all_cores[: -generator_cores] if generator else all_cores
    os.sched_setaffinity(0, learner_cores)
    torch.set_num_threads(max(1, len(learner_cores) // world_size))
    return torch.device("cpu"), generator


def init_learner_group(use_cuda: bool) -> None:
    # A backend per device: DDP/FSDP reduce GPU tensors over NCCL, while reduce_sums and
    # broadcast_object_list carry CPU tensors, which NCCL cannot ("cpu:gloo,cuda:nccl").
    dist.init_process_group("cpu:gloo,cuda:nccl" if use_cuda else "gloo")


def shard_or_replicate(trained: torch.nn.Module, frozen: list, args, device: torch.device):
    """What the optimizer trains: `trained` itself, its DDP wrapper, or (--fsdp) `trained` sharded in
    place by FSDP2 with the frozen models: each transformers model block by block, then each of its
    top-level pieces on its own (so that a score head can be called directly), then the whole."""
    if args.fsdp:
        from torch.distributed.fsdp import fully_shard

        inner = [trained] if hasattr(trained, "_no_split_modules") else list(trained.children())
        models = inner + frozen
        for model in models:
            for module in model.modules():
                if type(module).__name__ in (model._no_split_modules or []):
                    fully_shard(module)
            for child in model.children():
                fully_shard(child)
            fully_shard(model)
        if trained not in models:  # a module around them (PPO's policy and value model)
            fully_shard(trained)
    elif args.world_size > 1:
        return torch.nn.parallel.DistributedDataParallel(
            trained, device_ids=[device] if device.type == "cuda" else None, gradient_as_bucket_view=True)
    return trained


def prompt_rounds(num_prompts: int, args) -> np.ndarray:
    """[num_rounds, prompts per round] indices of the training prompts: a fresh shuffle per pass."""
    prompts_per_round = args.batch_size * args.num_mini_batches
    passes = -(-args.num_rounds * prompts_per_round // num_prompts)
    order = np.concatenate([np.random.permutation(num_prompts) for _ in range(passes)])
    return order[: args.num_rounds * prompts_per_round].reshape(args.num_rounds, prompts_per_round)


def my_share(args) -> np.ndarray:
    """This rank's positions in a round of [num_mini_batches, world_size, local] prompts: [:, rank]."""
    positions = np.arange(args.batch_size * args.num_mini_batches)
    return positions.reshape(args.num_mini_batches, args.world_size, -1)[:, args.rank].ravel()


def chunks(n: int, size: int, model: torch.nn.Module) -> list[slice]:
    """Slices of `size` over n items, for forward passes. Under FSDP2 every forward of a sharded model
    gathers its weights, a collective: there every rank runs as many as the rank with the most (a
    share of an evaluation can be one prompt short), its extra slices repeating its last one; the
    caller keeps the first n results."""
    from torch.distributed.fsdp import FSDPModule

    parts = [slice(i, i + size) for i in range(0, n, size)]
    if isinstance(model, FSDPModule):
        parts += parts[-1:] * (int(reduce_max(len(parts), dist.get_world_size())) - len(parts))
    return parts


def split(batch: dict, parts: int) -> list[dict]:
    """`parts` equal consecutive slices of every list and tensor in `batch` (mini-, micro-batches)."""
    size = len(next(iter(batch.values()))) // parts
    return [{key: value[i * size: (i + 1) * size] for key, value in batch.items()} for i in range(parts)]


def sampling_seed(seed: int, kind: str, index: int) -> int:
    """The sampling seed of a training round or an evaluation (by round or version), from --seed."""
    return int(np.random.SeedSequence([seed, ["train", "eval"].index(kind), index]).generate_state(1)[0])


def share(obj, rank: int, world_size: int):
    """Rank 0 talks to the generator; the other ranks get its messages (and errors) from here."""
    if world_size > 1:
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        obj = box[0]
    if isinstance(obj, BaseException):
        raise obj if rank == 0 else GeneratorError(f"rank 0 stopped: {obj}")
    return obj


def reduce_sums(sums: dict, world_size: int) -> dict:
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


def clip_grad_norm(parameters, max_norm: Optional[float]) -> float:
    """The gradients' norm over all ranks before clipping (to --max_grad_norm; None: no clipping)."""
    norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm or float("inf"))
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # (FSDP2: a DTensor)


def length_stats(lengths: torch.Tensor, cut: torch.Tensor, world_size: int) -> dict:
    """A step's completion lengths over all ranks: mean, median, p95, max, and the share cut at
    --response_length (a length that rises with the reward is the first sign of reward hacking)."""
    both = torch.stack([lengths.flatten().float(), cut.flatten().float()])
    if world_size > 1:
        gathered = [None] * world_size
        dist.all_gather_object(gathered, both)
        both = torch.cat(gathered, dim=1)
    lengths, cut = both
    return {"length/mean": lengths.mean().item(), "length/p50": lengths.quantile(0.5).item(),
            "length/p95": lengths.quantile(0.95).item(), "length/max": lengths.max().item(),
            "length/cut_fraction": cut.mean().item()}


# --- Checkpoints: --save_every N and --resume_from DIR, an exact resume ----------------------------
# Flags a resumed run may change: where and how it logs, and the evaluations (they draw no training
# sample). Any other difference is refused.
MAY_DIFFER = {"exp_name", "track", "wandb_project", "wandb_entity", "output_dir", "save_model", "verbose",
              "tiny_dir", "vllm_gpu_memory_utilization", "generator_cores", "gradient_checkpointing",
              "save_every", "resume_from", "run_name", "rank", "eval_every", "num_eval_prompts",
              "num_final_eval_prompts", "eval_temperature", "eval_response_length"}
TERM = threading.Event()  # SIGTERM arrived (see run)


def checkpoint_due(args, version: int) -> bool:
    """At a round's end: --save_every steps passed since the last checkpoint, or SIGTERM arrived (on
    any rank: all ranks agree)."""
    if not args.save_every:
        return False
    steps = args.num_mini_batches * args.num_epochs
    due = version // args.save_every > (version - steps) // args.save_every or TERM.is_set()
    return reduce_max(float(due), args.world_size) > 0


def save_checkpoint(args, loop: dict, generator, score: Callable, learner, optimizer, scheduler, weight_buffer,
                    metrics_file) -> int:
    """{output_dir}/checkpoint, at a round's end. The batch in flight is not saved: a resumed run
    requests it again, with the weights in the buffer, which the checkpoint holds. So are the
    evaluations queued behind it (their version is the buffer's); those queued before it, whose
    weights have left the buffer, are scored first (`score`). Then the learner and optimizer
    (torch.distributed.checkpoint: under FSDP2 each rank writes its own shards), the scheduler, the
    RNG states, the loop's counters, the flags and how much of metrics.jsonl is written, beside the
    last checkpoint, then renamed into place: an interrupted save leaves the last one whole. After
    SIGTERM, exit. Returns the evaluations still pending."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    in_flight = loop.pop("batch_in_flight", True)  # (gsm8k_async_dpo.py --sync requests it later)
    behind = int(in_flight and loop["pending_evals"] > 0 and loop["last_eval"] == loop["buffer_version"])
    for _ in range(loop["pending_evals"] - behind):
        score(collect(generator, args))
    loop["pending_evals"] = [loop["last_eval"]] * behind  # the versions a resumed run requests again
    start, folder = time.time(), os.path.join(args.output_dir, "checkpoint")
    if args.rank == 0:
        shutil.rmtree(folder + ".new", ignore_errors=True)
        os.makedirs(folder + ".new")
    if args.world_size > 1:
        dist.barrier()
    model_state, optim_state = get_state_dict(learner, optimizer)
    with warnings.catch_warnings():  # (one learner: "torch.distributed is disabled", as it should be)
        warnings.simplefilter("ignore")
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=os.path.join(folder + ".new", "learner"),
                 no_dist=args.world_size == 1)
    rng = [None] * args.world_size  # every rank's own states (its device's only), gathered on rank 0
    if args.world_size > 1:
        dist.gather_object(rng_states(), rng if args.rank == 0 else None, dst=0)
    else:
        rng = [rng_states()]
    if args.rank == 0:
        metrics_file.flush()
        state = dict(loop=loop, scheduler=scheduler.state_dict(), weight_buffer=weight_buffer, rng=rng,
                     args=asdict(args), metrics_bytes=metrics_file.tell(), wandb_id=wandb_run_id(args.track))
        torch.save(state, os.path.join(folder + ".new", "state.pt"))
        if os.path.exists(folder):  # (a save killed while deleting .old left it: never a valid one then)
            shutil.rmtree(folder + ".old", ignore_errors=True)
            os.replace(folder, folder + ".old")
        os.replace(folder + ".new", folder)
        shutil.rmtree(folder + ".old", ignore_errors=True)
        size = sum(f.stat().st_size for f in os.scandir(folder) if f.is_file()) + sum(
            f.stat().st_size for f in os.scandir(os.path.join(folder, "learner")))
        tqdm.write(f"checkpoint at step {loop['version']}: {size / 2**20:.1f} MiB in {time.time() - start:.2f} s")
    if reduce_max(float(TERM.is_set()), args.world_size):  # (one decision: a rank may see it late)
        tqdm.write(f"stopped by SIGTERM after the checkpoint; continue with --resume_from {args.output_dir}",
                   file=sys.stderr)
        raise SystemExit(128 + signal.SIGTERM)
    return behind


def allocate_optimizer_state(optimizer) -> None:
    """The optimizer's state (AdamW's moments), allocated for a checkpoint to load into, as DCP's
    get_state_dict does (a step at lr 0 on zero gradients), but with every plain (DDP) parameter's
    gradient a view of one shared zero buffer: DCP's own way zero-fills a full float32 gradient set
    beside DDP's gradient buckets, +4 bytes a parameter at the resume's peak. FSDP2's gradients are
    shards (a DTensor each), cheap, so they are allocated as DCP does."""
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


def rng_states() -> dict:
    """This process's RNG states: Python's, NumPy's, torch's CPU one and its own GPU's."""
    return dict(python=random.getstate(), numpy=np.random.get_state(), torch=torch.get_rng_state(),
                cuda=torch.cuda.get_rng_state() if torch.cuda.is_available() else None)


def restore_rng_states(states: dict) -> None:
    """The states rng_states() saved (this rank's), the GPU one on this process's own GPU."""
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if states["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])


def keep_metrics_covered(metrics_file, checkpoint: str, covered: int) -> None:
    """metrics.jsonl as the checkpoint left it: cut back to the bytes it covered, or, resuming into
    another --output_dir, those bytes copied from the resumed run's file (when it is there)."""
    source = os.path.join(os.path.dirname(checkpoint), "metrics.jsonl")
    if os.path.exists(source) and os.path.samefile(source, metrics_file.name):
        metrics_file.truncate(covered)
        return
    metrics_file.truncate(0)
    if os.path.exists(source):
        with open(source) as run_so_far:
            metrics_file.write(run_so_far.read(covered))
    else:
        print(f"{source} is missing: {metrics_file.name} starts empty at the checkpoint", file=sys.stderr)
    metrics_file.flush()


def checkpoint_folder(path: str) -> str:
    """--resume_from: a run's folder or its checkpoint folder (or what an interrupted save left)."""
    for folder in (path, os.path.join(path, "checkpoint"), os.path.join(path, "checkpoint.old")):
        if os.path.isfile(os.path.join(folder, "state.pt")):
            return os.path.abspath(folder)
    fail(f"--resume_from {path}: no checkpoint there (a run's folder, or its checkpoint folder, written "
         f"with --save_every)")


def read_checkpoint(path: str) -> dict:
    try:
        return torch.load(os.path.join(checkpoint_folder(path), "state.pt"), map_location="cpu", weights_only=False,
                          mmap=True)
    except Exception as e:
        fail(f"--resume_from {path}: damaged checkpoint ({type(e).__name__}: {str(e).splitlines()[0][:200]})")


def resume(args, learner, optimizer, scheduler, weight_buffer, metrics_file) -> dict:
    """--resume_from: the learner, optimizer, scheduler, generator weights and RNG states of a
    checkpoint, and metrics.jsonl cut back to what it covered. Returns where the loop was (without
    --resume_from: the start)."""
    if not args.resume_from:
        return dict(round=0, version=0, buffer_version=0, last_eval=0, pending_evals=[])
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    saved = read_checkpoint(args.resume_from)
    allocate_optimizer_state(optimizer)
    model_state, optim_state = get_state_dict(learner, optimizer)
    try:
        learner_folder = os.path.join(checkpoint_folder(args.resume_from), "learner")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load({"model": model_state, "optim": optim_state}, checkpoint_id=learner_folder,
                     no_dist=args.world_size == 1)
    except (Exception, dcp.api.CheckpointException) as e:  # (the latter is a BaseException)
        cause = next(iter(getattr(e, "failures", {}).values()), (e, None))[0]  # (DCP wraps them)
        detail = (str(cause).strip().splitlines() or [""])[0][:200]
        fail(f"--resume_from {args.resume_from}: damaged checkpoint ({type(cause).__name__}"
             f"{': ' + detail if detail else ''})")
    set_state_dict(learner, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)
    scheduler.load_state_dict(saved["scheduler"])
    if weight_buffer is not None:
        weight_buffer.copy_(saved["weight_buffer"])
    restore_rng_states(saved["rng"][args.rank])
    if metrics_file is not None:
        keep_metrics_covered(metrics_file, checkpoint_folder(args.resume_from), saved["metrics_bytes"])
    if args.rank == 0:
        print(f"resumed at step {saved['loop']['version']} (round {saved['loop']['round']})", flush=True)
    return saved["loop"]


# --- Metrics: metrics.jsonl (and wandb with --track) ---------------------------------------------
def open_metrics(args, rank: int, wandb_id: Optional[str] = None):
    """metrics.jsonl (appended to) and, with --track, the wandb run (a resumed run's own, by its id)."""
    if rank != 0:
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


def wandb_run_id(track: bool) -> Optional[str]:
    if not track:
        return None
    import wandb

    return wandb.run.id if wandb.run is not None else None


def log(record: dict, metrics_file, track: bool) -> None:
    if metrics_file is None:
        return
    metrics_file.write(json.dumps(record) + "\n")
    metrics_file.flush()
    if track:
        import wandb

        wandb.log({k: wandb.Table(columns=["prompt", "response"], data=[list(s.values()) for s in v])
                   if k == "eval/samples" else v for k, v in record.items()})


def episodes_at(step: int, args) -> int:
    """Training prompts consumed after `step` steps (epochs after the first revisit a round)."""
    rounds, step_in_round = divmod(step, args.num_mini_batches * args.num_epochs)
    return (rounds * args.num_mini_batches + min(step_in_round, args.num_mini_batches)) * args.batch_size


def timeline(origin: float, **phases: tuple[float, float]) -> dict:
    """`timeline/{phase}_start` and `_end`, seconds since training began (benchmarks/timeline.py)."""
    return {f"timeline/{phase}_{edge}": t - origin for phase, span in phases.items()
            for edge, t in zip(("start", "end"), span)}


def eval_times(message: dict, start: float, training_start: Optional[float]) -> dict:
    """An evaluation's `time/` seconds and, during training, its `timeline/` spans."""
    record = {"time/eval": time.time() - start,
              "time/elapsed": time.time() - training_start if training_start else 0.0}
    if training_start:
        record.update(timeline(training_start, evaluation=(start, time.time()),
                               eval_queued=(message["requested"], message["weight_load_start"]),
                               eval_generation=(message["generation_start"], message["generation_end"])))
    return record


def round_times(origin: float, round_start: float, eval_seconds: float, **phases: tuple) -> dict:
    """A round's `time/` and `timeline/` phases (the wait leaves out evaluations scored meanwhile)."""
    record = {f"time/{phase}": end - start for phase, (start, end) in phases.items()}
    record.update(timeline(origin, **phases))
    record["time/learner_wait"] -= eval_seconds
    record["time/step"] = time.time() - round_start
    return record


def print_evaluation(record: dict, reward_names) -> None:
    tqdm.write(f"eval @ step {record['step']} ({record['eval/num_prompts']} prompts): " + ", ".join(
        f"{name} win rate {record[f'eval/{name}_win_rate']:.3f} ± {record[f'eval/{name}_win_rate_stderr']:.3f}"
        for name in reward_names) + f", perplexity {record['eval/perplexity']:.3f} "
        f"(paper's: {record['eval/perplexity_paper']:.3f})")
    for sample in record["eval/samples"]:
        tqdm.write(f"  ...{sample['prompt'][-60:]!r} -> {sample['response']!r}")


# --- The generator process: talking to it without ever hanging on it, and stopping it ------------
class GeneratorError(RuntimeError):
    pass


@dataclass
class Generator:
    """The generator process and the one-slot queues to and from it (rank 0; other ranks: None)."""
    process: object
    requests: object
    results: object
    tmp_dir: str
    log_path: Optional[str] = None  # vLLM's log (None: --verbose, the console)
    error: Optional[GeneratorError] = None  # its death, noticed while sending (told at the next collect)


def submit(generator, request: dict) -> None:
    """Send a request (rank 0; the other ranks: nothing to do). A dead generator noticed here is told
    at the next collect, which every rank passes: only rank 0 is here."""
    if isinstance(generator, list):  # in this process (hf_generate): an evaluation now, with the
        generator.append(generator[0](request) if request["kind"] == "eval" else request)  # weights it names
    elif generator is not None and generator.error is None:
        try:
            send(generator.requests, request, generator.process)
        except GeneratorError as error:
            generator.error = error


def collect(generator, args) -> dict:
    """The generator's next message, on every rank (rank 0 receives it, then shares it), or its error."""
    if isinstance(generator, list):  # in this process: a training batch is sampled when collected
        return generator.pop(1) if "responses" in generator[1] else generator[0](generator.pop(1))
    message = None
    if args.rank == 0:
        try:
            message = generator.error or receive(generator.results, generator.process)
        except GeneratorError as error:
            message = error
    return share(message, args.rank, args.world_size)


@torch.no_grad()
def hf_generate(policy, my_prompts, args, pad_id: int, eos_id: int, autocast, request: dict) -> dict:
    """sync_baseline.py --generation_backend hf: the generator's message for `request`, sampled in
    this process by transformers' generate at the temperature alone (no top-k/top-p, as the learner's
    log-probs assume; log-probs: NaN). Each rank samples its own prompts (the others': None)."""
    prompts, n, start, device = request["prompts"], request["n"], time.time(), policy.device
    mine = range(args.rank, len(prompts), args.world_size) if request["kind"] == "eval" else my_prompts
    responses, chunk = [None] * (len(prompts) * n), args.per_device_train_batch_size
    policy.eval()  # generate with the KV cache: gradient checkpointing (training only) turns it off
    torch.manual_seed(request["seed"] + args.rank)  # as vLLM's: a request's own seed (resume)
    for part in [mine[c: c + chunk] for c in range(0, len(mine), chunk)]:
        inputs, _ = collate([prompts[i] for i in part], [[]] * len(part), pad_id, device)
        with autocast:
            out = policy.generate(
                inputs["input_ids"], attention_mask=inputs["attention_mask"], do_sample=True,
                temperature=request["temperature"], top_k=0, top_p=1.0, num_return_sequences=n,
                max_new_tokens=request["max_tokens"], eos_token_id=eos_id, pad_token_id=pad_id)
        sampled = out[:, inputs["input_ids"].shape[1]:].tolist()  # prompt-major, as vLLM's
        for j, i in enumerate(part):
            responses[i * n: (i + 1) * n] = sampled[j * n: (j + 1) * n]
    policy.train()
    return dict({k: v for k, v in request.items() if k != "prompts"}, responses=responses,
                logprobs=[float("nan")] * len(responses), generation_version=request["weights_version"],
                weight_load_start=start, generation_start=start, generation_end=time.time())


def send(requests, request: dict, process) -> None:
    """Put on the one-slot request queue, without hanging if the generator has died."""
    while True:
        try:
            return requests.put(request, timeout=0.5)
        except queue.Full:
            if not process.is_alive():
                raise GeneratorError(f"the generator process exited unexpectedly (exit code {process.exitcode})")


def receive(results, process) -> dict:
    """Take from the result queue, without hanging on a dead generator; re-raise its error."""
    while True:
        try:
            message = results.get(timeout=0.5)
        except queue.Empty:
            if process.is_alive():
                continue
            try:  # it may have reported its error just before exiting
                message = results.get(timeout=1.0)
            except queue.Empty:
                raise GeneratorError(f"the generator process exited unexpectedly (exit code "
                                     f"{process.exitcode})") from None
        if message["kind"] == "error":
            raise GeneratorError("the generator process failed:\n" + message["traceback"])
        return message


def become_generator(cores: Optional[list], run_tmp_dir: str, log_path: Optional[str]) -> None:
    """The generator process: Ctrl-C and SIGTERM go to the learner, death with it (PDEATHSIG), vLLM's
    log to a file, no torchrun variables (they describe the learners), temporary files where the
    learner removes them, and on CPU its own cores (before vLLM, which ignores later changes)."""
    import ctypes
    import tempfile

    for stop in (signal.SIGINT, signal.SIGTERM):  # a scheduler signals the process group: the learner
        signal.signal(stop, signal.SIG_IGN)  # decides (and may need us to finish an evaluation first)
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)
    if log_path:
        log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        for stream in (1, 2):
            os.dup2(log_fd, stream)
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID"):
        os.environ.pop(var, None)
    os.environ["TMPDIR"] = tempfile.tempdir = run_tmp_dir
    if cores:
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(len(cores))


def quiet_resource_tracker(log_path: Optional[str]) -> None:
    """Start multiprocessing's resource tracker with its stderr in the generator's log: it warns of
    vLLM's "leaked semaphore" when the generator is killed, which would read as a second failure. If
    it was killed too (`pkill -f multiprocessing`), it is relaunched here, where its warnings and the
    KeyErrors of the queues' semaphores it never saw registered go to the log as well."""
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


def stop_generator(generator: Generator) -> None:
    """Stop the generator, and exit whatever is queued: a queue's feeder thread blocks while the pipe
    is full (64 KiB) and is joined at exit; `cancel_join_thread()` (the documented way to exit
    "without waiting to flush enqueued data") drops a request nobody will read."""
    process = generator.process
    quiet_resource_tracker(generator.log_path)  # (relaunched there if it died with the generator)
    with contextlib.suppress(queue.Full, ValueError, OSError):
        generator.requests.put_nowait(None)  # a polite stop, seen if the generator is idle
    process.join(timeout=2)
    if process.is_alive():  # (it ignores SIGTERM)
        process.kill()
        process.join(timeout=3)
    for pending in (generator.requests, generator.results):
        pending.cancel_join_thread()
        pending.close()
    shutil.rmtree(generator.tmp_dir, ignore_errors=True)


# --- Tokens --------------------------------------------------------------------------------------
def tokenize_prompts(tokenizer, texts: list[str], max_length: int) -> list[list[int]]:
    """Token ids per prompt, after BOS where the tokenizer adds one; long prompts keep their end,
    where the instruction ('TL;DR:') sits."""
    bos = bos_prefix(tokenizer)
    return [bos + ids[max(len(ids) + len(bos) - max_length, 0):]
            for ids in tokenizer(list(texts), add_special_tokens=False)["input_ids"]]


def bos_prefix(tokenizer) -> list[int]:
    """[BOS] if the tokenizer starts texts with one (Llama's, rho-1b's), else [] (Pythia's)."""
    bos = tokenizer.bos_token_id
    with_special, without = tokenizer("x")["input_ids"], tokenizer("x", add_special_tokens=False)["input_ids"]
    return [bos] if bos is not None and with_special[:1] == [bos] and without[:1] != [bos] else []


def collate(prompts: list[list[int]], responses: list[list[int]], pad_id: int, device):
    """Left-pad the prompts and right-pad the responses, each to this micro-batch's own longest, so
    that every response starts at the same column. Position ids skip the left padding, so they match
    unpadded sequences. Returns the model inputs and the mask of the response tokens."""
    prompt_width, response_width = max(map(len, prompts)), max(map(len, responses))
    ids = [[pad_id] * (prompt_width - len(p)) + p + r + [pad_id] * (response_width - len(r))
           for p, r in zip(prompts, responses)]
    mask = [[0] * (prompt_width - len(p)) + [1] * (len(p) + len(r)) + [0] * (response_width - len(r))
            for p, r in zip(prompts, responses)]
    input_ids, attention_mask = torch.tensor(ids, device=device), torch.tensor(mask, device=device)
    inputs = dict(input_ids=input_ids, attention_mask=attention_mask,
                  position_ids=(attention_mask.cumsum(1) - 1).clamp(min=0), use_cache=False)
    return inputs, attention_mask[:, prompt_width:]
