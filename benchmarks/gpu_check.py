"""Checks of the learner's GPU code paths that need no vLLM and no downloads, built from async_dpo.py's own functions.

  (a) one real learner step (reward scoring, reference log-probs, a DPO update with gradient checkpointing, fused
      AdamW, the weight snapshot) with Pythia's architecture and random weights, at the preset's micro-batch and
      sequence lengths, printing peak GPU memory beside the README's estimate;
  (b) the learner ranks' collectives under `torchrun --nproc_per_node 2`, on the process group the scripts create
      (reduce_sums and share go over gloo; DDP's gradient all-reduce over NCCL when there are two GPUs);
  (c) the weight hand-off to a spawned reader process through the scripts' shared buffer (CUDA IPC on a GPU),
      checking that the reader sees each new version whole, never a mix of two.

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
import time
from dataclasses import dataclass
from typing import Literal

import torch
import torch.multiprocessing as mp
import tyro

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import async_dpo  # noqa: E402

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


def pythia_config(name: str):
    from transformers import GPTNeoXConfig

    hidden, layers, heads = PYTHIA[name]
    return GPTNeoXConfig(vocab_size=50304 if name != "cpu-small" else 512, hidden_size=hidden,
                         num_hidden_layers=layers, num_attention_heads=heads, intermediate_size=4 * hidden,
                         rotary_pct=0.25, max_position_embeddings=2048, num_labels=1)


def parameter_count(config) -> int:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())


def memory_estimate(name: str, micro_batch: int, sequence_length: int, response_length: int,
                    algorithm: str = "dpo") -> dict:
    """GiB per learner GPU for one replica (DDP), by component. Policy: float32 weights, gradients and two AdamW
    moments (16 bytes a parameter); reference, reward model and weight buffer in bfloat16 (2 bytes each).
    Activations of one micro-batch with gradient checkpointing: each block's float32 input kept for the backward
    pass, one block's working set while it is recomputed (~20 bytes a hidden unit with SDPA attention), and the
    response logits (bfloat16, their float32 copy, log-softmax and its gradient).
    DPO: a micro-batch is 2 x micro_batch sequences (chosen and rejected). PPO (one completion per prompt):
    micro_batch sequences, and a value model (the reward model's backbone and head, trained: 16 bytes a parameter)
    whose blocks keep their inputs too; the entropy adds a float32 copy of the response logits."""
    config = pythia_config(name)
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
    return {**estimate, "reference": 2 * params / GIB, "reward model": 2 * params / GIB,
            "weight buffer": 2 * params / GIB, "activations / micro-batch": activations / GIB}


def print_estimate_table(args: Args) -> None:
    for algorithm in ("dpo", "ppo"):
        columns = list(memory_estimate("cpu-small", 1, 2, 1, algorithm))[1:]
        print(f"\n{algorithm.upper()}\n\n| model | params | " + " | ".join(columns) +
              " | total (DDP, per learner GPU) | FSDP over 3 learners (rank 0) |")
        print("|---" * (len(columns) + 4) + "|")
        for name in ("pythia-410m", "pythia-1b", "pythia-2.8b"):
            e = memory_estimate(name, args.per_device_train_batch_size, args.prompt_length + args.response_length,
                                args.response_length, algorithm)
            unsharded = e["weight buffer"] + e["activations / micro-batch"]
            total = sum(v for k, v in e.items() if k != "parameters (B)")
            fsdp = (total - unsharded) / 3 + unsharded
            print(f"| {name} | {e['parameters (B)']:.2f} B | " + " | ".join(f"{e[k]:.1f}" for k in columns) +
                  f" | **{total:.1f} GiB** | {fsdp:.1f} GiB |")
    gold = parameter_count(pythia_config("pythia-6.9b"))
    print(f"\nthe 6.9B gold reward model (--gold_reward_model_path) adds {2 * gold / GIB:.1f} GiB in bfloat16 "
          f"(a third of that per learner with --fsdp over 3)")


def learner_step(args: Args, device: torch.device) -> None:
    """(a) One learner step through the script's own functions, timing it and measuring peak memory."""
    from transformers import AutoModelForCausalLM, GPTNeoXForSequenceClassification

    config, dtype = pythia_config(args.model), torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    policy = async_dpo.prepare_policy(AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(device), True)
    ref_policy = AutoModelForCausalLM.from_config(config, dtype=dtype).to(device).eval().requires_grad_(False)
    reward_model = GPTNeoXForSequenceClassification(config).to(dtype)
    reward_model.score.float()
    reward_model = reward_model.to(device).eval().requires_grad_(False)
    table = async_dpo.weight_table(policy)
    buffer = async_dpo.make_weight_buffer(table, dtype, device)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-6, fused=device.type == "cuda")
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    autocast = torch.autocast(device.type, dtype=dtype, enabled=device.type == "cuda")
    run_args = async_dpo.Args(per_device_train_batch_size=args.per_device_train_batch_size)
    M, vocab = args.per_device_train_batch_size, config.vocab_size
    prompts = torch.randint(1, vocab, (M, args.prompt_length)).tolist()
    chosen, rejected = (torch.randint(1, vocab, (M, args.response_length)).tolist() for _ in range(2))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for step in range(2):  # the second step has the AdamW moments allocated: the steady state
        start = time.time()
        scores = async_dpo.score_in_chunks(reward_model, prompts * 2, chosen + rejected, [True] * 2 * M, -1.0, 2 * M,
                                           0, device)
        ref_logps, _ = async_dpo.logprobs_in_chunks(ref_policy, prompts * 2, chosen + rejected, 0.7, 2 * M, 0, device)
        micro = dict(prompts=prompts, chosen=chosen, rejected=rejected, valid=(scores[:M] != scores[M:]).float(),
                     ref_chosen_logps=ref_logps[:M], ref_rejected_logps=ref_logps[M:])
        losses, _, _ = async_dpo.dpo_update(policy, optimizer, scheduler, [micro], float(M), run_args, 0, device,
                                            autocast)
        sync_start = time.time()
        async_dpo.write_weight_snapshot(policy, buffer, table)
        print(f"(a) step {step}: learner step {sync_start - start:.2f} s, weight snapshot "
              f"{time.time() - sync_start:.3f} s, DPO loss {losses.mean():.4f}", flush=True)
    assert math.isfinite(losses.mean().item()), "the DPO loss is not finite"
    estimate = memory_estimate(args.model, M, args.prompt_length + args.response_length, args.response_length)
    expected = sum(v for k, v in estimate.items() if k != "parameters (B)")
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / GIB
        print(f"(a) peak GPU memory {peak:.1f} GiB; README estimate {expected:.1f} GiB "
              f"({json.dumps({k: round(v, 2) for k, v in estimate.items()})})")
    else:
        print(f"(a) no GPU: ran on the CPU; the README's estimate for this model would be {expected:.2f} GiB")


def reader_main(buffer: torch.Tensor, table: list, versions, replies) -> None:
    """(c) The generator's side of the hand-off: on each new version, read the whole buffer the way the generator
    does (weights_from_buffer) and report the values it saw."""
    while (version := versions.get()) is not None:
        seen = torch.cat([w.reshape(-1) for _, w in async_dpo.weights_from_buffer(buffer, table)])
        replies.put((version, seen.min().item(), seen.max().item()))


def weight_handoff(args: Args, device: torch.device) -> None:
    """(c) Write versions 1..5 (every parameter set to the version number) and have a spawned reader check them."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(pythia_config(args.model), dtype=torch.float32).to(device)
    table = async_dpo.weight_table(model)
    buffer = async_dpo.make_weight_buffer(table, torch.bfloat16 if device.type == "cuda" else torch.float32, device)
    ctx = mp.get_context("spawn")
    versions, replies = ctx.Queue(maxsize=1), ctx.Queue(maxsize=1)
    reader = ctx.Process(target=reader_main, args=(buffer, table, versions, replies))
    reader.start()
    try:
        for version in range(1, 6):
            with torch.no_grad():
                for param in model.parameters():
                    param.fill_(version)
            start = time.time()
            async_dpo.write_weight_snapshot(model, buffer, table)  # must be complete before the reader is told
            elapsed = time.time() - start
            versions.put(version)
            seen = replies.get(timeout=300)
            print(f"(c) version {version}: snapshot {elapsed:.3f} s, reader saw values {seen[1]}..{seen[2]}",
                  flush=True)
            assert seen == (version, version, version), f"the reader saw a mix of versions: {seen}"
        versions.put(None)
        reader.join(timeout=60)
    finally:
        if reader.is_alive():
            reader.kill()
    assert reader.exitcode == 0, f"the reader process failed (exit code {reader.exitcode})"


def collectives_worker() -> None:
    """(b) One torchrun rank: the scripts' process group, their reduce_sums and share, and a DDP step."""
    use_cuda = torch.cuda.is_available()
    async_dpo.init_learner_group(use_cuda)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", rank % torch.cuda.device_count()) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    sums = async_dpo.reduce_sums({"rank": float(rank), "one": 1.0}, world_size)
    assert sums == {"rank": sum(range(world_size)), "one": world_size}, sums
    message = async_dpo.share({"kind": "train", "round": 3} if rank == 0 else None, rank, world_size)
    assert message == {"kind": "train", "round": 3}, message
    try:
        async_dpo.share(async_dpo.GeneratorError("test") if rank == 0 else None, rank, world_size)
        raise AssertionError("share did not raise the generator's error")
    except async_dpo.GeneratorError:
        pass
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
    else:
        backend = "skipped (NCCL needs a GPU per rank; this machine has one)"
    if rank == 0:
        print(f"(b) reduce_sums and share over gloo: ok; DDP gradient all-reduce: {backend}", flush=True)
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
    weight_handoff(args, device)
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", os.path.abspath(__file__),
                    "--collectives_worker"], check=True)
    print("gpu_check: all checks passed")
