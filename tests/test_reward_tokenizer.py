"""A reward model with a tokenizer of its own: the policy's completions are decoded to text and re-tokenised the
reward model's way (plumbing.reward_models), which must score a text exactly as the reward
model scores that text tokenised its own way; with --reward_chat_template, the text goes through its chat template;
a tokenizer that cannot encode the text is refused at start-up."""
import json
import os
import shutil

import pytest
import torch
from conftest import run_script
from test_end_to_end import read_metrics
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoTokenizer, GPTNeoXConfig, GPTNeoXForCausalLM, PreTrainedTokenizerFast

import tiny_world
from async_dpo import score_in_chunks
from plumbing import core
from plumbing.reward_models import load_reward_model, reward_tokenizer

CPU = torch.device("cpu")


def other_tokenizer(tiny_dir: str):
    texts = [json.loads(line)["query"] for line in open(os.path.join(tiny_dir, "data", "train.jsonl"))][:2000]
    return tiny_world.build_other_tokenizer(texts)


def validation_rows(tiny_dir: str, n: int) -> list[dict]:
    return [json.loads(line) for line in open(os.path.join(tiny_dir, "data", "validation.jsonl"))][:n]


def summary(row: dict) -> str:
    return row["reference_response"].removesuffix("<|endoftext|>")  # (the dataset's text ends with Pythia's EOS)


def tokenized(tokenizer, rows: list[dict], has_eos: list[bool]) -> tuple[list, list]:
    """Prompts as the scripts tokenise them, and the reference summaries as completions (EOS where asked)."""
    prompts = core.tokenize_prompts(tokenizer, [r["query"] for r in rows], 400)
    summaries = tokenizer([summary(r) for r in rows], add_special_tokens=False)["input_ids"]
    return prompts, [s + [tokenizer.eos_token_id] * eos for s, eos in zip(summaries, has_eos)]


def test_retokenised_scores_equal_the_reward_models_own(tiny_dir, capsys):
    policy_tokenizer, own = other_tokenizer(tiny_dir), AutoTokenizer.from_pretrained(os.path.join(tiny_dir, "proxy"))
    rows, has_eos = validation_rows(tiny_dir, 24), [i % 3 != 0 for i in range(24)]
    policy_prompts, policy_responses = tokenized(policy_tokenizer, rows, has_eos)
    own_prompts, own_responses = tokenized(own, rows, has_eos)
    assert [len(p) for p in policy_prompts] != [len(p) for p in own_prompts]  # the text splits differently

    reward_model = load_reward_model("reward_model_path", os.path.join(tiny_dir, "proxy"), torch.float32, CPU)
    direct = score_in_chunks(reward_model, own_prompts, own_responses, has_eos, None, 8, on_cpu(own.eos_token_id))
    reward_model.retokenize = reward_tokenizer("reward_model_path", os.path.join(tiny_dir, "proxy"),
                                                        reward_model, policy_tokenizer,
                                                        [r["query"] for r in rows], False, 0)
    assert reward_model.retokenize is not None and "its own tokenizer" in capsys.readouterr().out
    retokenised = score_in_chunks(reward_model, policy_prompts, policy_responses, has_eos, None, 8,
                                  on_cpu(policy_tokenizer.eos_token_id))
    torch.testing.assert_close(retokenised, direct, atol=1e-5, rtol=1e-5)
    # the missing-EOS rule follows the policy's EOS, whatever the reward model's is
    penalised = score_in_chunks(reward_model, policy_prompts, policy_responses, has_eos, -7.0, 8,
                                on_cpu(policy_tokenizer.eos_token_id))
    assert penalised.tolist() == [s if eos else -7.0 for s, eos in zip(retokenised.tolist(), has_eos)]

    # the policy's own tokenizer: its ids as they are, no decoding
    assert reward_tokenizer("reward_model_path", os.path.join(tiny_dir, "proxy"), reward_model, own,
                                     [r["query"] for r in rows], False, 0) is None
    assert "the policy's tokenizer" in capsys.readouterr().out


def on_cpu(pad_id: int) -> core.Run:
    """The run's fixed facts for scoring on CPU, padding with `pad_id` (the reward model re-tokenises: its own)."""
    return core.Run(CPU, torch.autocast("cpu", enabled=False), pad_id, pad_id)


def reward_model_with(tiny_dir: str, folder, tokenizer):
    """The tiny proxy reward model saved with another tokenizer."""
    shutil.copytree(os.path.join(tiny_dir, "proxy"), folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        os.remove(os.path.join(folder, name))
    tokenizer.save_pretrained(folder)
    return str(folder)


def test_chat_template_formats_prompt_and_completion(tiny_dir, tmp_path, capsys):
    own = AutoTokenizer.from_pretrained(os.path.join(tiny_dir, "proxy"))
    own.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{{ eos_token }}"
    path = reward_model_with(tiny_dir, tmp_path / "chat", own)
    rows = validation_rows(tiny_dir, 4)
    prompts, responses = tokenized(own, rows, [True] * 4)
    reward_model = load_reward_model("reward_model_path", path, torch.float32, CPU)
    retokenize = reward_tokenizer("reward_model_path", path, reward_model, own, [r["query"] for r in rows],
                                           True, 0)
    assert retokenize is not None and "chat template" in capsys.readouterr().out  # the same tokenizer, templated
    ids, empty, pad_id = retokenize(prompts, responses, [True] * 4)
    assert empty == [[]] * 4 and pad_id == own.eos_token_id
    for row, sequence in zip(rows, ids):
        assert own.decode(sequence) == (f"user: {row['query']}\nassistant: {summary(row)}\n"
                                        f"{own.eos_token}")
    reward_model.retokenize = retokenize
    assert torch.isfinite(score_in_chunks(reward_model, prompts, responses, [True] * 4, None, 4, on_cpu(pad_id))).all()

    # asked for, without a template to use: refused
    with pytest.raises(SystemExit):
        reward_tokenizer("reward_model_path", os.path.join(tiny_dir, "proxy"), reward_model, own,
                                  ["a text"], True, 0)
    assert "--reward_chat_template" in capsys.readouterr().err


@pytest.mark.parametrize("unk", [True, False])
def test_a_tokenizer_that_cannot_encode_the_text_is_refused(tiny_dir, tmp_path, capsys, unk):
    """A word-level tokenizer that knows two words: with an unknown token it loses the text, without one it
    cannot encode it at all. Either way the run stops at start-up with the flag named."""
    words = models.WordLevel(vocab={"[UNK]": 0, "</s>": 1, "TL;DR:": 2}, unk_token="[UNK]" if unk else None)
    word_level = Tokenizer(words)
    word_level.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    own = PreTrainedTokenizerFast(tokenizer_object=word_level, eos_token="</s>", unk_token="[UNK]" if unk else None)
    path = reward_model_with(tiny_dir, tmp_path / "words", own)
    reward_model = load_reward_model("reward_model_path", path, torch.float32, CPU)
    policy_tokenizer = AutoTokenizer.from_pretrained(os.path.join(tiny_dir, "sft"))
    with pytest.raises(SystemExit):
        reward_tokenizer("reward_model_path", path, reward_model, policy_tokenizer,
                                  [r["query"] for r in validation_rows(tiny_dir, 4)], False, 0)
    err = capsys.readouterr().err
    assert f"--reward_model_path {path}" in err
    assert ("unknown tokens" if unk else "cannot encode") in err, err


@pytest.fixture(scope="module")
def other_vocabulary_policy(tiny_dir, tmp_path_factory) -> str:
    """An untrained policy of the tiny world's shape over the other tokenizer's vocabulary."""
    folder = str(tmp_path_factory.mktemp("other_vocabulary"))
    tokenizer = other_tokenizer(tiny_dir)
    config = GPTNeoXConfig(vocab_size=len(tokenizer), hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=512, max_position_embeddings=512, bos_token_id=tokenizer.bos_token_id,
                           eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    GPTNeoXForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("script", ["async_dpo.py", "async_ppo.py"])
def test_a_policy_with_another_vocabulary_trains(tiny_dir, other_vocabulary_policy, tmp_path, script):
    """Both reward models of the tiny world read the other policy's completions as text; PPO's value model, which
    reads the policy's tokens, starts from the policy instead of the reward model."""
    result = run_script("--model", "tiny", "--sft_model_path", other_vocabulary_policy, "--reward_model_path",
                        os.path.join(tiny_dir, "proxy"), "--gold_reward_model_path", os.path.join(tiny_dir, "gold"),
                        "--dataset", os.path.join(tiny_dir, "data"), "--total_episodes", "128", "--eval_every", "2",
                        "--num_eval_prompts", "32", "--num_final_eval_prompts", "32", "--output_dir", str(tmp_path),
                        script=script)
    assert result.returncode == 0, result.stderr[-3000:]
    for flag in ("--reward_model_path", "--gold_reward_model_path"):
        assert f"{flag}: its own tokenizer" in result.stdout, result.stdout
    steps, evals = read_metrics(tmp_path, step_metric="reward/mean", eval_metric="eval/gold_win_rate")
    assert len(steps) == 4 and all(torch.isfinite(torch.tensor(r["reward/mean"])) for r in steps)
    assert [(r["step"], r["eval/num_prompts"]) for r in evals] == [(0, 32), (2, 32), (4, 32)]  # scored as text
