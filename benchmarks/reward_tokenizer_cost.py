"""What a reward model with a tokenizer of its own costs: one tiny-world round's scoring (the demo's 32 prompts x 2
samples) by the proxy reward model, through the direct path (the policy's token ids are the reward model's) and
through the re-tokenising one (the same texts, tokenised by another tokenizer, then decoded and re-tokenised for the
reward model: plumbing.reward_models.retokenize), each timed over repeats on one core (the learner's share of two).

    python benchmarks/reward_tokenizer_cost.py
"""
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass

import torch
import transformers
import tyro
from transformers import AutoTokenizer

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tiny_world  # noqa: E402
from async_dpo import score_in_chunks  # noqa: E402
from plumbing import core  # noqa: E402
from plumbing.reward_models import load_reward_model, reward_tokenizer  # noqa: E402


@dataclass
class Args:
    tiny_dir: str = tiny_world.SHIPPED["tldr"]
    """the tiny world (built there if missing)"""
    repeats: int = 20
    """timed repetitions of each path"""
    num_completions: int = 64
    """completions scored per round (the demo's: 32 prompts x 2 samples)"""


def timed(score, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        score()
        times.append(1000 * (time.perf_counter() - start))
    return times


if __name__ == "__main__":
    args = tyro.cli(Args)
    torch.set_num_threads(1)
    transformers.utils.logging.disable_progress_bar()
    _, proxy, data, _, _ = tiny_world.tldr_world(args.tiny_dir)
    rows = [json.loads(line) for line in open(os.path.join(data, "validation.jsonl"))][: args.num_completions]
    texts = [json.loads(line)["query"] for line in open(os.path.join(data, "train.jsonl"))][:2000]
    own, other = AutoTokenizer.from_pretrained(proxy), tiny_world.build_other_tokenizer(texts)
    has_eos = [True] * len(rows)

    def encoded(tokenizer) -> tuple[list, list]:
        prompts = core.tokenize_prompts(tokenizer, [r["query"] for r in rows], 512)
        summaries = [r["reference_response"].removesuffix(tiny_world.EOS) for r in rows]
        return prompts, [s + [tokenizer.eos_token_id] for s in tokenizer(summaries, add_special_tokens=False)[
            "input_ids"]]

    reward_model = load_reward_model("reward_model_path", proxy, torch.float32, torch.device("cpu"))
    (own_prompts, own_responses), (other_prompts, other_responses) = encoded(own), encoded(other)
    chunk = 32  # the demo's: per_device_train_batch_size x num_samples
    no_autocast = torch.autocast("cpu", enabled=False)
    direct = timed(lambda: score_in_chunks(reward_model, own_prompts, own_responses, has_eos, -1.0, chunk,
                                           core.Run(torch.device("cpu"), no_autocast, own.eos_token_id,
                                                    own.eos_token_id)), args.repeats)
    reward_model.retokenize = reward_tokenizer("reward_model_path", proxy, reward_model, other, texts[:16], False, 0)
    text_only = timed(lambda: reward_model.retokenize(other_prompts, other_responses, has_eos), args.repeats)
    retokenised = timed(lambda: score_in_chunks(reward_model, other_prompts, other_responses, has_eos, -1.0, chunk,
                                                core.Run(torch.device("cpu"), no_autocast, other.eos_token_id,
                                                         other.eos_token_id)), args.repeats)

    def spread(times: list[float]) -> str:
        return f"{statistics.median(times):.1f} ms (min {min(times):.1f}, max {max(times):.1f})"

    print(f"scoring {len(rows)} completions, median of {args.repeats}:")
    print(f"  direct (the policy's ids):       {spread(direct)}")
    print(f"  re-tokenised (another tokenizer): {spread(retokenised)}, of which decoding and encoding "
          f"{spread(text_only)}")
    print(f"ratio re-tokenised / direct: {statistics.median(retokenised) / statistics.median(direct):.2f}")
