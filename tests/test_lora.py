"""LoRA (--lora_rank): the reference is the base with the adapter off; the hand-off carries the adapter only and it
reaches the sampler (checked against the learner's log-probs, and a fork that never hands it to the sampler is
caught); every script trains with it; the adapter saves in PEFT's format (and merged) and resumes exactly."""
import contextlib
import math
import os

import pytest
import torch
from conftest import REPO, TORCHRUN_2, run_script
from test_end_to_end import read_metrics
from test_fully_async import stream_flags, stream_metrics
from transformers import AutoModelForCausalLM

import async_dpo
from benchmarks import token_versions
from plumbing import lora

SHORT = ("--model", "tiny", "--total_episodes", "128", "--eval_every", "0", "--num_eval_prompts", "32",
         "--num_final_eval_prompts", "64", "--lora_rank", "8", "--learning_rate", "1e-3")


def test_the_merged_model_is_written_in_the_sft_checkpoints_dtype(tiny_dir, tmp_path):
    """--save_merged merges in float32 and writes the SFT checkpoint's own dtype (a bfloat16 checkpoint here, as most
    hub models are: it wrote float32, twice what vLLM serves); its log-probs are the adapter's to bfloat16's
    precision. In-process: core.save_policy on a policy whose adapter has moved."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from plumbing import core

    sft = tmp_path / "sft_bf16"
    AutoModelForCausalLM.from_pretrained(os.path.join(tiny_dir, "sft"), dtype=torch.bfloat16).save_pretrained(sft)
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(tiny_dir, "sft"))
    args = SimpleNamespace(lora_rank=4, lora_alpha=None, lora_target_modules=None, fsdp=False, rank=0,
                           output_dir=str(tmp_path / "run"), save_merged=True, sft_model_path=str(sft))
    policy = lora.add_adapter(AutoModelForCausalLM.from_pretrained(sft, dtype=torch.float32), args).eval()
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05, generator=torch.Generator().manual_seed(0))
    core.save_policy(policy, tokenizer, args)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "model_merged")
    assert merged.config.dtype == torch.bfloat16 and next(merged.parameters()).dtype == torch.bfloat16
    ids = torch.tensor([tokenizer("A post about a cat.").input_ids])
    with torch.no_grad():
        gap = (torch.log_softmax(policy(ids).logits, -1) - torch.log_softmax(merged.float()(ids).logits, -1)).abs()
    assert gap.max() < 0.1, gap.max()


def test_the_reference_is_the_base_with_the_adapter_off(tiny_dir):
    """A fresh adapter (B = 0) gives the SFT model's logits exactly; a trained one moves them, and with it off
    (the reference, lora.AdapterOff) they are the SFT model's again, bit for bit: no second copy of the weights.
    The hand-off's table holds the adapter's tensors only, under a tenth of the policy's parameters."""
    sft = os.path.join(tiny_dir, "sft")
    base = AutoModelForCausalLM.from_pretrained(sft, dtype=torch.float32).eval()
    policy = lora.add_adapter(AutoModelForCausalLM.from_pretrained(sft, dtype=torch.float32),
                              async_dpo.Args(lora_rank=8)).eval()
    ids = torch.randint(0, base.config.vocab_size, (4, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = base(input_ids=ids).logits
        assert torch.equal(policy(input_ids=ids).logits, expected)
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.1)
        assert not torch.allclose(policy(input_ids=ids).logits, expected, atol=1e-3)
        assert torch.equal(lora.AdapterOff(policy)(input_ids=ids).logits, expected)
    table = async_dpo.weight_table(policy)
    assert table and all(".lora_A." in name or ".lora_B." in name for name, _, _ in table)
    handed = sum(math.prod(shape) for _, _, shape in table)
    assert handed == sum(p.numel() for p in policy.parameters() if p.requires_grad)
    assert handed < sum(p.numel() for p in base.parameters()) / 10


def test_the_sampler_samples_with_the_learners_adapter_and_a_skipped_delivery_is_caught(tiny_dir, tmp_path):
    """sync_baseline.py samples each batch with the weights it trains (staleness 0): with LoRA, vLLM's log-prob of
    every pair equals the learner's at every step (the adapter of version v reached the sampler before it sampled
    round v), and the first DPO loss is ln 2. A fork whose generator loads each adapter but never names it in the
    request (the silent no-op of an adapter that never reaches the sampler) trains, logs plausible losses, and is
    caught: from the second step on, the sampler's log-probs are the base's, and the per-token KL between sampler and
    learner (lag/kl_token, 1e-13 when the adapter arrives) is above 1e-5 at every step (measured 1.4e-4 to 2.7e-3)."""
    out = tmp_path / "run"
    result = run_script(*SHORT, "--tiny_dir", tiny_dir, "--output_dir", str(out), script="sync_baseline.py")
    assert result.returncode == 0, result.stderr[-3000:]
    steps, evals = read_metrics(str(out))
    assert len(steps) == 4 and steps[0]["loss/dpo"] == pytest.approx(math.log(2), abs=1e-6)
    assert all(abs(r["logps/generator_gap"]) < 1e-4 and r["lag/kl_token"] < 1e-8 for r in steps)
    assert all(r["lag/update"] > 0 for r in steps) and steps[-1]["loss/dpo"] < math.log(2)

    script = open(os.path.join(REPO, "sync_baseline.py")).read()
    named = "sampling, lora_request=adapter, use_tqdm=False)"
    assert script.count(named) == 1
    fork = tmp_path / "sync_baseline_unnamed_adapter.py"
    fork.write_text(script.replace(named, "sampling, use_tqdm=False)"))
    forked = tmp_path / "fork"
    result = run_script(*SHORT, "--tiny_dir", tiny_dir, "--output_dir", str(forked), script=str(fork),
                        env={"PYTHONPATH": REPO})
    assert result.returncode == 0, result.stderr[-3000:]
    fork_steps, _ = read_metrics(str(forked))
    assert abs(fork_steps[0]["logps/generator_gap"]) < 1e-4  # (version 0: the base on both sides)
    assert all(r["lag/kl_token"] > 1e-5 for r in fork_steps[1:]), [r["lag/kl_token"] for r in fork_steps]


@pytest.mark.parametrize("script, flags", [
    pytest.param("async_ppo.py", ("--recompute_old_logprobs", "--is_correction", "truncate"), marks=pytest.mark.slow),
    pytest.param("async_rloo.py", ("--recompute_old_logprobs", "--is_correction", "truncate"), marks=pytest.mark.slow),
    ("gsm8k_async_dpo.py", ("--total_episodes", "64")),  # (the fast subset's GSM8k run end to end; 2 steps:
    # vLLM samples with LoRA slowly on a CPU, ~6 s a round)
])
def test_every_one_step_script_trains_an_adapter_exact_at_its_first_step(script, flags, tmp_path):
    """With LoRA, the first step reads completions of the SFT weights with a learner that is the SFT weights (B = 0):
    PPO's and RLOO's ratio and importance weight are 1, GSM8k's DPO loss is ln 2; then the adapter moves."""
    out = tmp_path / "run"
    result = run_script(*SHORT, "--output_dir", str(out), *flags, script=script)
    assert result.returncode == 0, result.stderr[-3000:]
    steps, _ = read_metrics(str(out), step_metric="staleness", eval_metric="eval/num_prompts")
    first = steps[0]
    if script == "gsm8k_async_dpo.py":
        assert first["loss/dpo"] == pytest.approx(math.log(2), abs=1e-6)
    else:
        assert abs(first["policy/ratio_mean"] - 1) < 1e-5 and abs(first["policy/ratio_max"] - 1) < 1e-4
        assert abs(first["is/weight_min"] - 1) < 1e-5 and abs(first["is/weight_max"] - 1) < 1e-5
    assert all(r["lag/update"] > 0 for r in steps)


@pytest.mark.slow
def test_async_dpo_with_lora_sharded_over_two_ranks_saves_the_adapter_and_the_merged_model(tiny_dir, tmp_path):
    """Two FSDP2 ranks (the reference's forwards are collectives too: as many on each rank), the first DPO loss
    ln 2; --save_model writes the adapter in PEFT's format, loadable with PeftModel.from_pretrained, and
    --save_merged a plain checkpoint whose log-probs are the adapter's."""
    from peft import PeftModel

    out = tmp_path / "run"
    result = run_script(*SHORT, "--tiny_dir", tiny_dir, "--output_dir", str(out), "--eval_every", "2", "--fsdp",
                        "--save_model", "--save_merged", launcher=TORCHRUN_2)
    assert result.returncode == 0, result.stderr[-3000:]
    steps, evals = read_metrics(str(out))
    assert steps[0]["loss/dpo"] == pytest.approx(math.log(2), abs=1e-6) and [r["step"] for r in evals] == [0, 2, 4]
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(out / "model"))
    base = AutoModelForCausalLM.from_pretrained(os.path.join(tiny_dir, "sft"), dtype=torch.float32)
    adapted = PeftModel.from_pretrained(base, out / "model").eval()
    merged = AutoModelForCausalLM.from_pretrained(out / "model_merged", dtype=torch.float32).eval()
    ids = torch.randint(0, merged.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, adapted(input_ids=ids).logits, atol=1e-4, rtol=0)
        with adapted.disable_adapter():
            assert not torch.allclose(merged(input_ids=ids).logits, adapted(input_ids=ids).logits, atol=1e-3)


@pytest.mark.slow
def test_every_token_of_the_stream_is_its_versions_adapter(chains_dir, tmp_path):
    """fully_async_grpo.py with LoRA (k = 2, draining before each load): each recorded version is an adapter; every
    token's sampler log-prob equals its own version's recomputed by the learner's model (the SFT weights with that
    adapter), within the tolerance of the full-weight check, and mislabelled by one version the check fails."""
    out = tmp_path / "run"
    result = run_script(*stream_flags(chains_dir, out, "--total_episodes", "192", "--batch_size", "16",
                                      "--per_device_train_batch_size", "16", "--learning_rate", "1e-3",
                                      "--lora_rank", "8", "--record_rollouts"), script="fully_async_grpo.py")
    assert result.returncode == 0, result.stderr[-3000:]
    steps, _ = stream_metrics(out)
    assert len(steps) == 12 and all(r["staleness/max"] <= 2 for r in steps)
    assert abs(steps[0]["policy/ratio_mean"] - 1) < 1e-5 and abs(steps[0]["is/weight_mean"] - 1) < 1e-5
    assert abs(steps[0]["is/weight_max"] - 1) < 1e-4
    gaps = token_versions.token_gaps(str(out))
    assert len(gaps["first"]) > 1000 and gaps["first"].max() < token_versions.TOLERANCE
    mislabelled = token_versions.token_gaps(str(out), mislabel=1)
    assert (mislabelled["first"] > token_versions.TOLERANCE).float().mean() > 0.2, mislabelled


# (a LoRA run stopped by SIGTERM and resumed is the run that never stopped: test_resume.py, whose run is LoRA-DPO)


SAMPLE_WITH_AN_ADAPTER = """
import json, os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
from vllm.lora.request import LoRARequest
model, adapter = sys.argv[1:3]
llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=64, kv_cache_memory_bytes=2**25,
          enable_chunked_prefill=False, max_num_batched_tokens=4096, enable_lora=True, max_lora_rank=8, max_loras=1,
          logprobs_mode="processed_logprobs", skip_tokenizer_init=True)
sampling = SamplingParams(n=4, temperature=1.0, max_tokens=12, logprobs=0, seed=1, detokenize=False)
rows = []
for request in (LoRARequest("v1", 2, adapter), None):
    outputs = llm.generate([TokensPrompt(prompt_token_ids=[3, 14, 15, 92, 65])], sampling, lora_request=request)
    rows.append([[list(c.token_ids), [p[t].logprob for t, p in zip(c.token_ids, c.logprobs)]]
                 for c in outputs[0].outputs])
print(json.dumps(rows))
"""


@pytest.mark.slow
@pytest.mark.parametrize("architecture", ["qwen2", "llama"])
def test_an_adapter_on_a_model_vllm_implements_itself(architecture, tmp_path):
    """The tiny worlds' GPT-NeoX runs in vLLM through its Transformers backend; Qwen2 and Llama (the hub's usual
    policies) run in vLLM's own model classes, which pack q, k, v (and gate, up) into one projection, while peft
    trains them apart. A random small model of each, a PEFT adapter on every linear layer saved as the generator
    writes it: vLLM's log-probs of what it samples with the adapter equal peft's (float32, within 1e-5), and without
    it the base model's."""
    import json
    import subprocess
    import sys

    from peft import get_peft_model_state_dict
    from transformers import AutoConfig

    config = AutoConfig.for_model(architecture, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                  num_attention_heads=2, num_key_value_heads=1, vocab_size=512,
                                  max_position_embeddings=128, tie_word_embeddings=False)  # (head size 64: vLLM's CPU
    # attention takes no smaller)
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    base.save_pretrained(tmp_path / "base")
    policy = lora.add_adapter(AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32),
                              async_dpo.Args(lora_rank=8)).eval()
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)
    assert len(get_peft_model_state_dict(policy)) == 2 * 2 * 7  # q, k, v, o, gate, up, down in 2 layers: A and B
    policy.save_pretrained(tmp_path / "adapter")
    result = subprocess.run([sys.executable, "-c", SAMPLE_WITH_AN_ADAPTER, str(tmp_path / "base"),
                             str(tmp_path / "adapter")], capture_output=True, text=True, cwd=REPO, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    with_adapter, without = json.loads(result.stdout.strip().splitlines()[-1])
    prompt = [3, 14, 15, 92, 65]
    for rows, on in ((with_adapter, True), (without, False)):
        for tokens, sampler in rows:
            ids = torch.tensor([prompt + tokens])
            with torch.no_grad(), contextlib.nullcontext() if on else policy.disable_adapter():
                logits = policy(input_ids=ids).logits[0, len(prompt) - 1: -1]
            learner = torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None]).squeeze(1)
            assert (learner - torch.tensor(sampler)).abs().max() < 1e-5, (architecture, on)
        if on:  # (the adapter moves the log-probs far beyond the tolerance)
            with torch.no_grad(), policy.disable_adapter():
                logits = policy(input_ids=torch.tensor([prompt + rows[0][0]])).logits[0, len(prompt) - 1: -1]
            base_logprobs = torch.log_softmax(logits, -1).gather(1, torch.tensor(rows[0][0])[:, None]).squeeze(1)
            assert (base_logprobs - torch.tensor(rows[0][1])).abs().max() > 1e-2


def test_an_adapter_too_large_for_dev_shm_goes_to_the_runs_temporary_folder():
    """A container's /dev/shm is 64 MB unless given more; an 8B adapter at rank 64 is 336 MB: the generator writes
    an adapter that /dev/shm cannot hold twice over to tempfile's default folder (its TMPDIR: the run's own)."""
    import shutil

    free = shutil.disk_usage("/dev/shm").free
    assert lora.ram_folder(1 << 20) == "/dev/shm" and lora.ram_folder(free) is None
