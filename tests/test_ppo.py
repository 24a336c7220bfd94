"""async_ppo.py: the PPO pieces by hand and against independent forms, then end to end with real vLLM on CPU."""
import math
import os

import pytest
import torch
from conftest import TORCHRUN_2
from test_end_to_end import (
    EVAL_METRICS,
    SHORT_RUN,
    assert_importance_weights_start_at_one,
    assert_win_rate_rises,
    read_metrics,
    run_tiny,
)
from test_resume import COMPARED, assert_same_run, run_and_stop
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from async_ppo import (
    TINY_DEFAULTS,
    Args,
    PolicyAndValue,
    clip_gradients,
    collate,
    compute_gae,
    per_token_rewards,
    ppo_losses,
    token_entropy,
    token_logprobs,
    whiten,
)
from async_ppo import resolve_args as resolve_ppo_args

CPU = torch.device("cpu")
STEP_METRICS = ["step", "episode", "staleness", "loss/policy", "loss/value", "policy/clipfrac", "policy/approx_kl",
                "policy/ratio_mean", "policy/ratio_max", "value/clipfrac", "value/explained_variance",
                "objective/kl", "objective/non_score_reward", "objective/entropy", "objective/rlhf_reward",
                "reward/mean", "eos/fraction", "logps/generator_gap", "lag/kl", "lag/kl_token", "lag/update",
                "time/generation", "time/training", "time/weight_sync", "time/learner_wait", "lr"]


def test_gae_matches_a_hand_computed_example():
    # Row 0: three tokens, score 1 on the last. Row 1: two tokens then padding, whose value (7) must be ignored.
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    values = torch.tensor([[0.5, 0.5, 0.5], [1.0, 1.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    advantages, returns = compute_gae(rewards, values, mask, gamma=1.0, lam=0.5)
    # delta_t = r_t + V_{t+1} - V_t; A_t = delta_t + 0.5 A_{t+1}. Row 0: deltas (0, 0, 0.5); row 1: deltas (0, 1)
    torch.testing.assert_close(advantages, torch.tensor([[0.125, 0.25, 0.5], [0.5, 1.0, 0.0]]))
    torch.testing.assert_close(returns, torch.tensor([[0.625, 0.75, 1.0], [1.5, 2.0, 0.0]]))


def vectorised_gae(rewards, values, mask, gamma, lam):
    """A_t = sum_{j >= t} (gamma lam)^(j - t) delta_j as one matrix product (the script uses a reversed loop)."""
    values = values * mask
    next_values = torch.cat([values[:, 1:], torch.zeros(len(values), 1)], dim=1)
    deltas = (rewards + gamma * next_values - values) * mask
    t = torch.arange(rewards.shape[1])
    discount = torch.where(t[None, :] >= t[:, None], (gamma * lam) ** (t[None, :] - t[:, None]).double(), 0.0)
    advantages = (deltas.double() @ discount.T).float()  # [b, j] x [j, t]
    return advantages * mask, (advantages + values) * mask


@pytest.mark.parametrize("gamma, lam", [(1.0, 0.95), (0.9, 0.5), (1.0, 1.0), (0.99, 0.0)])
def test_gae_loop_equals_the_vectorised_form(gamma, lam):
    torch.manual_seed(0)
    lengths = torch.tensor([1, 5, 9, 12, 12, 3])
    mask = (torch.arange(12)[None, :] < lengths[:, None]).float()
    rewards, values = torch.randn(6, 12) * mask, torch.randn(6, 12)  # values on padding are garbage on purpose
    for got, want in zip(compute_gae(rewards, values, mask, gamma, lam), vectorised_gae(rewards, values, mask, gamma,
                                                                                         lam)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_whitening_uses_only_real_tokens():
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0], [4.0, 5.0, -50.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    white = whiten(x, mask, world_size=1)
    real = white[mask.bool()]
    assert real.mean().item() == pytest.approx(0.0, abs=1e-6)
    assert real.var(unbiased=False).item() == pytest.approx(1.0, abs=1e-5)
    assert (white[~mask.bool()] == 0).all()
    torch.testing.assert_close(real, (torch.arange(1.0, 6.0) - 3) / 2**0.5)  # the padding's 100 and -50 ignored


def test_clipped_policy_loss_at_and_beyond_the_clip():
    logprobs = torch.log(torch.tensor([1.0, 1.2, 1.3, 1.3, 0.7])).requires_grad_()
    advantages = torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0])
    zeros = torch.zeros(5)
    policy_losses, _, ratio, clipped, _ = ppo_losses(logprobs, zeros, advantages, zeros, zeros, zeros, 0.2, 0.2)
    torch.testing.assert_close(ratio.detach(), torch.tensor([1.0, 1.2, 1.3, 1.3, 0.7]))
    # at the clip (1.2) nothing is clipped; beyond it, a positive advantage gains nothing more (1.3 -> 1.2), while a
    # negative one keeps the unclipped, larger loss; below 1 - eps a negative advantage is clipped to 0.8
    torch.testing.assert_close(policy_losses.detach(), torch.tensor([-1.0, -1.2, -1.2, 1.3, 0.8]))
    assert clipped.tolist() == [False, False, True, False, True]
    policy_losses.sum().backward()
    assert logprobs.grad[2] == 0 and logprobs.grad[4] == 0  # clipped tokens give no gradient
    assert logprobs.grad[1] < 0 and logprobs.grad[3] > 0


def test_clipped_value_loss_at_and_beyond_the_clip():
    values = torch.tensor([0.5, 0.5, 0.2, -0.5]).requires_grad_()
    old_values, returns = torch.zeros(4), torch.tensor([1.0, 0.0, 1.0, -1.0])
    zeros = torch.zeros(4)
    _, value_losses, _, _, clipped = ppo_losses(zeros, zeros, zeros, values, old_values, returns, 0.2, 0.2)
    # 0.5 is clipped to 0.2: towards a return of 1 the clipped error (0.8) is larger and counts; towards 0 it is
    # smaller and the unclipped one counts; at the clip (0.2) both agree
    torch.testing.assert_close(value_losses.detach(), 0.5 * torch.tensor([0.64, 0.25, 0.64, 0.64]))
    assert clipped.tolist() == [True, False, False, True]
    value_losses.sum().backward()
    assert values.grad[0] == 0 and values.grad[3] == 0 and values.grad[1] > 0


def test_kl_penalty_on_every_token_and_score_on_the_last():
    logprobs = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, 0.0]])
    ref_logprobs = torch.tensor([[-1.5, -2.0, -2.0], [-2.0, -1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    rewards, kl = per_token_rewards(torch.tensor([3.0, -1.0]), logprobs, ref_logprobs, mask, kl_coef=0.1)
    torch.testing.assert_close(kl, torch.tensor([[0.5, 0.0, -1.0], [1.0, 0.0, 0.0]]))
    torch.testing.assert_close(rewards, torch.tensor([[-0.05, 0.0, 3.1], [-0.1, -1.0, 0.0]]))


def test_with_lora_the_adapter_and_the_value_model_have_their_own_rate_and_clip():
    """With LoRA the adapter trains at its own (larger) rate and the fully trained value model at full fine-tuning's,
    each clipped on its own gradient's norm (one group and one clip let the adapter's rate reach the value model and
    the value model's gradient, orders larger, shrink the adapter's step); without LoRA one clip over both, as one
    model (the paper's), and one rate."""
    lora_args = resolve_ppo_args(Args(model="tiny", lora_rank=8, learning_rate=1e-3, max_grad_norm=1.0))
    assert lora_args.value_learning_rate == TINY_DEFAULTS["learning_rate"] != 1e-3
    assert resolve_ppo_args(Args(model="tiny", learning_rate=1e-3)).value_learning_rate == 1e-3
    joint = math.hypot(0.1, 100)  # (the two gradients' norm together)
    for args, adapter_norm, value_norm in ((lora_args, 0.1, 1.0), (Args(max_grad_norm=1.0), 0.1 / joint, 100 / joint)):
        adapter, value = torch.zeros(4, requires_grad=True), torch.zeros(4, requires_grad=True)
        adapter.grad, value.grad = torch.full((4,), 0.05), torch.full((4,), 50.0)  # norms 0.1 and 100
        optimizer = torch.optim.AdamW([dict(params=[adapter]), dict(params=[value], lr=args.value_learning_rate)],
                                      lr=args.learning_rate)
        norms = clip_gradients(optimizer, args)
        assert adapter.grad.norm().item() == pytest.approx(adapter_norm, rel=1e-4)
        assert value.grad.norm().item() == pytest.approx(value_norm, rel=1e-4)
        assert norms["grad/norm"] == pytest.approx(0.1 if args.lora_rank else joint, rel=1e-4)


def test_values_and_logprobs_are_read_where_each_response_token_is_sampled(tiny_dir):
    """Padding (left for prompts, right for responses) changes nothing: each response token's log-prob and value
    equal those of an unpadded forward pass, where the value is read at the token before it."""
    policy = AutoModelForCausalLM.from_pretrained(os.path.join(tiny_dir, "sft")).eval()
    value_model = AutoModelForSequenceClassification.from_pretrained(os.path.join(tiny_dir, "proxy")).eval()
    model = PolicyAndValue(policy, value_model)
    prompts, responses = [[5, 6, 7, 8], [9, 10]], [[11, 12], [13, 14, 15]]
    inputs, response_mask = collate(prompts, responses, pad_id=0, device=CPU)
    with torch.no_grad():
        logits, values = model(inputs, response_mask.shape[1])
        logprobs = token_logprobs(logits, inputs["input_ids"], response_mask, temperature=0.7)
        entropy = token_entropy(logits, response_mask, temperature=0.7)
        for row, (prompt, response) in enumerate(zip(prompts, responses)):
            ids = torch.tensor([prompt + response])
            full_logprobs = torch.log_softmax(policy(ids).logits[0] / 0.7, -1)
            hidden = value_model.gpt_neox(ids).last_hidden_state[0]
            for t, token in enumerate(response):
                position = len(prompt) + t - 1  # the state in which the token was sampled
                assert logprobs[row, t].item() == pytest.approx(full_logprobs[position, token].item(), abs=1e-4)
                assert values[row, t].item() == pytest.approx(value_model.score(hidden[position]).item(), abs=1e-4)
            assert (logprobs[row, len(response):] == 0).all() and (entropy[row, len(response):] == 0).all()
    assert (entropy[response_mask.bool()] > 0).all()


# ---------------------------------------------------------------------------------------------------------------
# End to end, real vLLM on CPU
# ---------------------------------------------------------------------------------------------------------------


def run_ppo(tiny_dir: str, out, *flags: str, **kwargs) -> tuple[list, list]:
    return run_tiny("async_ppo.py", tiny_dir, out, *flags, step_metric="loss/policy", **kwargs)[:2]


@pytest.mark.slow
def test_tiny_demo_learns_with_the_generators_logprobs_as_pi_old(tiny_dir, tmp_path):
    """The README's PPO demo (the tiny defaults)."""
    steps, evals = run_ppo(tiny_dir, tmp_path / "run", "--save_model")
    assert [r["step"] for r in steps] == list(range(1, 61))
    assert all(set(STEP_METRICS) <= set(r) for r in steps)
    assert [r["staleness"] for r in steps] == [0] + [1] * 59
    # Step 1: vLLM sampled with the learner's very weights, so pi / pi_old is 1 within float error. From step 2 the
    # learner is a step ahead of the weights that sampled its batch, and the ratio shows it
    first, later = steps[0], steps[1:21]
    assert abs(first["policy/ratio_mean"] - 1) < 1e-4 and first["policy/ratio_max"] < 1 + 1e-3
    assert first["policy/approx_kl"] < 1e-7 and abs(first["logps/generator_gap"]) < 1e-3
    assert sorted(r["policy/approx_kl"] for r in later)[10] > 1e-5 and max(r["policy/ratio_max"] for r in later) > 1.05
    # the lag, per completion and per token: ~0 at step 1, far above that once the learner is a step ahead
    for key in ("lag/kl", "lag/kl_token"):
        assert first[key] < 1e-8 and min(r[key] for r in steps[1:]) > 100 * first[key], (key, first[key])
    assert [r["step"] for r in evals] == [0, 15, 30, 45, 60] and all(set(EVAL_METRICS) <= set(r) for r in evals)
    # The policy optimises the proxy; the gold model judges it better: win rates up by several standard errors (the
    # run's own; see assert_win_rate_rises), and a higher proxy mean score (how much higher depends on the build)
    assert_win_rate_rises(evals[0], evals[-1], "proxy")
    assert evals[-1]["eval/proxy_reward"] > evals[0]["eval/proxy_reward"]
    assert_win_rate_rises(evals[0], evals[-1], "gold")
    # Step 1 trains the weights that scored the batch: no value is clipped yet; the value model then learns
    assert first["value/clipfrac"] < 0.01 and steps[-1]["loss/value"] < steps[0]["loss/value"]
    AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "model")


# The paper code's recomputed pi_old, the truncated correction on top, gradient checkpointing: one run for the test
# below, and the single process the two learner ranks must follow
SHORT_CORRECTED_RUN = (*SHORT_RUN, "--recompute_old_logprobs", "--gradient_checkpointing", "True", "--is_correction",
                       "truncate")


@pytest.fixture(scope="module")
def single_process_run(tiny_dir, tmp_path_factory):
    """Its folder: the run straight through, which the two ranks and the resumed run must follow."""
    out = tmp_path_factory.mktemp("single")
    run_ppo(tiny_dir, out, *SHORT_CORRECTED_RUN)
    return out


@pytest.mark.slow
def test_recomputed_old_logprobs_hide_the_staleness(single_process_run):
    """The paper code's pi_old, recomputed by the learner just before its update: the ratio is 1 at every step
    although the batch was sampled by weights a step behind (the generator gap says so)."""
    steps, _ = read_metrics(str(single_process_run), step_metric="loss/policy")
    assert [r["staleness"] for r in steps] == [0] + [1] * 5
    assert all(abs(r["policy/ratio_mean"] - 1) < 1e-5 and r["policy/approx_kl"] < 1e-9 for r in steps)
    assert all(abs(r["logps/generator_gap"]) > 1e-4 for r in steps[1:])
    assert_importance_weights_start_at_one(steps)  # (the truncated correction on top: w = 1 at step 1)


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["ddp", "fsdp"])
def test_torchrun_two_learner_processes(tiny_dir, tmp_path, single_process_run, sharding):
    """Two learner ranks, policy and value model under one DDP or FSDP2 wrapper: same seed, same trajectory as one
    process (advantages are whitened over the whole batch, losses averaged over all ranks' tokens)."""
    steps, evals = run_ppo(tiny_dir, tmp_path / "run", *SHORT_CORRECTED_RUN,
                           *(["--fsdp"] if sharding == "fsdp" else []), launcher=TORCHRUN_2)
    assert [r["staleness"] for r in steps] == [0] + [1] * 5
    assert [r["step"] for r in evals] == [0, 3, 6]
    single_steps, single_evals = read_metrics(str(single_process_run), step_metric="loss/policy")
    for key in ("reward/mean", "loss/policy", "loss/value", "objective/kl", "policy/ratio_max"):
        assert [r[key] for r in steps] == pytest.approx([r[key] for r in single_steps], rel=1e-3, abs=1e-3), key
    assert [r["eval/gold_win_rate"] for r in evals] == [r["eval/gold_win_rate"] for r in single_evals]


@pytest.mark.slow
def test_stopped_and_resumed_into_another_folder_is_the_run_that_never_stopped(tiny_dir, tmp_path,
                                                                               single_process_run):
    """PPO (policy and value model under one optimizer, pi_old recomputed, gradient checkpointing) stopped by SIGTERM
    after 2 steps and resumed with --output_dir elsewhere: metrics.jsonl there starts with the records the checkpoint
    covers, copied from the stopped run's (the file used to be extended with NUL bytes), and continues: every step
    and evaluation is the straight run's, exactly; the stopped run's folder is left as it was."""
    stopped = tmp_path / "stopped"
    run_and_stop("async_ppo.py", stopped, 2, "--model", "tiny", "--tiny_dir", tiny_dir, *SHORT_CORRECTED_RUN)
    before = (stopped / "metrics.jsonl").read_bytes()
    steps, _ = run_ppo(tiny_dir, tmp_path / "elsewhere", *SHORT_CORRECTED_RUN, "--resume_from", str(stopped))
    assert b"\0" not in (tmp_path / "elsewhere" / "metrics.jsonl").read_bytes()
    assert_same_run(single_process_run, tmp_path / "elsewhere", COMPARED["async_ppo.py"])
    assert (stopped / "metrics.jsonl").read_bytes() == before


def test_the_lag_update_is_the_policys_step_alone(tiny_dir, tmp_path):
    """lag/update, how far a step moved the policy: one step, the saved policy against the SFT weights it started
    from. The value model, trained beside it under one optimizer, is not part of it (it used to be: the relative
    update of both models together, which says nothing about the policy's lag)."""
    steps, _ = run_ppo(tiny_dir, tmp_path / "run", "--total_episodes", "32", "--eval_every", "0",
                       "--num_final_eval_prompts", "8", "--save_model")
    before = AutoModelForCausalLM.from_pretrained(os.path.join(tiny_dir, "sft")).parameters()
    after = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "model").parameters()
    with torch.no_grad():
        delta, norm = zip(*[((a - b).double().norm() ** 2, b.double().norm() ** 2) for a, b in zip(after, before)])
    assert len(steps) == 1 and steps[0]["lag/update"] == pytest.approx(math.sqrt(sum(delta) / sum(norm)), rel=1e-4)


# (a value model started from an SFT checkpoint, --reward_model_path: refused before vLLM starts, as every reward
# model is: test_bad_input.test_reward_model_without_a_score_head_is_rejected_before_vllm_starts)
