# Synchronous Online DPO: the baseline of "Asynchronous RLHF" (Noukhovitch et al. 2024, arXiv 2410.18252).
# The twin of async_dpo.py: generate with the current weights, then train, then generate again; nothing overlaps.
# `diff sync_baseline.py async_dpo.py` shows what asynchrony changes. Demo: `python sync_baseline.py --model tiny`.
import contextlib
import json
import logging
import os
import queue
import random
import shutil
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Literal, NoReturn, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
import tyro
from tqdm import tqdm

TLDR_DATASET = "vwxyzjn/summarize_from_feedback_tldr_3_filtered_oai_preprocessing_1706381144"
PRESETS = {  # --model: (SFT policy, proxy reward model, dataset) on the Hugging Face hub
    "pythia-410m": ("mnoukhov/pythia410m-sft-tldr", "mnoukhov/pythia410m-rm-tldr6.9b", TLDR_DATASET),
    "pythia-1b": ("mnoukhov/pythia1b-sft-tldr", "mnoukhov/pythia1b-rm-tldr6.9b", TLDR_DATASET),
    "pythia-2.8b": ("mnoukhov/pythia2.8b-sft-tldr", "mnoukhov/pythia2.8b-rm-tldr6.9b", TLDR_DATASET),
}
# `--model tiny` swaps in defaults that train a locally built toy model on 2 CPU cores in a few minutes.
TINY_DEFAULTS = dict(
    learning_rate=3e-4, response_length=24, max_prompt_length=96, total_episodes=1920, batch_size=32,
    per_device_train_batch_size=16, eval_every=15, num_eval_prompts=64, eval_response_length=24,
)


@dataclass
class Args:
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment"""
    seed: int = 1
    """seed of the experiment (learner and vLLM sampling)"""
    track: bool = False
    """log to Weights & Biases"""
    wandb_project: str = "async-rlhf"
    """the wandb project name"""
    wandb_entity: Optional[str] = None
    """the wandb entity (team) name"""
    output_dir: Optional[str] = None
    """where metrics.jsonl and the saved model go (default: runs/{run_name})"""
    save_model: bool = False
    """save the final policy and tokenizer with save_pretrained to {output_dir}/model"""

    # Models and data
    model: Literal["tiny", "pythia-410m", "pythia-1b", "pythia-2.8b"] = "pythia-2.8b"
    """preset naming the SFT policy, proxy reward model and dataset; `tiny` builds a toy set locally for CPU"""
    sft_model_path: Optional[str] = None
    """SFT policy (hub name or local folder); also the frozen reference model. Overrides the preset"""
    reward_model_path: Optional[str] = None
    """reward model with a 1-label sequence-classification head (hub name or local folder). Overrides the preset"""
    dataset: Optional[str] = None
    """prompts with `query` and `reference_response` columns (hub name, local folder or file). Overrides the preset"""
    gold_reward_model_path: Optional[str] = None
    """optional gold reward model, used only in evaluation (must share the policy's tokenizer)"""
    tiny_dir: str = "~/.cache/async-rlhf/tiny-v1"
    """where `--model tiny` builds (once) and caches its toy models, tokenizer and dataset"""

    # Algorithm specific arguments (paper defaults for TL;DR)
    learning_rate: float = 3e-6
    """learning rate of AdamW, decayed linearly to 0"""
    beta: float = 0.1
    """DPO beta: strength of the implicit KL penalty towards the SFT reference"""
    temperature: float = 0.7
    """sampling temperature; the learner divides its logits by it too, so log-probs match the sampler"""
    num_samples: int = 2
    """K completions per prompt; the best and worst under the reward model form the DPO pair"""
    response_length: int = 128
    """maximum new tokens per completion"""
    max_prompt_length: int = 512
    """prompts longer than this keep their last tokens (where 'TL;DR:' sits)"""
    total_episodes: int = 131072
    """number of training prompts to consume (episodes)"""
    batch_size: int = 512
    """prompts per optimizer step, summed over all learner processes"""
    per_device_train_batch_size: int = 8
    """prompts per forward pass on one learner device; gradient accumulation makes up the rest"""
    num_mini_batches: int = 1
    """N: generate N mini-batches with one set of weights, then take N optimizer steps (the off-policyness knob)"""
    num_epochs: int = 1
    """T: passes over each generated batch"""
    missing_eos_penalty: Optional[float] = -1.0
    """score given to a completion that never emits EOS, instead of the reward model's score (None: no penalty)"""
    max_grad_norm: Optional[float] = None
    """clip gradients to this norm (off by default, as in the paper's TL;DR runs)"""

    # Evaluation
    eval_every: int = 32
    """evaluate every this many optimizer steps (0: only before and after training)"""
    num_eval_prompts: int = 512
    """held-out (validation split) prompts per evaluation"""
    eval_temperature: float = 0.01
    """near-greedy sampling for evaluation"""
    eval_response_length: int = 128
    """maximum new tokens per evaluation completion"""

    # Systems
    generation_backend: Literal["vllm", "hf"] = "vllm"
    """`vllm`: a vLLM generator process, idle while the learner trains. `hf`: the learner's own model samples with
    transformers' generate on the training device(s), no vLLM at all (the paper's TL;DR baseline)"""
    dtype: Optional[Literal["bfloat16", "float16", "float32"]] = None
    """vLLM, reference and reward model dtype, and the learner's autocast dtype (default: bfloat16 on GPU, float32
    on CPU). The policy's master weights stay float32"""
    vllm_gpu_memory_utilization: float = 0.9
    """fraction of GPU 0's memory vLLM may use (lower it when the learner shares that GPU)"""
    generator_cores: int = 1
    """CPU runs only: cores reserved for the generator; the learner gets the rest"""
    fsdp: bool = False
    """under torchrun, shard the policy, reference and reward models over the learners with FSDP2 instead of
    replicating the policy with DDP (for models that do not fit one GPU)"""

    # to be filled in at runtime
    run_name: str = ""
    """`{model}__{exp_name}__{seed}__{time}`"""
    world_size: int = 1
    """number of learner processes (torchrun)"""
    local_batch_size: int = 0
    """prompts per optimizer step on one learner process"""
    gradient_accumulation_steps: int = 0
    """forward passes per optimizer step on one learner process"""
    num_rounds: int = 0
    """generation rounds: each produces num_mini_batches * batch_size prompts x num_samples completions"""
    num_steps: int = 0
    """optimizer steps in total"""


def parse_args() -> Args:
    # `--model tiny` needs its own defaults (small batches, short responses), which flags still override.
    # tyro cannot see the preset before parsing, so peek at it.
    argv = sys.argv[1:]
    tiny = "--model=tiny" in argv or any(a == "--model" and argv[i + 1: i + 2] == ["tiny"] for i, a in enumerate(argv))
    return tyro.cli(Args, default=Args(model="tiny", **TINY_DEFAULTS) if tiny else Args())


def fail(message: str) -> NoReturn:
    """Stop early with a one-line error naming the bad flag or file."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def compute_batch_sizes(args: Args, world_size: int) -> None:
    """Fill in the runtime fields of Args, rejecting combinations that do not divide."""
    for name in ("response_length", "max_prompt_length", "total_episodes", "batch_size", "per_device_train_batch_size",
                 "num_mini_batches", "num_epochs", "num_eval_prompts", "eval_response_length", "generator_cores"):
        if getattr(args, name) <= 0:
            fail(f"--{name} must be positive, got {getattr(args, name)}")
    if args.num_samples < 2:
        fail(f"--num_samples must be at least 2 (a DPO pair needs two completions), got {args.num_samples}")
    if args.eval_every < 0:
        fail(f"--eval_every must be 0 (off) or positive, got {args.eval_every}")
    if not 0 < args.vllm_gpu_memory_utilization <= 1:
        fail(f"--vllm_gpu_memory_utilization must be in (0, 1], got {args.vllm_gpu_memory_utilization}")
    if args.temperature <= 0 or args.eval_temperature <= 0:
        fail("--temperature and --eval_temperature must be positive")
    if args.fsdp and world_size == 1:
        fail("--fsdp shards over several learner processes: launch with torchrun --nproc_per_node N")
    if args.batch_size % world_size:
        fail(f"--batch_size {args.batch_size} must divide evenly over {world_size} learner processes")
    args.world_size = world_size
    args.local_batch_size = args.batch_size // world_size
    if args.local_batch_size % args.per_device_train_batch_size:
        fail(f"--per_device_train_batch_size {args.per_device_train_batch_size} must divide the per-process batch "
             f"({args.batch_size} prompts / {world_size} processes = {args.local_batch_size})")
    args.gradient_accumulation_steps = args.local_batch_size // args.per_device_train_batch_size
    prompts_per_round = args.batch_size * args.num_mini_batches
    if args.total_episodes < prompts_per_round:
        fail(f"--total_episodes {args.total_episodes} is smaller than one generation round "
             f"(--batch_size x --num_mini_batches = {prompts_per_round})")
    args.num_rounds = args.total_episodes // prompts_per_round
    args.num_steps = args.num_rounds * args.num_mini_batches * args.num_epochs


# ---------------------------------------------------------------------------------------------------------------
# The tiny CPU configuration: a toy TL;DR built locally, so tests and the demo take the same path as a real run
# ---------------------------------------------------------------------------------------------------------------
def build_tiny_assets(tiny_dir: str, hidden_size: int = 128, num_layers: int = 2, num_heads: int = 4,
                      sft_steps: int = 150) -> str:
    """Build (once) a byte-level BPE tokenizer, a TL;DR-shaped dataset, a briefly SFT-trained Pythia-architecture
    policy and a reward model (the SFT backbone with a random, fixed score head). Returns the folder."""
    tiny_dir = os.path.expanduser(tiny_dir)
    if os.path.exists(os.path.join(tiny_dir, "READY")):
        return tiny_dir
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (
        GPTNeoXConfig,
        GPTNeoXForCausalLM,
        GPTNeoXForSequenceClassification,
        PreTrainedTokenizerFast,
    )

    rng = random.Random(0)
    words = ("cat dog house car work boss friend money rent roommate game phone girlfriend boyfriend school class "
             "exam teacher party food pizza coffee dinner weekend trip city job interview sister brother mom dad "
             "wedding apartment landlord neighbor bike gym advice help problem question fight love break late "
             "early happy sad angry tired week month year time night morning day plan idea moved quit asked told "
             "said wanted needed found lost bought sold paid called").split()
    subreddits = ["relationships", "AskReddit", "personalfinance", "tifu", "jobs", "dogs", "cats", "college"]

    def example() -> dict:
        title = " ".join(rng.choices(words, k=rng.randint(3, 7)))
        post = " ".join(rng.choices(words, k=rng.randint(15, 45))) + "."
        summary = " ".join(rng.sample(post[:-1].split(), k=rng.randint(3, 8)))
        subreddit = rng.choice(subreddits)
        query = f"SUBREDDIT: r/{subreddit}\n\nTITLE: {title}\n\nPOST: {post}\n\nTL;DR:"
        return dict(query=query, reference_response=f" {summary}<|endoftext|>", subreddit=subreddit, title=title,
                    post=post, summary=summary)

    parent = os.path.dirname(os.path.abspath(tiny_dir))
    os.makedirs(parent, exist_ok=True)
    build_dir = tempfile.mkdtemp(prefix=".building-", dir=parent)
    splits = {"train": [example() for _ in range(4000)], "validation": [example() for _ in range(256)]}
    os.makedirs(os.path.join(build_dir, "data"))
    for split, rows in splits.items():
        with open(os.path.join(build_dir, "data", f"{split}.jsonl"), "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    texts = [row["query"] + row["reference_response"] for row in splits["train"]]
    bpe.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=512, special_tokens=["<|endoftext|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    # Like Pythia's: EOS doubles as BOS, and there is no pad token (the scripts must cope without one).
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>", bos_token="<|endoftext|>")
    config = GPTNeoXConfig(vocab_size=len(tokenizer), hidden_size=hidden_size, num_hidden_layers=num_layers,
                           num_attention_heads=num_heads, intermediate_size=4 * hidden_size,
                           max_position_embeddings=512, bos_token_id=tokenizer.eos_token_id,
                           eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    policy = GPTNeoXForCausalLM(config)
    # A short SFT on the reference summaries, so the policy writes summary-like text that ends with EOS.
    optimizer = torch.optim.AdamW(policy.parameters(), lr=3e-3)
    for step in range(sft_steps):
        rows = rng.sample(splits["train"], 32)
        encoded = [tokenizer(r["query"] + r["reference_response"])["input_ids"] for r in rows]
        width = max(len(e) for e in encoded)
        input_ids = torch.tensor([e + [tokenizer.eos_token_id] * (width - len(e)) for e in encoded])
        labels = torch.tensor([e + [-100] * (width - len(e)) for e in encoded])
        loss = policy(input_ids=input_ids, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    reward_config = GPTNeoXConfig.from_dict(config.to_dict())
    reward_config.num_labels = 1
    reward_model = GPTNeoXForSequenceClassification(reward_config)
    reward_model.gpt_neox.load_state_dict(policy.gpt_neox.state_dict())
    torch.nn.init.normal_(reward_model.score.weight, std=1.0 / hidden_size**0.5)
    for name, model in (("sft", policy), ("reward", reward_model)):
        model.save_pretrained(os.path.join(build_dir, name))
        tokenizer.save_pretrained(os.path.join(build_dir, name))
    open(os.path.join(build_dir, "READY"), "w").close()
    try:
        os.rename(build_dir, tiny_dir)
    except OSError:  # another process finished the same (deterministic) build first
        shutil.rmtree(build_dir, ignore_errors=True)
    return tiny_dir


# ---------------------------------------------------------------------------------------------------------------
# Data and models
# ---------------------------------------------------------------------------------------------------------------
def load_prompt_splits(dataset: str, seed: int):
    """Load train and validation splits from a hub name, a local folder of split files, or a single local file
    (then 5% is held out for evaluation). Rejects data without the `query`/`reference_response` columns."""
    from datasets import load_dataset

    try:
        if os.path.isfile(dataset):
            kind = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}.get(
                os.path.splitext(dataset)[1])
            if kind is None:
                fail(f"--dataset {dataset}: unsupported file type (use .jsonl, .json, .parquet or .csv)")
            splits = load_dataset(kind, data_files=dataset)["train"].train_test_split(test_size=0.05, seed=seed)
            splits = {"train": splits["train"], "validation": splits["test"]}
        elif os.path.isdir(dataset) or "/" in dataset and not dataset.startswith((".", "/", "~")):
            splits = load_dataset(dataset)
        else:
            fail(f"--dataset {dataset}: no such file or folder")
    except SystemExit:
        raise
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


def check_model_path(flag: str, path: str) -> None:
    """Fail early, naming the flag, when a model is neither a local folder nor loadable from the hub."""
    from transformers import AutoConfig

    if path.startswith((".", "/", "~")) and not os.path.isdir(os.path.expanduser(path)):
        fail(f"--{flag} {path}: no such folder")
    try:
        AutoConfig.from_pretrained(path)
    except Exception as e:
        fail(f"--{flag} {path}: not a local model folder and could not be loaded from the hub "
             f"({type(e).__name__}: {str(e).splitlines()[0][:200]})")


def tokenize_prompts(tokenizer, texts: list[str], max_length: int) -> list[list[int]]:
    """Token ids per prompt; long prompts keep their end, where the instruction ('TL;DR:') sits."""
    return [ids[-max_length:] for ids in tokenizer(list(texts), add_special_tokens=False)["input_ids"]]


def left_pad(sequences: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack prompts left-padded (so all responses start at the same column); returns ids and attention mask."""
    width = max(len(s) for s in sequences)
    ids = torch.tensor([[pad_id] * (width - len(s)) + s for s in sequences])
    mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in sequences])
    return ids, mask


def pad_responses(responses: list[list[int]], length: int, eos_id: int, pad_id: int):
    """Right-pad completions to `length`, cutting each after its first EOS. Returns token ids, a mask over the kept
    tokens, and whether each completion emitted EOS (those that did not get --missing_eos_penalty)."""
    ids = torch.full((len(responses), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(responses), length), dtype=torch.long)
    has_eos = torch.zeros(len(responses), dtype=torch.bool)
    for i, tokens in enumerate(responses):
        tokens = list(tokens[:length])
        if eos_id in tokens:
            tokens = tokens[: tokens.index(eos_id) + 1]
            has_eos[i] = True
        ids[i, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        mask[i, : len(tokens)] = 1
    return ids, mask, has_eos


def forward_inputs(query_ids, query_mask, response_ids, response_mask):
    """Concatenate prompt and response; position ids skip the left padding so they match unpadded sequences."""
    input_ids = torch.cat([query_ids, response_ids], dim=1)
    attention_mask = torch.cat([query_mask, response_mask], dim=1)
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    return dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)


def sequence_logprobs(model, query_ids, query_mask, response_ids, response_mask, temperature: float):
    """Summed log-probs of each response under `model`, with logits divided by the sampling temperature so they
    match the distribution vLLM sampled from. Returns (sum of log-probs, number of response tokens)."""
    length = response_ids.shape[1]
    # Only the logits that predict response tokens: saves a [batch, prompt_length, vocab] tensor.
    logits = model(**forward_inputs(query_ids, query_mask, response_ids, response_mask),
                   logits_to_keep=length + 1).logits[:, :-1]
    logprobs = torch.log_softmax(logits.float() / temperature, dim=-1)
    token_logprobs = logprobs.gather(2, response_ids.unsqueeze(-1)).squeeze(-1)
    return (token_logprobs * response_mask).sum(1), response_mask.sum(1)


@torch.no_grad()
def get_reward(reward_model, query_ids, query_mask, response_ids, response_mask, has_eos,
               missing_eos_penalty: Optional[float]):
    """Reward-model score at the last non-padding token of prompt + response; completions without EOS get the
    penalty instead."""
    inputs = forward_inputs(query_ids, query_mask, response_ids, response_mask)
    hidden = getattr(reward_model, reward_model.base_model_prefix)(**inputs).last_hidden_state
    last_index = query_ids.shape[1] + response_mask.sum(1) - 1
    rows = torch.arange(len(hidden), device=hidden.device)
    scores = reward_model.score(hidden[rows, last_index]).squeeze(-1).float()
    if missing_eos_penalty is None:
        return scores
    return torch.where(has_eos.to(scores.device), scores, torch.full_like(scores, missing_eos_penalty))


def select_pairs(scores: torch.Tensor):
    """scores [prompts, K] -> (chosen index, rejected index, valid). Chosen is the best completion, rejected the
    worst; a prompt whose K completions all score the same carries no preference and is masked out (valid=False)."""
    chosen = scores.argmax(1)
    rejected = scores.argmin(1)
    valid = scores.max(1).values > scores.min(1).values
    return chosen, rejected, valid


def dpo_loss(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, beta: float) -> torch.Tensor:
    """Per-pair DPO loss: -log sigmoid(beta * ((log pi(y+) - log ref(y+)) - (log pi(y-) - log ref(y-))))."""
    return -F.logsigmoid(beta * ((chosen_logps - ref_chosen_logps) - (rejected_logps - ref_rejected_logps)))


@torch.no_grad()
def hf_generate(model, prompts: list, n: int, temperature: float, max_tokens: int, pad_id: int, eos_id: int,
                chunk: int) -> list:
    """Sample n completions per prompt with transformers' generate, prompt-major like vLLM's output. Pure
    temperature sampling (no top-k/top-p), the distribution the learner's log-probs assume."""
    responses = []
    device = next(model.parameters()).device
    for i in range(0, len(prompts), chunk):
        ids, mask = left_pad(prompts[i: i + chunk], pad_id)
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=True,
                             temperature=temperature, top_k=0, top_p=1.0, max_new_tokens=max_tokens,
                             num_return_sequences=n, eos_token_id=eos_id, pad_token_id=pad_id)
        responses += out[:, ids.shape[1]:].tolist()
    return responses


def disable_dropout(model: torch.nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0


# ---------------------------------------------------------------------------------------------------------------
# Weight hand-off: one persistent shared buffer, written by the learner, read by the generator
# ---------------------------------------------------------------------------------------------------------------
def weight_table(model: torch.nn.Module) -> list:
    """(name, offset, shape) of every parameter in one flat buffer, in the order of model.parameters()."""
    table, offset = [], 0
    for name, param in model.named_parameters():
        table.append((name, offset, tuple(param.shape)))
        offset += param.numel()
    return table


def make_weight_buffer(table: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Allocate, once, a flat buffer for every parameter. On CPU it lives in shared memory; on GPU torch shares it
    with the generator via CUDA IPC."""
    _, offset, shape = table[-1]
    buffer = torch.empty(offset + int(np.prod(shape)), dtype=dtype, device=device)
    return buffer.share_memory_() if device.type == "cpu" else buffer


@torch.no_grad()
def write_weight_snapshot(model: torch.nn.Module, buffer: Optional[torch.Tensor], table: list) -> None:
    """Copy the current parameters into the buffer: the generator sees a snapshot, never tensors the optimizer is
    about to change. Safe to call only when the generator is not reading (see the schedule in the main loop).
    Under FSDP2 every rank calls it (gathering a sharded parameter is a collective); only rank 0 has a buffer."""
    from torch.distributed.tensor import DTensor

    for (name, offset, shape), param in zip(table, model.parameters()):
        full = param.full_tensor() if isinstance(param, DTensor) else param
        if buffer is not None:
            buffer[offset: offset + full.numel()].copy_(full.detach().reshape(-1))


def weights_from_buffer(buffer: torch.Tensor, table: list) -> list:
    return [(name, buffer[offset: offset + int(np.prod(shape))].view(shape)) for name, offset, shape in table]


# ---------------------------------------------------------------------------------------------------------------
# Generator process: owns the vLLM engine
# ---------------------------------------------------------------------------------------------------------------
# The paper ran vLLM in a thread of the learner and lost ~15-20% of each step to the GIL. A spawned process
# shares no GIL, and it keeps vLLM's side effects out of the learner: vLLM patches transformers' GPTNeoX classes
# and initialises torch.distributed in whatever process builds the engine.
def generator_main(engine_kwargs: dict, weight_buffer: torch.Tensor, weight_layout: list, requests, results,
                   cores: Optional[list], run_tmp_dir: str) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the learner, which shuts us down
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the learner, whatever happens
    except OSError:
        pass
    try:
        for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                    "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID"):
            os.environ.pop(var, None)  # torchrun's variables describe the learners, not this engine
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # build the engine inside this process
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        # Every reload warns that rotary embeddings got no weights: they have none in the checkpoint to get.
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(logging.ERROR)
        os.environ["TMPDIR"] = tempfile.tempdir = run_tmp_dir  # vLLM's rendezvous files; the learner removes them
        if cores:  # before vLLM starts: its CPU worker makes later set_num_threads calls no-ops
            os.sched_setaffinity(0, cores)
            torch.set_num_threads(len(cores))
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        llm = LLM(**engine_kwargs)
        loaded_version = 0  # the engine starts from the SFT checkpoint, which is the learner's version 0
        while (request := requests.get()) is not None:
            start = time.time()
            if request["weights_version"] != loaded_version:
                llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights_from_buffer(
                    weight_buffer, weight_layout)})
                llm.reset_prefix_cache()  # without this, cached prompt states from the old weights are reused
                loaded_version = request["weights_version"]
            load_time = time.time() - start
            sampling = SamplingParams(n=request["n"], temperature=request["temperature"],
                                      max_tokens=request["max_tokens"], logprobs=0, detokenize=False)
            start = time.time()
            outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in request["prompts"]], sampling,
                                   use_tqdm=False)
            results.put(dict(kind=request["kind"], round=request["round"], generation_version=loaded_version,
                             responses=[list(c.token_ids) for out in outputs for c in out.outputs],
                             logprobs=[c.cumulative_logprob for out in outputs for c in out.outputs],
                             generation_time=time.time() - start, weight_load_time=load_time))
    except BaseException:
        results.put(dict(kind="error", traceback=traceback.format_exc()))
        raise SystemExit(1)


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


if __name__ == "__main__":
    args = parse_args()
    rank, local_rank = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    compute_batch_sizes(args, int(os.environ.get("WORLD_SIZE", 1)))
    if args.fsdp and args.generation_backend == "hf":  # ranks would sample different lengths: mismatched collectives
        fail("--fsdp works with --generation_backend vllm only")
    if args.model == "tiny":
        tiny_dir = build_tiny_assets(args.tiny_dir)
        preset = (os.path.join(tiny_dir, "sft"), os.path.join(tiny_dir, "reward"), os.path.join(tiny_dir, "data"))
    else:
        preset = PRESETS[args.model]
    args.sft_model_path = args.sft_model_path or preset[0]
    args.reward_model_path = args.reward_model_path or preset[1]
    args.dataset = args.dataset or preset[2]
    for flag in ("sft_model_path", "reward_model_path", "gold_reward_model_path"):
        if getattr(args, flag):
            check_model_path(flag, getattr(args, flag))
    train_data, eval_data = load_prompt_splits(args.dataset, args.seed)
    args.run_name = f"{args.model}__{args.exp_name}__{args.seed}__{int(time.time())}"
    args.output_dir = args.output_dir or os.path.join("runs", args.run_name)

    # Devices: vLLM owns GPU 0, learner rank i uses GPU i+1 (or shares GPU 0 when there are too few GPUs).
    # On CPU the generator gets its own cores, so that generation and training really run side by side.
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        device = torch.device("cuda", local_rank + 1 if torch.cuda.device_count() > args.world_size else local_rank)
        torch.cuda.set_device(device)
        if device.index == 0 and args.vllm_gpu_memory_utilization > 0.5 and rank == 0:
            print(f"warning: the learner shares GPU 0 with vLLM, which may take {args.vllm_gpu_memory_utilization:.0%}"
                  " of it: lower --vllm_gpu_memory_utilization if the learner runs out of memory", flush=True)
    else:
        device = torch.device("cpu")
        all_cores = sorted(os.sched_getaffinity(0))
        uses_generator = args.generation_backend == "vllm" and len(all_cores) > args.generator_cores
        generator_cores = all_cores[-args.generator_cores:] if uses_generator else None
        learner_cores = all_cores[: -args.generator_cores] if generator_cores else all_cores
        os.sched_setaffinity(0, learner_cores)
        torch.set_num_threads(max(1, len(learner_cores) // args.world_size))
    dtype_name = args.dtype or ("bfloat16" if use_cuda else "float32")
    dtype = getattr(torch, dtype_name)
    if args.world_size > 1:
        dist.init_process_group("nccl" if use_cuda else "gloo")
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    import datasets
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    transformers.utils.logging.disable_progress_bar()
    datasets.disable_progress_bars()

    tokenizer = AutoTokenizer.from_pretrained(args.sft_model_path)
    if tokenizer.eos_token_id is None:
        fail(f"--sft_model_path {args.sft_model_path}: the tokenizer has no EOS token")
    eos_id = tokenizer.eos_token_id
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id  # masks say what is padding
    policy = AutoModelForCausalLM.from_pretrained(args.sft_model_path, dtype=torch.float32).to(device)
    ref_policy = AutoModelForCausalLM.from_pretrained(args.sft_model_path, dtype=dtype).to(device)
    reward_model = AutoModelForSequenceClassification.from_pretrained(args.reward_model_path, dtype=dtype,
                                                                      num_labels=1).to(device)
    gold_model = None
    if args.gold_reward_model_path:
        gold_model = AutoModelForSequenceClassification.from_pretrained(
            args.gold_reward_model_path, dtype=dtype, num_labels=1).to(device).eval().requires_grad_(False)
    for frozen in (ref_policy, reward_model):
        frozen.eval().requires_grad_(False)
    disable_dropout(policy)
    unwrapped_policy, weight_layout = policy, weight_table(policy)
    if args.fsdp:  # shard every transformer block, then each top-level piece (embeddings, heads) as its own unit,
        from torch.distributed.fsdp import fully_shard  # so that get_reward may call the score head directly

        for model in filter(None, (policy, ref_policy, reward_model, gold_model)):
            for module in model.modules():
                if type(module).__name__ in (model._no_split_modules or []):
                    fully_shard(module)
            for child in model.children():
                fully_shard(child)
            fully_shard(model)
    elif args.world_size > 1:
        policy = torch.nn.parallel.DistributedDataParallel(policy, device_ids=[device] if use_cuda else None)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.learning_rate)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 - step / args.num_steps)
    autocast = torch.autocast(device.type, dtype=dtype, enabled=use_cuda and dtype != torch.float32)

    # Prompts: a fresh shuffle of the training split each pass; the first num_eval_prompts of validation
    train_prompts = tokenize_prompts(tokenizer, train_data["query"], args.max_prompt_length)
    prompts_per_round = args.batch_size * args.num_mini_batches
    passes = -(-args.num_rounds * prompts_per_round // len(train_prompts))
    prompt_order = np.concatenate([np.random.permutation(len(train_prompts)) for _ in range(passes)])
    # Equal shards per rank: sharded models need every rank to run the same number of forward passes
    eval_data = eval_data.select(range(min(args.num_eval_prompts, len(eval_data)) // args.world_size
                                       * args.world_size))
    eval_prompts = tokenize_prompts(tokenizer, eval_data["query"], args.max_prompt_length)
    eval_references = tokenizer(list(eval_data["reference_response"]), add_special_tokens=False)["input_ids"]
    eval_shard = slice(rank * len(eval_prompts) // args.world_size, (rank + 1) * len(eval_prompts) // args.world_size)

    # Logging (rank 0 only): metrics.jsonl, and wandb with --track
    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        metrics_file = open(os.path.join(args.output_dir, "metrics.jsonl"), "a")
        if args.track:
            import wandb

            wandb.init(project=args.wandb_project, entity=args.wandb_entity, name=args.run_name, config=asdict(args),
                       dir=args.output_dir, save_code=True)
            wandb.define_metric("step")
            wandb.define_metric("*", step_metric="step")
        print(f"run {args.run_name}: {args.num_steps} optimizer steps in {args.num_rounds} rounds of "
              f"{prompts_per_round} prompts x {args.num_samples} samples; metrics in {args.output_dir}/metrics.jsonl",
              flush=True)
    # Generator process (rank 0 only), the one-slot queues to and from it, and the shared weight buffer
    generator, requests, results, run_tmp_dir, weight_buffer = None, None, None, None, None
    if rank == 0 and args.generation_backend == "vllm":
        max_model_len = args.max_prompt_length + max(args.response_length, args.eval_response_length)
        # processed_logprobs: log-probs of the distribution actually sampled, log_softmax(logits / temperature)
        engine_kwargs = dict(model=args.sft_model_path, dtype=dtype_name, seed=args.seed, enforce_eager=True,
                             max_model_len=max_model_len, gpu_memory_utilization=args.vllm_gpu_memory_utilization,
                             logprobs_mode="processed_logprobs")
        if not use_cuda:  # size the CPU KV cache for one round of sequences; vLLM's default takes 18 GiB
            config = AutoConfig.from_pretrained(args.sft_model_path)
            bytes_per_token = 2 * config.num_hidden_layers * config.hidden_size * dtype.itemsize
            sequences = min(prompts_per_round * args.num_samples, 256)
            kv_bytes = bytes_per_token * max_model_len * sequences
            engine_kwargs["kv_cache_memory_bytes"] = min(max(kv_bytes, 2**25), 2**33)
        weight_buffer = make_weight_buffer(weight_layout, dtype, device)
        run_tmp_dir = tempfile.mkdtemp(prefix="async-rlhf-")
        ctx = mp.get_context("spawn")
        requests, results = ctx.Queue(maxsize=1), ctx.Queue(maxsize=1)
        generator = ctx.Process(target=generator_main, args=(
            engine_kwargs, weight_buffer, weight_layout, requests, results,
            None if use_cuda else generator_cores, run_tmp_dir))
        generator.start()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))

    def log(record: dict) -> None:
        if rank == 0:
            metrics_file.write(json.dumps(record) + "\n")
            metrics_file.flush()
            if args.track:
                wandb.log({k: wandb.Table(columns=["prompt", "response"], data=[list(s.values()) for s in v])
                           if k == "eval/samples" else v for k, v in record.items()})

    def round_prompts(round_index: int) -> list:
        return [train_prompts[i] for i in prompt_order[round_index * prompts_per_round:][:prompts_per_round]]

    def train_request(round_index: int, version: int) -> dict:
        return dict(kind="train", round=round_index, weights_version=version, prompts=round_prompts(round_index),
                    n=args.num_samples, temperature=args.temperature, max_tokens=args.response_length)

    def eval_request(version: int) -> dict:
        return dict(kind="eval", round=-1, weights_version=version, prompts=eval_prompts, n=1,
                    temperature=args.eval_temperature, max_tokens=args.eval_response_length)

    def score_in_chunks(model, query_ids, query_mask, response_ids, response_mask, has_eos) -> torch.Tensor:
        chunk = args.per_device_train_batch_size * args.num_samples
        with autocast:
            return torch.cat([
                get_reward(model, query_ids[i: i + chunk].to(device), query_mask[i: i + chunk].to(device),
                           response_ids[i: i + chunk].to(device), response_mask[i: i + chunk].to(device),
                           has_eos[i: i + chunk], args.missing_eos_penalty)
                for i in range(0, len(query_ids), chunk)]).cpu()

    @torch.no_grad()
    def ref_logprobs_in_chunks(query_ids, query_mask, response_ids, response_mask, temperature: float):
        chunk, logps, counts = args.per_device_train_batch_size * args.num_samples, [], []
        for i in range(0, len(query_ids), chunk):
            with autocast:
                lp, n = sequence_logprobs(ref_policy, query_ids[i: i + chunk].to(device),
                                          query_mask[i: i + chunk].to(device), response_ids[i: i + chunk].to(device),
                                          response_mask[i: i + chunk].to(device), temperature)
            logps.append(lp.cpu())
            counts.append(n.cpu())
        return torch.cat(logps), torch.cat(counts)

    # The human reference summaries' scores never change: compute them once
    eval_query_ids, eval_query_mask = left_pad(eval_prompts[eval_shard], pad_id)
    ref_ids, ref_mask, ref_has_eos = pad_responses(eval_references[eval_shard], args.eval_response_length, eos_id,
                                                   pad_id)
    reference_scores = {name: score_in_chunks(m, eval_query_ids, eval_query_mask, ref_ids, ref_mask, ref_has_eos)
                        for name, m in (("reward", reward_model), ("gold", gold_model)) if m is not None}

    def evaluate(message: dict) -> None:
        """Win rate of near-greedy samples against the reference summaries, and the SFT model's perplexity of them
        (the paper's KL proxy). Every rank scores its shard of the evaluation prompts."""
        start = time.time()
        response_ids, response_mask, has_eos = pad_responses(message["responses"][eval_shard],
                                                             args.eval_response_length, eos_id, pad_id)
        sums = {"count": len(response_ids), "eos": has_eos.sum().item()}
        for name, model in (("reward", reward_model), ("gold", gold_model)):
            if model is not None:
                scores = score_in_chunks(model, eval_query_ids, eval_query_mask, response_ids, response_mask, has_eos)
                sums[f"{name}_wins"] = (scores > reference_scores[name]).sum().item()
                sums[f"{name}_sum"] = scores.sum().item()
        logps, counts = ref_logprobs_in_chunks(eval_query_ids, eval_query_mask, response_ids, response_mask, 1.0)
        sums.update(logp=logps.sum().item(), tokens=counts.sum().item())
        sums = reduce_sums(sums, args.world_size)
        global evals_pending
        evals_pending -= 1
        record = {"step": message["generation_version"], "episode": message["generation_version"] * args.batch_size,
                  "eval/win_rate": sums["reward_wins"] / sums["count"],
                  "eval/reward": sums["reward_sum"] / sums["count"],
                  "eval/perplexity": float(np.exp(-sums["logp"] / max(sums["tokens"], 1))),
                  "eval/eos_fraction": sums["eos"] / sums["count"]}
        if gold_model is not None:
            record["eval/gold_win_rate"] = sums["gold_wins"] / sums["count"]
        if rank == 0:
            record["eval/samples"] = [dict(prompt=tokenizer.decode(eval_prompts[i])[-200:],
                                           response=tokenizer.decode(response_ids[i][response_mask[i].bool()]))
                                      for i in range(min(3, len(response_ids)))]
            record["time/eval"] = time.time() - start
            record["time/elapsed"] = time.time() - training_start
            tqdm.write(f"eval @ step {record['step']}: win rate {record['eval/win_rate']:.3f}, reward "
                       f"{record['eval/reward']:.3f}, perplexity {record['eval/perplexity']:.3f}")
            for sample in record["eval/samples"]:
                tqdm.write(f"  ...{sample['prompt'][-60:]!r} -> {sample['response']!r}")
        log(record)

    pending = []  # hf backend: requests not generated yet

    def submit(request: dict) -> None:
        """Queue a generation request for the generator process (rank 0 talks to it for all ranks)."""
        if args.generation_backend == "hf":
            pending.append(request)
        elif rank == 0:
            send(requests, request, generator)

    def collect() -> dict:
        """The generator's next result, on every rank. With the hf backend each rank samples only its own prompts."""
        if args.generation_backend == "vllm":
            return share(receive(results, generator) if rank == 0 else None, rank, args.world_size)
        request, start = pending.pop(0), time.time()
        n, mine = request["n"], range(len(request["prompts"]))[eval_shard] if request["kind"] == "eval" else local
        with autocast:
            sampled = hf_generate(unwrapped_policy, [request["prompts"][i] for i in mine], n, request["temperature"],
                                  request["max_tokens"], pad_id, eos_id, args.per_device_train_batch_size)
        responses = [None] * (len(request["prompts"]) * n)
        for j, i in enumerate(mine):
            responses[i * n: (i + 1) * n] = sampled[j * n: (j + 1) * n]
        return dict(kind=request["kind"], round=request["round"], generation_version=version, responses=responses,
                    logprobs=None, generation_time=time.time() - start, weight_load_time=0.0)

    def next_batch() -> tuple[dict, float]:
        """Wait for the next training batch, evaluating any evaluation results that arrive first. Returns the batch
        and the time spent waiting (evaluation excluded)."""
        waited = 0.0
        while True:
            start = time.time()
            message = collect()
            waited += time.time() - start
            if message["kind"] == "train":
                return message, waited
            evaluate(message)

    def sync_weights(version: int, synced_version: int) -> int:
        """Write the snapshot of `version` into the buffer if the generator does not have it yet."""
        if version != synced_version and (generator is not None or args.fsdp):
            write_weight_snapshot(unwrapped_policy, weight_buffer, weight_layout)
        return version

    def eval_due(version: int, last_eval: int) -> bool:
        return version == 0 or (args.eval_every > 0 and version // args.eval_every > last_eval // args.eval_every)

    # Training loop
    version, synced_version, last_eval = 0, 0, 0  # version = optimizer steps taken = weights generation
    evals_pending = 1  # the evaluation of the SFT weights, requested first
    L, K, G = args.local_batch_size, args.num_samples, args.gradient_accumulation_steps
    local = [m * args.batch_size + rank * L + j for m in range(args.num_mini_batches) for j in range(L)]  # my prompts
    local_completions = [i * K + k for i in local for k in range(K)]  # prompt-major, as the generator returns them
    progress = tqdm(total=args.num_steps, desc=args.exp_name, disable=rank != 0, dynamic_ncols=True)
    try:
        training_start = time.time()
        submit(eval_request(0))
        for round_index in range(args.num_rounds):
            round_start = time.time()
            # SYNC: hand over the newest weights, generate this round with them, and wait: the learner idles while
            # the generator works, and the generator idles while the learner trains. The data is always on-policy.
            sync_start = time.time()
            synced_version = sync_weights(version, synced_version)
            if version > 0 and eval_due(version, last_eval):
                last_eval, evals_pending = version, evals_pending + 1
                submit(eval_request(version))
            submit(train_request(round_index, version))
            weight_sync_time = time.time() - sync_start
            batch, learner_wait = next_batch()

            # Score every completion of this rank's prompts, pick pairs, and compute reference log-probs once
            train_start = time.time()
            prompts = round_prompts(round_index)
            query_ids, query_mask = left_pad([prompts[i] for i in local], pad_id)
            response_ids, response_mask, has_eos = pad_responses(
                [batch["responses"][c] for c in local_completions], args.response_length, eos_id, pad_id)
            repeated_ids, repeated_mask = query_ids.repeat_interleave(K, 0), query_mask.repeat_interleave(K, 0)
            scores = score_in_chunks(reward_model, repeated_ids, repeated_mask, response_ids, response_mask, has_eos)
            scores = scores.view(-1, K)
            chosen, rejected, valid = select_pairs(scores)
            rows = torch.arange(len(local)) * K
            pairs = torch.cat([rows + chosen, rows + rejected])  # all chosen completions, then all rejected ones
            pair_ids, pair_mask = response_ids[pairs], response_mask[pairs]
            ref_logps, _ = ref_logprobs_in_chunks(query_ids.repeat(2, 1), query_mask.repeat(2, 1), pair_ids, pair_mask,
                                                  args.temperature)
            ref_chosen_logps, ref_rejected_logps = ref_logps.chunk(2)
            # The generator's log-probs of the same pairs: against the learner's they show how off-policy the data is
            # (the hf backend samples with the learner's own weights and reports none)
            if batch["logprobs"] is not None:
                generator_pair_logps = torch.tensor([batch["logprobs"][c] for c in local_completions])[pairs]

            # N mini-batches x T epochs of DPO updates on this round's pairs
            for epoch in range(args.num_epochs):
                for mini_batch in range(args.num_mini_batches):
                    mb = slice(mini_batch * L, (mini_batch + 1) * L)
                    num_valid = max(reduce_sums({"v": valid[mb].sum().item()}, args.world_size)["v"], 1.0)
                    sums = {"loss": 0.0, "chosen_logps": 0.0, "rejected_logps": 0.0, "generator_gap": 0.0}
                    for micro in range(G):
                        idx = torch.arange(mb.start + micro * L // G, mb.start + (micro + 1) * L // G)
                        pair_idx = torch.cat([idx, idx + len(local)])
                        sync_grads = micro == G - 1 or args.world_size == 1
                        if args.fsdp:  # FSDP2's form of DDP's no_sync
                            policy.set_requires_gradient_sync(sync_grads)
                        no_sync = policy.no_sync() if not sync_grads and not args.fsdp else contextlib.nullcontext()
                        with no_sync, autocast:
                            logps, _ = sequence_logprobs(policy, query_ids[idx].repeat(2, 1).to(device),
                                                         query_mask[idx].repeat(2, 1).to(device),
                                                         pair_ids[pair_idx].to(device), pair_mask[pair_idx].to(device),
                                                         args.temperature)
                            chosen_logps, rejected_logps = logps.chunk(2)
                            losses = dpo_loss(chosen_logps, rejected_logps, ref_chosen_logps[idx].to(device),
                                              ref_rejected_logps[idx].to(device), args.beta)
                            mask = valid[idx].to(device).float()
                            # Mean over the mini-batch's valid pairs on all ranks (DDP averages over ranks)
                            ((losses * mask).sum() * args.world_size / num_valid).backward()
                        sums["loss"] += (losses * mask).sum().item()
                        sums["chosen_logps"] += (chosen_logps.detach() * mask).sum().item()
                        sums["rejected_logps"] += (rejected_logps.detach() * mask).sum().item()
                        if batch["logprobs"] is not None:
                            gap = logps.detach().cpu() - generator_pair_logps[pair_idx]
                            sums["generator_gap"] += (gap * mask.cpu().repeat(2)).sum().item()
                    if args.max_grad_norm:
                        torch.nn.utils.clip_grad_norm_(policy.parameters(), args.max_grad_norm)
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad(set_to_none=True)
                    version += 1

                    stats = reduce_sums({
                        **sums, "reward": scores[mb].sum().item(),
                        "chosen_reward": scores[mb].max(1).values.sum().item(),
                        "rejected_reward": scores[mb].min(1).values.sum().item(), "valid": valid[mb].sum().item(),
                        "eos": has_eos.view(-1, K)[mb].sum().item()}, args.world_size)
                    record = {
                        "step": version, "episode": version * args.batch_size, "round": round_index,
                        "generation_version": batch["generation_version"],
                        "staleness": version - 1 - batch["generation_version"],
                        "reward/mean": stats["reward"] / (args.batch_size * K),
                        "reward/chosen": stats["chosen_reward"] / args.batch_size,
                        "reward/rejected": stats["rejected_reward"] / args.batch_size,
                        "loss/dpo": stats["loss"] / num_valid, "logps/chosen": stats["chosen_logps"] / num_valid,
                        "logps/rejected": stats["rejected_logps"] / num_valid,
                        "logps/generator_gap": stats["generator_gap"] / (2 * num_valid),
                        "pairs/valid_fraction": stats["valid"] / args.batch_size,
                        "eos/fraction": stats["eos"] / (args.batch_size * K), "lr": scheduler.get_last_lr()[0],
                    }
                    if batch["logprobs"] is None:
                        del record["logps/generator_gap"]
                    if epoch == args.num_epochs - 1 and mini_batch == args.num_mini_batches - 1:
                        record.update({
                            "time/generation": batch["generation_time"], "time/weight_load": batch["weight_load_time"],
                            "time/weight_sync": weight_sync_time, "time/learner_wait": learner_wait,
                            "time/training": time.time() - train_start, "time/step": time.time() - round_start})
                    record["time/elapsed"] = time.time() - training_start
                    log(record)
                    progress.update(1)
                    progress.set_postfix(reward=f"{record['reward/mean']:.3f}", loss=f"{record['loss/dpo']:.3f}",
                                         staleness=record["staleness"])

        # Final evaluation with the last weights (after any still in flight), then save
        sync_weights(version, synced_version)
        if version != last_eval:
            evals_pending += 1
            submit(eval_request(version))
        while evals_pending:
            evaluate(collect())
        progress.close()
        if args.save_model:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            full_state = get_model_state_dict(unwrapped_policy, options=StateDictOptions(
                full_state_dict=True, cpu_offload=True)) if args.fsdp else None  # a collective under FSDP2
            if rank == 0:
                unwrapped_policy.save_pretrained(os.path.join(args.output_dir, "model"), state_dict=full_state)
                tokenizer.save_pretrained(os.path.join(args.output_dir, "model"))
                print(f"saved the policy to {os.path.join(args.output_dir, 'model')}")
    except GeneratorError as error:
        if args.world_size > 1 and rank == 0:
            share(error, rank, args.world_size)  # let the other ranks stop too
        progress.close()
        print(f"error: {error}", file=sys.stderr, flush=True)
        raise SystemExit(1)
    except KeyboardInterrupt:
        progress.close()
        print("interrupted: shutting down the generator", file=sys.stderr, flush=True)
        raise SystemExit(130)
    finally:
        if generator is not None:
            try:
                requests.put_nowait(None)  # a polite stop, seen if the generator is idle
            except (queue.Full, ValueError, OSError):
                pass
            generator.join(timeout=2)
            if generator.is_alive():
                generator.terminate()
                generator.join(timeout=3)
            if generator.is_alive():
                generator.kill()
                generator.join()
            shutil.rmtree(run_tmp_dir, ignore_errors=True)
        if rank == 0:
            metrics_file.close()
            if args.track:
                wandb.finish()
        if args.world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()
