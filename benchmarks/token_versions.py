"""Every token's log-prob against its own version's: the audit of a run made with `fully_async_grpo.py
--record_rollouts` (issue: in-flight weight updates make one completion the work of several versions), or
`agentic_grpo.py --record_rollouts` (an episode's turns, the tool's answers between them: version -1, not audited).

Reads the run's rollouts.jsonl (each completion's tokens, the sampler's log-probs, its (version, first token, end)
spans) and versions/ (every version's weights as the generator loaded them), re-reads each completion, prompt and
all, with the Hugging Face model under each version that sampled some of its tokens, and compares each token's
log-prob with the sampler's. Prints the largest and median gaps for the tokens of a completion's first version and
for those sampled after a load mid-generation. With `--kv_on_update recompute` both must be float error (fp32 on
a CPU: ~1e-6); with `keep` the later tokens were computed over a prefix older weights encoded, and their gap is what
keeping the KV cache costs. `--mislabel 1` labels every token with a neighbouring version: the check must fail.

    python benchmarks/token_versions.py runs/NAME              # a run made with --record_rollouts
    python benchmarks/token_versions.py runs/NAME --mislabel 1
"""
import json
import os
import sys
from dataclasses import dataclass

import torch
import tyro
from transformers import AutoConfig, AutoModelForCausalLM

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fully_async_grpo as fa  # noqa: E402  (its collate and log-probs: the learner's own)
from plumbing import core  # noqa: E402

TOLERANCE = 1e-4  # fp32 sampler and learner at the same weights: ~1e-6 (docs/fully_async.md); versions differ by ~1e-2


@dataclass
class Args:
    run_dir: tyro.conf.Positional[str]
    """a fully_async_grpo.py run folder made with --record_rollouts"""
    mislabel: int = 0
    """shift every token's version label by this many versions (to show the check fails when they are wrong)"""


def completions(run_dir: str) -> list[dict]:
    """A dict per completion: prompt, tokens, the sampler's log-probs, each token's version, the temperature."""
    rows, path = [], os.path.join(run_dir, "rollouts.jsonl")
    if not os.path.exists(path):
        raise SystemExit(f"{path} not found: the run in {run_dir} was not made with --record_rollouts")
    for line in open(path):
        group = json.loads(line)
        for response, logprobs, spans in zip(group["responses"], group["logprobs"], group["spans"]):
            versions = [v for v, start, end in spans for _ in range(end - start)]
            rows.append(dict(prompt=group["prompt"], response=response, logprobs=torch.tensor(logprobs),
                             versions=torch.tensor(versions), temperature=group["temperature"],
                             engine=group.get("engine", 0)))
    return rows


def token_gaps(run_dir: str, mislabel: int = 0, chunk: int = 32) -> dict:
    """|log pi_v(token) - sampler's log-prob| for every token, v its (possibly mislabelled) version: "first" for the
    tokens of the completion's first version, "later" for those sampled after a load mid-generation; and
    "engine{e}" for every token engine e sampled (--num_generators, --generator_nodes)."""
    rows, folder = completions(run_dir), os.path.join(run_dir, "versions")
    known = sorted(int(name[: -len(".pt")]) for name in os.listdir(folder) if name.endswith(".pt"))
    for row in rows:
        shifted = row["versions"] + mislabel
        outside = ~torch.isin(shifted, torch.tensor(known))  # (past the last version: the other neighbour)
        row["label"] = torch.where(outside, row["versions"] - mislabel, shifted) if mislabel else row["versions"]
        row["label"][row["versions"] < 0] = -1  # (agentic_grpo.py: the tool's tokens, which no version sampled)
        row["recomputed"] = torch.full_like(row["logprobs"], float("nan"))
    if os.path.exists(os.path.join(folder, "adapter_config.json")):  # (--lora_rank: adapters on the SFT weights)
        from peft import LoraConfig, get_peft_model

        config = LoraConfig.from_pretrained(folder)
        base = AutoModelForCausalLM.from_pretrained(config.base_model_name_or_path, dtype=torch.float32)
        model = get_peft_model(base, config).eval()
    else:
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=torch.float32).eval()
    frozen = {name for name, param in model.named_parameters() if not param.requires_grad}  # (LoRA: the base)
    run = core.Run(torch.device("cpu"), torch.autocast("cpu", enabled=False), 0, 0)
    for version in known:
        mine = [row for row in rows if (row["label"] == version).any()]
        if not mine:
            continue
        missing, unexpected = model.load_state_dict(torch.load(os.path.join(folder, f"{version}.pt")), strict=False)
        assert not unexpected and all("rotary" in name or "bias" in name or name in frozen for name in missing), (
            missing, unexpected)
        for start in range(0, len(mine), chunk):
            part = mine[start: start + chunk]
            logprobs = fa.logprobs_in_chunks(model, [r["prompt"] for r in part], [r["response"] for r in part],
                                             part[0]["temperature"], chunk, run)
            for row, row_logprobs in zip(part, logprobs):
                here = row["label"] == version
                row["recomputed"][here] = row_logprobs[: len(row["response"])][here]
    gaps = {"first": [], "later": []}
    for row in rows:  # (a token whose version was not kept, --record_every, stays NaN: left out)
        policy_versions = row["versions"][row["versions"] >= 0]
        gap = (row["recomputed"] - row["logprobs"]).abs()
        later = row["versions"] != (policy_versions[0] if len(policy_versions) else -1)
        gaps["first"].append(gap[~later & ~gap.isnan()])
        gaps["later"].append(gap[later & ~gap.isnan()])
        gaps.setdefault(f"engine{row['engine']}", []).append(gap[~gap.isnan()])
    return {key: torch.cat(value) for key, value in gaps.items()}


def describe(gaps: torch.Tensor) -> str:
    if not len(gaps):
        return "no tokens"
    return (f"{len(gaps)} tokens, max {gaps.max():.2e}, median {gaps.median():.2e}, "
            f"{(gaps > TOLERANCE).float().mean():.1%} beyond {TOLERANCE:.0e}")


if __name__ == "__main__":
    args = tyro.cli(Args)
    gaps = token_gaps(args.run_dir, args.mislabel)
    print(f"|log pi_version(token) - the sampler's log-prob|, versions mislabelled by {args.mislabel}:")
    print(f"  tokens of the completion's first version:   {describe(gaps['first'])}")
    print(f"  tokens sampled after a mid-generation load: {describe(gaps['later'])}")
    for name in sorted(key for key in gaps if key.startswith("engine")):
        print(f"  {name}'s tokens: {' ' * (33 - len(name))}{describe(gaps[name])}")
