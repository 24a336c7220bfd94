"""What per-request sampling seeds cost vLLM: the scripts give every prompt of a request its own seed (exact resume
regenerates a batch from its seed and weights), and vLLM's sampler then draws row by row ("can be slow", its source
says) instead of for the whole batch at once. Times the tiny world's demo round (32 prompts x 2 samples of 16
tokens) and its evaluation (128 prompts x 1, near-greedy) with seeds and without, in a vLLM engine built as the
scripts build theirs, on the generator's one core.

    python benchmarks/sampling_seeds.py                 # 40 interleaved repeats: about 2 minutes on 2 cores
"""
import os
import statistics
import sys
import time
from dataclasses import dataclass

import tyro

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tiny_world  # noqa: E402


@dataclass
class Args:
    tiny_dir: str = tiny_world.SHIPPED["tldr"]
    """the tiny world (built there if missing)"""
    repeats: int = 40
    """timed generations of each kind, with and without seeds, interleaved"""


def seed_costs(tiny_dir: str, repeats: int, use_cuda: bool = False, gpu_memory_utilization: float = 0.9) -> dict:
    """{request: (median ms with a seed per prompt, without)} over `repeats` interleaved generations of each, in this
    process (an engine built as async_dpo.py's generator builds it: CUDA graphs on a GPU, eager on the CPU)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process, as the generator has it
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # (its log would bury the table)
    import json

    from transformers import AutoConfig, AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    import async_dpo
    from plumbing import core, generator_io

    run_args = async_dpo.resolve_args(async_dpo.Args(model="tiny", tiny_dir=tiny_dir, **async_dpo.TINY_DEFAULTS,
                                                     vllm_gpu_memory_utilization=gpu_memory_utilization))
    data = run_args.dataset
    llm = LLM(**async_dpo.engine_kwargs(run_args, AutoConfig.from_pretrained(run_args.sft_model_path), use_cuda))
    tokenizer = AutoTokenizer.from_pretrained(run_args.sft_model_path)
    queries = [json.loads(line)["query"] for line in open(os.path.join(data, "validation.jsonl"))]
    prompts = [TokensPrompt(prompt_token_ids=p)
               for p in core.tokenize_prompts(tokenizer, queries, run_args.max_prompt_length)]
    kinds = {"training round (32 prompts x 2)": (prompts[:32], 2, run_args.temperature),
             "evaluation (128 prompts x 1)": (prompts[:128], 1, run_args.eval_temperature)}
    costs = {}
    for kind, (batch, n, temperature) in kinds.items():
        times = {True: [], False: []}
        for repeat in range(repeats + 1):  # (the first of each is a warm-up)
            for seeded in (True, False):
                sampling = ([SamplingParams(n=n, temperature=temperature, max_tokens=16, seed=1000 + i * n,
                                            logprobs=0, detokenize=False) for i in range(len(batch))] if seeded else
                            SamplingParams(n=n, temperature=temperature, max_tokens=16, logprobs=0, detokenize=False))
                generator_io.reset_prefix_cache(llm.llm_engine)
                start = time.perf_counter()
                llm.generate(batch, sampling, use_tqdm=False)
                if repeat:
                    times[seeded].append(1000 * (time.perf_counter() - start))
        costs[kind] = tuple(statistics.median(times[s]) for s in (True, False))
    return costs


def main(args: Args) -> None:
    import torch

    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[-1:])  # the generator's core (the last one)
    torch.set_num_threads(1)
    print("| request | with a seed per prompt (ms) | without seeds (ms) | cost of the seeds |\n|---|---|---|---|")
    for kind, (seeded, unseeded) in seed_costs(args.tiny_dir, args.repeats).items():
        print(f"| {kind} | {seeded:.0f} | {unseeded:.0f} | {100 * (seeded / unseeded - 1):+.1f}% |", flush=True)
    print(f"(medians of {args.repeats} generations each, interleaved, on one core)")


if __name__ == "__main__":
    main(tyro.cli(Args))
