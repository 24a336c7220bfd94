"""Checks of the learner's GPU code paths that need no vLLM and no downloads, built from async_dpo.py's own functions.

  (a) one real learner step (reward scoring, reference log-probs, a DPO update with gradient checkpointing, fused
      AdamW, the weight snapshot) with Pythia's architecture and random weights, at the preset's micro-batch and
      sequence lengths, printing peak GPU memory beside the README's estimate; then what --resume_from allocates
      before it loads a checkpoint (AdamW's moments, on no gradient set of their own);
  (b) the learner ranks' collectives under `torchrun --nproc_per_node 2`, on the process group the scripts create:
      the generator's "ready" taken by every rank at the same point (before loading the models when rank 0 shares
      GPU 0 with vLLM, as on a one-GPU machine), reduce_sums and share over gloo, and DDP's gradient all-reduce over
      NCCL when there are two GPUs;
  (c) the weight hand-off to a spawned reader process through the scripts' shared buffer (CUDA IPC on a GPU),
      checking that the reader sees each new version whole, never a mix of two; then the same through
      fully_async_grpo.py's k + 1 weight slots;
  (e) loading under --fsdp (on the collectives' ranks): the models go to the GPU shard by shard as they load, and
      the device's peak while they do is printed beside the shards;
  (d) precision parity at step 0 (equal weights): DPO's first loss against ln 2, the reference's log-probs against
      the policy's, and PPO's and RLOO's first ratios with pi_old recomputed and with pi_old from a bfloat16 sampler
      (steps at lr 0 with plain SGD, which holds no state; each algorithm's peak GPU memory printed);
  (f) real generators reloading versions (in flight, between rounds, a LoRA adapter); (g) seeded sampling's cost;
  (h) the in-flight reload of (f) with two engines under one admission record, both loading, each on its own GPU
      (engine 1 on GPU 1 by vLLM's device_ids, reading the slots on GPU 0; it needs 3 GPUs, two engines and a
      learner's: with fewer it is listed as skipped);
  (i) the LoRA preset's learner (async_dpo.py --model llama-3.1-8b-no-robots-lora: Llama 3.1 8B's architecture with
      random weights, a rank-64 adapter, the adapter off as the reference, its micro-batch of 2 prompts of 512 + 1024
      tokens): one step, its peak beside docs/gpu.md's row.

    python benchmarks/gpu_check.py                       # every check: vLLM's GPU build, a few minutes on one GPU
    python benchmarks/gpu_check.py --learner_only        # torch, transformers and peft only: (a) (b) (c) (d) (e) (i)
    python benchmarks/gpu_check.py --model pythia-410m   # smaller
    python benchmarks/gpu_check.py --estimate_only       # print the README's memory table and stop

Without vLLM installed it runs the learner's checks only (--learner_only), saying so. On a machine without a GPU it
runs the same code on the CPU with small models (what CI runs, so that neither mode can rot); a machine that has a
GPU torch cannot use is refused, so that no check passes on the CPU by mistake.
"""
import gc
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Literal

import torch
import torch.multiprocessing as mp
import tyro

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from types import SimpleNamespace  # noqa: E402

import async_dpo  # noqa: E402
import tiny_world  # noqa: E402
from plumbing import checkpoint, core, lora, transport  # noqa: E402
from plumbing.generator_io import Generator, GeneratorError  # noqa: E402

GIB = 2**30
PYTHIA = {  # hidden size, layers, heads (from the EleutherAI Pythia configs; vocabulary 50304, intermediate 4x hidden)
    "pythia-410m": (1024, 24, 16), "pythia-1b": (2048, 16, 8), "pythia-2.8b": (2560, 32, 32),
    "pythia-6.9b": (4096, 32, 32), "cpu-small": (128, 2, 4),
}
LORA_PRESET = dict(rank=64, micro_batch=2, prompt_length=512, response_length=1024)  # (async_dpo.py's LoRA preset)


@dataclass
class Args:
    model: Literal["pythia-410m", "pythia-1b", "pythia-2.8b", "cpu-small"] = "pythia-2.8b"
    """architecture to build with random weights (on a machine without a GPU, cpu-small is used instead)"""
    per_device_train_batch_size: int = async_dpo.Args.per_device_train_batch_size
    """prompts per micro-batch (each gives a chosen and a rejected sequence)"""
    prompt_length: int = async_dpo.Args.max_prompt_length
    """prompt tokens per sequence"""
    response_length: int = async_dpo.Args.response_length
    """response tokens per sequence"""
    estimate_only: bool = False
    """print the memory estimate table for the presets and exit"""
    learner_only: bool = False
    """the checks that need no vLLM: (a) (b) (c) (d) (e) (i) (the default where vLLM is not installed)"""
    only: tuple[str, ...] = ()
    """run only these checks, by letter (`--only f g`; default: all)"""
    collectives_worker: bool = False
    """internal: run as one torchrun rank of check (b)"""


def model_config(name: str):
    from transformers import GPTNeoXConfig, LlamaConfig

    if name == "llama-3.1-8b":  # meta-llama/Llama-3.1-8B's config.json (the No Robots preset's architecture)
        return LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                           num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False, num_labels=1)
    if name == "cpu-small-llama":  # (i) on a CPU: the same architecture, toy-sized
        return LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, num_labels=1)
    if name == "rho-1b":  # TinyLlama-1.1B's architecture, which microsoft/rho-math-1b (the GSM8k SFT's base) has
        return LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                           num_attention_heads=32, num_key_value_heads=4, tie_word_embeddings=False, num_labels=1)
    hidden, layers, heads = PYTHIA[name]
    return GPTNeoXConfig(vocab_size=50304 if name != "cpu-small" else 512, hidden_size=hidden,
                         num_hidden_layers=layers, num_attention_heads=heads, intermediate_size=4 * hidden,
                         rotary_pct=0.25, max_position_embeddings=2048, num_labels=1)


def parameter_count(config) -> int:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())


CUDA_CONTEXT_GIB = 0.5  # a CUDA context: the generator opens one on rank 0's GPU to map the weight buffer (IPC)


def memory_estimate(name: str, micro_batch: int, sequence_length: int, response_length: int,
                    algorithm: str = "dpo") -> dict:
    """GiB on rank 0's learner GPU for one replica (DDP), by component. Policy: float32 weights, gradients and two
    AdamW moments (16 bytes a parameter); the reference in float32 too (it runs as the policy does, under the same
    autocast, so that log pi - log pi_ref is 0 at step 0); reward model and weight buffer in bfloat16 (2 bytes each).
    Activations of one micro-batch with gradient checkpointing: each block's float32 input kept for the backward
    pass, one block's working set while it is recomputed (~20 bytes a hidden unit with SDPA attention), and the
    response logits (bfloat16, their float32 copy, log-softmax and its gradient).
    DPO: a micro-batch is 2 x micro_batch sequences (chosen and rejected). PPO (one completion per prompt):
    micro_batch sequences, and a value model (the reward model's backbone and head, trained: 16 bytes a parameter)
    whose blocks keep their inputs too; the entropy adds a float32 copy of the response logits."""
    config = model_config(name)
    params, sequences = parameter_count(config), (2 if algorithm == "dpo" else 1) * micro_batch
    tokens, hidden = sequences * sequence_length, config.hidden_size
    backbones = 1 if algorithm == "dpo" else 2
    logits_bytes = 14 if algorithm == "dpo" else 18
    activations = (backbones * config.num_hidden_layers * tokens * hidden * 4 + tokens * hidden * 20
                   + sequences * (response_length + 1) * config.vocab_size * logits_bytes)
    estimate = {"parameters (B)": params / 1e9, "policy weights": 4 * params / GIB,
                "gradients + AdamW": 12 * params / GIB}
    if algorithm == "ppo":
        value_params = params - config.vocab_size * hidden + hidden  # no output embedding; a 1-output head
        estimate["value model + grads + AdamW"] = 16 * value_params / GIB
    return {**estimate, "reference": 4 * params / GIB, "reward model": 2 * params / GIB,
            "weight buffer": 2 * params / GIB, "activations / micro-batch": activations / GIB,
            "generator's CUDA context": CUDA_CONTEXT_GIB}


def fsdp_rank0(estimate: dict, name: str, learners: int) -> float:
    """GiB on rank 0 under --fsdp: weights, gradients, AdamW moments and frozen models sharded over the learners.
    Gradients stay sharded because every micro-batch reduce-scatters (the scripts do not skip gradient sync under
    FSDP: skipping it would hold the full, unsharded float32 gradients until the last micro-batch). Not sharded: the
    weight buffer, the activations, the generator's CUDA context, the reward model's input embeddings, which
    stay gathered after its forward because its backbone is called as its own FSDP root, and the policy's largest
    pieces while they run: FSDP2 gathers its float32 input embedding for the whole backbone's forward and backward,
    and its output layer for its own, whose gradient is whole until its reduce-scatter: three float32 vocabulary x
    hidden matrices at once, at most (1.96 GiB each at 8B)."""
    config = model_config(name)
    gathered_embeddings = (2 + 3 * 4) * config.vocab_size * config.hidden_size / GIB
    unsharded = (estimate["weight buffer"] + estimate["activations / micro-batch"]
                 + estimate["generator's CUDA context"])
    sharded = sum(v for k, v in estimate.items() if k != "parameters (B)") - unsharded
    return sharded / learners + unsharded + gathered_embeddings


def print_estimate_table(args: Args) -> None:
    for algorithm in ("dpo", "ppo"):
        columns = list(memory_estimate("cpu-small", 1, 2, 1, algorithm))[1:]
        print(f"\n{algorithm.upper()}\n\n| model | params | " + " | ".join(columns) +
              " | total (DDP, rank 0's GPU) | FSDP over 3 learners (rank 0) |")
        print("|---" * (len(columns) + 4) + "|")
        for name in ("pythia-410m", "pythia-1b", "pythia-2.8b"):
            e = memory_estimate(name, args.per_device_train_batch_size, args.prompt_length + args.response_length,
                                args.response_length, algorithm)
            total = sum(v for k, v in e.items() if k != "parameters (B)")
            print(f"| {name} | {e['parameters (B)']:.2f} B | " + " | ".join(f"{e[k]:.1f}" for k in columns) +
                  f" | **{total:.1f} GiB** | {fsdp_rank0(e, name, 3):.1f} GiB |")
    # The chatbot preset (async_dpo.py --model llama-3.1-8b-no-robots): 7 learners beside one vLLM GPU, FSDP2 only
    # (a replica, 16 bytes a parameter for the policy alone, is 120 GiB), its micro-batch and lengths
    micro, prompt, response = 2, 512, 1024
    e = memory_estimate("llama-3.1-8b", micro, prompt + response, response)
    print(f"\nLlama 3.1 8B (the No Robots preset: DPO, micro-batch {micro} prompts x 2 sequences of {prompt} + "
          f"{response} tokens, {e['parameters (B)']:.2f} B parameters): "
          f"{fsdp_rank0(e, 'llama-3.1-8b', 7):.1f} GiB on rank 0 under --fsdp over 7 learners (" + ", ".join(
              f"{k} {v:.1f}" for k, v in e.items() if k != "parameters (B)") + " GiB before sharding)")
    before, after = load_peaks("llama-3.1-8b", 7)
    print(f"\nLoading it (the load-time peak on rank 0, before the first step): {before:.1f} GiB if every model "
          f"went whole to the GPU before sharding, beside the buffer; {after:.1f} GiB sharded as they load "
          f"(core.on_learner), the buffer allocated afterwards")
    llama = parameter_count(model_config("llama-3.1-8b"))
    print(f"\nHost memory while it loads: every rank reads each model whole to the CPU first (from_pretrained), the "
          f"float32 policy and reference one after the other: {4 * llama / GIB:.1f} GiB a rank, "
          f"{7 * 4 * llama / GIB:.0f} GiB on a node of 7 learners. --save_model writes the float32 policy: "
          f"{4 * llama / 1e9:.0f} GB ({2 * llama / 1e9:.0f} GB once cast to bfloat16)")
    print_lora_estimate()
    print_stream_estimate()
    gold = parameter_count(model_config("pythia-6.9b"))
    embeddings = 2 * 50304 * PYTHIA["pythia-6.9b"][0] / GIB
    print(f"\nthe 6.9B gold reward model (--gold_reward_model_path) adds {2 * gold / GIB:.1f} GiB in bfloat16 "
          f"(with --fsdp over 3: a third of that, plus {embeddings:.1f} GiB of its embeddings, gathered)")
    print("not counted: the CUDA caching allocator's fragmentation, NCCL's buffers, and the peak of a checkpointed "
          "block's recomputation beyond the working set above")


def lora_parameters(config, rank: int) -> int:
    """An adapter's parameters on every linear layer of the blocks (peft's all-linear: the output layer left out):
    rank x (inputs + outputs) for each."""
    import peft
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = peft.get_peft_model(AutoModelForCausalLM.from_config(config),
                                    peft.LoraConfig(r=rank, target_modules="all-linear"))
        return sum(p.numel() for p in model.parameters() if p.requires_grad)


def print_lora_estimate(rank: int = 64, gpu_gib: float = 79.2) -> None:
    """The No Robots preset with LoRA (async_dpo.py --model llama-3.1-8b-no-robots-lora) on one learner process:
    the base frozen in float32 (as the policy always is here: no gradient, no AdamW state), the adapter with its
    gradients and AdamW moments (16 bytes a parameter), no reference (the adapter off), the reward model and the
    buffer (the adapter alone) in bfloat16, the activations of one micro-batch as in the full-weight row (the
    adapter's own are a rank-r sliver), the generator's CUDA context. vLLM beside it: its bfloat16 weights, the
    adapter slot (max_lora_rank x every linear layer, bfloat16), the rest KV cache."""
    config = model_config("llama-3.1-8b")
    params, adapter = parameter_count(config), lora_parameters(config, rank)
    print(f"\nLlama 3.1 8B with LoRA (rank {rank} on every linear layer: {adapter / 1e6:.0f} M parameters, "
          f"{adapter / params:.2%} of {params / 1e9:.2f} B), DPO, one learner process:")
    for micro in (2, 1):
        e = memory_estimate("llama-3.1-8b", micro, 512 + 1024, 1024)
        rows = lora_learner_rows(micro, rank)
        learner = sum(rows.values())
        optimizer_saved = e["gradients + AdamW"] - rows["adapter + grads + AdamW"]
        buffer_saved = e["weight buffer"] - rows["buffer (adapter, bf16)"]
        vllm = 2 * params / GIB + 2 * adapter / GIB
        parts = ", ".join(f"{k} {v:.1f}" for k, v in rows.items())
        print(f"  micro-batch {micro}: learner {learner:.1f} GiB ({parts}); against a full-weight replica it saves "
              f"the reference's {e['reference']:.1f} GiB (the adapter off), {optimizer_saved:.1f} of gradients and "
              f"AdamW, {buffer_saved:.1f} of buffer; vLLM's weights and adapter slot {vllm:.1f} GiB. Two 80 GB GPUs "
              f"(vLLM on GPU 0, the learner on GPU 1): the learner fits with {gpu_gib - learner:.1f} GiB spare. "
              + "; ".join(shared_gpu(learner, vllm, gib) for gib in (gpu_gib, 131.0)))


# vLLM's own memory beside its request on a shared GPU (gpu_worker.py: the KV cache is the request, utilization x the
# GPU, less the weights and the profile run's peak; its CUDA context and the CUDA graphs captured after it lie
# outside the request unless VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS). Assumed, not measured here: vLLM logs its
# own at start-up ("Available KV cache memory", its CUDA graph estimate)
VLLM_PROFILE_PEAK_GIB, VLLM_OUTSIDE_REQUEST_GIB, ALLOCATOR_MARGIN_GIB = 1.5, 1.5, 2.0


def shared_gpu(learner: float, vllm_weights: float, gpu_gib: float) -> str:
    """The learner and vLLM on one GPU: the largest --vllm_gpu_memory_utilization that leaves the learner its
    estimate (whose generator's CUDA context is here the learner's own: the generator's is vLLM's, outside its
    request) and a margin for the allocator, beside vLLM's context and CUDA graphs; and the KV cache vLLM's formula
    then leaves (its request less its weights and the profile run's peak)."""
    room = gpu_gib - learner - ALLOCATOR_MARGIN_GIB - VLLM_OUTSIDE_REQUEST_GIB
    share = math.floor(100 * room / gpu_gib) / 100
    kv = share * gpu_gib - vllm_weights - VLLM_PROFILE_PEAK_GIB
    if kv <= 0:
        return f"one {gpu_gib:.0f} GiB GPU shared: does not fit (at {share:.2f}, no KV cache is left)"
    return (f"one {gpu_gib:.0f} GiB GPU shared: --vllm_gpu_memory_utilization {share:.2f} at most, {kv:.1f} GiB of KV "
            f"cache ({kv * GIB / 2**17 / 1e3:.0f} k tokens at 128 KiB a token)")


def lora_learner_rows(micro: int, rank: int = LORA_PRESET["rank"]) -> dict:
    """GiB of the LoRA preset's learner by component (docs/gpu.md's row; print_lora_estimate says what each is)."""
    config = model_config("llama-3.1-8b")
    adapter = lora_parameters(config, rank)
    e = memory_estimate("llama-3.1-8b", micro, LORA_PRESET["prompt_length"] + LORA_PRESET["response_length"],
                        LORA_PRESET["response_length"])
    return {"base fp32 (frozen)": e["policy weights"], "adapter + grads + AdamW": 16 * adapter / GIB,
            "reference": 0.0, "reward model": e["reward model"], "buffer (adapter, bf16)": 2 * adapter / GIB,
            "activations / micro-batch": e["activations / micro-batch"], "generator's CUDA context": CUDA_CONTEXT_GIB}


def print_stream_estimate() -> None:
    """fully_async_grpo.py's learner rank 0: the policy in float32 with its gradients and AdamW moments (no reference,
    no reward model), the k + 1 weight slots in bfloat16 (whole, on rank 0, under --fsdp too), one micro-batch's
    activations (sequences of 512 + 512 tokens: 16, the preset's micro-batch, for rho-1b, 4 at 8B; PPO's arithmetic,
    whose float32 copy of the logits the entropy makes here too, with one trained backbone), the generator's CUDA
    context; under --fsdp over 7 learners, the policy's pieces gathered as in the DPO row."""
    print("\nfully_async_grpo.py (GRPO, sequences of 512 + 512 tokens), learner rank 0, one engine (each engine maps "
          f"the slots on rank 0's GPU by CUDA IPC: --num_generators G adds {CUDA_CONTEXT_GIB} GiB a further engine):")
    for name, micro in (("rho-1b", 16), ("llama-3.1-8b", 4)):
        config = model_config(name)
        params, hidden, layers = parameter_count(config), config.hidden_size, config.num_hidden_layers
        e = memory_estimate(name, micro, 1024, 512, algorithm="ppo")
        activations = e["activations / micro-batch"] - layers * micro * 1024 * hidden * 4 / GIB  # (one backbone)
        for k in (1, 2, 4):
            slots = (k + 1) * 2 * params / GIB
            ddp = 16 * params / GIB + slots + activations + CUDA_CONTEXT_GIB
            gathered = 3 * 4 * config.vocab_size * hidden / GIB
            fsdp = 16 * params / GIB / 7 + slots + activations + CUDA_CONTEXT_GIB + gathered
            print(f"  {name} ({params / 1e9:.2f} B, micro-batch {micro}), k = {k}: slots {slots:.1f} GiB, activations "
                  f"{activations:.1f} GiB; total {ddp:.1f} GiB with DDP, {fsdp:.1f} GiB under --fsdp over 7 learners")


def dpo_args(per_device_train_batch_size: int):
    """async_dpo.py's Args for one step of one micro-batch on one learner process."""
    run_args = async_dpo.resolve_args(async_dpo.Args(per_device_train_batch_size=per_device_train_batch_size))
    run_args.batch_size = run_args.local_batch_size = per_device_train_batch_size
    run_args.gradient_accumulation_steps = 1
    return run_args


def dpo_mini_batch(prompts: list, chosen: list, rejected: list, valid: torch.Tensor, ref_logps: torch.Tensor) -> dict:
    """One mini-batch as async_dpo.py's make_pairs builds it (scores and generator log-probs only feed its logs)."""
    M = len(prompts)
    return dict(prompts=prompts, chosen=chosen, rejected=rejected, valid=valid, scores=torch.zeros(M, 2),
                eos=torch.ones(M, 2), lengths=torch.tensor([[len(c), len(r)] for c, r in zip(chosen, rejected)]),
                generator_chosen_logps=torch.zeros(M), generator_rejected_logps=torch.zeros(M),
                generator_chosen_logprobs=torch.zeros(M, len(chosen[0])),
                generator_rejected_logprobs=torch.zeros(M, len(rejected[0])), kl=torch.zeros(M),
                ref_chosen_logps=ref_logps[:M], ref_rejected_logps=ref_logps[M:])


def learner_step(args: Args, device: torch.device, lora_rank: int = 0) -> str:
    """(a) One learner step through the script's own functions, timing it and measuring peak memory. With
    `lora_rank`, (i): the LoRA preset's learner (Llama 3.1 8B's architecture, toy-sized on a CPU; the adapter on every
    linear layer, the adapter off as the reference, the preset's micro-batch and lengths on a GPU)."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    on_gpu = device.type == "cuda"
    name = args.model if not lora_rank else "llama-3.1-8b" if on_gpu else "cpu-small-llama"
    M, prompt_length, response_length = (
        (LORA_PRESET["micro_batch"], LORA_PRESET["prompt_length"], LORA_PRESET["response_length"]) if lora_rank
        and on_gpu else (args.per_device_train_batch_size, args.prompt_length, args.response_length))
    config, dtype = model_config(name), torch.bfloat16 if on_gpu else torch.float32
    torch.manual_seed(0)
    with device:  # random weights drawn on the device itself: on the CPU, 2.8B of them take a minute a model
        policy = core.train_without_dropout(AutoModelForCausalLM.from_config(config, dtype=torch.float32), True)
        ref_policy = None if lora_rank else AutoModelForCausalLM.from_config(
            config, dtype=torch.float32).eval().requires_grad_(False)
        reward_model = AutoModelForSequenceClassification.from_config(config, dtype=dtype)
    assert all(p.device.type == device.type for p in policy.parameters()), "the policy is not on the check's device"
    if lora_rank:  # (as the scripts build it: the adapter on the base, the reference the adapter off)
        policy = lora.add_adapter(policy, SimpleNamespace(lora_rank=lora_rank, lora_alpha=None,
                                                          lora_target_modules=None)).to(device)
        ref_policy = lora.AdapterOff(policy)
    reward_model.score.float()
    reward_model.retokenize = None  # it shares the policy's tokens (as plumbing.reward_models says)
    reward_model = reward_model.to(device).eval().requires_grad_(False)
    table = async_dpo.weight_table(policy)
    buffer = async_dpo.make_weight_buffer(table, dtype, device)
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-6, fused=on_gpu)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    autocast = torch.autocast(device.type, dtype=dtype, enabled=on_gpu)
    run = core.Run(device, autocast, 0, 0)  # the run's fixed facts (random tokens: 0 ends and pads)
    run_args = dpo_args(M)
    vocab, label = config.vocab_size, "(i)" if lora_rank else "(a)"
    prompts = torch.randint(1, vocab, (M, prompt_length)).tolist()
    chosen, rejected = (torch.randint(1, vocab, (M, response_length)).tolist() for _ in range(2))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for step in range(2):  # the second step has the AdamW moments allocated: the steady state
        start = time.time()
        scores = async_dpo.score_in_chunks(reward_model, prompts * 2, chosen + rejected, [True] * 2 * M, -1.0, 2 * M,
                                           run)
        ref_logps = async_dpo.logprobs_in_chunks(ref_policy, prompts * 2, chosen + rejected, 0.7, 2 * M, run).sum(1)
        mini_batch = dpo_mini_batch(prompts, chosen, rejected, (scores[:M] != scores[M:]).float(), ref_logps)
        stats = async_dpo.dpo_update(policy, optimizer, scheduler, mini_batch, run_args, run)
        loss = stats["loss/dpo"]
        sync_start = time.time()
        async_dpo.write_weight_snapshot(policy, buffer, table)
        step_seconds = sync_start - start
        print(f"{label} step {step}: learner step {step_seconds:.2f} s, weight snapshot "
              f"{time.time() - sync_start:.3f} s, DPO loss {loss:.4f}", flush=True)
    assert math.isfinite(loss), "the DPO loss is not finite"
    if lora_rank:  # docs/gpu.md's LoRA row at the preset's micro-batch (the generator's CUDA context is not ours)
        estimate = lora_learner_rows(LORA_PRESET["micro_batch"], lora_rank)
    else:
        estimate = memory_estimate(args.model, M, prompt_length + response_length, response_length)
    expected = sum(v for k, v in estimate.items() if k not in ("parameters (B)", "generator's CUDA context"))
    figure = f"{name}, step {step_seconds:.2f} s"
    if on_gpu:
        peak = torch.cuda.max_memory_allocated(device) / GIB
        print(f"{label} peak GPU memory {peak:.1f} GiB; the docs' estimate {expected:.1f} GiB "
              f"({json.dumps({k: round(v, 2) for k, v in estimate.items()})})")
        figure += f", peak {peak:.1f} GiB (estimate {expected:.1f})"
    else:
        print(f"{label} no GPU: ran on the CPU; the docs' estimate at this check's GPU size is {expected:.2f} GiB")
    if lora_rank:
        return figure
    # --resume_from, before it loads a checkpoint: a fresh AdamW's moments, allocated by a step at lr 0 on zero
    # gradients that are views of one shared buffer (DCP's own way zero-fills a full gradient set: +4 B/parameter)
    del optimizer, scheduler
    gc.collect()
    resumed = torch.optim.AdamW(policy.parameters(), lr=1e-6, fused=device.type == "cuda")
    before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    checkpoint.allocate_optimizer_state(resumed)
    assert all(p.grad is None for p in policy.parameters()), "the resume's zero gradients were not freed"
    if device.type == "cuda":
        extra = (torch.cuda.max_memory_allocated(device) - before) / GIB
        print(f"(a) resume: the optimizer state's allocation peaks {extra:.1f} GiB above the weights and models "
              f"(AdamW's moments: {8 * estimate['parameters (B)'] * 1e9 / GIB:.1f} GiB; DCP's own way adds "
              f"{4 * estimate['parameters (B)'] * 1e9 / GIB:.1f} GiB of zero gradients)", flush=True)
        figure += f", resume +{extra:.1f} GiB"
    return figure


def precision_parity(args: Args, device: torch.device) -> str:
    """(d) Step 0 in the scripts' precisions, through their own functions, at equal weights: DPO's first loss against
    ln 2, the reference's log-probs against the policy's, and the first ratios of PPO (per token) and RLOO (per
    sequence) with pi_old recomputed by the learner (--recompute_old_logprobs) and with pi_old from the sampler.
    vLLM is not installed here: a bfloat16 copy of the policy stands in for it (vLLM samples with bfloat16
    weights), and random weights stand in for a trained model, so the sampler's figures are indicative only."""
    from transformers import AutoModelForCausalLM, GPTNeoXForSequenceClassification

    import async_ppo
    import async_rloo

    config, dtype = model_config(args.model), torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    with device:  # (random weights drawn on the device)
        policy = core.train_without_dropout(AutoModelForCausalLM.from_config(config, dtype=torch.float32), True)
        reference = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval().requires_grad_(False)
        old_regime = AutoModelForCausalLM.from_config(config, dtype=dtype).eval().requires_grad_(False)
    reference.load_state_dict(policy.state_dict())  # what the scripts load: the SFT weights in float32
    old_regime.load_state_dict(policy.state_dict())  # a reference loaded in bfloat16, as before; also the sampler
    autocast = torch.autocast(device.type, dtype=dtype, enabled=device.type == "cuda")
    no_autocast = torch.autocast(device.type, enabled=False)
    M, vocab, temperature = args.per_device_train_batch_size, config.vocab_size, 0.7
    prompts = torch.randint(1, vocab, (M, args.prompt_length)).tolist()
    responses = torch.randint(1, vocab, (2 * M, args.response_length)).tolist()
    chosen, rejected = responses[:M], responses[M:]

    def run_in(regime) -> core.Run:  # the run's fixed facts, in one precision regime
        return core.Run(device, regime, 0, 0)

    def optimizer_for(model):  # the step must not move the weights; plain SGD holds no state at all
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)

    def sequence_logps(model, regime) -> torch.Tensor:
        logprobs = async_dpo.logprobs_in_chunks(model, prompts * 2, responses, temperature, 2 * M, run_in(regime))
        return logprobs.sum(1)

    ref_logps, bf16_logps = sequence_logps(reference, autocast), sequence_logps(old_regime, no_autocast)
    policy_logps = sequence_logps(policy, autocast)  # as the update computes them (same autocast)
    ppo_prompts, ppo_responses = prompts * 2, responses  # PPO's sampler log-probs, before the sampler is freed
    sampler_logprobs = async_ppo.logprobs_in_chunks(old_regime, ppo_prompts, ppo_responses, temperature, M,
                                                    run_in(no_autocast))
    del reference, old_regime
    mini_batch = dpo_mini_batch(prompts, chosen, rejected, torch.ones(M), ref_logps)
    stats = async_dpo.dpo_update(policy, *optimizer_for(policy), mini_batch, dpo_args(M), run_in(autocast))
    loss = stats["loss/dpo"]
    offset, old_offset = (policy_logps - ref_logps).abs(), (policy_logps - bf16_logps).abs()
    print(f"(d) DPO step 0: loss {loss:.6f} (ln 2 = {math.log(2):.6f}); |log pi - log pi_ref| per sequence "
          f"mean {offset.mean():.2e}, max {offset.max():.2e} (a reference loaded in {dtype}: mean "
          f"{old_offset.mean():.2e}, max {old_offset.max():.2e})", flush=True)
    tolerance = 1e-4 if device.type == "cpu" else 1e-2
    assert abs(loss - math.log(2)) < tolerance, "DPO's first loss is not ln 2 at equal weights"

    print_peak_memory("(d) DPO", device)
    # PPO: per-token ratios at step 0, pi_old from the learner's rollout pass or from the bfloat16 sampler
    with device:
        value_model = core.train_without_dropout(GPTNeoXForSequenceClassification(config), True)
    model = async_ppo.PolicyAndValue(policy, value_model)
    learner_logprobs, values = async_ppo.rollout_in_chunks(model, ppo_prompts, ppo_responses, temperature, M,
                                                           run_in(autocast))
    n, width = len(ppo_prompts), args.response_length
    logged_only = dict(scores=torch.zeros(n), eos=torch.zeros(n))  # (they feed the logs only)
    log_ratio = learner_logprobs - sampler_logprobs  # log pi_old - log mu per token (mu: the sampler)
    is_factor, is_changed = async_ppo.importance_correction(log_ratio.exp(), one_step_args(async_ppo, n))
    for name, old_logprobs in (("recomputed", learner_logprobs), ("sampler's", sampler_logprobs)):
        mini_batch = dict(prompts=ppo_prompts, responses=ppo_responses, old_logprobs=old_logprobs,
                          advantages=torch.randn_like(values), values=values, returns=values,
                          response_mask=torch.ones(n, width), generator_logprobs=sampler_logprobs,
                          explained_variance=[0.0] * n, learner_log_ratio=log_ratio, is_weights=log_ratio.exp(),
                          is_factor=is_factor, is_changed=is_changed, is_terms=torch.ones(n, width).bool(),
                          **logged_only, kl=torch.zeros(n, width))
        stats = async_ppo.ppo_update(model, *optimizer_for(model), mini_batch, one_step_args(async_ppo, n),
                                     run_in(autocast))
        print(f"(d) PPO step 0, pi_old {name}: ratio mean {stats['policy/ratio_mean']:.6f}, max "
              f"{stats['policy/ratio_max']:.4f}, clip fraction {stats['policy/clipfrac']:.4f}", flush=True)
        if name == "recomputed":
            assert abs(stats["policy/ratio_mean"] - 1) < tolerance, "PPO's first ratio is not 1"
            ppo_ratio = stats["policy/ratio_mean"]
    print(f"(d) PPO step 0, w = pi_old / mu per token (mu: the sampler in {dtype}): min {stats['is/weight_min']:.4f}, "
          f"max {stats['is/weight_max']:.4f}, |log pi_old - log mu| mean {stats['offpolicy/mismatch_mean']:.2e}, "
          f"max {stats['offpolicy/mismatch_max']:.2e}, k3 KL {stats['offpolicy/kl_k3']:.2e}", flush=True)
    print_peak_memory("(d) PPO", device)
    del model, value_model
    # RLOO: sequence-level ratios (a sum over the response's tokens, so per-token differences add up)
    learner_tokens = async_dpo.logprobs_in_chunks(policy, ppo_prompts, ppo_responses, temperature, M,
                                                  run_in(autocast))
    for name, old_logprobs in (("recomputed", learner_tokens), ("sampler's", sampler_logprobs)):
        mini_batch = dict(prompts=ppo_prompts, responses=ppo_responses, old_logps=old_logprobs.sum(1),
                          advantages=torch.randn(n), generator_logps=old_logprobs.sum(1),
                          generator_logprobs=old_logprobs, rewards=torch.zeros(n), advantage_std=[1.0] * n,
                          response_mask=torch.ones(n, width), is_factor=torch.ones(n), **logged_only,
                          kl=torch.zeros(n))
        stats = async_rloo.rloo_update(policy, *optimizer_for(policy), mini_batch, one_step_args(async_rloo, n),
                                       run_in(autocast))
        print(f"(d) RLOO step 0, pi_old {name}: ratio mean {stats['policy/ratio_mean']:.6f}, max "
              f"{stats['policy/ratio_max']:.4f}, clip fraction {stats['policy/clipfrac']:.4f}", flush=True)
        if name == "recomputed":
            assert max(abs(stats["policy/ratio_mean"] - 1), stats["policy/ratio_max"] - 1) < tolerance * 10, \
                "RLOO's first ratio is not 1"
            rloo_ratio = stats["policy/ratio_max"]
    print_peak_memory("(d) RLOO", device)
    # The lag's floor: at equal weights the learner against a bfloat16 sampler (vLLM's precision on a GPU; on the CPU
    # too, to show it), per sequence (lag/kl) and per token (lag/kl_token), as the scripts log them; random weights
    with device:
        bf16_sampler = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval().requires_grad_(False)
    bf16_sampler.load_state_dict(policy.state_dict())
    sampler_logprobs = async_ppo.logprobs_in_chunks(bf16_sampler, ppo_prompts, ppo_responses, temperature, M,
                                                    run_in(no_autocast))
    gap = (learner_logprobs - sampler_logprobs).double()  # log pi - log mu per token
    sequence_kl = (torch.expm1(gap.sum(1)) - gap.sum(1)).mean().item()
    token_kl = (torch.expm1(gap) - gap).mean().item()
    print(f"(d) the lag at staleness 0, the sampler in bfloat16: lag/kl {sequence_kl:.2e} per sequence of {width} "
          f"tokens, lag/kl_token {token_kl:.2e} (per-token gap spread {gap.std():.2e})", flush=True)
    return (f"DPO loss - ln 2 {loss - math.log(2):+.1e}, PPO ratio {ppo_ratio:.5f}, RLOO max ratio {rloo_ratio:.5f};"
            f" lag floor with a bfloat16 sampler: lag/kl {sequence_kl:.1e}, lag/kl_token {token_kl:.1e}")


def print_peak_memory(check: str, device: torch.device) -> None:
    """A check's peak GPU memory (then the peak is reset for the next one); nothing to measure on the CPU."""
    if device.type == "cuda":
        print(f"{check}: peak GPU memory {torch.cuda.max_memory_allocated(device) / GIB:.1f} GiB", flush=True)
        torch.cuda.reset_peak_memory_stats(device)


def one_step_args(script, rows: int):
    """A script's Args for one optimizer step of one micro-batch of `rows` completions on one learner process."""
    run_args = script.Args(num_samples=1)
    run_args.world_size, run_args.batch_size, run_args.gradient_accumulation_steps = 1, rows, 1
    run_args.per_device_train_batch_size = rows
    return run_args


def reader_main(table: list, versions, replies) -> None:
    """(c) The generator's side of the hand-off: the buffer first, by the queue (as the scripts send it), then on
    each new version, read the whole buffer (fully_async_grpo.py: the version's slot) the way the generator does
    (weights_from_buffer) and report the values it saw."""
    buffer = versions.get()["weight_buffer"]
    while (message := versions.get()) is not None:
        version, slot = message
        seen = torch.cat([w.reshape(-1) for _, w in async_dpo.weights_from_buffer(
            buffer if slot is None else buffer[slot], table)])
        replies.put((version, seen.min().item(), seen.max().item()))


def weight_handoff(args: Args, device: torch.device, slots: int = 0) -> str:
    """(c) Write versions 1..5 (every parameter set to the version number) and have a spawned reader check them:
    into the one buffer of the paper's scripts, or (`slots`) into slot version mod slots of fully_async_grpo.py's."""
    from transformers import AutoModelForCausalLM

    import fully_async_grpo

    with device:
        model = AutoModelForCausalLM.from_config(model_config(args.model), dtype=torch.float32)
    table, dtype = async_dpo.weight_table(model), torch.bfloat16 if device.type == "cuda" else torch.float32
    buffer = (fully_async_grpo.make_weight_slots(table, slots, dtype, device) if slots
              else async_dpo.make_weight_buffer(table, dtype, device))
    ctx = mp.get_context("spawn")
    versions, replies = ctx.Queue(maxsize=1), ctx.Queue(maxsize=1)
    reader = ctx.Process(target=reader_main, args=(table, versions, replies))
    reader.start()
    versions.put(dict(kind="weight_buffer", weight_buffer=buffer))  # (shared memory, or CUDA IPC)
    try:
        for version in range(1, 6):
            with torch.no_grad():
                for param in model.parameters():
                    param.fill_(version)
            start, slot = time.time(), version % slots if slots else None
            if slots:
                fully_async_grpo.write_weight_snapshot(model, buffer[slot], table)
            else:  # (both must be complete before the reader is told)
                async_dpo.write_weight_snapshot(model, buffer, table)
            elapsed = time.time() - start
            versions.put((version, slot))
            seen = replies.get(timeout=300)
            print(f"(c) version {version}{f' in slot {slot}' if slots else ''}: snapshot {elapsed:.3f} s, reader saw "
                  f"values {seen[1]}..{seen[2]}", flush=True)
            assert seen == (version, version, version), f"the reader saw a mix of versions: {seen}"
        versions.put(None)
        reader.join(timeout=60)
    finally:
        if reader.is_alive():
            reader.kill()
    assert reader.exitcode == 0, f"the reader process failed (exit code {reader.exitcode})"
    return f"versions 1-5 whole{f' in {slots} slots' if slots else ''}, last snapshot {elapsed:.3f} s"


def load_peaks(name: str, learners: int) -> tuple[float, float]:
    """GiB on learner rank 0's GPU while a DPO run's models load under --fsdp over `learners`: the policy and the
    reference in float32, the reward model (no output embedding) in bfloat16. Moved whole to the device before
    sharding (the scripts' way until this check was written), beside the bfloat16 weight buffer allocated before
    them; and sharded as they load (core.on_learner: one piece at most whole on the device at a time, here the
    float32 output or input embedding; the buffer allocated afterwards, its 2 bytes a parameter then part of the
    steady state)."""
    config = model_config(name)
    params, embedding = parameter_count(config), config.vocab_size * config.hidden_size
    models = (4 + 4) * params + 2 * (params - embedding)
    return (models + 2 * params) / GIB, (models / learners + 4 * embedding) / GIB


def fsdp_load_peak(device: torch.device, world_size: int) -> None:
    """(e) Loading under --fsdp as the scripts do: each model built on the CPU, then core.on_learner, which shards it
    block by block (fully_shard moves each block to the device as it shards it). The device's peak while a policy,
    a reference (float32) and a reward model (bfloat16) load stays near their shards plus one embedding, where
    moving each whole first would have held a whole float32 model."""
    from transformers import AutoModelForCausalLM

    config = model_config("pythia-410m" if device.type == "cuda" else "cpu-small")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
    sizes = []
    for dtype in (torch.float32, torch.float32, torch.bfloat16):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)  # on the CPU, as from_pretrained loads it
        sizes.append(sum(p.numel() * p.element_size() for p in model.parameters()))
        core.on_learner(model, SimpleNamespace(fsdp=True), device)
        assert all(p.device == device and p.placements[0].is_shard() for p in model.parameters()), \
            "a parameter was left off the learner's device, or whole"
    if device.type == "cpu" and torch.distributed.get_rank() == 0:
        print(f"(e) --fsdp load over {world_size} ranks: every parameter sharded on the learner's device (no GPU: no "
              f"peak to measure)", flush=True)
    if device.type == "cuda":
        peak = (torch.cuda.max_memory_allocated(device) - start) / GIB
        whole = max(sizes) / GIB
        shards, embedding = sum(sizes) / world_size / GIB, 4 * config.vocab_size * config.hidden_size / GIB
        print(f"(e) --fsdp load over {world_size} ranks: peak {peak:.2f} GiB on this rank (shards {shards:.2f} GiB "
              f"+ one float32 embedding {embedding:.2f} GiB; a whole float32 model first: {whole:.2f} GiB more)",
              flush=True)
        assert peak <= shards + 2 * embedding + 0.1, "a model was whole on the device before it was sharded"


def ready_main(results) -> None:
    """(b) A stand-in for the generator process: it says "ready", as the scripts' does once vLLM is built."""
    results.put(dict(kind="ready"))


def collectives_worker() -> None:
    """(b) One torchrun rank: the scripts' process group, the generator's "ready" taken by every rank at the same
    point (where plumbing.core.shares_gpu0 puts it), the generator's error raised on every rank, reduce_sums, and
    a DDP step."""
    use_cuda = torch.cuda.is_available()
    core.init_learner_group(use_cuda)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", rank % torch.cuda.device_count()) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    generator, ranks = Generator(), SimpleNamespace(rank=rank, world_size=world_size)  # (rank 0's: a stand-in)
    if rank == 0:
        ctx = mp.get_context("spawn")
        requests, results = ctx.Queue(maxsize=1), ctx.Queue(maxsize=1)
        process = ctx.Process(target=ready_main, args=(results,))
        process.start()
        generator = Generator(process, requests, results, tempfile.mkdtemp())
    shares = core.shares_gpu0()  # one GPU, two learners: rank 0 beside the "generator" on GPU 0
    decisions = [None] * world_size
    torch.distributed.all_gather_object(decisions, shares)
    assert len(set(decisions)) == 1, f"the ranks disagree on when to take the generator's ready: {decisions}"
    if shares:
        assert async_dpo.collect(generator, ranks)["kind"] == "ready"
    sums = core.reduce_sums({"rank": float(rank), "one": 1.0}, world_size)
    assert sums == {"rank": sum(range(world_size)), "one": world_size}, sums
    if not use_cuda or torch.cuda.device_count() >= world_size:  # NCCL needs one GPU per rank
        model = torch.nn.Linear(4, 1).to(device)
        ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device] if use_cuda else None,
                                                        gradient_as_bucket_view=True)
        ddp(torch.full((1, 4), float(rank + 1), device=device)).sum().backward()
        expected = sum(range(1, world_size + 1)) / world_size  # DDP averages the ranks' gradients
        assert torch.allclose(model.weight.grad, torch.full_like(model.weight.grad, expected)), model.weight.grad
        backend = "nccl" if use_cuda else "gloo"
        # DDP's state holds the process group: free it before the group is torn down, as the scripts do (else a
        # gloo thread can abort the process at exit, now and then)
        del ddp, model
        gc.collect()
        fsdp_load_peak(device, world_size)
    else:
        backend = "skipped (NCCL needs a GPU per rank; this machine has one)"
    if not shares:
        assert async_dpo.collect(generator, ranks)["kind"] == "ready"
    generator.error = GeneratorError("test") if rank == 0 else None  # (as a death noticed while sending)
    try:
        async_dpo.collect(generator, ranks)
        raise AssertionError("collect did not raise the generator's error on every rank")
    except GeneratorError:
        pass
    if rank == 0:
        generator.stop()
        print(f"(b) the generator's ready taken by every rank {'before' if shares else 'after'} the models, as "
              f"plumbing.core.shares_gpu0 says; its error raised on every rank; reduce_sums over gloo: ok; "
              f"DDP gradient all-reduce: {backend}", flush=True)
    torch.distributed.destroy_process_group()


# --- (f) weight reloads in a real vLLM engine, (g) what seeded sampling costs it -------------------------------------
RELOAD_TOLERANCE = {"cpu": 1e-4, "cuda": 0.05}  # median |sampler - learner| per token at the same weights: float32 on
# CPU (~1e-6 measured), bfloat16 sampler against the learner's float32-under-bfloat16 forward on GPU (~1e-2 a token)
FAR_APART = 0.5  # median per-token gap between the two versions' log-probs that the perturbation must exceed (nats)


def perturbed(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model` whose output layer's rows are permuted (each token gets another's logit): a version whose
    log-probs of what it samples differ from the original's by nats a token, far beyond bfloat16's noise."""
    import copy

    model = copy.deepcopy(model)
    output = model.get_output_embeddings().weight
    with torch.no_grad():
        output.copy_(output[torch.randperm(len(output), generator=torch.Generator().manual_seed(1))])
    return model


def token_gaps(sampled: list, models: dict, prompts: list, temperature: float, device: torch.device) -> dict:
    """|sampler's log-prob - each model's| per token of `sampled` ((prompt index, tokens, the sampler's log-probs,
    the token positions to compare)), the models run as the learner runs them (float32, bfloat16 autocast on GPU)."""
    import fully_async_grpo as fa

    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    run = core.Run(device, autocast, 0, 0)
    gaps = {}
    for name, model in models.items():
        learner = fa.logprobs_in_chunks(model, [prompts[i] for i, *_ in sampled], [t for _, t, *_ in sampled],
                                        temperature, 64, run)
        gaps[name] = torch.cat([(row[: len(tokens)] - torch.tensor(logprobs))[where].abs()
                                for row, (_, tokens, logprobs, where) in zip(learner, sampled)])
    return gaps


def judge_reload(label: str, own: torch.Tensor, other: torch.Tensor, device: torch.device) -> str:
    """The sampler's tokens after a reload must match the new weights (to bfloat16's noise on GPU) and not the old."""
    tolerance = RELOAD_TOLERANCE[device.type]
    figure = (f"{label}: median |sampler - new| {own.median():.1e} (p99 {own.quantile(0.99):.1e}, {len(own)} tokens), "
              f"|sampler - old| {other.median():.2f}")
    print(f"(f) {figure}", flush=True)
    assert own.median() < tolerance, f"the sampler's log-probs after the load are not the new weights' ({figure})"
    assert other.median() > FAR_APART, f"the versions are too close to tell apart ({figure})"
    return figure


def inflight_reload(device: torch.device, num_generators: int = 1) -> str:
    """(f) fully_async_grpo.py's generator_main (its engine_kwargs: CUDA graphs on a GPU, the synchronous scheduler),
    streaming groups; once the first group is back, version 1 (the SFT weights perturbed far beyond bfloat16's noise)
    is published and loaded mid-generation (--inflight_updates, recompute). Every token labelled 1 must carry the
    new weights' log-prob, every token labelled 0 the old ones'. With `num_generators` 2: two engines under the
    shared admission record (on GPUs, engine 1 on GPU 1, reading the slots on GPU 0 by CUDA IPC), both loading."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    import fully_async_grpo as fa

    use_cuda, out = device.type == "cuda", tempfile.mkdtemp(prefix="gpu-check-")
    args = fa.resolve_args(fa.Args(model="tiny", **fa.TINY_DEFAULTS, inflight_updates=True, output_dir=out,
                                   vllm_gpu_memory_utilization=0.3, num_generators=num_generators))
    tokenizer = AutoTokenizer.from_pretrained(args.sft_model_path)
    train, _ = core.load_prompt_splits(args.dataset, args.seed, ("question", "answer"), ("train", "test"))
    prompts = fa.tokenize_prompts(tokenizer, train, args)
    old = AutoModelForCausalLM.from_pretrained(args.sft_model_path, dtype=torch.float32).to(device).eval()
    new, table = perturbed(old), fa.weight_table(old)
    slots = fa.make_weight_slots(table, fa.len_slots(args), torch.bfloat16 if use_cuda else torch.float32, device)
    fa.write_weight_snapshot(new, slots[1], table)
    engine = fa.engine_kwargs(args, AutoConfig.from_pretrained(args.sft_model_path), use_cuda)
    assert engine["async_scheduling"] is False and engine["enforce_eager"] is not use_cuda, engine
    record, address = transport.open_record(args)
    engines = transport.start_engines(fa.generator_main, engine, table, tokenizer.eos_token_id, None, 0, args)
    groups, gpus = [], []
    try:
        for engine in engines:  # (each engine's "ready" says which GPU it built on)
            gpus.append(transport.collect(engines, args)["gpu"])
            transport.submit([engine], dict(kind="start", weight_slots=slots, prompts=prompts, adapter_config=None,
                                            engine=engine.engine, record=address))
        fa.open_admission(record, 0, args)
        transport.submit(engines, dict(
            kind="go", first_group=0, missing=[], next_index=0, version=0, slot=0, seed=args.seed,
            n=args.num_samples, temperature=args.temperature, max_tokens=args.response_length,
            max_staleness=args.max_staleness, groups_per_step=args.groups_per_step, stale_policy="pace",
            max_in_flight=args.max_in_flight, inflight_updates=True, kv_on_update="recompute",
            engine_room=-(-args.max_in_flight // num_generators)))
        groups.append(transport.collect(engines, args))  # the others are mid-generation now
        transport.submit(engines, dict(kind="weights", version=1, slot=1, taken=1, taken_from={0: 1}))  # (the
        # stream then fills, and stops)
        while len(groups) < args.max_in_flight:
            groups.append(transport.collect(engines, args))
    finally:
        for engine in engines:
            engine.stop()
    if use_cuda:  # (engine i on GPU i: vLLM's device_ids, as start_engines asks)
        assert sorted(gpus) == list(range(num_generators)), f"the engines built on GPUs {gpus}"
    # Each completion's tokens by label: (prompt, tokens, the sampler's log-probs, the tokens of that version)
    by_version = {0: [], 1: []}
    for group in groups:
        for tokens, logprobs, spans in zip(group["responses"], group["logprobs"], group["spans"]):
            labels = torch.tensor([v for v, start, end in spans for _ in range(end - start)])
            for version in (0, 1):
                if (labels == version).any() and len(spans) > 1:  # (the completions loaded mid-generation)
                    by_version[version].append((group["index"] % len(prompts), tokens, logprobs, labels == version))
    assert by_version[1], "no completion was sampled by two versions: nothing was loaded mid-generation"
    assert {g["engine"] for g in groups} == set(range(num_generators)), "an engine sampled no group"
    after = token_gaps(by_version[1], {"new": new, "old": old}, prompts, args.temperature, device)
    before = token_gaps(by_version[0], {"old": old}, prompts, args.temperature, device)
    judge_reload(f"{len(by_version[1])} completions loaded mid-generation, their later tokens", after["new"],
                 after["old"], device)
    assert before["old"].median() < RELOAD_TOLERANCE[device.type], "their earlier tokens are not the old weights'"
    return (f"{num_generators} engine(s){f' on GPUs {sorted(gpus)}' if use_cuda else ''}, {len(by_version[1])} "
            f"completions over 2 versions: version-1 tokens median gap "
            f"{after['new'].median():.1e} to v1, {after['old'].median():.2f} to v0; version-0 tokens "
            f"{before['old'].median():.1e} to v0")


def reload_between_rounds(device: torch.device, lora_rank: int = 0) -> str:
    """(f) async_dpo.py's generator_main (the paper's scripts' reload, CUDA graphs on a GPU): a round with the SFT
    weights, then a round after version 1 (perturbed) was written to the buffer and reloaded. The second round's
    log-probs must be the new weights' (a CUDA graph still reading the old weights would give the old ones').
    With `lora_rank` (LoRA's hand-off): version 1 is an adapter (its B drawn large enough to move the log-probs by
    nats), the buffer holds it alone, and the engine (enable_lora) samples round 2 with it as a LoRARequest."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    use_cuda, out = device.type == "cuda", tempfile.mkdtemp(prefix="gpu-check-")
    args = async_dpo.resolve_args(async_dpo.Args(model="tiny", **async_dpo.TINY_DEFAULTS, output_dir=out,
                                                 vllm_gpu_memory_utilization=0.3, lora_rank=lora_rank))
    tokenizer = AutoTokenizer.from_pretrained(args.sft_model_path)
    queries = [json.loads(line)["query"] for line in open(os.path.join(args.dataset, "validation.jsonl"))]
    prompts = core.tokenize_prompts(tokenizer, queries[:32], args.max_prompt_length)
    old = AutoModelForCausalLM.from_pretrained(args.sft_model_path, dtype=torch.float32).to(device).eval()
    new, table = perturbed(old), async_dpo.weight_table(old)
    if lora_rank:  # (the policy with an adapter; `old`, its base, is the reference: the adapter off)
        new = lora.add_adapter(AutoModelForCausalLM.from_pretrained(args.sft_model_path, dtype=torch.float32),
                               args).to(device).eval()
        with torch.no_grad():  # each adapter's update 4x the weight it adapts (Frobenius norms): log-probs move by
            # nats, the hidden states grow ~2x at most (measured on the tiny policy; B ~ N(0, 1) made them ~7x larger,
            # and bfloat16's noise with them)
            for module in new.modules():
                if isinstance(getattr(module, "lora_B", None), torch.nn.ModuleDict) and "default" in module.lora_B:
                    a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
                    b.normal_(0, 1.0, generator=torch.Generator(device).manual_seed(1))
                    b.mul_(4 * module.base_layer.weight.norm() / (module.scaling["default"] * b @ a).norm())
        table = async_dpo.weight_table(new)
    buffer = async_dpo.make_weight_buffer(table, torch.bfloat16 if use_cuda else torch.float32, device)
    engine = async_dpo.engine_kwargs(args, AutoConfig.from_pretrained(args.sft_model_path), use_cuda)
    generator = async_dpo.start_generator(engine, table, tokenizer.eos_token_id, None, args)
    rounds = []
    try:
        assert async_dpo.collect(generator, args)["kind"] == "ready"
        async_dpo.submit(generator, dict(kind="weight_buffer", weight_buffer=buffer,
                                         adapter_config=lora.adapter_config(new)))
        for version in (0, 1):
            if version:
                async_dpo.write_weight_snapshot(new, buffer, table)
            async_dpo.submit(generator, dict(kind="train", round=version, weights_version=version, prompts=prompts,
                                             n=2, temperature=args.temperature, max_tokens=args.response_length,
                                             seed=version))
            rounds.append(async_dpo.collect(generator, args))
    finally:
        generator.stop()
    sampled = [[(i // 2, tokens, logprobs, torch.ones(len(tokens), dtype=torch.bool))
                for i, (tokens, logprobs) in enumerate(zip(r["responses"], r["logprobs"]))] for r in rounds]
    first = token_gaps(sampled[0], {"old": old}, prompts, args.temperature, device)
    second = token_gaps(sampled[1], {"new": new, "old": old}, prompts, args.temperature, device)
    assert first["old"].median() < RELOAD_TOLERANCE[device.type], "the first round is not the SFT weights'"
    judge_reload("the round after the reload", second["new"], second["old"], device)
    return (f"round 1 median gap {first['old'].median():.1e} to v0; round 2 {second['new'].median():.1e} to v1, "
            f"{second['old'].median():.2f} to v0" + (f"; {buffer.numel() * buffer.element_size():,} bytes handed "
                                                     "off" if lora_rank else ""))


def seeded_sampling_main(use_cuda: bool, repeats: int, replies) -> None:
    """(g) In its own process (vLLM in-process, as the generator runs it): sampling_seeds.py's timing."""
    import sampling_seeds

    replies.put(sampling_seeds.seed_costs(tiny_world.SHIPPED["tldr"], repeats, use_cuda, 0.3))


def seeded_sampling(device: torch.device, repeats: int = 10) -> str:
    """(g) What a seed per prompt costs vLLM's sampler: the demo's training round (32 prompts x 2 samples of 16
    tokens) and evaluation (128 prompts x 1), with seeds and without, on the shipped TL;DR world's policy (hub-free),
    in an engine built as async_dpo.py builds it. A measurement: it fails only if the timing fails."""
    ctx = mp.get_context("spawn")
    replies = ctx.Queue()
    process = ctx.Process(target=seeded_sampling_main, args=(device.type == "cuda", repeats, replies))
    process.start()
    try:
        costs = replies.get(timeout=600)
    finally:
        process.join(timeout=60)
        if process.is_alive():
            process.kill()
    for kind, (seeded, unseeded) in costs.items():
        print(f"(g) {kind}: {seeded:.1f} ms with a seed per prompt, {unseeded:.1f} ms without: "
              f"{seeded / unseeded:.2f}x", flush=True)
    return ", ".join(f"{kind.split(' (')[0]} {seeded / unseeded:.2f}x" for kind, (seeded, unseeded) in costs.items())


# --- Running the checks: each timed, one table -----------------------------------------------------------------------
def run_check(name: str, function, *inputs) -> tuple:
    """Run one check: (its name, its result: pass, FAIL or skipped, its figure or its error or why it was
    skipped, its seconds). A check's SystemExit (a script's refusal at start-up) is its failure, not the run's end."""
    start = time.time()
    try:
        figure, result = function(*inputs) or "", "pass"
    except Skipped as reason:
        figure, result = str(reason), "skipped"
    except (Exception, SystemExit) as error:  # (one check's failure must not hide the others' results)
        traceback.print_exc()
        figure, result = f"{type(error).__name__}: {str(error).splitlines()[0][:300] if str(error) else ''}", "FAIL"
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()
    print(f"== {name}: {result} in {time.time() - start:.0f} s", flush=True)
    return name, result, figure, time.time() - start


def skipped(reason: str):
    """A check this machine cannot run: listed in the table as skipped, with why."""
    def check() -> None:
        raise Skipped(reason)
    return check


class Skipped(Exception):
    pass


def check_list(args: Args, device: torch.device) -> list:
    """(name, function, inputs) of each check this run makes: --learner_only, the ones without vLLM; those this
    machine cannot run listed as skipped. The vLLM checks first: a lent GPU's time may run out."""
    gpus = torch.cuda.device_count()
    # (h): two engines and a learner, a GPU each (the scripts' rule); (e) and DDP over NCCL: a GPU per rank
    two_engines = gpus == 0 or gpus >= 3
    engine_checks = [
        ("(f) in-flight reload, fully_async_grpo.py" + (", (h) two engines" if two_engines else ""), inflight_reload,
         device, 2 if two_engines else 1),
        *([] if two_engines else [("(h) two engines", skipped(f"needs 3 GPUs (2 engines, a learner), {gpus} here"))]),
        ("(f) reload between rounds, async_dpo.py", reload_between_rounds, device),
        ("(f) LoRA hand-off between rounds, async_dpo.py --lora_rank 8", reload_between_rounds, device, 8),
        ("(g) seeded sampling's cost", seeded_sampling, device, 10 if device.type == "cuda" else 1)]  # (CPU: CI's)
    learner_checks = [
        ("(a) learner step and resume", learner_step, args, device),
        ("(i) the LoRA preset's learner step", learner_step, args, device, LORA_PRESET["rank"]),
        ("(d) precision parity at step 0", precision_parity, args, device),
        ("(c) weight hand-off, one buffer", weight_handoff, args, device),
        ("(c) weight hand-off, k + 1 slots", weight_handoff, args, device, 3),  # (fully_async_grpo.py at k = 2)
        (f"(b, e) collectives on 2 ranks{' (gloo only)' if gpus == 1 else ''}", collectives),
        *([("(e) --fsdp load, DDP over NCCL", skipped("need a GPU per rank, one here"))] if gpus == 1 else [])]
    return learner_checks if args.learner_only else engine_checks + learner_checks


def collectives(world_size: int = 2) -> str:
    """(b) and (e) on `world_size` torchrun ranks (this file with --collectives_worker)."""
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                             str(world_size), os.path.abspath(__file__), "--collectives_worker"],
                            capture_output=True, text=True, timeout=600)
    print(result.stdout, result.stderr[-3000:] if result.returncode else "", sep="", flush=True)
    assert result.returncode == 0, f"the torchrun ranks failed (exit code {result.returncode})"
    return next((line.split(": ", 1)[-1] for line in result.stdout.splitlines() if "DDP gradient all-reduce" in line),
                "")


if __name__ == "__main__":
    args = tyro.cli(Args)
    if args.collectives_worker:
        collectives_worker()
        sys.exit(0)
    if args.estimate_only:
        print_estimate_table(args)
        sys.exit(0)
    if os.path.exists("/dev/nvidia0") and not torch.cuda.is_available():  # (never a CPU run passed as a GPU's)
        sys.exit(f"error: this machine has an NVIDIA GPU (/dev/nvidia0) but torch cannot use it (torch "
                 f"{torch.__version__}, CUDA {torch.version.cuda}): the checks would run on the CPU")
    if not args.learner_only and importlib.util.find_spec("vllm") is None:
        print("vLLM is not installed: the learner's checks only (--learner_only)", flush=True)
        args.learner_only = True
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cpu":
        args.model = "cpu-small"
    print(f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'no GPU'}), "
          f"model {args.model}, micro-batch {args.per_device_train_batch_size} x 2 sequences of "
          f"{args.prompt_length} + {args.response_length} tokens", flush=True)
    start, results = time.time(), []
    for name, function, *inputs in check_list(args, device):
        letters = {x for group in re.findall(r"\(([a-i](?:, [a-i])*)\)", name) for x in group.split(", ")}
        if not args.only or letters & set(args.only):  # ("(b, e) ...", "(f) ..., (h) ...": each letter)
            results.append(run_check(name, function, *inputs))
    print("\n| check | result | measured | seconds |\n|---|---|---|---|")
    for name, result, figure, seconds in results:
        print(f"| {name} | {'**FAIL**' if result == 'FAIL' else result} | {figure} | {seconds:.0f} |")
    failed, passed = (sum(result == r for _, result, _, _ in results) for r in ("FAIL", "pass"))
    print(f"\ngpu_check{' --learner_only' if args.learner_only else ''}: {passed} of {len(results)} checks passed, "
          f"{len(results) - passed - failed} skipped, in {time.time() - start:.0f} s on "
          f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'the CPU'}", flush=True)
    sys.exit(1 if failed else 0)
