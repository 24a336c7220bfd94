"""async_rloo.py: leave-one-out advantages, the clipped sequence-level objective and the KL-penalised reward by
hand, then end to end with real vLLM on CPU."""
import math

import pytest
import torch
from conftest import TORCHRUN_2
from test_end_to_end import (
    EVAL_METRICS,
    SHORT_RUN,
    assert_importance_weights_start_at_one,
    assert_win_rate_rises,
    run_tiny,
)

import async_ppo
import async_rloo
from async_rloo import kl_penalised_rewards, rloo_advantages, rloo_loss
from plumbing import core

STEP_METRICS = ["step", "episode", "staleness", "loss/policy", "policy/clipfrac", "policy/approx_kl",
                "policy/ratio_mean", "policy/ratio_max", "objective/kl", "objective/non_score_reward",
                "objective/rlhf_reward", "advantage/std", "reward/mean", "eos/fraction", "logps/generator_gap",
                "lag/kl", "lag/kl_token", "lag/update", "time/generation", "time/training", "time/weight_sync",
                "time/learner_wait", "lr"]


def test_leave_one_out_advantages_k2():
    # K = 2: each completion's baseline is the other one's reward
    advantages = rloo_advantages(torch.tensor([[1.0, 3.0], [0.5, 0.5]]))
    torch.testing.assert_close(advantages, torch.tensor([[-2.0, 2.0], [0.0, 0.0]]))


def test_leave_one_out_advantages_k4():
    # baselines: (2+3+6)/3, (1+3+6)/3, (1+2+6)/3, (1+2+3)/3
    advantages = rloo_advantages(torch.tensor([[1.0, 2.0, 3.0, 6.0]]))
    torch.testing.assert_close(advantages, torch.tensor([[1 - 11 / 3, 2 - 10 / 3, 0.0, 4.0]]))
    assert advantages.sum().item() == pytest.approx(0.0, abs=1e-6)  # the advantages of a prompt sum to 0


def test_clipped_objective_at_and_beyond_the_clip():
    logps = torch.log(torch.tensor([1.0, 1.2, 1.5, 1.5, 0.5])).requires_grad_()
    advantages = torch.tensor([2.0, 1.0, 1.0, -1.0, -1.0])
    losses, ratio, clipped = rloo_loss(logps, torch.zeros(5), advantages, cliprange=0.2)
    torch.testing.assert_close(ratio.detach(), torch.tensor([1.0, 1.2, 1.5, 1.5, 0.5]))
    # at the clip nothing is clipped; beyond it a positive advantage is capped at 1.2 A, a negative one keeps the
    # larger unclipped loss, and below 0.8 a negative advantage is clipped to 0.8 A
    torch.testing.assert_close(losses.detach(), torch.tensor([-2.0, -1.2, -1.2, 1.5, 0.8]))
    assert clipped.tolist() == [False, False, True, False, True]
    losses.sum().backward()
    assert logps.grad[2] == 0 and logps.grad[4] == 0 and logps.grad[0] < 0 and logps.grad[3] > 0


def test_kl_penalty_is_subtracted_from_the_score():
    # a sample the policy likes more than the reference (log-ratio +2) pays 0.05 x 2; one it likes less gains
    rewards, kl = kl_penalised_rewards(torch.tensor([1.0, 1.0]), torch.tensor([-3.0, -6.0]),
                                       torch.tensor([-5.0, -5.0]), kl_coef=0.05)
    torch.testing.assert_close(kl, torch.tensor([2.0, -1.0]))
    torch.testing.assert_close(rewards, torch.tensor([0.9, 1.05]))


# ---------------------------------------------------------------------------------------------------------------
# End to end, real vLLM on CPU
# ---------------------------------------------------------------------------------------------------------------
def run_rloo(tiny_dir: str, out, *flags: str, **kwargs) -> tuple[list, list]:
    return run_tiny("async_rloo.py", tiny_dir, out, *flags, step_metric="loss/policy", **kwargs)[:2]


@pytest.mark.slow
def test_tiny_demo_learns_with_the_generators_logprobs_as_pi_old(tiny_dir, tmp_path):
    """The README's RLOO demo (the tiny defaults)."""
    steps, evals = run_rloo(tiny_dir, tmp_path / "run")
    assert [r["step"] for r in steps] == list(range(1, 61))
    assert all(set(STEP_METRICS) <= set(r) for r in steps)
    assert [r["staleness"] for r in steps] == [0] + [1] * 59
    # Step 1: vLLM sampled with the learner's weights, so the sequence ratio is 1 within float error; from step 2
    # the learner is a step ahead
    first, later = steps[0], steps[1:21]
    assert abs(first["policy/ratio_mean"] - 1) < 1e-4 and first["policy/ratio_max"] < 1 + 1e-3
    assert first["policy/approx_kl"] < 1e-7
    assert sorted(r["policy/approx_kl"] for r in later)[10] > 1e-5 and max(r["policy/ratio_max"] for r in later) > 1.05
    # the lag, per completion and per token: ~0 at step 1, far above that once the learner is a step ahead
    for key in ("lag/kl", "lag/kl_token"):
        assert first[key] < 1e-8 and min(r[key] for r in steps[1:]) > 100 * first[key], (key, first[key])
    assert [r["step"] for r in evals] == [0, 15, 30, 45, 60] and all(set(EVAL_METRICS) <= set(r) for r in evals)
    # The policy optimises the proxy and gold judges it better: win rates up by several standard errors (the run's
    # own; see assert_win_rate_rises), and a higher proxy mean score (how much higher depends on the build)
    assert_win_rate_rises(evals[0], evals[-1], "proxy")
    assert evals[-1]["eval/proxy_reward"] > evals[0]["eval/proxy_reward"]
    assert_win_rate_rises(evals[0], evals[-1], "gold")
    assert steps[-1]["objective/kl"] > steps[0]["objective/kl"]  # the policy moved away from the reference


@pytest.mark.parametrize("script", [async_rloo, async_ppo])
def test_importance_correction_at_and_beyond_the_caps(script):
    """w = pi_old / mu against --is_cap 2 and --is_cap_low 0.1: truncation caps w (at the cap: kept as it is), the
    mask drops what lies outside [0.1, 2] (the bounds kept), and neither lets a gradient flow into w."""
    weights = torch.tensor([0.5, 1.0, 2.0, 2.5, 0.05], requires_grad=True)
    expected = {"none": ([1.0] * 5, [False] * 5),
                "truncate": ([0.5, 1.0, 2.0, 2.0, 0.05], [False] * 3 + [True, False]),
                "mask": ([1.0, 1.0, 1.0, 0.0, 0.0], [False] * 3 + [True, True])}
    for correction, (factor, changed) in expected.items():
        args = script.Args(is_correction=correction, is_cap=2.0, is_cap_low=0.1)
        got_factor, got_changed = script.importance_correction(weights, args)
        assert got_factor.tolist() == pytest.approx(factor) and got_changed.tolist() == changed, correction
        assert not got_factor.requires_grad


def test_the_corrected_loss_has_the_gradient_worked_by_hand():
    """At ratio 1 the clipped objective's gradient is -A per completion; truncated importance weights (1.5, and 3
    capped at 2) scale it to -A w, and w itself receives none."""
    logps = torch.tensor([-3.0, -4.0], requires_grad=True)
    weights = torch.tensor([1.5, 3.0], requires_grad=True)
    factor, _ = async_rloo.importance_correction(weights, async_rloo.Args(is_correction="truncate", is_cap=2.0))
    losses, _, _ = rloo_loss(logps, logps.detach(), torch.tensor([1.0, -2.0]), cliprange=0.2)
    (losses * factor).sum().backward()
    assert logps.grad.tolist() == pytest.approx([-1.5, 4.0]) and weights.grad is None


def test_sequence_weight_is_the_geometric_mean_of_the_token_weights():
    """Two completions of 3 and 1 tokens: per-token log w = log pi_old - log mu; RLOO's `sequence` level takes the
    mean over each completion's tokens (the geometric mean of w), `token` their sum (the product); PPO's `sequence`
    level gives every token its completion's geometric mean."""
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    generator = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, 0.0, 0.0]])
    old = generator + torch.tensor([[0.3, -0.6, 0.9], [0.2, 5.0, 5.0]]) * mask  # (padding carries nothing)
    geometric, product = torch.tensor([0.2, 0.2]).exp(), torch.tensor([0.6, 0.2]).exp()
    for level, expected in (("sequence", geometric), ("token", product)):
        episodes = dict(scores=torch.zeros(2), generator_logprobs=generator, response_mask=mask)
        async_rloo.add_advantages(episodes, torch.zeros(2), old, async_rloo.Args(is_level=level))
        torch.testing.assert_close(episodes["is_weights"], expected)
    episodes = dict(scores=torch.zeros(2), generator_logprobs=generator, response_mask=mask)
    async_ppo.add_advantages(episodes, torch.zeros(2, 3), old, torch.zeros(2, 3),
                             async_ppo.Args(is_level="sequence", recompute_old_logprobs=True))
    torch.testing.assert_close(episodes["is_weights"] * mask, geometric[:, None] * mask)


def test_importance_weights_stay_finite_and_their_statistics_count_the_loss_terms():
    """RLOO's `token` level multiplies a completion's token weights: over a long completion the product overflows
    float32 (here log w = 150, from three tokens); it is capped at 1e30, so that truncation and the mask treat it as
    any weight above their cap and the statistics stay finite. PPO's `sequence` level gives a completion one weight:
    its statistics count completions (two here), not tokens (four)."""
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    generator = torch.full((2, 3), -2.0) * mask
    old = generator + torch.tensor([[50.0, 50.0, 50.0], [0.1, 0.0, 0.0]])
    episodes = dict(scores=torch.zeros(2), generator_logprobs=generator, response_mask=mask)
    args = async_rloo.Args(is_level="token", is_correction="mask", recompute_old_logprobs=True)
    async_rloo.add_advantages(episodes, torch.zeros(2), old, args)
    assert episodes["is_weights"].tolist() == pytest.approx([1e30, math.exp(0.1)], rel=1e-4)
    assert episodes["is_factor"].tolist() == [0.0, 1.0]
    stats = core.offpolicy_stats(episodes["log_ratio"], mask, episodes["is_weights"], episodes["is_changed"], 1)
    assert all(math.isfinite(v) for v in stats.values()) and stats["is/ess_fraction"] == pytest.approx(0.5)

    old = generator + torch.tensor([[0.3, 0.3, 0.3], [-0.2, 0.0, 0.0]]) * mask
    episodes = dict(scores=torch.zeros(2), generator_logprobs=generator, response_mask=mask)
    async_ppo.add_advantages(episodes, torch.zeros(2, 3), old, torch.zeros(2, 3),
                             async_ppo.Args(is_level="sequence", recompute_old_logprobs=True))
    terms = episodes["is_terms"]
    stats = core.offpolicy_stats(episodes["learner_log_ratio"], mask, episodes["is_weights"][terms],
                                      episodes["is_changed"][terms], 1)
    w = torch.tensor([0.3, -0.2]).exp()  # one weight a completion
    assert terms.sum() == 2 and stats["is/ess_fraction"] == pytest.approx((w.sum() ** 2 / (2 * (w**2).sum())).item())
    assert stats["is/weight_mean"] == pytest.approx(w.mean().item())


@pytest.mark.parametrize("script", ["async_rloo", "async_ppo"])
def test_importance_statistics_stay_finite_when_every_weight_underflows(script):
    """Every completion far less likely under pi_old than under the sampler (log w = -300 over three tokens): the
    weights, capped at 1e-30 from below as at 1e30 from above, never underflow to 0, so the effective sample size
    (sum w)^2 / (n sum w^2) does not divide by zero (it used to raise ZeroDivisionError and stop the run); equal
    weights at the floor have a full effective sample, and truncation leaves them as they are."""
    module = async_rloo if script == "async_rloo" else async_ppo
    mask = torch.ones(2, 3)
    generator = torch.full((2, 3), -1.0)
    episodes = dict(scores=torch.zeros(2), generator_logprobs=generator, response_mask=mask)
    args = module.Args(is_level="token" if script == "async_rloo" else "sequence", is_correction="truncate",
                       recompute_old_logprobs=True)
    if script == "async_rloo":
        module.add_advantages(episodes, torch.zeros(2), generator - 100.0, args)
        log_ratio, weights, changed = episodes["log_ratio"], episodes["is_weights"], episodes["is_changed"]
    else:
        module.add_advantages(episodes, torch.zeros(2, 3), generator - 100.0, torch.zeros(2, 3), args)
        terms = episodes["is_terms"]
        log_ratio, weights, changed = (episodes["learner_log_ratio"], episodes["is_weights"][terms],
                                       episodes["is_changed"][terms])
    assert (weights > 0).all()
    stats = core.offpolicy_stats(log_ratio, mask, weights, changed, 1)
    assert all(math.isfinite(v) for v in stats.values()) and stats["is/ess_fraction"] == pytest.approx(1.0)


# K = 4 with the paper code's recomputed pi_old and the truncated correction on top: one run for the tests below,
# and the single process the two learner ranks must follow
SHORT_CORRECTED_RUN = (*SHORT_RUN, "--num_samples", "4", "--recompute_old_logprobs", "--whiten_advantages",
                       "--is_correction", "truncate")


@pytest.fixture(scope="module")
def four_samples_run(tiny_dir, tmp_path_factory) -> tuple[list, list]:
    return run_rloo(tiny_dir, tmp_path_factory.mktemp("k4"), *SHORT_CORRECTED_RUN)


def test_recomputed_old_logprobs_hide_the_staleness(four_samples_run):
    """The paper code's pi_old: the ratio is 1 at every step although the batch was sampled a step behind. With the
    sampler's truncated importance weight w = pi_old / mu on top: w is 1 at step 1 (same weights, float32 on both
    sides) and departs from 1 only through staleness after it."""
    steps, _ = four_samples_run
    assert [r["staleness"] for r in steps] == [0] + [1] * 5
    assert all(abs(r["policy/ratio_mean"] - 1) < 1e-5 and r["policy/approx_kl"] < 1e-9 for r in steps)
    assert all(abs(r["logps/generator_gap"]) > 1e-4 for r in steps[1:])
    assert_importance_weights_start_at_one(steps)



def test_four_samples_per_prompt(four_samples_run):
    steps, evals = four_samples_run
    assert [r["staleness"] for r in steps] == [0] + [1] * 5 and len(evals) == 3
    # every completion counted: the EOS fraction is a count out of the step's 32 prompts x 4 completions
    assert all(r["advantage/std"] > 0 and (r["eos/fraction"] * 32 * 4).is_integer() for r in steps)


@pytest.mark.slow
def test_torchrun_two_learner_processes(tiny_dir, tmp_path, four_samples_run):
    """Two learner ranks under DDP: same seed, same trajectory as one process (pi_old recomputed by each rank's
    learner, the advantages whitened over both ranks' completions)."""
    steps, evals = run_rloo(tiny_dir, tmp_path / "run", *SHORT_CORRECTED_RUN, launcher=TORCHRUN_2)
    assert [r["staleness"] for r in steps] == [0] + [1] * 5
    single_steps, single_evals = four_samples_run
    for key in ("reward/mean", "loss/policy", "objective/kl", "advantage/std", "policy/ratio_max"):
        assert [r[key] for r in steps] == pytest.approx([r[key] for r in single_steps], rel=1e-3, abs=1e-3), key
    assert [r["eval/gold_win_rate"] for r in evals] == [r["eval/gold_win_rate"] for r in single_evals]



def test_copg_loss_has_vanilla_rloos_gradient_at_any_staleness():
    """--loss copg (the paper's Appendix B): -A log(pi(y) / pi_old(y)) has the gradient -A grad log pi(y) of vanilla
    RLOO whatever pi_old is, where the proximal loss, clipped (r = e with A > 0, r = 1/e with A < 0), has none."""
    logps = torch.tensor([-3.0, -4.0, -2.0], requires_grad=True)
    old_logps, advantages = torch.tensor([-3.0, -5.0, -1.0]), torch.tensor([1.0, 2.0, -0.5])
    async_rloo.copg_loss(logps, old_logps, advantages).sum().backward()
    torch.testing.assert_close(logps.grad, -advantages)
    torch.testing.assert_close(async_rloo.copg_loss(logps, old_logps, advantages).detach(),
                               -advantages * torch.tensor([0.0, 1.0, -1.0]))
    proximal, _, clipped = rloo_loss(logps, old_logps, advantages, cliprange=0.2)
    logps.grad = None
    proximal.sum().backward()
    assert clipped.tolist() == [False, True, True] and logps.grad.tolist() == [-1.0, 0.0, 0.0]
