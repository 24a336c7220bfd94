"""The streaming twins' --record_rollouts: what the learner trained on and every version that sampled it, for
benchmarks/token_versions.py's audit (each token's log-prob against its own version's, recomputed from the weights
saved here). Nothing here changes what a run does."""
import json
import math
import os
from typing import Optional

import torch
from tqdm import tqdm
from transformers import AutoConfig


def record_first_version(weight_slots: Optional[torch.Tensor], table: list, dtype: torch.dtype,
                         adapter_config: Optional[dict], args) -> None:
    """Version 0 (the SFT weights, already in slot 0), with what the recording will write said first (a version is
    the policy's size; LoRA: the adapter's, on the SFT weights, whose settings are saved beside them)."""
    if args.rank == 0:
        _, offset, shape = table[-1]
        each = (offset + math.prod(shape)) * dtype.itemsize / 1e9
        kept = args.num_steps // args.record_every + 1
        tqdm.write(f"--record_rollouts: {kept} versions of {each:.2f} GB each, {kept * each:.1f} GB in "
                   f"{args.output_dir}/versions (--record_every {args.record_every})")
    record_version(weight_slots, 0, table, 0, args)
    if args.rank == 0 and adapter_config is not None:
        with open(os.path.join(args.output_dir, "versions", "adapter_config.json"), "w") as f:
            json.dump(adapter_config, f)


def record_version(weight_slots: Optional[torch.Tensor], slot: int, table: list, version: int, args) -> None:
    """Version `version`'s weights as the generator loads them (its slot), to {output_dir}/versions/{version}.pt
    (every --record_every-th version)."""
    if weight_slots is not None and version % args.record_every == 0:
        folder = os.path.join(args.output_dir, "versions")
        if not os.path.exists(os.path.join(folder, "config.json")):  # (the architecture, to load them into)
            AutoConfig.from_pretrained(args.sft_model_path).save_pretrained(folder)
        weights = {name: weight_slots[slot][offset: offset + math.prod(shape)].view(shape).cpu().clone()
                   for name, offset, shape in table}
        torch.save(weights, os.path.join(folder, f"{version}.pt"))


def record_groups(groups: list, prompts: list, fate: str, fields: tuple, args) -> None:
    """The groups, a line each in {output_dir}/rollouts.jsonl: the index, the prompt's tokens, the group's `fields`
    (completions' tokens, the sampler's per-token log-probs, each completion's (version, first token, end) spans,
    the engine, ...), its fate (trained, discarded: too stale, or in flight at the end) and the sampling
    temperature."""
    if args.rank == 0:
        with open(os.path.join(args.output_dir, "rollouts.jsonl"), "a") as f:
            for group, prompt in zip(groups, prompts):
                f.write(json.dumps(dict(index=group["index"], prompt=prompt, **{k: group[k] for k in fields},
                                        fate=fate, temperature=args.temperature)) + "\n")
