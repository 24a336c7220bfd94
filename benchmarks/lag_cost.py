"""What the `lag/update` metric costs: the scripts copy the policy's parameters to host memory before a step
(core.parameters_copy) and compare after it (core.relative_update, which moves each copy back to the device), every
--lag_every steps (default 10; `--model tiny`: 1). Timed here, medians of --repeats, on the tiny world's policy and
on a model of a preset's architecture with random weights (on this machine's device: a GPU if there is one).

    python benchmarks/lag_cost.py                           # the tiny policy, and pythia-410m's size
    python benchmarks/lag_cost.py --model pythia-2.8b       # on a GPU: the size the docs quote
    python benchmarks/lag_cost.py --quick                   # the tiny policy only (CI)
"""
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Literal

import torch
import tyro

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from gpu_check import model_config  # noqa: E402

import tiny_world  # noqa: E402
from plumbing import core  # noqa: E402


@dataclass
class Args:
    tiny_dir: str = tiny_world.SHIPPED["tldr"]
    """the tiny world (built there if missing)"""
    model: Literal["pythia-410m", "pythia-1b", "pythia-2.8b"] = "pythia-410m"
    """the larger model's architecture (random weights)"""
    repeats: int = 5
    """measurements per model (their median is printed)"""
    quick: bool = False
    """the tiny policy only"""


def measure(model: torch.nn.Module, repeats: int) -> float:
    """Median seconds of one measurement of lag/update: the copy before a step, the comparison after it."""
    times = []
    for _ in range(repeats):
        start = time.time()
        before = core.parameters_copy(model)
        with torch.no_grad():
            next(model.parameters()).add_(1e-3)  # (a step's change, so that the update is not 0)
        update = core.relative_update(model, before, world_size=1)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.time() - start)
        assert update > 0
    return statistics.median(times)


if __name__ == "__main__":
    import transformers
    from transformers import AutoModelForCausalLM

    args = tyro.cli(Args)
    transformers.utils.logging.disable_progress_bar()
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    sft = tiny_world.tldr_world(args.tiny_dir)[0]
    models = {"tiny policy": lambda: AutoModelForCausalLM.from_pretrained(sft)}
    if not args.quick:
        models[args.model] = lambda: AutoModelForCausalLM.from_config(model_config(args.model), dtype=torch.float32)
    print(f"| model on {device.type} | parameters | float32 bytes | one measurement | per step, every step | "
          f"per step, every 10 |")
    print("|---|---|---|---|---|---|")
    for name, build in models.items():
        model = build().to(device)
        count = sum(p.numel() for p in model.parameters())
        seconds = measure(model, args.repeats)
        print(f"| {name} | {count / 1e6:.1f} M | {4 * count / 2**30:.2f} GiB | {1000 * seconds:.1f} ms | "
              f"{1000 * seconds:.1f} ms | {100 * seconds:.1f} ms |", flush=True)
        del model
