"""LoRA (--lora_rank r > 0): a rank-r adapter trained on the frozen SFT weights, with `peft` on the learner and
vLLM's LoRA support in the generator. What each script keeps of it (the lesson): the reference is the base with
the adapter off, the hand-off's buffer holds the adapter's tensors only, and the generator samples each request
with the newest loaded version's adapter. What is here: the flags checked, the adapter added, the reference's
wrapper, the engine's LoRA settings, and an adapter written where vLLM reads it (core.check_flags checks the
flags, core.save_policy saves the adapter and, with --save_merged, the merged model)."""
import json
import os
import shutil
import tempfile
from typing import Optional

import torch

from plumbing.core import fail

VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM 0.32's max_lora_rank values (vllm/config/lora.py)
ALL_LINEAR = "all-linear"  # peft: every linear layer but the output layer


def add_adapter(model: torch.nn.Module, args) -> torch.nn.Module:
    """`model` under a fresh adapter (peft: A random, B zero, so it starts as the base exactly; no dropout, so that
    the learner's log-probs are the sampler's), or `model` itself with --lora_rank 0. On the meta device too."""
    if not args.lora_rank:
        return model
    from peft import LoraConfig, get_peft_model

    targets = args.lora_target_modules or [ALL_LINEAR]
    config = LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha or 2 * args.lora_rank, lora_dropout=0.0,
                        target_modules=targets[0] if targets == [ALL_LINEAR] else targets)
    try:
        return get_peft_model(model, config)
    except ValueError as error:  # (peft names the modules it did not find)
        fail(f"--lora_target_modules {' '.join(targets)}: {str(error).splitlines()[0]}")


class AdapterOff(torch.nn.Module):
    """The reference with LoRA: the policy with its adapter disabled, the SFT weights themselves, no second copy.
    (The policy is a submodule here, so core.chunks sees an FSDP2-sharded one.)"""

    def __init__(self, policy: torch.nn.Module):
        super().__init__()
        self.policy = policy

    def forward(self, **inputs):
        with self.policy.disable_adapter():
            return self.policy(**inputs)


def adapter_config(model: torch.nn.Module) -> Optional[dict]:
    """The adapter's PEFT config (what vLLM reads beside its tensors), or None without LoRA."""
    config = getattr(model, "peft_config", {}).get("default")
    return None if config is None else json.loads(json.dumps(config.to_dict(), default=list))


def engine_kwargs(args, max_loras: int) -> dict:
    """vLLM's LoRA settings: room for `max_loras` adapters at once (the versions the engine may hold) of the
    smallest rank vLLM allows at or above r."""
    if not args.lora_rank:
        return {}
    rank = next(r for r in VLLM_RANKS if r >= args.lora_rank)
    return dict(enable_lora=True, max_lora_rank=rank, max_loras=max_loras)


def load_adapter(llm, weights: list, version: int, config: dict):
    """Hand the engine version `version`'s adapter; returns the LoRARequest that names it. vLLM 0.32 loads an
    adapter from a folder only (LoRARequest has a path and no tensors; its from-tensors constructor is internal),
    so the adapter is written in PEFT's format to RAM-backed /dev/shm (a few MB: no disk; ram_folder), added at once
    (read into the engine's own memory) and the folder removed. Version v is adapter id v + 1 (vLLM: ids > 0, one per
    adapter); the engine evicts the least recently used one beyond max_loras."""
    from safetensors.torch import save_file
    from vllm.lora.request import LoRARequest

    nbytes = sum(tensor.numel() * tensor.element_size() for _, tensor in weights)
    folder = tempfile.mkdtemp(prefix=f"adapter-v{version}-", dir=ram_folder(nbytes))
    try:  # PEFT's file names its tensors without the adapter's name (".default")
        save_file({name.replace(".default", ""): tensor.detach().to("cpu").contiguous() for name, tensor in weights},
                  os.path.join(folder, "adapter_model.safetensors"))
        with open(os.path.join(folder, "adapter_config.json"), "w") as f:
            json.dump(config, f)
        request = LoRARequest(lora_name=f"v{version}", lora_int_id=version + 1, lora_path=folder)
        if not llm.llm_engine.add_lora(request):
            raise RuntimeError(f"vLLM did not load version {version}'s adapter")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return request


def ram_folder(nbytes: int) -> Optional[str]:
    """/dev/shm where it holds the adapter twice over; else None, tempfile's default: the generator's TMPDIR, the
    run's temporary folder on disk (a container's /dev/shm is 64 MB unless given more: an 8B adapter at rank 64 is
    336 MB in bfloat16)."""
    if os.path.isdir("/dev/shm") and shutil.disk_usage("/dev/shm").free > 2 * nbytes:
        return "/dev/shm"
    return None

