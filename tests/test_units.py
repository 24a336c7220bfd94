"""Unit tests of the numerically delicate pieces of async_dpo.py, on the tiny models (no vLLM)."""
import math
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

import async_dpo
from async_dpo import (
    Args,
    compute_batch_sizes,
    dpo_loss,
    get_reward,
    left_pad,
    make_weight_buffer,
    pad_responses,
    select_pairs,
    sequence_logprobs,
    weight_table,
    weights_from_buffer,
    write_weight_snapshot,
)

EOS, PAD = 0, 0


def test_dpo_loss_matches_formula_and_prefers_the_chosen_response():
    chosen, rejected = torch.tensor([-5.0, -3.0], requires_grad=True), torch.tensor([-6.0, -2.0])
    ref_chosen, ref_rejected = torch.tensor([-5.5, -3.0]), torch.tensor([-5.0, -2.5])
    loss = dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta=0.1)
    margin = (chosen.detach() - ref_chosen) - (rejected - ref_rejected)
    torch.testing.assert_close(loss, -torch.log(torch.sigmoid(0.1 * margin)))
    # identical policy and reference: log 2
    assert dpo_loss(chosen, rejected, chosen.detach(), rejected, 0.1).detach() == pytest.approx([math.log(2)] * 2)
    loss.sum().backward()
    assert (chosen.grad < 0).all()  # gradient descent raises the chosen log-prob


def test_pad_responses_cuts_after_first_eos_and_flags_missing_eos():
    ids, mask, has_eos = pad_responses([[5, 6, EOS, 7, EOS], [5, 6, 7, 8, 9, 10], [EOS]], length=5, eos_id=EOS,
                                       pad_id=99)
    assert ids.tolist() == [[5, 6, EOS, 99, 99], [5, 6, 7, 8, 9], [EOS, 99, 99, 99, 99]]
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]
    assert has_eos.tolist() == [True, False, True]


def test_select_pairs_takes_best_and_worst_and_masks_ties():
    scores = torch.tensor([[0.1, 0.9, 0.5], [-1.0, -1.0, -1.0], [2.0, 2.0, 1.0]])
    chosen, rejected, valid = select_pairs(scores)
    assert chosen.tolist()[0] == 1 and rejected.tolist()[0] == 0
    assert valid.tolist() == [True, False, True]  # all tied: no preference to learn
    assert scores[2, chosen[2]] == 2.0 and rejected[2] == 2


def _encode(tiny_dir, texts):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(os.path.join(tiny_dir, "sft"))
    return tokenizer, [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def test_sequence_logprobs_are_temperature_scaled_and_ignore_padding(tiny_dir):
    policy = AutoModelForCausalLM.from_pretrained(os.path.join(tiny_dir, "sft"))
    tokenizer, prompts = _encode(tiny_dir, ["SUBREDDIT: r/cats\n\nTITLE: my cat\n\nTL;DR:", "POST: hi\n\nTL;DR:"])
    responses = [[5, 6, 7, tokenizer.eos_token_id], [8, 9]]
    query_ids, query_mask = left_pad(prompts, tokenizer.eos_token_id)
    response_ids, response_mask, _ = pad_responses(responses, 6, tokenizer.eos_token_id, tokenizer.eos_token_id)
    with torch.no_grad():
        batched, counts = sequence_logprobs(policy, query_ids, query_mask, response_ids, response_mask, 0.7)
        for i, (prompt, response) in enumerate(zip(prompts, responses)):
            logits = policy(torch.tensor([prompt + response])).logits[0, len(prompt) - 1: -1]
            expected = torch.log_softmax(logits / 0.7, -1).gather(1, torch.tensor(response)[:, None]).sum()
            torch.testing.assert_close(batched[i], expected, atol=1e-4, rtol=1e-4)
            assert counts[i] == len(response)


def test_reward_is_read_at_the_last_real_token_and_penalises_missing_eos(tiny_dir):
    reward_model = AutoModelForSequenceClassification.from_pretrained(os.path.join(tiny_dir, "reward"))
    tokenizer, prompts = _encode(tiny_dir, ["TITLE: a long title here\n\nTL;DR:", "TL;DR:"])
    eos = tokenizer.eos_token_id
    query_ids, query_mask = left_pad(prompts, eos)
    response_ids, response_mask, has_eos = pad_responses([[5, eos], [6, 7, 8]], 5, eos, eos)
    scores = get_reward(reward_model, query_ids, query_mask, response_ids, response_mask, has_eos, -7.0)
    with torch.no_grad():  # the model's own score for the unpadded sequence, read at its last token
        hidden = reward_model.gpt_neox(torch.tensor([prompts[0] + [5, eos]])).last_hidden_state
        expected = reward_model.score(hidden[0, -1])
    torch.testing.assert_close(scores[0], expected[0], atol=1e-4, rtol=1e-4)
    assert scores[1] == -7.0


def test_batch_size_arithmetic():
    args = Args(batch_size=512, per_device_train_batch_size=8, num_mini_batches=2, num_epochs=3, total_episodes=131072)
    compute_batch_sizes(args, world_size=4)
    assert (args.local_batch_size, args.gradient_accumulation_steps) == (128, 16)
    assert (args.num_rounds, args.num_steps) == (128, 128 * 2 * 3)


@pytest.mark.parametrize("overrides, message", [
    (dict(num_samples=1), "--num_samples"),
    (dict(batch_size=510), "--batch_size"),
    (dict(per_device_train_batch_size=7), "--per_device_train_batch_size"),
    (dict(response_length=0), "--response_length"),
    (dict(total_episodes=100), "--total_episodes"),
    (dict(vllm_gpu_memory_utilization=1.5), "--vllm_gpu_memory_utilization"),
])
def test_batch_size_arithmetic_rejects_bad_values(overrides, message, capsys):
    with pytest.raises(SystemExit):
        compute_batch_sizes(Args(**overrides), world_size=4)
    assert message in capsys.readouterr().err


def test_weight_snapshot_is_independent_of_the_optimizer(tiny_dir):
    policy = AutoModelForCausalLM.from_pretrained(os.path.join(tiny_dir, "sft"))
    table = weight_table(policy)
    buffer = make_weight_buffer(table, torch.float32, torch.device("cpu"))
    assert buffer.is_shared()
    write_weight_snapshot(policy, buffer, table)
    snapshot = buffer.clone()
    optimizer = torch.optim.SGD(policy.parameters(), lr=1.0)
    policy(torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, 2, 3]])).loss.backward()
    optimizer.step()
    assert torch.equal(buffer, snapshot)  # the optimizer never writes into what the generator reads
    weights = dict(weights_from_buffer(buffer, table))
    assert list(weights) == [name for name, _ in policy.named_parameters()]
    changed = [n for n, p in policy.named_parameters() if not torch.equal(p.detach(), weights[n])]
    assert changed  # and the snapshot is the old weights, not a view of the new ones


def test_tiny_assets_have_the_hub_dataset_columns(tiny_dir):
    train, validation = async_dpo.load_prompt_splits(os.path.join(tiny_dir, "data"), seed=1)
    for split in (train, validation):
        assert {"query", "reference_response"} <= set(split.column_names)
        assert split[0]["query"].startswith("SUBREDDIT: r/") and split[0]["query"].endswith("\n\nTL;DR:")
        assert split[0]["reference_response"].startswith(" ") and split[0]["reference_response"].endswith(
            "<|endoftext|>")
