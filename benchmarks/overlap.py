"""How well does async_dpo.py overlap generation with training? Runs the asynchronous pipeline on CPU with a model
large enough that one generation and one training step each take ~0.3 s or more, generator and learner pinned to
separate cores, and prints

    overlap_efficiency = mean step time / mean max(generation time, training time)

over the steady-state steps (1.00 is perfect overlap; the paper's runs sit near 1.17).

    python benchmarks/overlap.py            # ~3 minutes on 2 cores
"""
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass

import tyro

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
import tiny_world  # noqa: E402


@dataclass
class Args:
    steps: int = 30
    """optimizer steps to run"""
    warmup_steps: int = 5
    """steps left out of the averages (engine and allocator warm-up)"""
    hidden_size: int = 256
    """width of the benchmark's Pythia-architecture model"""
    num_layers: int = 4
    """depth of the benchmark's model"""
    batch_size: int = 3
    """prompts per step (x 2 samples): 3 made the two phases about equal, as in the paper's runs, on the machine of the
    first measurement; which phase is heavier depends on the CPU (docs/results.md gives both measurements)"""
    response_length: int = 128
    """tokens per completion (the model is untrained, so completions run to this length)"""
    max_prompt_length: int = 48
    """prompt tokens kept"""
    cache_dir: str = "~/.cache/async-rlhf/overlap-model-v2"
    """where the benchmark's model is built once"""


def run_pipeline(script: str, sft: str, reward: str, data: str, args: Args, output_dir: str, *extra: str) -> list:
    """Run one of the DPO scripts on the benchmark model; return its records (steps and evaluations)."""
    command = [sys.executable, os.path.join(REPO, script), "--model", "tiny", "--sft_model_path", sft,
               "--reward_model_path", reward, "--dataset", data, "--batch_size", str(args.batch_size),
               "--per_device_train_batch_size", str(args.batch_size), "--response_length", str(args.response_length),
               "--max_prompt_length", str(args.max_prompt_length),
               "--total_episodes", str(args.steps * args.batch_size),
               # evaluations only before the clock starts and after the last step: never inside the timed steps
               "--eval_every", "0", "--num_eval_prompts", "64", "--num_final_eval_prompts", "64",
               "--output_dir", output_dir, *extra]
    subprocess.run(command, check=True, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return [json.loads(line) for line in open(os.path.join(output_dir, "metrics.jsonl"))]


def mean(values: list) -> float:
    return sum(values) / len(values)


if __name__ == "__main__":
    args = tyro.cli(Args)
    sft, reward, data = tiny_world.build_untrained(args.cache_dir, args.hidden_size, args.num_layers)
    with tempfile.TemporaryDirectory() as output_dir:
        records = run_pipeline("async_dpo.py", sft, reward, data, args, output_dir)
    steps = [r for r in records if "time/step" in r]
    steady = steps[args.warmup_steps:]
    print(f"{'step':>4} {'generation':>10} {'weight_load':>11} {'training':>9} {'weight_sync':>11} {'wait':>6} "
          f"{'step_time':>9}")
    for r in steady:
        print(f"{r['step']:>4} {r['time/generation']:>10.3f} {r['time/weight_load']:>11.4f} {r['time/training']:>9.3f}"
              f" {r['time/weight_sync']:>11.4f} {r['time/learner_wait']:>6.3f} {r['time/step']:>9.3f}")
    generation, training = mean([r["time/generation"] for r in steady]), mean([r["time/training"] for r in steady])
    step_time = mean([r["time/step"] for r in steady])
    ideal = mean([max(r["time/generation"], r["time/training"]) for r in steady])
    print(f"mean generation={generation:.3f}s training={training:.3f}s step={step_time:.3f}s "
          f"(sequential would be {generation + training:.3f}s)")
    print(f"overlap_efficiency={step_time / ideal:.2f}")
