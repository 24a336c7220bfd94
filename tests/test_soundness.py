"""What real sizes and real tokenizers need, checked on CPU: prompts start with BOS where the tokenizer adds one,
float16 training is refused, the final evaluation waits for the one in flight, and an evaluation split that does
not divide over the learner processes is scored whole."""
import importlib

import pytest
from conftest import TORCHRUN_2, run_script
from test_end_to_end import read_metrics
from test_shutdown import long_prompts  # noqa: F401 (a fixture)
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SCRIPTS = ["async_dpo", "async_ppo", "async_rloo", "sync_baseline", "gsm8k_async_dpo"]


def word_tokenizer(add_bos_token: bool) -> PreTrainedTokenizerFast:
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "a": 3, "b": 4, "TL;DR:": 5, "Problem:": 6, "Solution:": 7}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   add_bos_token=add_bos_token)


@pytest.mark.parametrize("script", ["plumbing.core", "gsm8k_async_dpo"])  # (the TL;DR scripts use the core's)
def test_prompts_start_with_bos_when_the_tokenizer_adds_one(script):
    """rho-1b's Llama tokenizer adds BOS and its SFT saw it; Pythia's does not. Truncation keeps BOS and the end."""
    tokenize_prompts = importlib.import_module(script).tokenize_prompts
    with_bos, without_bos = word_tokenizer(True), word_tokenizer(False)
    text = "a b a b a" if script != "gsm8k_async_dpo" else "a b"
    long_prompt, = tokenize_prompts(with_bos, [text], 64)
    assert long_prompt[0] == 1 and long_prompt.count(1) == 1 and long_prompt[-1] != 2  # BOS once, no EOS
    assert tokenize_prompts(without_bos, [text], 64)[0] == long_prompt[1:]
    assert tokenize_prompts(with_bos, [text], 3)[0] == [1] + long_prompt[-2:]


@pytest.mark.parametrize("script", SCRIPTS)
def test_float16_training_is_refused(script, capsys):
    module = importlib.import_module(script)
    with pytest.raises(SystemExit):
        module.resolve_args(module.Args(dtype="float16"))
    assert "--dtype float16" in capsys.readouterr().err


def test_final_evaluation_waits_for_the_one_in_flight(tiny_dir, long_prompts, tmp_path):  # noqa: F811
    """An evaluation requested in the last round (step 3 of 4) takes far longer to generate (512 long prompts) than
    the round's training (4 prompts): the learner scores it before it rewrites the weight buffer for the final one."""
    result = run_script("--model", "tiny", "--tiny_dir", tiny_dir, "--output_dir", str(tmp_path), "--dataset",
                        long_prompts, "--max_prompt_length", "400", "--total_episodes", "16", "--batch_size", "4",
                        "--per_device_train_batch_size", "4", "--eval_every", "3", "--num_eval_prompts", "512")
    assert result.returncode == 0, result.stderr[-3000:]
    steps, evals = read_metrics(str(tmp_path))
    assert [r["step"] for r in evals] == [0, 3, 4]
    in_flight, final = evals[1], evals[2]
    assert in_flight["timeline/eval_generation_end"] > steps[-1]["timeline/training_end"]  # it was still running
    assert final["timeline/eval_queued_start"] >= in_flight["timeline/eval_generation_end"]


@pytest.mark.parametrize("sharding", ["ddp", "fsdp"])
def test_uneven_evaluation_split_is_scored_whole(tiny_dir, tmp_path, sharding):
    """129 final prompts over 2 learner processes: 65 and 64, all scored (none dropped to make the shares equal).
    Under FSDP2 every forward of a sharded model is a collective: the rank with 64 prompts (two whole chunks of 32)
    runs as many forwards as the one with 65 (three), and so for the 33 and 32 of the first evaluation (the ranks'
    collectives used to fall out of step: gloo aborted rank 1, NCCL would hang)."""
    result = run_script("--model", "tiny", "--tiny_dir", tiny_dir, "--output_dir", str(tmp_path), "--total_episodes",
                        "64", "--eval_every", "0", "--num_eval_prompts", "65", "--num_final_eval_prompts", "129",
                        *(["--fsdp"] if sharding == "fsdp" else []), launcher=TORCHRUN_2)
    assert result.returncode == 0, result.stderr[-3000:]
    _, evals = read_metrics(str(tmp_path))
    assert [r["eval/num_prompts"] for r in evals] == [65, 129]


def test_sync_baseline_under_torchrun(tiny_dir, tmp_path):
    """Every rank takes the engine's "ready" message, not only the rank that owns the generator (a second rank used
    to read it as the first evaluation and fail)."""
    result = run_script("--model", "tiny", "--tiny_dir", tiny_dir, "--output_dir", str(tmp_path), "--total_episodes",
                        "64", "--num_eval_prompts", "16", script="sync_baseline.py",
                        launcher=TORCHRUN_2)
    assert result.returncode == 0, result.stderr[-3000:]
    steps, evals = read_metrics(str(tmp_path))
    assert [r["staleness"] for r in steps] == [0, 0] and [r["step"] for r in evals] == [0, 2]
