"""What every run passes through and a reader need not study: checks of the flags (errors that name
the flag or file), loading models, tokenizers and data, the run's fixed facts, devices and learner
processes, the collectives between learner ranks, and prompt tokens."""
import datetime
import hashlib
import math
import os
import sys
from dataclasses import dataclass
from typing import NoReturn, Optional

import numpy as np
import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoTokenizer

from plumbing import metrics


# --- Flags, models and data, checked --------------------------------------------------------------
def fail(message: str) -> NoReturn:
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def check_flags(args, positive: tuple = ("temperature", "eval_temperature"),
                round_prompts: Optional[int] = None, unit: str = "prompts") -> None:
    """Refuse common flags that make no sense, and sizes that do not divide over args.world_size ranks (a
    script checks its own flags itself, in its resolve_args). `positive`: the script's own flags that must be
    positive; `round_prompts`: what one generation round takes (default --batch_size); `unit`: what --batch_size
    counts (the streaming twins: completions)."""
    for name in ("response_length", "max_prompt_length", "total_episodes", "batch_size",
                 "per_device_train_batch_size", "num_eval_prompts", "eval_response_length", "generator_cores",
                 "lag_every", *positive):
        if getattr(args, name) <= 0:
            fail(f"--{name} must be positive, got {getattr(args, name)}")
    world_size, per_round = args.world_size, round_prompts or args.batch_size
    local, per_device = args.batch_size // world_size, args.per_device_train_batch_size
    for bad, message in [
        (args.dtype == "float16", "--dtype float16: the learner would train under float16 autocast "
         "without a gradient scaler, and small gradients would underflow to 0 silently; use "
         "bfloat16 (or float32)"),
        (args.eval_every < 0, f"--eval_every must be 0 (off) or positive, got {args.eval_every}"),
        (args.save_every < 0, f"--save_every must be 0 (off) or positive, got {args.save_every}"),
        (not 0 < args.vllm_gpu_memory_utilization <= 1,
         "--vllm_gpu_memory_utilization must be in (0, 1]"),
        (min(args.num_eval_prompts, args.num_final_eval_prompts or world_size) < world_size,
         "--num_eval_prompts and --num_final_eval_prompts must give every learner a prompt"),
        (args.fsdp and world_size == 1,
         "--fsdp shards over several learner processes: launch with torchrun"),
        (args.batch_size % world_size,
         f"--batch_size {args.batch_size} must divide over {world_size} processes"),
        (local % per_device, f"--per_device_train_batch_size {per_device} must divide the "
         f"per-process batch ({local} {unit})"),
        (args.total_episodes < per_round, f"--total_episodes {args.total_episodes} is smaller than "
         f"one generation round ({per_round} {unit})"),
        # LoRA (plumbing.lora): flags that set an adapter need a rank; vLLM sizes adapters up to rank 512
        (args.lora_rank < 0, f"--lora_rank must be 0 (full fine-tuning) or positive, got {args.lora_rank}"),
        (args.lora_rank == 0 and (args.lora_alpha is not None or args.lora_target_modules is not None
                                  or args.save_merged), "--lora_alpha, --lora_target_modules and --save_merged "
         "set LoRA's adapter: give --lora_rank r > 0 too (0, the default, trains every weight)"),
        (args.lora_rank > 512, f"--lora_rank {args.lora_rank}: vLLM's engine takes adapters of rank at most 512"),
        (args.save_merged and not args.save_model, "--save_merged saves the merged model beside the adapter: "
         "give --save_model too"),
    ]:
        if bad:
            fail(message)



def check_model_paths(args, *flags: str) -> None:
    """Each model flag that is set names a local model folder or a hub model that loads."""
    for flag in flags:
        path = getattr(args, flag)
        if not path:
            continue
        if path.startswith((".", "/", "~")) and not os.path.isdir(os.path.expanduser(path)):
            fail(f"--{flag} {path}: no such folder")
        try:
            AutoConfig.from_pretrained(path)
        except Exception as e:
            fail(f"--{flag} {path}: not a local model folder and could not be loaded from the hub "
                 f"({type(e).__name__}: {str(e).splitlines()[0][:200]})")


def load_prompt_splits(dataset: str, seed: int, columns=("query", "reference_response"),
                       names=("train", "validation"), config: Optional[str] = None, tokenizer=None,
                       tokenizer_path: str = "", max_prompt_length: int = 0):
    """The train and evaluation splits (`names`) from a hub name (and `config`), a folder of split
    files or one file (then 5% is held out), with `columns`; a chat dataset (a `messages` column)
    given them by the tokenizer's chat template (plumbing.chat)."""
    import datasets  # (here, not at the top: a spawned generator imports this module, and needs no datasets)

    kind = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}.get(
        os.path.splitext(dataset)[1])
    if os.path.isfile(dataset) and kind is None:
        fail(f"--dataset {dataset}: unsupported file type (use .jsonl, .json, .parquet or .csv)")
    if not os.path.exists(dataset) and ("/" not in dataset or dataset.startswith((".", "/", "~"))):
        fail(f"--dataset {dataset}: no such file or folder")
    cache_dir = local_cache_dir(dataset) if os.path.exists(dataset) else None
    try:
        if os.path.isfile(dataset):
            split = datasets.load_dataset(kind, data_files=dataset, cache_dir=cache_dir)["train"]
            split = split.train_test_split(0.05, seed=seed)
            splits = {names[0]: split["train"], names[1]: split["test"]}
        else:
            splits = datasets.load_dataset(dataset, config, cache_dir=cache_dir)
    except Exception as e:  # offline hub names, unreadable files
        fail(f"--dataset {dataset}: could not be loaded "
             f"({type(e).__name__}: {str(e).splitlines()[0][:200]})")
    for split in names:
        if split not in splits:
            fail(f"--dataset {dataset}: no '{split}' split (found {sorted(splits)})")
    splits = {name: splits[name] for name in names}
    if tokenizer is not None and "messages" in splits[names[0]].column_names:
        from plumbing.chat import format_chats

        splits = format_chats(splits, dataset, tokenizer, tokenizer_path, max_prompt_length)
    for split in names:
        missing = set(columns) - set(splits[split].column_names)
        if missing:
            fail(f"--dataset {dataset}: {split} split lacks column(s) {sorted(missing)}; "
                 f"found {splits[split].column_names}")
    learners = int(os.getenv("WORLD_SIZE", "1"))  # each evaluates its share (a collective needs them all)
    for split in names[1:]:
        if len(splits[split]) < learners:
            fail(f"--dataset {dataset}: the {split} split has {len(splits[split])} prompt(s), fewer than "
                 f"the {learners} learner processes: each evaluates a share of it")
    return tuple(splits[name] for name in names)


def local_cache_dir(dataset: str) -> str:
    """`datasets`' cache for a local file or folder, named by its files' paths, sizes and modification times. Left
    to itself, `datasets` names the cache of a folder whose card lists its splits by the file names alone: a world
    rebuilt in place (or any folder whose files changed) would load its old rows."""
    import datasets

    files = [dataset] if os.path.isfile(dataset) else sorted(
        os.path.join(root, name) for root, _, names in os.walk(dataset) for name in names)
    stamp = repr([(os.path.relpath(f, dataset), os.path.getsize(f), os.path.getmtime(f)) for f in files])
    return os.path.join(datasets.config.HF_DATASETS_CACHE, "local", hashlib.sha256(stamp.encode()).hexdigest()[:16])


def hub_snapshot(flag: str, path: str, revision: Optional[str]) -> str:
    """`path` as it is without a revision; with one, the local folder of that revision (a branch,
    tag or commit) of the hub repository `path`, downloaded once into the Hugging Face cache."""
    if revision is None:
        return path
    if os.path.exists(os.path.expanduser(path)):
        fail(f"--{flag}_revision {revision}: --{flag}_path {path} is a local folder, and a revision "
             f"names a version of a hub repository")
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(path, revision=revision, ignore_patterns=["original/*", "*.pth"])
    except Exception as e:  # offline, no such repository or revision
        fail(f"--{flag}_revision {revision} of --{flag}_path {path} could not be fetched "
             f"({type(e).__name__}: {str(e).splitlines()[0][:200]})")


def load_tokenizer(path: str):
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.eos_token_id is None:
        fail(f"--sft_model_path {path}: the tokenizer has no EOS token")
    return tokenizer


def special_ids(tokenizer, chat: bool = False) -> tuple[int, int]:
    """The token that ends a completion (EOS; chat: the template's end of turn), and the id to pad
    with (EOS if the tokenizer has none: masks say what is padding)."""
    from plumbing.chat import end_of_turn_id

    eos_id = end_of_turn_id(tokenizer) if chat else tokenizer.eos_token_id
    return eos_id, tokenizer.eos_token_id if tokenizer.pad_token_id is None else tokenizer.pad_token_id


@dataclass(frozen=True)
class Run:
    """The run's fixed facts, set once in main(): the learner's device and autocast, and the token
    ids that end a completion and pad a batch."""
    device: torch.device
    autocast: object
    eos_id: int
    pad_id: int


# --- Models on the learner's device ---------------------------------------------------------------
def train_without_dropout(model: torch.nn.Module, gradient_checkpointing: bool) -> torch.nn.Module:
    """Training mode (for checkpointing) with dropout off: ratios of log-probs carry no noise."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def on_learner(model: torch.nn.Module, args, device: torch.device) -> torch.nn.Module:
    """`model` on this learner's device: moved there, or (--fsdp) sharded over the learners in place by
    FSDP2, block by block, then each of its top-level pieces on its own (so that a score head can be
    called directly), then whole. A script calls it on each model as it loads it (on the CPU):
    fully_shard moves each block to the device as it shards it, so the device never holds a whole
    model (at 8B, 30 GiB in float32), and the host holds one model at a time."""
    if not args.fsdp:
        return model.to(device)
    from torch.distributed.fsdp import fully_shard

    for module in model.modules():
        if type(module).__name__ in (model._no_split_modules or []):
            fully_shard(module)
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model  # (LoRA: peft calls it directly)
    for child in inner.children():
        fully_shard(child)
    fully_shard(model)
    return model


def shard_or_replicate(trained: torch.nn.Module, args, device: torch.device) -> torch.nn.Module:
    """What the optimizer trains, its models already on the learner (on_learner): `trained` itself, its
    DDP wrapper under torchrun, or (--fsdp) `trained`, sharded as a whole too if it is a module around
    sharded ones (PPO's policy and value model)."""
    metrics.startup_mark("models")  # (start-up's breakdown: every model is loaded by now)
    if args.fsdp:
        from torch.distributed.fsdp import FSDPModule, fully_shard

        if not isinstance(trained, FSDPModule):
            fully_shard(trained)
        return trained
    if args.world_size > 1:
        return torch.nn.parallel.DistributedDataParallel(
            trained, device_ids=[device] if device.type == "cuda" else None,
            gradient_as_bucket_view=True)
    return trained


def save_policy(policy: torch.nn.Module, tokenizer, args) -> None:
    """--save_model: save_pretrained to {output_dir}/model (FSDP2: every rank gathers, 0 writes). With LoRA that is
    the adapter in PEFT's format, and --save_merged adds the adapter merged into the SFT weights, a plain checkpoint,
    in {output_dir}/model_merged (read back from the two folders: any sharding), merged in float32 and written in
    the SFT checkpoint's own dtype (bfloat16 for most hub models: the size vLLM serves, not twice it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full_state = get_model_state_dict(policy, options=StateDictOptions(
        full_state_dict=True, cpu_offload=True)) if args.fsdp else None  # (FSDP2: a collective)
    if args.rank != 0:
        return
    folder = os.path.join(args.output_dir, "model")
    policy.save_pretrained(folder, state_dict=full_state)
    tokenizer.save_pretrained(folder)
    print(f"saved the policy to {folder}")
    if args.save_merged:
        from peft import PeftModel
        from transformers import AutoConfig

        saved_dtype = AutoConfig.from_pretrained(args.sft_model_path).dtype or torch.float32  # (the checkpoint's)
        base = type(policy.get_base_model()).from_pretrained(args.sft_model_path, dtype=torch.float32)
        merged = PeftModel.from_pretrained(base, folder).merge_and_unload().to(saved_dtype)
        merged.save_pretrained(folder + "_merged")
        tokenizer.save_pretrained(folder + "_merged")
        print(f"saved the merged policy to {folder}_merged")


# --- Devices and learner processes (torchrun) -----------------------------------------------------
def shares_gpu0(gpus: Optional[int] = None, learners: Optional[int] = None,
                nodes: Optional[int] = None) -> bool:
    """Whether learner rank 0 shares GPU 0 with vLLM: a one-node run whose node has GPUs but none
    spare per learner (of `gpus` and `learners` on the node, of `nodes`; default: this machine's
    and torchrun's). Every rank answers the same, so that all take the generator's "ready" message
    at the same point; across nodes, node 0 must leave GPU 0 to vLLM (the scripts' placement rule)."""
    gpus = torch.cuda.device_count() if gpus is None else gpus
    learners = int(os.environ.get("LOCAL_WORLD_SIZE", 1)) if learners is None else learners
    nodes = int(os.environ.get("GROUP_WORLD_SIZE", 1)) if nodes is None else nodes
    return nodes == 1 and 0 < gpus <= learners


def learner_device(world_size: int, gpu: int, generator_cores: int) -> tuple:
    """This learner's device, GPU `gpu` of its node if there are GPUs (and its process group, under
    torchrun); on CPU the generator gets cores of its own (the last ones). Returns the device and the
    generator's cores."""
    if torch.cuda.is_available():
        refuse_expandable_segments(os.environ)
    if world_size > 1:
        init_learner_group(torch.cuda.is_available())
    if torch.cuda.is_available():
        if gpu >= torch.cuda.device_count():
            fail(f"learner rank {os.environ.get('RANK', 0)} needs GPU {gpu} of its node, which has "
                 f"{torch.cuda.device_count()}: on the generator's node (node 0) launch at most one learner "
                 f"per GPU but GPU 0 (--nproc_per_node), on the others one per GPU")
        device = torch.device("cuda", gpu)
        torch.cuda.set_device(device)
        return device, None
    all_cores = sorted(os.sched_getaffinity(0))
    generator = all_cores[-generator_cores:] if 0 < generator_cores < len(all_cores) else None
    learner_cores = all_cores[: -generator_cores] if generator else all_cores
    os.sched_setaffinity(0, learner_cores)
    torch.set_num_threads(max(1, len(learner_cores) // world_size))
    return torch.device("cpu"), generator


def refuse_expandable_segments(environ) -> None:
    """The weight buffer reaches the generator by CUDA IPC, which torch's expandable segments (CUDA's virtual
    memory API) turn into a file-descriptor hand-off that containers often forbid (pytorch/pytorch#165685:
    "pidfd_getfd: Operation not permitted"), reserving more virtual memory per import (#186213): refused early."""
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        if "expandable_segments:true" in environ.get(name, "").replace(" ", "").lower():
            fail(f"{name}={environ[name]}: expandable segments break the CUDA IPC hand-off of the weight buffer "
                 f"to the generator in many containers; unset expandable_segments (or set it to False)")


# How long a learner waits in one collective before it fails. The longest legitimate wait is on rank
# 0's generator (the other ranks sit in a broadcast, on gloo): vLLM's first build, one generation
# round, an evaluation, a few minutes on the presets' GPUs; NCCL's default (10 min) could end a run
# with long completions, and gloo's (30 min) holds the survivors that long when a rank on another node
# hangs or dies (on one node torchrun stops them all at once). A fork with longer rounds raises it.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=20)


def init_learner_group(use_cuda: bool) -> None:
    # A backend per device: DDP/FSDP reduce GPU tensors over NCCL, while the collectives below carry
    # CPU tensors, which NCCL cannot ("cpu:gloo,cuda:nccl")
    dist.init_process_group("cpu:gloo,cuda:nccl" if use_cuda else "gloo", timeout=COLLECTIVE_TIMEOUT)


def sampling_seed(seed: int, kind: str, index: int) -> int:
    """The sampling seed of a training round or an evaluation (by round or version), from --seed."""
    sequence = np.random.SeedSequence([seed, ["train", "eval"].index(kind), index])
    return int(sequence.generate_state(1)[0])


# --- Collectives between the learner ranks --------------------------------------------------------
def reduce_sums(sums: dict, world_size: int) -> dict:
    if world_size == 1:
        return sums
    values = torch.tensor(list(sums.values()), dtype=torch.float64)
    dist.all_reduce(values)
    return dict(zip(sums, values.tolist()))


def reduce_median(values: torch.Tensor, world_size: int) -> float:
    """The median of every rank's `values` (as many on each rank; NaN: left out, nan if all are)."""
    values = values.detach().double().flatten().cpu()
    if world_size > 1:
        gathered = [torch.empty_like(values) for _ in range(world_size)]
        dist.all_gather(gathered, values)
        values = torch.cat(gathered)
    return values.nanmedian().item()


def reduce_max(value: float, world_size: int) -> float:
    if world_size == 1:
        return value
    values = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return values.item()


def clip_grad_norm(parameters, max_norm: Optional[float]) -> float:
    """The gradients' norm over all ranks before clipping (to --max_grad_norm; None: no clip)."""
    norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm or float("inf"))
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # (FSDP2: DTensor)


def check_hand_off(policy: torch.nn.Module, table: list) -> None:
    """The weight hand-off's table (built before the policy loads, from a fresh model: its trained parameters, by
    name) against the policy as it trains: each name a parameter of the policy, of the same shape, and every
    parameter that trains in the table (else the generator would never receive its updates). The snapshot copies
    by name: a fork that freezes a parameter the table lists passes (its SFT values, unchanged, go to the
    generator); one that trains a parameter the table lacks, or renames or reshapes one, is refused here."""
    params = dict(policy.named_parameters())
    for name, _, shape in table:
        if name not in params or tuple(params[name].shape) != tuple(shape):
            fail(f"the weight hand-off carries {name} {list(shape)}, but the policy "
                 + (f"has it as {list(params[name].shape)}" if name in params else "has no parameter of that name")
                 + ": build the table (weight_table) from the model as the learner trains it")
    listed = {name for name, _, _ in table}
    for name, param in params.items():
        if param.requires_grad and name not in listed:
            fail(f"the policy trains {name}, which the weight hand-off does not carry (weight_table lists the "
                 "parameters a fresh model trains): the generator would sample with its SFT values for ever")


def local_parameters(model: torch.nn.Module) -> list[torch.Tensor]:
    """This rank's parameters that train (LoRA: the adapter's), detached: under FSDP2 its shard of each
    (DTensor.to_local)."""
    from torch.distributed.tensor import DTensor

    return [(p.to_local() if isinstance(p, DTensor) else p).detach() for p in model.parameters() if p.requires_grad]


def parameters_copy(model: torch.nn.Module) -> list[torch.Tensor]:
    """This rank's parameters copied to host memory, so that measuring an update costs no
    accelerator memory: at 2.8B, 11 GB over the bus each way per step."""
    return [t.to("cpu", copy=True) for t in local_parameters(model)]


def relative_update(model: torch.nn.Module, before: list[torch.Tensor], world_size: int) -> float:
    """||theta - before|| / ||before|| over all ranks' parameters (under DDP every rank holds all of
    them: the sums grow by the same factor, the ratio does not change). One sync, not one a tensor."""
    deltas, norms = [], []
    for local, old in zip(local_parameters(model), before):
        old = old.to(local.device)
        deltas.append(torch.linalg.vector_norm(local - old, dtype=torch.float64))
        norms.append(torch.linalg.vector_norm(old, dtype=torch.float64))
    delta, norm = (torch.stack(values).square().sum().item() for values in (deltas, norms))
    sums = reduce_sums({"delta": delta, "norm": norm}, world_size)
    return math.sqrt(sums["delta"] / max(sums["norm"], 1e-30))


def chunks(n: int, size: int, model: torch.nn.Module) -> list[slice]:
    """Slices of `size` over n items, for forward passes. Under FSDP2 every forward of a sharded
    model gathers its weights, a collective: there every rank runs as many as the rank with the
    most (a share of an evaluation can be one prompt short), its extra slices repeating its last
    one; the caller keeps the first n results."""
    from torch.distributed.fsdp import FSDPModule

    parts = [slice(i, i + size) for i in range(0, n, size)]
    if any(isinstance(module, FSDPModule) for module in model.modules()):  # (LoRA's reference: the policy inside)
        parts += parts[-1:] * (int(reduce_max(len(parts), dist.get_world_size())) - len(parts))
    return parts


# --- A step's statistics, reduced over its micro-batches and the learner ranks --------------------
def step_stats(world_size: int, means: dict, spread: tuple = (), maxima: Optional[dict] = None,
               lengths: Optional[torch.Tensor] = None, cut: Optional[torch.Tensor] = None) -> dict:
    """What an update logs, over all learner ranks. `means`: a name for each of this rank's values
    (a tensor, or (values, weights)), logged as their (weighted) mean over all ranks, all in one
    reduction; a name in `spread` also gets `{name}_std`. `maxima`: a name for each value, the max
    over ranks. `lengths`, `cut`: the completions' lengths and whether each was cut at the limit."""
    sums = {}
    for name, entry in means.items():
        values, weights = entry if isinstance(entry, tuple) else (entry, torch.ones_like(entry))
        values, weights = values.detach().double().flatten(), weights.double().flatten()
        sums[name], sums[f"{name}/weight"] = (values * weights).sum().item(), weights.sum().item()
        if name in spread:
            sums[f"{name}/square"] = (values**2 * weights).sum().item()
    sums = reduce_sums(sums, world_size)
    stats = {name: sums[name] / (sums[f"{name}/weight"] or 1) for name in means}
    for name in spread:
        variance = sums[f"{name}/square"] / (sums[f"{name}/weight"] or 1) - stats[name] ** 2
        stats[f"{name}_std"] = max(variance, 0.0) ** 0.5
    stats.update({name: reduce_max(value, world_size) for name, value in (maxima or {}).items()})
    if lengths is not None:
        stats.update(length_stats(lengths, cut, world_size))
    return stats


def offpolicy_stats(log_ratio: torch.Tensor, token_mask: torch.Tensor, weights: torch.Tensor,
                    changed: torch.Tensor, world_size: int) -> dict:
    """What an async run shows of its off-policy data (PPO, RLOO), over all ranks. Per token: the
    learner-sampler mismatch |log pi_old - log mu| (mean, max) and the k3 estimate of
    KL(mu || pi_old), mean(w - log w - 1). Over the loss's terms (`weights`, `changed`: one each):
    the weights' min, mean and max, the share the correction changed, and the effective sample
    size (sum w)^2 / (n sum w^2) as a share of n (float64: w^2 of a capped weight stays finite)."""
    mismatch, weights = log_ratio.abs() * token_mask, weights.double()
    k3 = log_ratio.exp() - log_ratio - 1
    stats = step_stats(world_size, {
        "offpolicy/mismatch_mean": (mismatch, token_mask), "offpolicy/kl_k3": (k3, token_mask),
        "is/weight_mean": weights, "is/weight_square": weights**2, "is/changed_fraction": changed},
        maxima={"offpolicy/mismatch_max": mismatch.max().item(),
                "is/weight_max": weights.max().item(), "is/weight_min": -weights.min().item()})
    stats["is/weight_min"] *= -1
    square = stats.pop("is/weight_square")  # (0 only if every weight is 0: no effective sample)
    stats["is/ess_fraction"] = stats["is/weight_mean"] ** 2 / square if square > 0 else 0.0
    return stats


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


# --- Prompt tokens --------------------------------------------------------------------------------
def tokenize_prompts(tokenizer, texts: list[str], max_length: int) -> list[list[int]]:
    """Token ids per prompt, after BOS where the tokenizer adds one; long prompts keep their end,
    where the instruction ('TL;DR:') sits."""
    bos = bos_prefix(tokenizer)
    return [bos + ids[max(len(ids) + len(bos) - max_length, 0):]
            for ids in tokenizer(list(texts), add_special_tokens=False)["input_ids"]]


def bos_prefix(tokenizer) -> list[int]:
    """[BOS] if the tokenizer starts texts with one (Llama's, rho-1b's), else [] (Pythia's)."""
    bos = tokenizer.bos_token_id
    with_special = tokenizer("x")["input_ids"]
    without = tokenizer("x", add_special_tokens=False)["input_ids"]
    return [bos] if bos is not None and with_special[:1] == [bos] and without[:1] != [bos] else []
