"""Bad input gets an early, clear error naming the flag or file, and a non-zero exit: never a hang, never a
traceback. Input refused before anything starts is run through the script's own entry point in the test's process
(run_in_process: an exception would fail the test with its traceback); the rest as a user runs the script."""
import json
import os

import pytest
from conftest import run_in_process, run_script


@pytest.mark.parametrize("flags, message", [
    (["--num_samples", "1"], "--num_samples"),
    (["--response_length", "0"], "--response_length"),
    (["--total_episodes", "-5"], "--total_episodes"),
    (["--batch_size", "30"], "--per_device_train_batch_size"),
    (["--vllm_gpu_memory_utilization", "0"], "--vllm_gpu_memory_utilization"),
    (["--fsdp"], "--fsdp"),  # without torchrun there is nothing to shard over
    (["--sft_model_path", "/no/such/model"], "--sft_model_path /no/such/model"),
    (["--dataset", "/no/such/data.jsonl"], "--dataset /no/such/data.jsonl"),
    (["--eval_split", "test"], "no 'test' split"),
    (["--sft_model_revision", "main"], "--sft_model_revision main: --sft_model_path"),  # a local folder
    (["--lora_alpha", "16"], "--lora_alpha, --lora_target_modules and --save_merged set LoRA's adapter"),
    (["--lora_target_modules", "q_proj"], "give --lora_rank r > 0 too"),
    (["--lora_rank", "8", "--lora_target_modules", "q_proj", "v_proj"], "--lora_target_modules q_proj v_proj: "),
    (["--lora_rank", "1024"], "--lora_rank 1024: vLLM's engine takes adapters of rank at most 512"),
    (["--lora_rank", "8", "--save_merged"], "--save_merged saves the merged model beside the adapter"),
])
def test_bad_flags_are_rejected_early(tiny_dir, tmp_path, flags, message, capsys):
    code, stderr = run_in_process("async_dpo.py", "--model", "tiny", "--output_dir", str(tmp_path), *flags,
                                  capsys=capsys)
    assert code == 2 and message in stderr, stderr


@pytest.mark.parametrize("flags, message", [
    (["--reward_model_path", "nobody/no-such-reward-model"], "--reward_model_path nobody/no-such-reward-model"),
    (["--reward_model_path", "nobody/no-such-rm", "--reward_model_revision", "v1"],
     "--reward_model_revision v1 of --reward_model_path nobody/no-such-rm could not be fetched"),
])
def test_hub_names_that_do_not_load_are_rejected_early(tmp_path, flags, message):
    """(In a process of their own: the hub's offline switch is read when it is imported.)"""
    result = run_script("--model", "tiny", "--output_dir", str(tmp_path), *flags, timeout=120,
                        env={"HF_HUB_OFFLINE": "1"})
    assert result.returncode != 0
    assert message in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("script, flags, message", [
    ("async_ppo.py", ["--num_samples", "0"], "--num_samples"),
    ("async_ppo.py", ["--cliprange", "-0.2"], "--cliprange"),
    ("async_ppo.py", ["--lam", "1.5"], "--lam"),
    ("async_rloo.py", ["--num_samples", "1"], "--num_samples"),
    ("async_rloo.py", ["--cliprange", "-1"], "--cliprange"),
    ("async_ppo.py", ["--is_correction", "truncate"], "--is_correction needs --recompute_old_logprobs"),
    ("async_rloo.py", ["--is_correction", "mask"], "--is_correction needs --recompute_old_logprobs"),
    ("async_rloo.py", ["--is_cap", "0.5", "--is_cap_low", "0.8"], "--is_cap_low and --is_cap"),
    ("sync_baseline.py", ["--num_samples", "1"], "--num_samples"),
    ("sync_baseline.py", ["--batch_size", "30"], "--per_device_train_batch_size"),
    ("gsm8k_async_dpo.py", ["--num_samples", "1"], "--num_samples"),
    ("gsm8k_async_dpo.py", ["--eval_temperature", "-1"], "--eval_temperature"),
    ("gsm8k_async_dpo.py", ["--dataset", "/no/such/folder"], "--dataset /no/such/folder"),
])
def test_the_other_scripts_reject_bad_flags_early(tmp_path, script, flags, message, capsys):
    code, stderr = run_in_process(script, "--model", "tiny", "--output_dir", str(tmp_path), *flags, capsys=capsys)
    assert code == 2 and message in stderr, stderr


@pytest.mark.parametrize("script", ["async_dpo.py", "async_ppo.py", "async_rloo.py", "sync_baseline.py"])
def test_reward_model_without_a_score_head_is_rejected_before_vllm_starts(script, tiny_dir, tmp_path, capsys):
    """An SFT checkpoint passed as the reward model would get a random head and train against noise (PPO's value
    model starts from it too). Its weight names are read at start-up, before the generator is spawned: the message
    names what the checkpoint holds (the check made when the model loads, after vLLM's start, names what is
    missing instead)."""
    code, stderr = run_in_process(script, "--model", "tiny", "--tiny_dir", tiny_dir, "--output_dir", str(tmp_path),
                                  "--reward_model_path", os.path.join(tiny_dir, "sft"), capsys=capsys)
    assert code == 2 and "--reward_model_path" in stderr and "no trained `score` head" in stderr, stderr
    assert "(its weights: embed_out.*, gpt_neox.*)" in stderr, stderr


def test_dataset_without_expected_columns_names_what_it_found(tmp_path, capsys):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"p{i}", "completion": "c"}) + "\n" for i in range(50)))
    code, stderr = run_in_process("async_dpo.py", "--model", "tiny", "--output_dir", str(tmp_path), "--dataset",
                                  str(data), capsys=capsys)
    assert code == 2 and "lacks column(s) ['query', 'reference_response']" in stderr
    assert "'prompt', 'completion'" in stderr


def test_unknown_preset_is_rejected_by_the_parser(capsys):
    code, stderr = run_in_process("async_dpo.py", "--model", "pythia-7b", capsys=capsys)
    assert code == 2 and "--model" in stderr


def test_an_evaluation_split_smaller_than_the_learners_is_refused_on_every_rank(tiny_dir, tmp_path):
    """Two learner ranks and a validation split of one prompt: rank 1 would evaluate none, and crash (or hang its
    partner in the padding collective). Both stop at once with an error naming the split, before vLLM starts."""
    from conftest import TORCHRUN_2

    row = {"query": "SUBREDDIT: r/cats\n\nTITLE: t\n\nPOST: p\n\nTL;DR:", "reference_response": " cats<|endoftext|>"}
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text((json.dumps(row) + "\n") * 2)
    (tmp_path / "data" / "validation.jsonl").write_text(json.dumps(row) + "\n")
    result = run_script("--model", "tiny", "--tiny_dir", tiny_dir, "--output_dir", str(tmp_path / "run"),
                        "--dataset", str(tmp_path / "data"), launcher=TORCHRUN_2, timeout=300)
    # (torchrun prints a traceback of its own when a rank fails; none passes through the script)
    assert result.returncode != 0 and 'async_dpo.py", line' not in result.stderr, result.stderr[-3000:]
    assert result.stderr.count("the validation split has 1 prompt(s), fewer than the 2 learner processes") == 2


@pytest.mark.parametrize("environ, refused", [
    ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, True),
    ({"PYTORCH_ALLOC_CONF": "max_split_size_mb:128, expandable_segments: true"}, True),
    ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}, False), ({}, False)])
def test_expandable_segments_are_refused_before_cuda_starts(environ, refused, capsys):
    """On a GPU the weight buffer reaches the generator by CUDA IPC, which expandable segments break in many
    containers (a failure deep in the generator's first load): refused at the start, naming the variable."""
    from plumbing import core

    if not refused:
        core.refuse_expandable_segments(environ)
        return
    with pytest.raises(SystemExit) as stop:
        core.refuse_expandable_segments(environ)
    assert stop.value.code == 2 and f"error: {next(iter(environ))}=" in capsys.readouterr().err
