"""What real sizes and real tokenizers need, checked on CPU: prompts start with BOS where the tokenizer adds one,
float16 training is refused. (An evaluation split that does not divide over the learner processes, scored whole:
tests/test_end_to_end.py; the final evaluation's wait for the one in flight: tests/test_shutdown.py.)"""
import importlib

import pytest
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
