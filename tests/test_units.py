"""Unit tests of the numerically delicate pieces of async_dpo.py, on the tiny models (no vLLM engine)."""
import json
import math
import os
import re
import sys

import pytest
import torch
from conftest import REPO
from transformers import AutoModelForCausalLM, AutoTokenizer

from async_dpo import (
    Args,
    collate,
    dpo_loss,
    eval_record,
    evaluate,
    make_weight_buffer,
    resolve_args,
    response_logits,
    score_in_chunks,
    select_pairs,
    token_logprobs,
    truncate_at_eos,
    weight_table,
    weights_from_buffer,
    write_weight_snapshot,
)
from plumbing import checkpoint, core, metrics
from plumbing.reward_models import check_score_heads, load_reward_model, weight_names

EOS, PAD = 0, 0
CPU = torch.device("cpu")


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


def test_truncate_at_eos_cuts_after_the_first_eos_and_flags_missing_eos():
    cut, has_eos = truncate_at_eos([[5, 6, EOS, 7, EOS], [5, 6, 7, 8, 9, 10], [EOS]], length=5, eos_id=EOS)
    assert cut == [[5, 6, EOS], [5, 6, 7, 8, 9], [EOS]]
    assert has_eos == [True, False, True]


def test_collate_pads_each_micro_batch_to_its_own_longest():
    inputs, response_mask = collate([[1, 2], [3, 4, 5]], [[6], [7, 8]], pad_id=99, device=CPU)
    assert inputs["input_ids"].tolist() == [[99, 1, 2, 6, 99], [3, 4, 5, 7, 8]]  # 3 prompt + 2 response columns
    assert inputs["attention_mask"].tolist() == [[0, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    assert inputs["position_ids"].tolist()[0][1:4] == [0, 1, 2]  # positions skip the left padding
    assert response_mask.tolist() == [[1, 0], [1, 1]]
    assert inputs["use_cache"] is False


def test_select_pairs_takes_best_and_worst_and_masks_ties():
    scores = torch.tensor([[0.1, 0.9, 0.5], [-1.0, -1.0, -1.0], [2.0, 2.0, 1.0]])
    chosen, rejected, valid = select_pairs(scores)
    assert chosen.tolist()[0] == 1 and rejected.tolist()[0] == 0
    assert valid.tolist() == [True, False, True]  # all tied: no preference to learn
    assert scores[2, chosen[2]] == 2.0 and rejected[2] == 2


def run_facts(eos_id: int) -> core.Run:
    """The run's fixed facts on CPU (float32, no autocast), padding with EOS as the tiny tokenizer does."""
    return core.Run(CPU, torch.autocast("cpu", enabled=False), eos_id, eos_id)


def _encode(tiny_dir, texts):
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(tiny_dir, "sft"))
    return tokenizer, [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def sequence_logprobs(model, inputs: dict, response_mask: torch.Tensor, temperature: float):
    """What DPO and the perplexities use: the script's per-token log-probs summed, and the response lengths."""
    logits = response_logits(model, inputs, response_mask.shape[1])
    return token_logprobs(logits, inputs["input_ids"], response_mask, temperature).sum(1), response_mask.sum(1)


def test_sequence_logprobs_are_temperature_scaled_and_ignore_padding(tiny_dir):
    policy = AutoModelForCausalLM.from_pretrained(os.path.join(tiny_dir, "sft"))
    tokenizer, prompts = _encode(tiny_dir, ["SUBREDDIT: r/cats\n\nTITLE: my cat\n\nTL;DR:", "POST: hi\n\nTL;DR:"])
    responses = [[5, 6, 7, tokenizer.eos_token_id], [8, 9]]
    with torch.no_grad():
        batched, counts = sequence_logprobs(policy, *collate(prompts, responses, tokenizer.eos_token_id, CPU), 0.7)
        for i, (prompt, response) in enumerate(zip(prompts, responses)):
            logits = policy(torch.tensor([prompt + response])).logits[0, len(prompt) - 1: -1]
            expected = torch.log_softmax(logits / 0.7, -1).gather(1, torch.tensor(response)[:, None]).sum()
            torch.testing.assert_close(batched[i], expected, atol=1e-4, rtol=1e-4)
            assert counts[i] == len(response)


def test_reward_is_read_at_the_last_real_token_and_penalises_missing_eos(tiny_dir):
    reward_model = load_reward_model("reward_model_path", os.path.join(tiny_dir, "proxy"), torch.float32, CPU)
    tokenizer, prompts = _encode(tiny_dir, ["TITLE: a long title here\n\nTL;DR:", "TL;DR:"])
    eos = tokenizer.eos_token_id
    scores = score_in_chunks(reward_model, prompts, [[5, eos], [6, 7, 8]], [True, False], -7.0, 2, run_facts(eos))
    with torch.no_grad():  # the model's own score for the unpadded sequence, read at its last token
        hidden = reward_model.gpt_neox(torch.tensor([prompts[0] + [5, eos]])).last_hidden_state
        expected = reward_model.score(hidden[0, -1])
    torch.testing.assert_close(scores[0], expected[0], atol=1e-4, rtol=1e-4)
    assert scores[1] == -7.0


def test_reward_head_scores_in_float32_under_bfloat16(tiny_dir):
    """The backbone may run in bfloat16, but close scores must not round to the same bfloat16 value (false ties)."""
    reward_model = load_reward_model("reward_model_path", os.path.join(tiny_dir, "proxy"), torch.bfloat16,
                                              CPU)
    assert reward_model.score.weight.dtype == torch.float32
    tokenizer, prompts = _encode(tiny_dir, [f"TITLE: post number {i}\n\nTL;DR:" for i in range(16)])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        scores = score_in_chunks(reward_model, prompts, [[5, 6]] * 16, [True] * 16, None, 16,
                                 run_facts(tokenizer.eos_token_id))
    assert scores.dtype == torch.float32
    assert (scores.bfloat16().float() != scores).any()  # more precision than bfloat16 has


def test_a_checkpoint_without_a_trained_score_head_is_refused(tiny_dir, capsys):
    with pytest.raises(SystemExit):
        load_reward_model("reward_model_path", os.path.join(tiny_dir, "sft"), torch.float32, CPU)
    err = capsys.readouterr().err
    assert "--reward_model_path" in err and "score" in err


def test_score_heads_are_read_from_the_weight_names_before_anything_loads(tiny_dir, tmp_path, capsys):
    """check_score_heads, at start-up, reads a checkpoint's weight names (one safetensors file, or a sharded one's
    index) without loading it: the proxy passes, the SFT policy and a sharded causal LM are refused, a sharded
    classifier passes; a checkpoint it cannot read so (.bin) is left to the check as it loads."""
    from types import SimpleNamespace

    args = SimpleNamespace(reward_model_path=os.path.join(tiny_dir, "proxy"), gold_reward_model_path=None)
    check_score_heads(args, "reward_model_path", "gold_reward_model_path")
    for head, refused in (("embed_out", True), ("score", False)):
        folder = tmp_path / head
        folder.mkdir()
        weight_map = {"gpt_neox.layers.0.attention.dense.weight": "a.safetensors", f"{head}.weight": "b.safetensors"}
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
        args.reward_model_path = str(folder)
        if refused:
            with pytest.raises(SystemExit):
                check_score_heads(args, "reward_model_path")
            assert "(its weights: embed_out.*, gpt_neox.*)" in capsys.readouterr().err
        else:
            check_score_heads(args, "reward_model_path")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "pytorch_model.bin").write_bytes(b"")
    assert weight_names(str(tmp_path / "bin")) is None


@pytest.mark.parametrize("lora_rank", [0, 8])
def test_gradient_checkpointing_recomputes_and_gives_the_same_gradients(tiny_dir, lora_rank):
    """Also with LoRA (the hub presets check-point by default): the frozen base's blocks are recomputed and the
    adapter's gradients are the same (its B starts at 0, so its A's are 0: B's are compared)."""
    from plumbing import lora

    tokenizer, prompts = _encode(tiny_dir, ["TITLE: my dog ate my homework\n\nTL;DR:"])
    inputs = collate(prompts * 2, [[5, 6, 7], [8, 9]], tokenizer.eos_token_id, CPU)
    gradients, forward_calls = [], []
    for checkpointing in (False, True):
        sft = AutoModelForCausalLM.from_pretrained(os.path.join(tiny_dir, "sft"))
        torch.manual_seed(0)  # (the adapter's A)
        policy = lora.add_adapter(core.train_without_dropout(sft, checkpointing), Args(lora_rank=lora_rank))
        assert policy.training
        calls = []
        # a pre-hook: the recomputation stops early, once it has what backward needs, so a post-hook may not fire
        policy.gpt_neox.layers[0].register_forward_pre_hook(lambda *_: calls.append(1))
        sequence_logprobs(policy, *inputs, 0.7)[0].sum().backward()
        gradients.append([p.grad for p in policy.parameters() if p.requires_grad])
        forward_calls.append(len(calls))
    assert forward_calls == [1, 2]  # with checkpointing, the backward pass recomputes the block
    assert gradients[1] and all(g is not None for g in gradients[1])
    assert any(g.abs().sum() > 0 for g in gradients[1])
    for without, with_ in zip(*gradients):
        torch.testing.assert_close(without, with_, atol=1e-5, rtol=1e-4)


def test_evaluation_scores_gold_without_the_eos_penalty_and_computes_both_perplexities(tiny_dir):
    reward_model = load_reward_model("reward_model_path", os.path.join(tiny_dir, "proxy"), torch.float32, CPU)
    sft = AutoModelForCausalLM.from_pretrained(os.path.join(tiny_dir, "sft"))
    tokenizer, prompts = _encode(tiny_dir, ["TITLE: my cat\n\nTL;DR:", "TITLE: my job\n\nTL;DR:"])
    eos = tokenizer.eos_token_id
    responses = [[5, 6, eos], [7, 8, 9, 10]]  # the second never ends
    args = Args(missing_eos_penalty=-3.0, eval_response_length=4, per_device_train_batch_size=1)
    # The first completion is its reference: a tie (half a win) under both models, whatever their scores say
    references = {"proxy": torch.tensor([0.0, 0.0]), "gold": torch.tensor([0.0, 0.0]), "tokens": [[5, 6, eos], [5]]}
    sums = evaluate(responses, prompts, references, {"proxy": reward_model, "gold": reward_model}, sft, args,
                    run_facts(eos))
    raw = score_in_chunks(reward_model, prompts, responses, [True, False], None, 2, run_facts(eos))
    assert sums["proxy_reward"] == pytest.approx(raw[0].item() - 3.0, abs=1e-5)
    assert sums["gold_reward"] == pytest.approx(raw.sum().item(), abs=1e-5)
    assert sums["proxy_wins"] == 0.5 and sums["gold_wins"] == 0.5 + (raw[1] > 0).item()
    logps, counts = sequence_logprobs(sft, *collate(prompts, responses, eos, CPU), 1.0)
    paper = torch.exp(-logps / (torch.tensor([len(p) for p in prompts]) + counts)).sum().item()
    assert sums["paper_perplexity"] == pytest.approx(paper, rel=1e-5)
    record = eval_record(sums, 0, args)
    assert record["eval/perplexity"] == pytest.approx(math.exp(-logps.sum().item() / 7), rel=1e-5)
    assert record["eval/perplexity_paper"] == pytest.approx(paper / 2, rel=1e-5)
    assert record["eval/perplexity_paper"] < record["eval/perplexity"]  # the prompt tokens dilute the NLL


def test_eval_record_gives_win_rates_with_their_standard_errors():
    sums = dict(count=400, eos=400, proxy_wins=300, proxy_reward=40.0, gold_wins=100, gold_reward=-20.0, logp=-80.0,
                tokens=800, paper_perplexity=420.0)
    record = eval_record(sums, 0, Args())
    assert record["eval/proxy_win_rate"] == 0.75 and record["eval/gold_win_rate"] == 0.25
    assert record["eval/gold_win_rate_stderr"] == pytest.approx(math.sqrt(0.25 * 0.75 / 400))
    assert record["eval/gold_reward"] == -0.05 and record["eval/perplexity"] == pytest.approx(math.exp(0.1))


def test_batch_size_arithmetic_and_episodes_count_prompts_consumed(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")  # as torchrun sets it
    args = Args(batch_size=512, per_device_train_batch_size=8, num_mini_batches=2, num_epochs=3, total_episodes=131072)
    resolve_args(args)
    assert (args.local_batch_size, args.gradient_accumulation_steps) == (128, 16)
    assert (args.num_rounds, args.num_steps) == (128, 128 * 2 * 3)
    # A round: 2 mini-batches of 512 prompts, 3 epochs over them -> 6 steps that consume 1024 prompts
    assert [metrics.episodes_at(step, args) for step in range(8)] == [0, 512, 1024, 1024, 1024, 1024, 1024, 1536]
    assert metrics.episodes_at(args.num_steps, args) == args.total_episodes


@pytest.mark.parametrize("overrides, message", [
    (dict(num_samples=1), "--num_samples"),
    (dict(batch_size=510), "--batch_size"),
    (dict(per_device_train_batch_size=7), "--per_device_train_batch_size"),
    (dict(response_length=0), "--response_length"),
    (dict(total_episodes=100), "--total_episodes"),
    (dict(vllm_gpu_memory_utilization=1.5), "--vllm_gpu_memory_utilization"),
    (dict(num_final_eval_prompts=2), "--num_final_eval_prompts"),
    (dict(eval_temperature=0.0), "--eval_temperature"),
])
def test_batch_size_arithmetic_rejects_bad_values(overrides, message, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(SystemExit):
        resolve_args(Args(**overrides))
    assert message in capsys.readouterr().err


def test_weight_snapshot_is_independent_of_the_optimizer(tiny_dir):
    policy = AutoModelForCausalLM.from_pretrained(os.path.join(tiny_dir, "sft"))
    table = weight_table(policy)
    buffer = make_weight_buffer(table, torch.float32, CPU)
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
    train, validation = core.load_prompt_splits(os.path.join(tiny_dir, "data"), seed=1)
    for split in (train, validation):
        assert {"query", "reference_response"} <= set(split.column_names)
        assert split[0]["query"].startswith("SUBREDDIT: r/") and split[0]["query"].endswith("\n\nTL;DR:")
        assert split[0]["reference_response"].startswith(" ") and split[0]["reference_response"].endswith(
            "<|endoftext|>")


def test_resume_allocates_the_optimizer_state_without_a_gradient_set():
    """--resume_from first allocates AdamW's moments (to load the checkpoint's into), by a step at lr 0 on zero
    gradients. DCP's own way gives every parameter a zero gradient of its own: beside DDP's gradient buckets, a
    second full float32 gradient set at the resume's peak. Here the step sees one shared zero buffer, the weights do
    not move (weight decay included), the learning rate comes back, and no gradient is left behind."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    weights = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5)
    storages = []
    optimizer.register_step_pre_hook(lambda opt, *_: storages.append(
        {p.grad.untyped_storage().data_ptr() for group in opt.param_groups for p in group["params"]}))
    checkpoint.allocate_optimizer_state(optimizer)
    assert len(storages) == 1 and len(storages[0]) == 1  # one step, on one shared buffer
    assert all(p.grad is None for p in model.parameters()) and optimizer.param_groups[0]["lr"] == 0.1
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))
    assert all(set(optimizer.state[p]) == {"step", "exp_avg", "exp_avg_sq"} for p in model.parameters())


def _one_sgd_step_args(script, rows: int, **flags):
    """A script's Args for one optimizer step of one micro-batch of `rows` prompts on one learner process."""
    run_args = script.Args(**flags)
    run_args.world_size, run_args.batch_size, run_args.local_batch_size = 1, rows, rows
    run_args.per_device_train_batch_size, run_args.gradient_accumulation_steps = rows, 1
    return run_args


def _step_with_sgd(update, policy, mini_batch: dict, args) -> tuple[list, dict]:
    """Run the script's update with plain SGD at lr 1: the weights move by minus the gradient, which it returns."""
    before = [p.detach().clone() for p in policy.parameters()]
    optimizer = torch.optim.SGD(policy.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    stats = update(policy, optimizer, scheduler, mini_batch, args, core.Run(CPU, torch.autocast("cpu", enabled=False),
                                                                            EOS, PAD))
    return [old - p.detach() for old, p in zip(before, policy.parameters())], stats


def test_best_of_k_sft_trains_on_the_best_completions_of_prompts_that_do_not_tie(tiny_dir):
    """--loss best_of_k_sft: one step's gradient is that of the mean, over the prompts whose K completions do not
    all tie, of -log pi(best completion), worked by hand from the model. A tied prompt (here the second: as when no
    completion ended and all took the missing-EOS penalty) has no best completion and takes no part (it used to
    count like any other, fine-tuning on a truncated completion), and the step reads the chosen completions alone
    (it used to run the rejected ones' forward and backward for nothing). The tie fraction is logged; the DPO step
    on the same batch differs and reads both completions."""
    import async_dpo

    prompts, chosen, rejected = [[5, 6, 7], [8, 9]], [[10, 11, EOS], [12]], [[13, 14], [12]]
    valid = torch.tensor([1.0, 0.0])  # the second prompt's completions tied
    mini_batch = dict(prompts=prompts, chosen=chosen, rejected=rejected, valid=valid, scores=torch.zeros(2, 2),
                      eos=torch.ones(2, 2), lengths=torch.tensor([[3, 2], [1, 1]]),
                      generator_chosen_logps=torch.zeros(2), generator_rejected_logps=torch.zeros(2),
                      generator_chosen_logprobs=torch.zeros(2, 3), generator_rejected_logprobs=torch.zeros(2, 3),
                      kl=torch.zeros(2), ref_chosen_logps=torch.zeros(2), ref_rejected_logps=torch.zeros(2))
    sft = os.path.join(tiny_dir, "sft")
    by_hand = core.train_without_dropout(AutoModelForCausalLM.from_pretrained(sft), False)
    inputs, mask = collate(prompts[:1], chosen[:1], PAD, CPU)
    logps = token_logprobs(response_logits(by_hand, inputs, mask.shape[1]), inputs["input_ids"], mask, 0.7).sum(1)
    (-logps.mean()).backward()
    steps, rows_read = {}, {}
    for loss in ("best_of_k_sft", "dpo"):
        policy = core.train_without_dropout(AutoModelForCausalLM.from_pretrained(sft), False)
        policy.register_forward_pre_hook(lambda _, a, kw, loss=loss: rows_read.update(
            {loss: len(kw["input_ids"])}), with_kwargs=True)
        args = _one_sgd_step_args(async_dpo, 2, loss=loss, temperature=0.7)
        steps[loss], stats = _step_with_sgd(async_dpo.dpo_update, policy, mini_batch, args)
        assert f"loss/{loss}" in stats and stats["pairs/tie_fraction"] == 0.5
    for moved, param in zip(steps["best_of_k_sft"], by_hand.parameters()):
        torch.testing.assert_close(moved, param.grad, atol=1e-6, rtol=1e-4)
    assert rows_read == {"best_of_k_sft": 2, "dpo": 4}
    assert not all(torch.allclose(a, b) for a, b in zip(steps["best_of_k_sft"], steps["dpo"]))


def test_the_lag_kl_is_an_unbiased_k3_estimate_and_the_update_is_relative():
    """lag/kl's estimator, expm1(d) - d with d = log pi(y) - log mu(y) for y sampled from mu, averages to the exact
    KL(mu || pi) (a three-outcome example, 200,000 samples); relative_update measures ||delta theta|| / ||theta||."""
    mu, pi = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64), torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64)
    exact = (mu * (mu / pi).log()).sum().item()
    samples = torch.multinomial(mu, 200_000, replacement=True, generator=torch.Generator().manual_seed(0))
    gap = pi.log()[samples] - mu.log()[samples]
    assert (torch.expm1(gap) - gap).mean().item() == pytest.approx(exact, rel=0.02)
    model = torch.nn.Linear(3, 4)
    with torch.no_grad():
        model.weight.fill_(1.0), model.bias.fill_(0.0)  # ||theta|| = sqrt(12)
        before = core.parameters_copy(model)
        model.weight[0, 0] += 0.6
        model.bias[1] -= 0.8  # ||delta theta|| = 1
    assert core.relative_update(model, before, world_size=1) == pytest.approx(1 / math.sqrt(12))


def _lag_mini_batch(script: str, prompts: list, responses: list, generator: torch.Tensor, valid: torch.Tensor) -> dict:
    """A mini-batch for `script`'s update: rows `responses` (DPO: the pairs' chosen, then their rejected), with the
    generator's per-token log-probs `generator` (as wide as the round; what lies past a row's tokens is padding)."""
    n, width = len(responses), generator.shape[1]
    mask = torch.tensor([[1.0] * len(r) + [0.0] * (width - len(r)) for r in responses])
    logged_only = dict(scores=torch.zeros(n), eos=torch.ones(n))  # (they feed the logs only)
    if script in ("async_dpo", "sync_baseline", "gsm8k_async_dpo"):
        m, logps = n // 2, (generator * mask).sum(1)
        return dict(prompts=prompts, chosen=responses[:m], rejected=responses[m:], valid=valid,
                    scores=torch.tensor([[1.0, 0.0]] * m), eos=torch.ones(m, 2), lengths=torch.ones(m, 2),
                    generator_chosen_logps=logps[:m], generator_rejected_logps=logps[m:], kl=torch.zeros(m),
                    generator_chosen_logprobs=generator[:m], generator_rejected_logprobs=generator[m:],
                    ref_chosen_logps=torch.zeros(m), ref_rejected_logps=torch.zeros(m))
    rows = prompts * (n // len(prompts))
    if script == "async_rloo":
        import async_rloo

        episodes = dict(prompts=rows, responses=responses, response_mask=mask, generator_logprobs=generator,
                        generator_logps=(generator * mask).sum(1), **logged_only)
        async_rloo.add_advantages(episodes, torch.zeros(n), generator * mask, _one_sgd_step_args(
            async_rloo, len(prompts), num_samples=2))
        return episodes
    if script == "async_ppo":
        zeros = torch.zeros(n, width)
        return dict(prompts=rows, responses=responses, old_logprobs=generator, advantages=zeros, values=zeros,
                    returns=zeros, response_mask=mask, generator_logprobs=generator, explained_variance=[0.0] * n,
                    learner_log_ratio=zeros, is_weights=torch.ones(n, width), is_factor=torch.ones(n, width),
                    is_changed=zeros.bool(), is_terms=mask.bool(), kl=zeros, **logged_only)
    return dict(prompts=rows, responses=responses, proximal_logprobs=generator, behaviour_logprobs=generator,
                advantages=torch.zeros(n), rewards=torch.zeros(n), ended=torch.ones(n), response_mask=mask)


@pytest.mark.parametrize("script, flags", [
    ("async_dpo", dict(loss="dpo")), ("async_dpo", dict(loss="best_of_k_sft")), ("sync_baseline", dict(loss="dpo")),
    ("gsm8k_async_dpo", {}), ("async_rloo", dict(num_samples=2)), ("async_ppo", dict(num_samples=2)),
    ("fully_async_grpo", {"is_correction": "tis"})])
def test_the_per_token_lag_kl_is_the_mean_k3_over_the_tokens_read(script, flags, tiny_dir):
    """lag/kl_token, worked by hand: mean over every token the step reads of exp(d_t) - 1 - d_t, d_t = log pi(y_t) -
    log mu(y_t), weighted by tokens; lag/kl beside it is the mean over completions of the same term of their summed d.
    Four completions of 1 to 3 tokens, padded, the generator's log-probs one column wider with garbage past each
    completion's end; DPO's second pair ties (valid 0) and counts in neither, Best-of-K SFT reads the chosen alone."""
    from transformers import AutoModelForSequenceClassification

    import async_ppo

    module = __import__(script)
    prompts, responses = [[5, 6, 7], [8, 9]], [[10, 11, EOS], [12], [13, 14], [12, 15]]
    gaps = [[0.3, -0.2, 0.4], [0.4], [-0.5, 0.2], [0.3, 0.1]]  # d_t, row by row
    policy = core.train_without_dropout(AutoModelForCausalLM.from_pretrained(os.path.join(tiny_dir, "sft")), False)
    inputs, mask = collate(prompts * 2, responses, PAD, CPU)
    with torch.no_grad():  # pi's log-probs at the step's start; mu's are pi's minus d, and garbage on padding
        learner = token_logprobs(response_logits(policy, inputs, mask.shape[1]), inputs["input_ids"], mask, 0.7)
    generator = torch.full((4, 4), 9.0)
    for row, d in enumerate(gaps):
        generator[row, : len(d)] = learner[row, : len(d)] - torch.tensor(d)
    valid = torch.tensor([1.0, 0.0])
    read = {"async_dpo": [0, 2] if flags.get("loss") == "dpo" else [0], "sync_baseline": [0, 2],
            "gsm8k_async_dpo": [0, 2]}.get(script, [0, 1, 2, 3])  # rows the step reads, of valid pairs
    tokens = [d for row in read for d in gaps[row]]
    per_token = sum(math.expm1(d) - d for d in tokens) / len(tokens)
    per_sequence = sum(math.expm1(sum(gaps[row])) - sum(gaps[row]) for row in read) / len(read)
    rows = 4 if script == "fully_async_grpo" else 2  # (its micro-batches count completions, the others' prompts)
    args = _one_sgd_step_args(module, rows, temperature=0.7, **flags)
    if script == "async_ppo":  # (the value head rides along: only the policy's log-probs enter the lag)
        value_model = AutoModelForSequenceClassification.from_pretrained(os.path.join(tiny_dir, "proxy"))
        policy = async_ppo.PolicyAndValue(policy, value_model)
    update = {"async_rloo": "rloo_update", "async_ppo": "ppo_update", "fully_async_grpo": "grpo_update"}.get(
        script, "dpo_update")
    _, stats = _step_with_sgd(getattr(module, update), policy,
                              _lag_mini_batch(script, prompts, responses, generator, valid), args)
    assert stats["lag/kl_token"] == pytest.approx(per_token, rel=1e-4)
    assert stats["lag/kl"] == pytest.approx(per_sequence, rel=1e-4)
    assert abs(per_token - per_sequence) > 0.01  # (two different quantities, not two roundings of one)


def round_record(start: float, generation: float, training: float, learner_wait: float) -> dict:
    """A round's timings as round_times logs them: the batch's generation, then its training."""
    return {"time/weight_load": 0.0, "time/generation": generation, "time/weight_sync": 0.0,
            "time/training": training, "time/learner_wait": learner_wait,
            "timeline/weight_load_start": start, "timeline/generation_end": start + generation}


def test_regime_names_the_side_that_waited_and_its_knob():
    """Generation-bound: each batch takes 2 s to generate and 1 s to train on; back to back, the learner waits 1 s
    and the generator never. Training-bound: the reverse (the next batch's load starts when training asks for it,
    3 s after the previous batch's end, an evaluation of 1 s in between not counted as the generator's wait)."""
    generation_bound = [round_record(2.0 * i, 2.0, 1.0, 1.0) for i in range(5)]
    line = metrics.regime(generation_bound)
    assert line.startswith("regime: generation-bound (2.0x)") and "--num_epochs" in line, line
    assert "the learner waited 1.00 s a round, the generator 0.00 s" in line, line
    training_bound = [round_record(4.0 * i, 1.0, 3.0, 0.0) for i in range(5)]
    training_bound.append({"timeline/eval_generation_start": 9.5, "timeline/eval_generation_end": 10.5})
    line = metrics.regime(training_bound)
    assert line.startswith("regime: training-bound (3.0x)") and "--num_samples 4" in line, line
    assert "the generator 2.67 s" in line, line  # (3 + 2 + 3) / 3: the evaluation's second is not a wait
    two_rounds = metrics.regime(training_bound[:2])  # one round after the first: no gap between two to measure
    assert two_rounds.startswith("regime: training-bound") and "a round." in two_rounds, two_rounds
    assert metrics.regime([round_record(0.0, 1.0, 1.1, 0.0)] * 3).startswith("regime: balanced")
    assert "too few rounds" in metrics.regime(generation_bound[:1])


def test_the_chatbot_preset_has_table_7s_defaults_and_flags_override_them(monkeypatch):
    """`--model llama-3.1-8b-no-robots`: the paper's chatbot models at their revisions, its Table 7 (but 252 prompts a
    step, to divide over 7 learners), the test split; a flag still wins; the sync baseline has the same preset."""
    import async_dpo
    import sync_baseline
    from plumbing import launch

    for script in (async_dpo, sync_baseline):
        monkeypatch.setattr(sys, "argv", ["x.py", "--model", "llama-3.1-8b-no-robots", "--beta", "0.05"])
        args = launch.parse_args(script.Args, script.TINY_DEFAULTS, script.PRESET_DEFAULTS)
        assert (args.learning_rate, args.beta, args.temperature, args.batch_size, args.max_prompt_length,
                args.response_length, args.missing_eos_penalty, args.total_episodes, args.eval_split) == (
            8e-7, 0.05, 0.7, 252, 512, 1024, -10.0, 100_000, "test")
        assert args.sft_model_revision.startswith("costa_finetune_tulu3_8b_norobot__meta-llama_Meta-Llama-3.1-8B")
        assert args.reward_model_revision == "reward_modeling__1__1725760619" and args.batch_size % 7 == 0
        assert script.PRESETS[args.model][2] == "HuggingFaceH4/no_robots"


def test_the_last_model_flag_names_the_defaults_as_tyro_keeps_it(monkeypatch):
    """A benchmark runs `fully_async_grpo.py --model tiny ... --model rho-1b` (its own flag, then the user's): tyro
    keeps the last, so the defaults must be the last one's too (the first used to name them: rho-1b trained with the
    tiny world's learning rate and batch)."""
    import fully_async_grpo
    from plumbing import launch

    monkeypatch.setattr(sys, "argv", ["x.py", "--model", "tiny", "--num_samples", "4", "--model", "rho-1b"])
    args = launch.parse_args(fully_async_grpo.Args, fully_async_grpo.TINY_DEFAULTS)
    assert (args.model, args.learning_rate, args.batch_size, args.num_samples) == ("rho-1b", 1e-6, 512, 4)
    monkeypatch.setattr(sys, "argv", ["x.py", "--model=rho-1b", "--model", "tiny"])
    assert launch.parse_args(fully_async_grpo.Args, fully_async_grpo.TINY_DEFAULTS).learning_rate == 1e-4


def test_a_resume_compares_hub_models_by_repository_and_commit_not_by_cache_path(tmp_path, capsys):
    """A model fetched with a revision is read from the Hugging Face cache, whose path differs between machines (and
    users): a checkpoint written on one resumes on another with the same repository and commit (it used to be
    refused, naming --sft_model_path), and is still refused at another commit."""
    snapshot = "hub/models--allenai--open_instruct_dev/snapshots/0123abcd"
    saved = Args(model="pythia-410m", sft_model_path=f"/home/alice/.cache/huggingface/{snapshot}")
    os.makedirs(tmp_path / "checkpoint")
    torch.save(dict(args=vars(saved), wandb_id=None), tmp_path / "checkpoint" / "state.pt")
    here = Args(model="pythia-410m", resume_from=str(tmp_path), sft_model_path=f"/scratch/hf/{snapshot}/")
    checkpoint.check_same_run(here, {"resume_from"})
    here.sft_model_path = here.sft_model_path.replace("0123abcd", "4567ef01")
    with pytest.raises(SystemExit):
        checkpoint.check_same_run(here, {"resume_from"})
    assert "its run had --sft_model_path /home/alice/.cache" in capsys.readouterr().err


def test_a_dataset_folder_rewritten_in_place_loads_its_new_rows(tmp_path):
    """A folder whose card names its splits by file (as every world's `data/` does) and whose files are then rewritten,
    as a world rebuilt in place is: the new rows load, not the ones `datasets` cached from the old files (it did:
    its cache was named by the card's file names alone)."""
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "README.md").write_text("---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n"
                                      "    path: train.jsonl\n  - split: test\n    path: test.jsonl\n---\n")
    for rows in (2, 3):
        for split in ("train", "test"):
            (folder / f"{split}.jsonl").write_text("".join(f'{{"query": "q{i}", "reference_response": "r"}}\n'
                                                           for i in range(rows)))
        train, test = core.load_prompt_splits(str(folder), 1, names=("train", "test"))
        assert len(train) == len(test) == rows


@pytest.mark.parametrize("truncation", [dict(top_p=0.9), dict(top_k=50), dict(min_p=0.05)])
def test_truncated_sampling_is_refused_where_every_script_builds_it(truncation):
    """top-p < 1, top-k or min-p make the sampler's log-probs those of a truncated distribution while the learner's
    are of the whole one: the importance ratio would compare different supports. generator_io.check_untruncated
    refuses them, and every SamplingParams a script builds passes through it (a fork adding top_p is stopped)."""
    from vllm import SamplingParams

    from plumbing import generator_io

    generator_io.check_untruncated([SamplingParams(temperature=0.7), SamplingParams(temperature=0.0)])
    with pytest.raises(ValueError, match="would compare different supports"):
        generator_io.check_untruncated([SamplingParams(temperature=0.7), SamplingParams(**truncation)])
    for script in ("async_dpo", "async_ppo", "async_rloo", "sync_baseline", "gsm8k_async_dpo", "fully_async_grpo",
                   "agentic_grpo"):
        source = open(os.path.join(REPO, f"{script}.py")).read()
        built = [m.end() for m in re.finditer(r"SamplingParams\(", source)]
        checked = [m.start() for m in re.finditer(r"generator_io\.check_untruncated\(sampling\)", source)]
        assert built and len(built) == len(checked), script  # (each construction, then its check before use)
        assert all(0 < c - b < 1200 for b, c in zip(built, checked)), script
