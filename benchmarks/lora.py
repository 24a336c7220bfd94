"""LoRA (--lora_rank) against full fine-tuning: what the hand-off carries and costs, what each side's memory peaks at,
and what the demo learns.

Table 1, the hand-off, per model: the bytes one version puts in the buffer (async_dpo.py's weight_table over what
trains), the learner's seconds to write them (write_weight_snapshot: the scripts' `time/weight_sync`), and the
generator's seconds to take them into vLLM (the scripts' `time/weight_load`: reload_weights in place, or the adapter
written to /dev/shm and added, plumbing.lora.load_adapter); medians of 5. Table 2, memory: the peak resident memory
of a learner process (the policy, the reference and AdamW's state after one step on 8 prompts of 64 tokens, the
buffer) and of a generator process (vLLM's engine, with LoRA sized for one rank-r adapter, the buffer, after loading
5 versions), each in a process of its own. The models: the tiny world's policy, and two real architectures written
to a local folder with random weights (pythia-160m's, which vLLM serves through its Transformers backend like the
tiny one, and Qwen2.5-0.5B's, a model vLLM implements itself, its q, k, v projections packed into one): bytes and
seconds depend on the shapes, not the values. On a CPU in float32; a GPU's bfloat16 halves the bytes.

Table 3, learning: the demo (async_dpo.py --model tiny, 60 steps) with LoRA at rank 8 against full fine-tuning at
its own learning rate (1e-4). LoRA's learning rate is picked on seed 1 from a small sweep, then both are run on
seeds 2-4, which the pick never saw, and compared seed by seed (the gap judged on the t-distribution).

    python benchmarks/lora.py            # all three tables (the runs kept in benchmarks/runs/lora: resumable)
    python benchmarks/lora.py --quick    # the hand-off and memory of the tiny world only (what CI runs)
"""
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Optional

import torch
import tyro

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import stats  # noqa: E402
from benchmarks.off_policy import sweep_folder, train  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REAL_SHAPES = {  # config.json fields of real checkpoints (their hub names), written with random weights
    "pythia-160m": dict(architectures=["GPTNeoXForCausalLM"], model_type="gpt_neox", hidden_size=768,
                        num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072, vocab_size=50304,
                        rotary_pct=0.25, max_position_embeddings=2048, use_parallel_residual=True,
                        tie_word_embeddings=False, bos_token_id=0, eos_token_id=0),
    "qwen2.5-0.5b": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=896,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         intermediate_size=4864, vocab_size=151936, max_position_embeddings=32768,
                         tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151643, rope_theta=1e6),
}
SWEEP = (3e-4, 1e-3, 3e-3)  # LoRA's learning rates tried on seed 1
FULL_LR = 1e-4  # the demo's (async_dpo.py's TINY_DEFAULTS)


@dataclass
class Args:
    quick: bool = False
    """the tiny world's hand-off and memory only (a minute): what CI runs"""
    runs_dir: Optional[str] = None
    """where the learning runs and the real architectures' folders go (default: benchmarks/runs/lora)"""
    lora_rank: int = 8
    """the adapter's rank in every table"""
    tables: str = "handoff,learning"
    """which tables: handoff (tables 1 and 2), learning (table 3)"""
    one: Optional[str] = None
    """(internal) measure one side in this process: `learner|generator,MODEL_PATH,RANK`"""


def model_folders(folder: str, quick: bool) -> dict:
    """The tiny world's policy, and (not --quick) the real architectures with random weights, written once."""
    from transformers import AutoConfig, AutoModelForCausalLM

    import tiny_world

    models = {"tiny world": os.path.join(tiny_world.SHIPPED["tldr"], "sft")}
    for name, fields in ({} if quick else REAL_SHAPES).items():
        path = os.path.join(folder, "models", name)
        if not os.path.exists(os.path.join(path, "model.safetensors")):
            config = AutoConfig.for_model(fields.pop("model_type"), **fields)
            torch.manual_seed(0)
            AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
        models[name] = path
    return models


def peak_mib() -> float:
    """This process's peak resident memory (VmHWM: ru_maxrss would count the parent's at the fork)."""
    status = open("/proc/self/status").read()
    return int(status.split("VmHWM:")[1].split()[0]) / 1024  # (kB)


def measure_learner(path: str, rank: int) -> dict:
    """The learner side, as async_dpo.py builds it: the policy (with its adapter), the reference (a second copy, or
    the adapter off), AdamW after one step; then the hand-off's bytes and snapshot seconds."""
    from transformers import AutoModelForCausalLM

    import async_dpo
    from plumbing import lora

    args = async_dpo.Args(lora_rank=rank)
    policy = lora.add_adapter(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), args).train()
    if rank:
        reference = lora.AdapterOff(policy)
    else:
        reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval().requires_grad_(False)
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-5)
    ids = torch.randint(0, policy.config.vocab_size, (8, 64))
    with torch.no_grad():
        reference(input_ids=ids)
    policy(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    table = async_dpo.weight_table(policy)
    buffer = async_dpo.make_weight_buffer(table, torch.float32, torch.device("cpu"))
    seconds = []
    for _ in range(5):
        start = time.perf_counter()
        async_dpo.write_weight_snapshot(policy, buffer, table)
        seconds.append(time.perf_counter() - start)
    return dict(bytes=buffer.numel() * buffer.element_size(), snapshot=statistics.median(seconds),
                learner_mib=peak_mib())


def measure_generator(path: str, rank: int) -> dict:
    """The generator side: vLLM's engine (LoRA: sized for one adapter of rank r) taking 5 versions from a buffer
    of the hand-off's layout, as the scripts' generators do."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from transformers import AutoConfig, AutoModelForCausalLM

    import async_dpo
    from plumbing import lora

    args = async_dpo.Args(lora_rank=rank)
    with torch.device("meta"):
        model = lora.add_adapter(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path)), args)
        table, config = async_dpo.weight_table(model), lora.adapter_config(model)
    buffer = async_dpo.make_weight_buffer(table, torch.float32, torch.device("cpu")).normal_(0, 0.02)
    from vllm import LLM

    llm = LLM(model=path, dtype="float32", enforce_eager=True, max_model_len=256, kv_cache_memory_bytes=2**28,
              enable_chunked_prefill=False, max_num_batched_tokens=4096, **lora.engine_kwargs(args, max_loras=1))
    seconds = []
    for version in range(1, 6):
        weights, start = async_dpo.weights_from_buffer(buffer, table), time.perf_counter()
        if rank:
            lora.load_adapter(llm, weights, version, config)
        else:
            llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        seconds.append(time.perf_counter() - start)
    return dict(load=statistics.median(seconds), generator_mib=peak_mib())


def measured(side: str, path: str, rank: int) -> dict:
    """One side measured in a process of its own (its peak memory its own; vLLM's patches of transformers' model
    classes kept out of the learner's)."""
    result = subprocess.run([sys.executable, __file__, "--one", f"{side},{path},{rank}"], cwd=REPO,
                            capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"measuring the {side} of {path} at rank {rank} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def handoff_tables(models: dict, rank: int) -> None:
    rows = {}
    for name, path in models.items():
        for r in (0, rank):
            rows[name, r] = {**measured("learner", path, r), **measured("generator", path, r)}
    print(f"\nTable 1: the hand-off of one version, full fine-tuning against LoRA at rank {rank} (float32, CPU; "
          "medians of 5)")
    print(f"{'model':<14} {'weights':<9} {'bytes':>12} {'learner writes (s)':>19} {'vLLM loads (s)':>15}")
    for (name, r), row in rows.items():
        print(f"{name:<14} {'LoRA' if r else 'all':<9} {row['bytes']:>12,} {row['snapshot']:>19.4f} "
              f"{row['load']:>15.4f}")
    for name in models:
        full, adapter = rows[name, 0], rows[name, rank]
        print(f"  {name}: LoRA's hand-off is {adapter['bytes'] / full['bytes']:.2%} of the bytes; the learner's "
              f"write {full['snapshot'] / adapter['snapshot']:.1f}x faster, vLLM's load "
              f"{full['load'] / adapter['load']:.1f}x faster")
    print("\nTable 2: peak resident memory of each side's process (MiB; the learner: policy, reference, AdamW after a "
          "step, the buffer; the generator: vLLM's engine, the buffer, 5 loads)")
    print(f"{'model':<14} {'weights':<9} {'learner':>9} {'generator':>10}")
    for (name, r), row in rows.items():
        print(f"{name:<14} {'LoRA' if r else 'all':<9} {row['learner_mib']:>9.0f} {row['generator_mib']:>10.0f}")
    for name in models:
        full, adapter = rows[name, 0], rows[name, rank]
        print(f"  {name}: LoRA changes the learner's peak by {adapter['learner_mib'] - full['learner_mib']:+.0f} "
              f"MiB (no reference copy, AdamW's state for the adapter alone, the adapter's buffer) and the "
              f"generator's by {adapter['generator_mib'] - full['generator_mib']:+.0f} MiB (the buffer it maps is "
              f"the adapter's, no full reload's copies; vLLM's adapter slot added)")


def learning_table(folder: str, rank: int) -> None:
    """LoRA's learning rate picked on seed 1, then LoRA and full fine-tuning on seeds 2-4."""
    def run(lr: float, seed: int, lora_rank: int) -> dict:
        name = f"{'lora' if lora_rank else 'full'}_lr{lr:g}_seed{seed}"
        flags = ["--seed", str(seed), "--learning_rate", str(lr), "--lora_rank", str(lora_rank)]
        return train("async_dpo.py", flags, os.path.join(folder, name), 60, f"{name} ...")

    sweep = {lr: run(lr, 1, rank) for lr in SWEEP}
    best = max(SWEEP, key=lambda lr: sweep[lr]["final"]["eval/gold_win_rate"])
    print(f"\nTable 3a: LoRA (rank {rank}) on seed 1, by learning rate: gold win rate after 60 steps (SFT "
          f"{sweep[best]['sft']['eval/gold_win_rate']:.3f})")
    for lr, result in sweep.items():
        print(f"  lr {lr:g}: {result['final']['eval/gold_win_rate']:.3f}{'  <- picked' if lr == best else ''}")
    seeds = (2, 3, 4)
    lora_runs = [run(best, seed, rank) for seed in seeds]
    full_runs = [run(FULL_LR, seed, 0) for seed in seeds]
    gold = {name: [r["final"]["eval/gold_win_rate"] for r in runs] for name, runs in
            (("lora", lora_runs), ("full", full_runs))}
    sft = [r["sft"]["eval/gold_win_rate"] for r in full_runs]
    print(f"\nTable 3b: gold win rate after 60 steps on seeds {', '.join(map(str, seeds))} (SFT {stats.fmt(sft)})")
    family = [("full - SFT", stats.gap(gold["full"], sft)), ("LoRA - SFT", stats.gap(gold["lora"], sft)),
              ("LoRA - full", stats.gap(gold["lora"], gold["full"]))]
    print(f"  full fine-tuning (lr {FULL_LR:g}): {stats.fmt(gold['full'])}   gain over SFT {family[0][1]['text']}")
    print(f"  LoRA rank {rank} (lr {best:g}):      {stats.fmt(gold['lora'])}   gain over SFT {family[1][1]['text']}")
    print(f"  LoRA - full: {family[2][1]['text']}\n  {stats.holm_line(family)}")


if __name__ == "__main__":
    args = tyro.cli(Args)
    if args.one:
        side, path, rank = args.one.split(",")
        print(json.dumps((measure_learner if side == "learner" else measure_generator)(path, int(rank))))
        sys.exit(0)
    folder, keep = sweep_folder(args.runs_dir, "lora", args.quick)
    tables = set(args.tables.split(","))
    if tables - {"handoff", "learning"}:
        sys.exit(f"--tables {args.tables}: unknown; handoff, learning or both")
    if "handoff" in tables:
        handoff_tables(model_folders(folder, args.quick), args.lora_rank)
    if "learning" in tables and not args.quick:
        learning_table(folder, args.lora_rank)
    if not keep:
        shutil.rmtree(folder, ignore_errors=True)
