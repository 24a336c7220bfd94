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
      (steps at lr 0 with plain SGD, which holds no state; each algorithm's peak GPU memory printed).

    python benchmarks/gpu_check.py                       # a few minutes on one 80 GB GPU (pythia-2.8b)
    python benchmarks/gpu_check.py --model pythia-410m   # smaller
    python benchmarks/gpu_check.py --estimate_only       # print the README's memory table and stop

On a machine without a GPU it runs the same code on the CPU with a small model (what CI runs, so it cannot rot).
"""
import gc
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Literal

import torch
import torch.multiprocessing as mp
import tyro

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from types import SimpleNamespace  # noqa: E402

import async_dpo  # noqa: E402
from plumbing import checkpoint, core  # noqa: E402
from plumbing.generator_io import Generator, GeneratorError  # noqa: E402

GIB = 2**30
PYTHIA = {  # hidden size, layers, heads (from the EleutherAI Pythia configs; vocabulary 50304, intermediate 4x hidden)
    "pythia-410m": (1024, 24, 16), "pythia-1b": (2048, 16, 8), "pythia-2.8b": (2560, 32, 32),
    "pythia-6.9b": (4096, 32, 32), "cpu-small": (128, 2, 4),
}


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
    collectives_worker: bool = False
    """internal: run as one torchrun rank of check (b)"""


def model_config(name: str):
    from transformers import GPTNeoXConfig, LlamaConfig

    if name == "llama-3.1-8b":  # meta-llama/Llama-3.1-8B's config.json (the No Robots preset's architecture)
        return LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                           num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False, num_labels=1)
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
    weight buffer, the activations, the generator's CUDA context, and the reward model's input embeddings, which
    stay gathered after its forward because its backbone is called as its own FSDP root."""
    config = model_config(name)
    gathered_embeddings = 2 * config.vocab_size * config.hidden_size / GIB
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
    gold = parameter_count(model_config("pythia-6.9b"))
    embeddings = 2 * 50304 * PYTHIA["pythia-6.9b"][0] / GIB
    print(f"\nthe 6.9B gold reward model (--gold_reward_model_path) adds {2 * gold / GIB:.1f} GiB in bfloat16 "
          f"(with --fsdp over 3: a third of that, plus {embeddings:.1f} GiB of its embeddings, gathered)")
    print("not counted: the CUDA caching allocator's fragmentation, NCCL's buffers, and the peak of a checkpointed "
          "block's recomputation beyond the working set above")


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
                generator_chosen_logps=torch.zeros(M),
                generator_rejected_logps=torch.zeros(M), kl=torch.zeros(M),
                ref_chosen_logps=ref_logps[:M], ref_rejected_logps=ref_logps[M:])


def learner_step(args: Args, device: torch.device) -> None:
    """(a) One learner step through the script's own functions, timing it and measuring peak memory."""
    from transformers import AutoModelForCausalLM, GPTNeoXForSequenceClassification

    config, dtype = model_config(args.model), torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    policy = core.train_without_dropout(AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(device), True)
    ref_policy = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(device).eval().requires_grad_(False)
    reward_model = GPTNeoXForSequenceClassification(config).to(dtype)
    reward_model.score.float()
    reward_model.retokenize = None  # it shares the policy's tokens (as plumbing.reward_models says)
    reward_model = reward_model.to(device).eval().requires_grad_(False)
    table = async_dpo.weight_table(policy)
    buffer = async_dpo.make_weight_buffer(table, dtype, device)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-6, fused=device.type == "cuda")
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    autocast = torch.autocast(device.type, dtype=dtype, enabled=device.type == "cuda")
    run = core.Run(device, autocast, 0, 0)  # the run's fixed facts (random tokens: 0 ends and pads)
    run_args = dpo_args(args.per_device_train_batch_size)
    M, vocab = args.per_device_train_batch_size, config.vocab_size
    prompts = torch.randint(1, vocab, (M, args.prompt_length)).tolist()
    chosen, rejected = (torch.randint(1, vocab, (M, args.response_length)).tolist() for _ in range(2))
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
        print(f"(a) step {step}: learner step {sync_start - start:.2f} s, weight snapshot "
              f"{time.time() - sync_start:.3f} s, DPO loss {loss:.4f}", flush=True)
    assert math.isfinite(loss), "the DPO loss is not finite"
    estimate = memory_estimate(args.model, M, args.prompt_length + args.response_length, args.response_length)
    expected = sum(v for k, v in estimate.items() if k not in ("parameters (B)", "generator's CUDA context"))
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / GIB
        print(f"(a) peak GPU memory {peak:.1f} GiB; README estimate {expected:.1f} GiB "
              f"({json.dumps({k: round(v, 2) for k, v in estimate.items()})})")
    else:
        print(f"(a) no GPU: ran on the CPU; the README's estimate for this model would be {expected:.2f} GiB")
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


def precision_parity(args: Args, device: torch.device) -> None:
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
    policy = core.train_without_dropout(AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(device), True)
    reference = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(device).eval().requires_grad_(False)
    reference.load_state_dict(policy.state_dict())  # what the scripts load: the SFT weights in float32
    old_regime = AutoModelForCausalLM.from_config(config, dtype=dtype).to(device).eval().requires_grad_(False)
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
    value_model = core.train_without_dropout(GPTNeoXForSequenceClassification(config).to(device), True)
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
    print(f"(d) PPO step 0, w = pi_old / mu per token (mu: the sampler in {dtype}): min {stats['is/weight_min']:.4f}, "
          f"max {stats['is/weight_max']:.4f}, |log pi_old - log mu| mean {stats['offpolicy/mismatch_mean']:.2e}, "
          f"max {stats['offpolicy/mismatch_max']:.2e}, k3 KL {stats['offpolicy/kl_k3']:.2e}", flush=True)
    print_peak_memory("(d) PPO", device)
    del model, value_model
    # RLOO: sequence-level ratios (a sum over the response's tokens, so per-token differences add up)
    learner_seq = async_dpo.logprobs_in_chunks(policy, ppo_prompts, ppo_responses, temperature, M,
                                               run_in(autocast)).sum(1)
    for name, old_logps in (("recomputed", learner_seq), ("sampler's", bf16_logps)):
        mini_batch = dict(prompts=ppo_prompts, responses=ppo_responses, old_logps=old_logps,
                          advantages=torch.randn(n), generator_logps=old_logps, rewards=torch.zeros(n),
                          advantage_std=[1.0] * n, response_mask=torch.ones(n, width), is_factor=torch.ones(n),
                          **logged_only, kl=torch.zeros(n))
        stats = async_rloo.rloo_update(policy, *optimizer_for(policy), mini_batch, one_step_args(async_rloo, n),
                                       run_in(autocast))
        print(f"(d) RLOO step 0, pi_old {name}: ratio mean {stats['policy/ratio_mean']:.6f}, max "
              f"{stats['policy/ratio_max']:.4f}, clip fraction {stats['policy/clipfrac']:.4f}", flush=True)
        if name == "recomputed":
            assert max(abs(stats["policy/ratio_mean"] - 1), stats["policy/ratio_max"] - 1) < tolerance * 10, \
                "RLOO's first ratio is not 1"
    print_peak_memory("(d) RLOO", device)


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


def weight_handoff(args: Args, device: torch.device, slots: int = 0) -> None:
    """(c) Write versions 1..5 (every parameter set to the version number) and have a spawned reader check them:
    into the one buffer of the paper's scripts, or (`slots`) into slot version mod slots of fully_async_grpo.py's."""
    from transformers import AutoModelForCausalLM

    import fully_async_grpo

    model = AutoModelForCausalLM.from_config(model_config(args.model), dtype=torch.float32).to(device)
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


if __name__ == "__main__":
    args = tyro.cli(Args)
    if args.collectives_worker:
        collectives_worker()
        sys.exit(0)
    if args.estimate_only:
        print_estimate_table(args)
        sys.exit(0)
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cpu":
        args.model = "cpu-small"
    print(f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'no GPU'}), "
          f"model {args.model}, micro-batch {args.per_device_train_batch_size} x 2 sequences of "
          f"{args.prompt_length} + {args.response_length} tokens", flush=True)
    learner_step(args, device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    precision_parity(args, device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    weight_handoff(args, device)
    weight_handoff(args, device, slots=3)  # (fully_async_grpo.py at k = 2)
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                    os.path.abspath(__file__), "--collectives_worker"], check=True)
    print("gpu_check: all checks passed")
