# Asynchronous Proximal RLOO (Noukhovitch et al. 2024, "Asynchronous RLHF", arXiv 2410.18252).
# vLLM generates the next batch with the newest weights while the learner trains on the batch the previous
# weights produced. Walkthrough and diagram: README.md. Demo on CPU: `python async_rloo.py --model tiny`.
# The same script as async_dpo.py except for the learning rule: `diff async_dpo.py async_rloo.py` shows RLOO.
import contextlib
import ctypes
import gc
import math
import os
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Literal, Optional

import datasets
import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import transformers
from tqdm import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import plumbing
import tiny_world

TLDR_DATASET = "vwxyzjn/summarize_from_feedback_tldr_3_filtered_oai_preprocessing_1706381144"
PRESETS = {  # --model: (SFT policy, proxy reward model, dataset) on the Hugging Face hub
    "pythia-410m": ("mnoukhov/pythia410m-sft-tldr", "mnoukhov/pythia410m-rm-tldr6.9b", TLDR_DATASET),
    "pythia-1b": ("mnoukhov/pythia1b-sft-tldr", "mnoukhov/pythia1b-rm-tldr6.9b", TLDR_DATASET),
    "pythia-2.8b": ("mnoukhov/pythia2.8b-sft-tldr", "mnoukhov/pythia2.8b-rm-tldr6.9b", TLDR_DATASET),
}
# `--model tiny` swaps in defaults that train a locally built toy model on 2 CPU cores in a few minutes.
TINY_DEFAULTS = dict(
    learning_rate=1e-4, response_length=16, max_prompt_length=64, total_episodes=1920, batch_size=32,
    per_device_train_batch_size=16, eval_every=15, num_eval_prompts=128, eval_response_length=16,
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
    """where metrics.jsonl, the generator's log and the saved model go (default: runs/{run_name})"""
    save_model: bool = False
    """save the final policy and tokenizer with save_pretrained to {output_dir}/model"""
    verbose: bool = False
    """show vLLM's own log on the console (by default it goes to {output_dir}/generator.log)"""

    # Models and data
    model: Literal["tiny", "pythia-410m", "pythia-1b", "pythia-2.8b"] = "pythia-2.8b"
    """preset naming the SFT policy, proxy reward model and dataset; `tiny` builds a toy world locally for CPU"""
    sft_model_path: Optional[str] = None
    """SFT policy (hub name or local folder); also the frozen reference model. Overrides the preset"""
    reward_model_path: Optional[str] = None
    """reward model with a 1-label sequence-classification head (hub name or local folder). Overrides the preset"""
    dataset: Optional[str] = None
    """prompts with `query` and `reference_response` columns (hub name, local folder or file). Overrides the preset"""
    gold_reward_model_path: Optional[str] = None
    """gold reward model, used only in evaluation (must share the policy's tokenizer); `tiny` has its own"""
    tiny_dir: str = "~/.cache/async-rlhf/tiny-v3"
    """where `--model tiny` builds (once) and caches its toy models, tokenizer and dataset"""

    # Algorithm specific arguments (paper defaults for TL;DR)
    learning_rate: float = 3e-6
    """learning rate of AdamW, decayed linearly to 0"""
    kl_coef: float = 0.05
    """KL penalty towards the SFT reference: the reward is the score minus kl_coef * (log pi_old(y) - log ref(y))"""
    cliprange: float = 0.2
    """clip range of the sequence-level ratio pi(y) / pi_old(y)"""
    whiten_advantages: bool = False
    """whiten the leave-one-out advantages over the batch (off in the paper's released code)"""
    recompute_old_logprobs: bool = False
    """pi_old from the learner's current weights before the update (the paper's released code), instead of the
    generator's log-probs of what it sampled. It makes the first ratio exactly 1 and hides the staleness"""
    temperature: float = 0.7
    """sampling temperature; the learner divides its logits by it too, so log-probs match the sampler"""
    num_samples: int = 2
    """K completions per prompt; each one's baseline is the mean reward of the other K-1"""
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
    """validation prompts per evaluation during training"""
    num_final_eval_prompts: Optional[int] = None
    """validation prompts in the final evaluation (default: the whole validation split)"""
    eval_temperature: float = 0.01
    """near-greedy sampling for evaluation"""
    eval_response_length: int = 128
    """maximum new tokens per evaluation completion"""

    # Systems
    dtype: Optional[Literal["bfloat16", "float16", "float32"]] = None
    """vLLM's (and reward models') dtype, the learner's autocast dtype (default: bfloat16 on GPU, else float32)"""
    gradient_checkpointing: Optional[bool] = None
    """recompute activations in the backward pass instead of storing them (default: on, but off for tiny)"""
    vllm_gpu_memory_utilization: float = 0.9
    """fraction of GPU 0's memory vLLM may use (lower it when the learner shares that GPU)"""
    generator_cores: int = 1
    """CPU runs only: cores reserved for the generator; the learner gets the rest"""
    fsdp: bool = False
    """under torchrun, shard all models over the learners with FSDP2 instead of replicating the policy with DDP"""

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


def compute_batch_sizes(args: Args, world_size: int) -> None:
    """Fill in the runtime fields of Args, rejecting values that make no sense or do not divide."""
    for name in ("response_length", "max_prompt_length", "total_episodes", "batch_size", "per_device_train_batch_size",
                 "num_mini_batches", "num_epochs", "num_eval_prompts", "eval_response_length", "generator_cores",
                 "temperature", "eval_temperature"):
        if getattr(args, name) <= 0:
            plumbing.fail(f"--{name} must be positive, got {getattr(args, name)}")
    local_batch_size, prompts_per_round = args.batch_size // world_size, args.batch_size * args.num_mini_batches
    for bad, message in [
        (args.num_samples < 2, f"--num_samples must be at least 2 (a leave-one-out baseline needs another "
         f"completion), got {args.num_samples}"),
        (min(args.cliprange, args.kl_coef) < 0, "--cliprange and --kl_coef must not be negative"),
        (args.dtype == "float16", "--dtype float16: the learner would train under float16 autocast without a "
         "gradient scaler, and small gradients would underflow to 0 silently; use bfloat16 (or float32)"),
        (args.eval_every < 0, f"--eval_every must be 0 (off) or positive, got {args.eval_every}"),
        (not 0 < args.vllm_gpu_memory_utilization <= 1, "--vllm_gpu_memory_utilization must be in (0, 1]"),
        (min(args.num_eval_prompts, args.num_final_eval_prompts or world_size) < world_size, "--num_eval_prompts "
         "and --num_final_eval_prompts must give every learner process a prompt"),
        (args.fsdp and world_size == 1, "--fsdp shards over several learner processes: launch with torchrun"),
        (args.batch_size % world_size, f"--batch_size {args.batch_size} must divide over {world_size} processes"),
        (local_batch_size % args.per_device_train_batch_size, f"--per_device_train_batch_size "
         f"{args.per_device_train_batch_size} must divide the per-process batch ({local_batch_size} prompts)"),
        (args.total_episodes < prompts_per_round, f"--total_episodes {args.total_episodes} is smaller than one "
         f"generation round (--batch_size x --num_mini_batches = {prompts_per_round})"),
    ]:
        if bad:
            plumbing.fail(message)
    args.world_size, args.local_batch_size = world_size, local_batch_size
    args.gradient_accumulation_steps = local_batch_size // args.per_device_train_batch_size
    args.num_rounds = args.total_episodes // prompts_per_round
    args.num_steps = args.num_rounds * args.num_mini_batches * args.num_epochs
    if args.gradient_checkpointing is None:
        args.gradient_checkpointing = args.model != "tiny"


# ---------------------------------------------------------------------------------------------------------------
# Data and models
# ---------------------------------------------------------------------------------------------------------------
def tokenize_prompts(tokenizer, texts: list[str], max_length: int) -> list[list[int]]:
    """Token ids per prompt, after BOS where the tokenizer adds one; long prompts keep their end, where the
    instruction ('TL;DR:') sits."""
    bos = plumbing.bos_prefix(tokenizer)
    return [bos + ids[max(len(ids) + len(bos) - max_length, 0):]
            for ids in tokenizer(list(texts), add_special_tokens=False)["input_ids"]]


def truncate_at_eos(responses: list[list[int]], length: int, eos_id: int) -> tuple[list[list[int]], list[bool]]:
    """Cut each completion after its first EOS (and at `length`); report which ones emitted EOS (those that did
    not get --missing_eos_penalty)."""
    cut, has_eos = [], []
    for tokens in responses:
        tokens = list(tokens[:length])
        has_eos.append(eos_id in tokens)
        cut.append(tokens[: tokens.index(eos_id) + 1] if has_eos[-1] else tokens)
    return cut, has_eos


def collate(prompts: list[list[int]], responses: list[list[int]], pad_id: int, device: torch.device):
    """Left-pad the prompts and right-pad the responses, each only to this micro-batch's own longest, so that every
    response starts at the same column. Position ids skip the left padding, so they match unpadded sequences.
    Returns the model inputs and the mask of the response tokens."""
    prompt_width, response_width = max(map(len, prompts)), max(map(len, responses))
    ids = [[pad_id] * (prompt_width - len(p)) + p + r + [pad_id] * (response_width - len(r))
           for p, r in zip(prompts, responses)]
    mask = [[0] * (prompt_width - len(p)) + [1] * (len(p) + len(r)) + [0] * (response_width - len(r))
            for p, r in zip(prompts, responses)]
    input_ids, attention_mask = torch.tensor(ids, device=device), torch.tensor(mask, device=device)
    inputs = dict(input_ids=input_ids, attention_mask=attention_mask,
                  position_ids=(attention_mask.cumsum(1) - 1).clamp(min=0), use_cache=False)
    return inputs, attention_mask[:, prompt_width:]


def sequence_logprobs(model, inputs: dict, response_mask: torch.Tensor, temperature: float):
    """Summed log-probs of each response under `model`, with logits divided by the sampling temperature so they
    match the distribution vLLM sampled from. Returns (sum of log-probs, number of response tokens)."""
    width = response_mask.shape[1]
    # Only the logits that predict response tokens: saves a [batch, prompt_length, vocab] tensor.
    logits = model(**inputs, logits_to_keep=width + 1).logits[:, :-1]
    logprobs = torch.log_softmax(logits.float() / temperature, dim=-1)
    token_logprobs = logprobs.gather(2, inputs["input_ids"][:, -width:, None]).squeeze(-1)
    return (token_logprobs * response_mask).sum(1), response_mask.sum(1)


def get_reward(reward_model, inputs: dict, response_mask: torch.Tensor, has_eos: list[bool],
               missing_eos_penalty: Optional[float]) -> torch.Tensor:
    """Reward-model score at the last non-padding token of prompt + response; completions without EOS get the
    penalty instead (None: no penalty)."""
    hidden = getattr(reward_model, reward_model.base_model_prefix)(**inputs).last_hidden_state
    last_index = inputs["input_ids"].shape[1] - response_mask.shape[1] + response_mask.sum(1) - 1
    rows = torch.arange(len(hidden), device=hidden.device)
    with torch.autocast(hidden.device.type, enabled=False):  # the float32 head (see load_reward_model)
        scores = reward_model.score(hidden[rows, last_index].float()).squeeze(-1)
    if missing_eos_penalty is None:
        return scores
    return torch.where(torch.tensor(has_eos, device=scores.device), scores, missing_eos_penalty)


@torch.no_grad()
def score_in_chunks(model, prompts: list, responses: list, has_eos: list, missing_eos_penalty: Optional[float],
                    chunk: int, pad_id: int, device: torch.device) -> torch.Tensor:
    return torch.cat([get_reward(model, *collate(prompts[i: i + chunk], responses[i: i + chunk], pad_id, device),
                                 has_eos[i: i + chunk], missing_eos_penalty).cpu()
                      for i in range(0, len(prompts), chunk)])


@torch.no_grad()
def logprobs_in_chunks(model, prompts: list, responses: list, temperature: float, chunk: int, pad_id: int,
                       device: torch.device, autocast) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed log-probs of each response, under the update's autocast: on GPU, the reference's log-probs (and
    pi_old's) must be computed as pi's are, or their log-ratio is not 0 at equal weights."""
    with autocast:
        logps, counts = zip(*[sequence_logprobs(model, *collate(prompts[i: i + chunk], responses[i: i + chunk],
                                                                pad_id, device), temperature)
                              for i in range(0, len(prompts), chunk)])
    return torch.cat(logps).cpu(), torch.cat(counts).cpu()


def kl_penalised_rewards(scores: torch.Tensor, logps: torch.Tensor, ref_logps: torch.Tensor,
                         kl_coef: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence rewards: the score minus kl_coef times the summed per-token log-ratio log pi_old(y) - log ref(y) of
    the policy that sampled y. Returns the rewards and that log-ratio (the KL estimate)."""
    kl = logps - ref_logps
    return scores - kl_coef * kl, kl


def rloo_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """rewards [prompts, K] -> each completion's reward minus the mean reward of the other K-1 of its prompt."""
    K = rewards.shape[1]
    return rewards - (rewards.sum(1, keepdim=True) - rewards) / (K - 1)


def rloo_loss(logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor,
              cliprange: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-completion clipped loss -min(r A, clip(r, 1 - eps, 1 + eps) A) with the sequence-level ratio
    r = pi(y) / pi_old(y). Returns the losses, the ratios and where the clip was active."""
    ratio = torch.exp(logps - old_logps)
    losses, clipped_losses = -advantages * ratio, -advantages * ratio.clamp(1 - cliprange, 1 + cliprange)
    return torch.max(losses, clipped_losses), ratio, clipped_losses > losses


def rloo_update(learner, optimizer, scheduler, micro_batches: list[dict], num_completions: float, args: Args,
                pad_id: int, device: torch.device, autocast) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                      torch.Tensor]:
    """One optimizer step on one mini-batch, accumulating gradients over its micro-batches. The loss is the mean over
    the completions of all ranks (DDP and FSDP average gradients over ranks, hence the world_size factor).
    Returns the per-completion losses, policy log-probs, ratios and clip flags (CPU, detached)."""
    outputs = []
    for i, micro in enumerate(micro_batches):
        sync_gradients = i == len(micro_batches) - 1
        # FSDP2 reduce-scatters every micro-batch: skipping it would hold full, unsharded float32 gradients
        skip_sync = args.world_size > 1 and not args.fsdp and not sync_gradients  # DDP: all-reduce on the last
        inputs, response_mask = collate(micro["prompts"], micro["responses"], pad_id, device)
        with learner.no_sync() if skip_sync else contextlib.nullcontext(), autocast:
            logps = sequence_logprobs(learner, inputs, response_mask, args.temperature)[0]
            losses, ratio, clipped = rloo_loss(logps, micro["old_logps"].to(device), micro["advantages"].to(device),
                                               args.cliprange)
            (losses.sum() * args.world_size / num_completions).backward()
        outputs.append(torch.stack([losses, logps, ratio, clipped.float()]).detach().cpu())
    if args.max_grad_norm:
        torch.nn.utils.clip_grad_norm_(learner.parameters(), args.max_grad_norm)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return torch.cat(outputs, dim=1).unbind()


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
    with the generator via CUDA IPC when it is passed to the spawned process."""
    _, offset, shape = table[-1]
    buffer = torch.empty(offset + math.prod(shape), dtype=dtype, device=device)
    return buffer.share_memory_() if device.type == "cpu" else buffer


@torch.no_grad()
def write_weight_snapshot(model: torch.nn.Module, buffer: Optional[torch.Tensor], table: list) -> None:
    """Copy the current parameters into the buffer: the generator sees a snapshot, never tensors the optimizer is
    about to change. Safe to call only when the generator is not reading (see the schedule in the main loop).
    Every rank calls it (under FSDP2, gathering a sharded parameter is a collective); only rank 0 has a buffer."""
    from torch.distributed.tensor import DTensor

    for (name, offset, shape), param in zip(table, model.parameters()):
        full = param.full_tensor() if isinstance(param, DTensor) else param
        if buffer is not None:
            buffer[offset: offset + full.numel()].copy_(full.detach().reshape(-1))
    if buffer is not None and buffer.is_cuda:
        # copy_ only queues kernels on our stream; the generator reads the memory from another process, so the
        # copies must be finished before the request that makes it read is sent.
        torch.cuda.current_stream(buffer.device).synchronize()


def weights_from_buffer(buffer: torch.Tensor, table: list) -> list:
    return [(name, buffer[offset: offset + math.prod(shape)].view(shape)) for name, offset, shape in table]


# ---------------------------------------------------------------------------------------------------------------
# Generator process: owns the vLLM engine
# ---------------------------------------------------------------------------------------------------------------
# The paper ran vLLM in a thread of the learner and lost ~15-20% of each step to the GIL. A spawned process
# shares no GIL, and it keeps vLLM's side effects out of the learner: vLLM patches transformers' GPTNeoX classes
# and initialises torch.distributed in whatever process builds the engine.
def generator_main(engine_kwargs: dict, weight_buffer: torch.Tensor, weight_layout: list, requests, results,
                   cores: Optional[list], run_tmp_dir: str, log_path: Optional[str]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the learner, which shuts us down
    with contextlib.suppress(OSError):  # PR_SET_PDEATHSIG: die with the learner, whatever happens
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)
    try:
        if log_path:  # vLLM's start-up warnings and messages go to a file, not the user's console (--verbose)
            log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
            for stream in (1, 2):
                os.dup2(log_fd, stream)
        for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                    "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID"):
            os.environ.pop(var, None)  # torchrun's variables describe the learners, not this engine
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # build the engine inside this process
        os.environ["TMPDIR"] = tempfile.tempdir = run_tmp_dir  # vLLM's rendezvous files; the learner removes them
        if cores:  # before vLLM starts: its CPU worker makes later set_num_threads calls no-ops
            os.sched_setaffinity(0, cores)
            torch.set_num_threads(len(cores))
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        llm = LLM(**engine_kwargs)
        results.put(dict(kind="ready"))
        loaded_version = 0  # the engine starts from the SFT checkpoint, which is the learner's version 0
        while (request := requests.get()) is not None:
            load_start = time.time()
            if request["weights_version"] != loaded_version:
                # In place (vllm/model_executor/model_loader/reload/inplace.py): captured CUDA graphs stay valid
                llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights_from_buffer(
                    weight_buffer, weight_layout)})
                llm.reset_prefix_cache()  # without this, cached prompt states from the old weights are reused
                if torch.cuda.is_available():  # done reading the buffer before the learner may rewrite it
                    torch.cuda.synchronize()
                loaded_version = request["weights_version"]
            sampling = SamplingParams(n=request["n"], temperature=request["temperature"],
                                      max_tokens=request["max_tokens"], logprobs=0, detokenize=False)
            generation_start = time.time()
            outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in request["prompts"]], sampling,
                                   use_tqdm=False)
            # time.time() is one clock for both processes: the learner places these on its timeline
            results.put(dict({k: v for k, v in request.items() if k != "prompts"}, generation_version=loaded_version,
                             responses=[list(c.token_ids) for out in outputs for c in out.outputs],
                             logprobs=[c.cumulative_logprob for out in outputs for c in out.outputs],
                             weight_load_start=load_start, generation_start=generation_start,
                             generation_end=time.time()))
    except BaseException:
        results.put(dict(kind="error", traceback=traceback.format_exc()))
        raise SystemExit(1)


def start_generator(engine_kwargs: dict, weight_buffer: torch.Tensor, weight_layout: list, cores: Optional[list],
                    log_path: Optional[str]):
    """Spawn the generator with a one-slot queue each way. Returns (process, requests, results, its temp folder)."""
    run_tmp_dir = tempfile.mkdtemp(prefix="async-rlhf-")
    plumbing.quiet_resource_tracker(log_path)
    ctx = mp.get_context("spawn")
    requests, results = ctx.Queue(maxsize=1), ctx.Queue(maxsize=1)
    generator = ctx.Process(target=generator_main, args=(engine_kwargs, weight_buffer, weight_layout, requests,
                                                         results, cores, run_tmp_dir, log_path))
    generator.start()
    return generator, requests, results, run_tmp_dir


def train_request(round_index: int, version: int, prompts: list, args: Args) -> dict:
    return dict(kind="train", round=round_index, weights_version=version, prompts=prompts, n=args.num_samples,
                temperature=args.temperature, max_tokens=args.response_length)


def eval_request(version: int, prompts: list, args: Args, final: bool = False) -> dict:
    return dict(kind="eval", final=final, weights_version=version, prompts=prompts, n=1,
                temperature=args.eval_temperature, max_tokens=args.eval_response_length, requested=time.time())


# ---------------------------------------------------------------------------------------------------------------
# Evaluation and logging
# ---------------------------------------------------------------------------------------------------------------
def evaluate(responses: list, prompts: list, reference_scores: dict, reward_models: dict, ref_policy, args: Args,
             pad_id: int, eos_id: int, device: torch.device, autocast) -> dict:
    """Sums over this rank's evaluation prompts: wins against the reference summary and the mean score under each
    reward model, and the SFT model's log-probs of the summaries (the perplexities)."""
    responses, has_eos = truncate_at_eos(responses, args.eval_response_length, eos_id)
    chunk = args.per_device_train_batch_size * args.num_samples
    sums = {"count": len(responses), "eos": sum(has_eos)}
    for name, model in reward_models.items():
        penalty = args.missing_eos_penalty if name == "proxy" else None  # gold judges the summary as it is
        scores = score_in_chunks(model, prompts, responses, has_eos, penalty, chunk, pad_id, device)
        sums[f"{name}_wins"] = (scores > reference_scores[name][: len(scores)]).sum().item()
        sums[f"{name}_reward"] = scores.sum().item()
    logps, counts = logprobs_in_chunks(ref_policy, prompts, responses, 1.0, chunk, pad_id, device, autocast)
    prompt_lengths = torch.tensor([len(p) for p in prompts])
    # The paper's "KL" axis: per sample, exp(response NLL / (prompt + response tokens)), then the mean
    sums.update(logp=logps.sum().item(), tokens=counts.sum().item(),
                paper_perplexity=torch.exp(-logps / (prompt_lengths + counts)).sum().item())
    return sums


def eval_record(sums: dict, step: int, args: Args) -> dict:
    n = int(sums["count"])
    record = {"step": step, "episode": plumbing.episodes_at(step, args), "eval/num_prompts": n,
              "eval/perplexity": math.exp(-sums["logp"] / max(sums["tokens"], 1)),
              "eval/perplexity_paper": sums["paper_perplexity"] / n, "eval/eos_fraction": sums["eos"] / n}
    for name in ("proxy", "gold"):
        if f"{name}_wins" in sums:
            win_rate = sums[f"{name}_wins"] / n
            record.update({f"eval/{name}_win_rate": win_rate, f"eval/{name}_reward": sums[f"{name}_reward"] / n,
                           f"eval/{name}_win_rate_stderr": math.sqrt(win_rate * (1 - win_rate) / n)})
    return record


if __name__ == "__main__":
    args = plumbing.parse_args(Args, TINY_DEFAULTS)
    rank, local_rank = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    compute_batch_sizes(args, int(os.environ.get("WORLD_SIZE", 1)))
    transformers.utils.logging.disable_progress_bar()
    datasets.disable_progress_bars()
    # The tiny world has a gold reward model for evaluation (the paper's 6.9B one is optional on GPUs: 13 GB more).
    # A run that names its own models and data does not need the tiny world built.
    if args.model == "tiny" and None in (args.sft_model_path, args.reward_model_path, args.dataset):
        sft, reward, data, gold = tiny_world.build_tldr(args.tiny_dir)
    else:
        sft, reward, data, gold = *PRESETS.get(args.model, (None, None, None)), None
    args.sft_model_path, args.reward_model_path = args.sft_model_path or sft, args.reward_model_path or reward
    args.dataset, args.gold_reward_model_path = args.dataset or data, args.gold_reward_model_path or gold
    for flag in ("sft_model_path", "reward_model_path", "gold_reward_model_path"):
        if getattr(args, flag):
            plumbing.check_model_path(flag, getattr(args, flag))
    train_data, eval_data = plumbing.load_prompt_splits(args.dataset, args.seed)
    args.run_name = f"{args.model}__{args.exp_name}__{args.seed}__{int(time.time())}"
    args.output_dir = args.output_dir or os.path.join("runs", args.run_name)

    # Devices: vLLM owns GPU 0, the learners the others; on CPU, generator and learner get cores of their own
    device, generator_cores = plumbing.learner_device(local_rank, args.world_size, args.generator_cores)
    use_cuda = device.type == "cuda"
    shares_gpu0 = use_cuda and device.index == 0
    dtype_name = args.dtype or ("bfloat16" if use_cuda else "float32")
    dtype = getattr(torch, dtype_name)
    if args.world_size > 1:
        plumbing.init_learner_group(use_cuda)
    plumbing.seed_everything(args.seed)

    # Logging (rank 0 only): metrics.jsonl, and wandb with --track
    metrics_file = plumbing.open_metrics(args, rank)
    if rank == 0:
        print(f"run {args.run_name}: {args.num_steps} optimizer steps in {args.num_rounds} rounds of "
              f"{args.batch_size * args.num_mini_batches} prompts x {args.num_samples} samples; metrics in "
              f"{args.output_dir}/metrics.jsonl", flush=True)

    # Generator process (rank 0), started before the learner loads its models: when both share GPU 0, vLLM must
    # measure the free memory first. The weight buffer's layout comes from the config alone (no weights loaded).
    config = AutoConfig.from_pretrained(args.sft_model_path)
    with torch.device("meta"):
        weight_layout = weight_table(AutoModelForCausalLM.from_config(config))
    generator, requests, results, run_tmp_dir, weight_buffer = None, None, None, None, None
    if rank == 0:
        max_model_len = args.max_prompt_length + max(args.response_length, args.eval_response_length)
        # processed_logprobs: log-probs of the distribution actually sampled, log_softmax(logits / temperature).
        # enforce_eager on CPU only: on GPU, CUDA graphs make generation several times faster.
        engine_kwargs = dict(model=args.sft_model_path, dtype=dtype_name, seed=args.seed, enforce_eager=not use_cuda,
                             max_model_len=max_model_len, gpu_memory_utilization=args.vllm_gpu_memory_utilization,
                             logprobs_mode="processed_logprobs")
        if not use_cuda:  # size the CPU KV cache for one round of sequences; vLLM's default takes 18 GiB
            bytes_per_token = 2 * config.num_hidden_layers * config.hidden_size * dtype.itemsize
            sequences = min(args.batch_size * args.num_mini_batches * args.num_samples, 256)
            engine_kwargs["kv_cache_memory_bytes"] = min(max(bytes_per_token * max_model_len * sequences, 2**25),
                                                         2**33)
        weight_buffer = make_weight_buffer(weight_layout, dtype, device)
        generator, requests, results, run_tmp_dir = start_generator(
            engine_kwargs, weight_buffer, weight_layout, None if use_cuda else generator_cores,
            None if args.verbose else os.path.join(args.output_dir, "generator.log"))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))

    def submit(request: dict) -> None:
        if rank == 0:
            plumbing.send(requests, request, generator)

    def collect() -> dict:
        """The generator's next result, on every rank (rank 0 receives it and broadcasts it)."""
        return plumbing.share(plumbing.receive(results, generator) if rank == 0 else None, rank, args.world_size)

    progress = tqdm(total=args.num_steps, desc=args.exp_name, disable=rank != 0, dynamic_ncols=True)
    try:
        if shares_gpu0:
            collect()  # the engine's "ready": it has measured GPU 0's free memory and taken its share

        # Models: the policy trains in float32 (under autocast on GPU), and the reference runs exactly as it does
        # (float32 weights, the same autocast), so that log pi - log pi_ref is 0 at step 0 on GPU as on CPU. The
        # reward models are loaded in `dtype`.
        tokenizer = AutoTokenizer.from_pretrained(args.sft_model_path)
        if tokenizer.eos_token_id is None:
            plumbing.fail(f"--sft_model_path {args.sft_model_path}: the tokenizer has no EOS token")
        eos_id = tokenizer.eos_token_id
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id  # masks say what is padding
        policy = AutoModelForCausalLM.from_pretrained(args.sft_model_path, dtype=torch.float32).to(device)
        policy = plumbing.prepare_policy(policy, args.gradient_checkpointing)
        ref_policy = AutoModelForCausalLM.from_pretrained(args.sft_model_path, dtype=torch.float32).to(device)
        ref_policy.eval().requires_grad_(False)
        reward_models = {"proxy": plumbing.load_reward_model("reward_model_path", args.reward_model_path, dtype,
                                                             device)}
        if args.gold_reward_model_path:
            reward_models["gold"] = plumbing.load_reward_model("gold_reward_model_path", args.gold_reward_model_path,
                                                               dtype, device)
        learner = policy  # what trains: the policy itself (FSDP2 shards it in place) or its DDP wrapper
        if args.fsdp:  # shard every transformer block, then each top-level piece (embeddings, heads) as its own
            from torch.distributed.fsdp import fully_shard  # unit, so that get_reward may call the score head directly

            for model in (policy, ref_policy, *reward_models.values()):
                for module in model.modules():
                    if type(module).__name__ in (model._no_split_modules or []):
                        fully_shard(module)
                for child in model.children():
                    fully_shard(child)
                fully_shard(model)
        elif args.world_size > 1:
            learner = torch.nn.parallel.DistributedDataParallel(policy, device_ids=[device] if use_cuda else None,
                                                                gradient_as_bucket_view=True)
        optimizer = torch.optim.AdamW(learner.parameters(), lr=args.learning_rate, fused=use_cuda)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 - step / args.num_steps)
        autocast = torch.autocast(device.type, dtype=dtype, enabled=use_cuda and dtype != torch.float32)

        # Prompts: a fresh shuffle of the training split each pass. Evaluation prompts are sharded over the ranks
        # by interleaving, so that each rank's share of the first num_eval_prompts is a prefix of its final share.
        train_prompts = tokenize_prompts(tokenizer, train_data["query"], args.max_prompt_length)
        prompts_per_round, K = args.batch_size * args.num_mini_batches, args.num_samples
        passes = -(-args.num_rounds * prompts_per_round // len(train_prompts))
        prompt_order = np.concatenate([np.random.permutation(len(train_prompts)) for _ in range(passes)])
        rounds = prompt_order[: args.num_rounds * prompts_per_round].reshape(args.num_rounds, prompts_per_round)
        L, M = args.local_batch_size, args.per_device_train_batch_size
        local = [m * args.batch_size + rank * L + j for m in range(args.num_mini_batches) for j in range(L)]  # mine
        eval_data = eval_data.select(range(min(args.num_final_eval_prompts or len(eval_data), len(eval_data))))
        num_eval = min(args.num_eval_prompts, len(eval_data))  # the ranks' shares may differ by one: sums add up
        eval_prompts = tokenize_prompts(tokenizer, eval_data["query"], args.max_prompt_length)
        my_eval_prompts = eval_prompts[rank:: args.world_size]
        # The human reference summaries' scores never change: compute them once (gold: without the EOS penalty)
        references, references_eos = truncate_at_eos(tokenizer(
            list(eval_data["reference_response"][rank:: args.world_size]), add_special_tokens=False)["input_ids"],
            args.eval_response_length, eos_id)
        reference_scores = {name: score_in_chunks(model, my_eval_prompts, references, references_eos,
                                                  args.missing_eos_penalty if name == "proxy" else None,
                                                  args.per_device_train_batch_size * K, pad_id, device)
                            for name, model in reward_models.items()}
        if not shares_gpu0:
            collect()  # the engine's "ready": it was built while we loaded our models
        training_start = None

        evaluated_versions = []  # the weights' versions evaluated so far

        def run_evaluation(message: dict) -> None:
            """Score an evaluation's summaries on every rank, then log them (closes over the models and data)."""
            evaluated_versions.append(message["generation_version"])
            start = time.time()
            responses = message["responses"][rank:: args.world_size]
            sums = evaluate(responses, my_eval_prompts[: len(responses)], reference_scores, reward_models,
                            ref_policy, args, pad_id, eos_id, device, autocast)
            record = eval_record(plumbing.reduce_sums(sums, args.world_size), message["generation_version"], args)
            record["time/eval"] = time.time() - start
            record["time/elapsed"] = time.time() - training_start if training_start else 0.0
            if training_start:
                record.update(plumbing.timeline(training_start, evaluation=(start, time.time()), eval_queued=(
                    message["requested"], message["weight_load_start"]), eval_generation=(
                    message["generation_start"], message["generation_end"])))
            if rank == 0:
                record["eval/samples"] = [dict(prompt=tokenizer.decode(my_eval_prompts[i])[-200:],
                                               response=tokenizer.decode(truncate_at_eos(
                                                   [responses[i]], args.eval_response_length, eos_id)[0][0]))
                                          for i in range(min(3, len(responses)))]
                tqdm.write(f"eval @ step {record['step']} ({record['eval/num_prompts']} prompts): " + ", ".join(
                    f"{name} win rate {record[f'eval/{name}_win_rate']:.3f} ± "
                    f"{record[f'eval/{name}_win_rate_stderr']:.3f}" for name in reward_models) +
                    f", perplexity {record['eval/perplexity']:.3f} (paper's: {record['eval/perplexity_paper']:.3f})")
                for sample in record["eval/samples"]:
                    tqdm.write(f"  ...{sample['prompt'][-60:]!r} -> {sample['response']!r}")
            plumbing.log(record, metrics_file, args.track)

        def next_batch() -> tuple[dict, float]:
            """Wait for the next training batch, scoring any evaluation that arrives first. Returns the batch and
            the time spent waiting (evaluation excluded)."""
            waited = 0.0
            while True:
                start = time.time()
                message = collect()
                waited += time.time() - start
                if message["kind"] == "train":
                    return message, waited
                run_evaluation(message)

        # Evaluate the SFT policy, then start the clock
        submit(eval_request(0, eval_prompts[:num_eval], args))
        run_evaluation(collect())
        training_start = time.time()

        # Training loop. version = optimizer steps taken = the version of the policy's weights
        version = synced_version = last_eval = 0  # the generator starts with version 0, the SFT weights
        submit(train_request(0, version, [train_prompts[i] for i in rounds[0]], args))
        for round_index in range(args.num_rounds):
            round_start = time.time()
            wait_start = time.time()
            batch, learner_wait = next_batch()
            wait_end = time.time()
            if batch["round"] != round_index:
                raise RuntimeError(f"expected the batch of round {round_index}, got round {batch['round']}")
            # ASYNC: request the next round with the newest weights now, so it is generated while we train on this
            # one. The buffer is free to rewrite: the generator loaded the previous weights before producing `batch`.
            sync_start = time.time()
            if version != synced_version:
                write_weight_snapshot(policy, weight_buffer, weight_layout)
                synced_version = version
            if round_index + 1 < args.num_rounds:
                submit(train_request(round_index + 1, version, [train_prompts[i] for i in rounds[round_index + 1]],
                                     args))
            if args.eval_every and version // args.eval_every > last_eval // args.eval_every:
                last_eval = version  # queued behind the training batch, which is never generated after it
                submit(eval_request(version, eval_prompts[:num_eval], args))
            sync_end = time.time()

            # ALGO: score every completion of this rank's prompts; a prompt's K completions are each other's baseline
            train_start = time.time()
            prompts = [train_prompts[rounds[round_index][i]] for i in local for _ in range(K)]
            completions = [i * K + k for i in local for k in range(K)]
            responses, has_eos = truncate_at_eos([batch["responses"][c] for c in completions], args.response_length,
                                                 eos_id)
            scores = score_in_chunks(reward_models["proxy"], prompts, responses, has_eos, args.missing_eos_penalty,
                                     M * K, pad_id, device)
            ref_logps, _ = logprobs_in_chunks(ref_policy, prompts, responses, args.temperature, M * K, pad_id, device,
                                              autocast)
            # pi_old is the policy that sampled the batch: vLLM's log-probs of what it sampled, one step behind the
            # learner. The paper's code recomputed them with the learner (--recompute_old_logprobs), hiding that.
            generator_logps = torch.tensor([batch["logprobs"][c] for c in completions])
            old_logps = generator_logps
            if args.recompute_old_logprobs:
                old_logps, _ = logprobs_in_chunks(policy, prompts, responses, args.temperature, M * K, pad_id, device,
                                                  autocast)  # pi_old in the update's precision
            rewards, kl = kl_penalised_rewards(scores, old_logps, ref_logps, args.kl_coef)
            advantages = rloo_advantages(rewards.view(-1, K)).view(-1)
            stats = plumbing.reduce_sums({"n": len(advantages), "sum": advantages.sum().item(),
                                 "squares": (advantages**2).sum().item()}, args.world_size)  # over all ranks
            advantage_mean = stats["sum"] / stats["n"]  # 0 by construction; whitening only rescales
            advantage_std = math.sqrt(max(stats["squares"] / stats["n"] - advantage_mean**2, 0.0))
            if args.whiten_advantages:
                advantages = (advantages - advantage_mean) / (advantage_std + 1e-8)
            episodes = dict(prompts=prompts, responses=responses, old_logps=old_logps, advantages=advantages)

            # ALGO: N mini-batches x T epochs of clipped RLOO updates on this round's completions
            for epoch in range(args.num_epochs):
                for mini_batch in range(args.num_mini_batches):
                    mb = slice(mini_batch * L * K, (mini_batch + 1) * L * K)
                    micro_batches = [{k: v[s: s + M * K] for k, v in episodes.items()}
                                     for s in range(mb.start, mb.stop, M * K)]
                    losses, logps, ratio, clipped = rloo_update(learner, optimizer, scheduler, micro_batches,
                                                                args.batch_size * K, args, pad_id, device, autocast)
                    version += 1

                    # Sums over this rank's share, reduced over ranks, then averaged per completion
                    sums = plumbing.reduce_sums({
                        "loss/policy": losses.sum().item(), "policy/clipfrac": clipped.sum().item(),
                        "policy/ratio_mean": ratio.sum().item(),
                        "policy/approx_kl": (0.5 * (logps - old_logps[mb]) ** 2).sum().item(),
                        "logps/generator_gap": (logps - generator_logps[mb]).sum().item(),
                        "logps/generator_gap_sq": ((logps - generator_logps[mb]) ** 2).sum().item(),
                        "objective/kl": kl[mb].sum().item(),
                        "objective/non_score_reward": -args.kl_coef * kl[mb].sum().item(),
                        "objective/rlhf_reward": rewards[mb].sum().item(), "reward/mean": scores[mb].sum().item(),
                        "eos/fraction": sum(has_eos[mb])}, args.world_size)
                    record = {"step": version, "episode": plumbing.episodes_at(version, args), "round": round_index,
                              "generation_version": batch["generation_version"],
                              "staleness": version - 1 - batch["generation_version"], "lr": scheduler.get_last_lr()[0],
                              **{k: v / (args.batch_size * K) for k, v in sums.items()},
                              "policy/ratio_max": plumbing.reduce_max(ratio.max().item(), args.world_size),
                              "advantage/std": advantage_std}
                    record["logps/generator_gap_std"] = math.sqrt(max(record.pop("logps/generator_gap_sq")
                                                                      - record["logps/generator_gap"] ** 2, 0.0))
                    if epoch == args.num_epochs - 1 and mini_batch == args.num_mini_batches - 1:  # the round's times
                        spans = dict(weight_load=(batch["weight_load_start"], batch["generation_start"]),
                                     generation=(batch["generation_start"], batch["generation_end"]),
                                     learner_wait=(wait_start, wait_end), weight_sync=(sync_start, sync_end),
                                     training=(train_start, time.time()))
                        record.update({f"time/{phase}": end - start for phase, (start, end) in spans.items()})
                        record.update(plumbing.timeline(training_start, **spans))
                        # the waiting time, evaluations scored meanwhile excluded; the whole round
                        record.update({"time/learner_wait": learner_wait, "time/step": time.time() - round_start})
                    record["time/elapsed"] = time.time() - training_start
                    plumbing.log(record, metrics_file, args.track)
                    progress.update(1)
                    progress.set_postfix(reward=f"{record['reward/mean']:.3f}", kl=f"{record['objective/kl']:.3f}",
                                         staleness=record["staleness"])

        # Final evaluation (the whole validation split by default) with the last weights, after any still in flight
        # An evaluation requested in the last round may still be loading its weights from the buffer: score it
        # before the buffer is rewritten, or it could run on a mix of two versions.
        while evaluated_versions[-1] != last_eval:
            run_evaluation(collect())
        write_weight_snapshot(policy, weight_buffer, weight_layout)
        submit(eval_request(version, eval_prompts, args, final=True))
        run_evaluation(collect())
        progress.close()
        if args.save_model:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            full_state = get_model_state_dict(policy, options=StateDictOptions(
                full_state_dict=True, cpu_offload=True)) if args.fsdp else None  # a collective under FSDP2
            if rank == 0:
                policy.save_pretrained(os.path.join(args.output_dir, "model"), state_dict=full_state)
                tokenizer.save_pretrained(os.path.join(args.output_dir, "model"))
                print(f"saved the policy to {os.path.join(args.output_dir, 'model')}")
    except plumbing.GeneratorError as error:
        if args.world_size > 1 and rank == 0:
            plumbing.share(error, rank, args.world_size)  # let the other ranks stop too
        progress.close()
        hint = "\n(the learner shares GPU 0 with vLLM: lower --vllm_gpu_memory_utilization)" if shares_gpu0 else ""
        log_hint = f"\nvLLM's log: {args.output_dir}/generator.log" if rank == 0 and not args.verbose else ""
        print(f"error: {error}{hint}{log_hint}", file=sys.stderr, flush=True)
        raise SystemExit(1)
    except KeyboardInterrupt:
        progress.close()
        print("interrupted: shutting down the generator", file=sys.stderr, flush=True)
        raise SystemExit(130)
    finally:
        if generator is not None:
            plumbing.stop_generator(generator, requests, results, run_tmp_dir)
        plumbing.close_metrics(metrics_file, args.track)
        if args.world_size > 1 and dist.is_initialized():
            # DDP's and FSDP's state holds the process group: free them first, so that the group is torn down while
            # all it uses is alive (else a gloo thread can abort the process at exit, now and then)
            policy = learner = ref_policy = reward_models = optimizer = scheduler = None
            gc.collect()
            dist.destroy_process_group()
