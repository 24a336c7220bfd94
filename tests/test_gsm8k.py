"""gsm8k_async_dpo.py: answer extraction and the verifiable reward, pairs, and the GSM8k miniature end to end with
real vLLM on CPU, asynchronous and --sync."""
import json
import os

import pytest
import torch
from test_end_to_end import run_tiny
from transformers import AutoTokenizer

from gsm8k_async_dpo import correctness, extract_answer, select_pairs


@pytest.mark.parametrize("text, answer", [
    ("Tom has 3 + 4 = 7 pencils.\n#### 7", 7),
    ("so 1,234 in all\n#### 1,234", 1234),  # commas removed
    ("#### -12", -12),  # negatives
    ("half of 7 is 3.5\n####3.5", 3.5),  # decimals, no space
    ("#### $1,000", 1000),  # a currency sign
    ("#### 5.00", 5),  # read as a number: 5.00 is 5
    ("#### 7 and then #### 9", 7),  # several "####": the first
    ("the answer is 7", None),  # no "####"
    ("#### seven", None),  # no number after it
])
def test_extract_answer(text, answer):
    assert extract_answer(text) == answer


def test_reward_compares_the_final_answers_as_numbers(gsm8k_dir):
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(gsm8k_dir, "sft"))
    texts = [" Tom has 3 + 4 = 7 pencils.\n#### 7", " 3 + 4 = 8\n#### 8", " no answer here", " #### 7.00",
             " #### 1,000", " #### $1,000"]
    responses = [tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for t in texts]
    answers = ["3 + 4 = 7\n#### 7"] * 4 + ["#### 1000"] * 2
    assert correctness(tokenizer, responses, answers).tolist() == [1.0, 0.0, 0.0, 1.0, 1.0, 1.0]  # as numbers


def test_pairs_take_a_correct_and_an_incorrect_sample_and_skip_ties():
    chosen, rejected, valid = select_pairs(torch.tensor([[0.0, 1.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0],
                                                         [0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]]))
    assert valid.tolist() == [True, False, False, True]  # all right or all wrong: no preference
    assert chosen[0].item() in (1, 3) and rejected[0].item() in (0, 2)
    assert chosen[3].item() == 3 and rejected[3].item() != 3


def test_miniature_splits_ask_new_questions_over_seen_facts_and_keep_unseen_facts_apart(gsm8k_dir):
    import datasets

    splits = datasets.load_dataset(os.path.join(gsm8k_dir, "data"))
    assert {name: len(split) for name, split in splits.items()} == {"train": 7000, "test": 400,
                                                                     "test_unseen_facts": 200}
    assert {"question", "answer"} <= set(splits["train"].column_names)
    def facts(split: str) -> list:  # "Tom has 23 - 11 = 12 pencils left." -> ("23", "-", "11")
        return [tuple(answer.split(" = ")[0].split()[-3:]) for answer in splits[split]["answer"]]

    assert set(facts("test")) <= set(facts("train"))  # every test problem's operation and operands were trained on
    assert not set(splits["test"]["question"]) & set(splits["train"]["question"])  # but never its question
    assert not set(facts("test_unseen_facts")) & set(facts("train"))  # the second split's facts were never seen
    assert all(extract_answer(answer) is not None for answer in splits["train"]["answer"])
    world = json.load(open(os.path.join(gsm8k_dir, "world.json")))
    assert 0.3 <= world["sft_test_pass_at_1"] <= 0.6 and 0.2 <= world["sft_unseen_facts_pass_at_1"] <= 0.5


def test_evaluation_set_puts_training_evaluations_first_and_labels_each_split(gsm8k_dir):
    import datasets

    from gsm8k_async_dpo import Args, evaluation_set

    tokenizer = AutoTokenizer.from_pretrained(os.path.join(gsm8k_dir, "sft"))
    first, second = (datasets.Dataset.from_dict({"question": [f"{name}{i}" for i in range(4)],
                                                 "answer": [f"#### {i}" for i in range(4)]}) for name in "ab")
    args = Args(num_eval_prompts=2, num_final_eval_prompts=3, eval_splits=("test", "other"), rank=1, world_size=2)
    eval_set = evaluation_set([first, second], tokenizer, args)
    order = ["a0", "a1", "b0", "b1", "a2", "b2"]  # training's evaluations (2 of each) are a prefix of the final one
    assert [tokenizer.decode(p).split("\n")[1] for p in eval_set["prompts"]] == order
    assert eval_set["num_prompts"] == 4
    assert eval_set["my_answers"] == ["#### 1", "#### 1", "#### 2"]  # rank 1 of 2: positions 1, 3, 5
    assert eval_set["my_splits"] == [0, 1, 1]


STEP_METRICS = ["step", "staleness", "reward/accuracy", "pairs/fraction", "loss/dpo", "logps/generator_gap",
                "lag/kl", "lag/kl_token", "lag/update", "time/generation", "time/training", "time/learner_wait",
                "eos/fraction"]


def run_gsm8k(gsm8k_dir: str, out, *flags: str) -> tuple[list, list, str]:
    return run_tiny("gsm8k_async_dpo.py", gsm8k_dir, out, *flags, step_metric="loss/dpo", eval_metric="eval/pass_at_1")


@pytest.mark.slow
def test_tiny_gsm8k_demo_learns_with_staleness_one(gsm8k_dir, tmp_path):
    """The README's GSM8k demo for its first 50 steps of 100 (the whole demo's five seeds are archived:
    docs/gsm8k.md): asynchronous Online DPO on the miniature, one step stale."""
    steps, evals, console = run_gsm8k(gsm8k_dir, tmp_path / "run", "--total_episodes", "1600")
    assert [r["staleness"] for r in steps] == [0] + [1] * 49
    assert all(set(STEP_METRICS) <= set(r) for r in steps)
    assert [r["step"] for r in evals] == [0, 25, 50]
    assert all(r["eval/num_prompts"] == 400 and 0 < r["eval/pass_at_1_stderr"] < 0.05 for r in evals)
    assert all(0 < r["eval/test_unseen_facts/pass_at_1"] < 1 for r in evals)  # the second split, reported
    # vLLM's log-probs equal the learner's at step 1 (same weights), token by token; then the lag shows the staleness
    assert abs(steps[0]["logps/generator_gap"]) < 1e-4
    for key in ("lag/kl", "lag/kl_token"):
        lags = [r[key] for r in steps]
        assert lags[0] < 1e-8 and min(lags[1:]) > 100 * lags[0], (key, lags[:3])
    # At step 0 pass@1 is the SFT policy's, which the build measured with transformers (vLLM's greedy decoding may
    # break a near-tie the other way on a few problems). Greedy pass@1 on new problems over seen facts rises by more
    # than one standard error of an evaluation (~0.025) in 50 steps (the archived seeds: +0.050 to +0.080 at step 50,
    # docs/runs/gsm8k_async_vs_sync.tar.xz). (The accuracy of the samples on training problems rises too, but within
    # its steps' noise at 50 steps: 0.83 standard errors on seed 1; held-out pass@1 is the test of learning.)
    world = json.load(open(os.path.join(gsm8k_dir, "world.json")))
    assert evals[0]["eval/pass_at_1"] == pytest.approx(world["sft_test_pass_at_1"], abs=0.03)
    assert evals[-1]["eval/pass_at_1"] - evals[0]["eval/pass_at_1"] > evals[0]["eval/pass_at_1_stderr"]
    assert "pass@1" in console and "test_unseen_facts" in console
