"""fully_async_grpo.py: the advantages, the loss and its aggregation worked by hand, the admission bound, bad flags,
and the stream end to end with a real vLLM engine stepped by hand: the staleness never above k (drop: by discarding;
pace: by never sampling what would arrive staler), k = 0 on-policy, the first step's ratio and weight 1."""
import math
import os
import signal
import statistics
import subprocess
import time
from types import SimpleNamespace

import pytest
import torch
from conftest import REPO, TORCHRUN_2, run_in_process, run_script, start_as_a_foreground_job
from test_end_to_end import read_metrics
from test_failures import STOPS_WITHIN, assert_all_gone, generator_of, wait_for_training
from test_shutdown import assert_clean_exit

import fully_async_grpo as fa
from benchmarks import token_versions
from plumbing import checkpoint


def flags(**overrides) -> SimpleNamespace:
    return SimpleNamespace(**{**dict(advantage="grpo", cliprange=0.2, is_cap=2.0, response_length=4), **overrides})


def test_group_advantages_worked_by_hand():
    """Two groups of K = 4: rewards 1, 0, 0, 1 and four ties. GRPO: (r - 0.5) / std, the std torch's (unbiased):
    sqrt(1/3), so +-0.866; Dr. GRPO: r - 0.5 = +-0.5; RLOO: r - the mean of the other three, 1 - 1/3 and 0 - 2/3. A
    group whose rewards tie gets 0 under all three (no signal, and no division by its zero std)."""
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    expected = {"grpo": 0.5 / math.sqrt(1 / 3), "dr_grpo": 0.5, "rloo": 2 / 3}
    for advantage, magnitude in expected.items():
        got = fa.group_advantages(rewards, flags(advantage=advantage))
        torch.testing.assert_close(got[0], torch.tensor([1.0, -1.0, -1.0, 1.0]) * magnitude, rtol=1e-5, atol=1e-5)
        assert torch.all(got[1].abs() < 1e-5), advantage
    with pytest.raises(ValueError, match="unknown --advantage unheard_of"):
        fa.group_advantages(rewards, flags(advantage="unheard_of"))


def test_the_clipped_weighted_loss_at_and_beyond_the_clip():
    """Per token: -w min(r A, clip(r) A), r = pi / pi_prox, w = min(pi_prox / mu, cap), a constant. At r = 1 the term
    is -w A; beyond the clip (r = e^0.5 with A > 0) the term is flat at -w (1.2) A and has no gradient; w is 1 when
    pi_prox is mu (`behaviour`), truncated at the cap, and 0 on padding."""
    logprobs = torch.tensor([[0.0, 0.5, 0.0]], requires_grad=True)
    proximal, behaviour = torch.zeros(1, 3), torch.tensor([[0.0, 0.0, -3.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    losses, ratio, weight, clipped = fa.grpo_loss(logprobs, proximal, behaviour, torch.tensor([2.0]), mask, flags())
    torch.testing.assert_close(losses.detach(), torch.tensor([[-2.0, -2.0 * 1.2, 0.0]]))
    assert clipped.tolist() == [[False, True, False]] and weight.tolist() == [[1.0, 1.0, 0.0]]
    losses.sum().backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-2.0, 0.0, 0.0]]))  # d(-w r A)/d logp = -w r A at r = 1
    _, _, weight, _ = fa.grpo_loss(torch.zeros(1, 3), proximal, torch.tensor([[-0.2, 1.0, -5.0]]),
                                   torch.tensor([1.0]), torch.ones(1, 3), flags())
    torch.testing.assert_close(weight, torch.tensor([[math.exp(0.2), math.exp(-1.0), 2.0]]))  # (the last: e^5, cut)


def test_the_aggregation_worked_by_hand():
    """Two completions of 1 and 3 tokens, each token's term 1 (4 terms): GRPO averages each completion's tokens, then
    the completions ((1 + 1) / 2 = 1 for the step's 2 completions); Dr. GRPO sums the tokens over the step's
    completions times --response_length (4 / (2 x 4) = 0.5)."""
    mask = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    assert fa.aggregate(mask.clone(), mask, 2, flags(advantage="grpo")).item() == pytest.approx(1.0)
    assert fa.aggregate(mask.clone(), mask, 2, flags(advantage="dr_grpo")).item() == pytest.approx(0.5)


@pytest.mark.parametrize("policy, k, loaded, oldest, next_group, in_stream, load_due, inflight, admit", [
    ("pace", 2, 0, 0, 23, 5, False, False, True),  # groups 0..23 may sample with version 0 (3 batches of 8)
    ("pace", 2, 0, 0, 24, 5, False, False, False),  # group 24 would be taken at version 3 at the earliest: 3 stale
    ("pace", 2, 1, 1, 31, 5, False, False, True),  # with version 1 loaded, one batch further
    ("pace", 0, 4, 4, 39, 1, False, False, True),  # k = 0: only the batch of the loaded version, 32..39
    ("pace", 0, 4, 4, 40, 0, False, False, False),
    ("drop", 2, 0, 0, 500, 23, False, False, True),  # drop: only the stream's room counts ((k + 1) B = 24)
    ("drop", 2, 0, 0, 500, 24, False, False, False),
    ("drop", 2, 0, 0, 0, 0, True, False, False),  # a newer version published: drain, then load it
    ("drop", 2, 0, 0, 0, 0, True, True, True),  # ... unless it is loaded in flight: admission goes on
    ("pace", 2, 5, 1, 31, 5, False, True, True),  # in flight, pace: the oldest running group's version bounds
    ("pace", 2, 5, 1, 32, 5, False, True, False),  # admission (version 5 loaded, a group of version 1 sampling)
    ("head", 2, 5, 1, 63, 5, False, True, True),  # head: the loaded version does ((k + 5 + 1) B = 64)
    ("head", 2, 5, 1, 64, 5, False, True, False),
])
def test_the_admission_bound(policy, k, loaded, oldest, next_group, in_stream, load_due, inflight, admit):
    go = dict(max_staleness=k, groups_per_step=8, stale_policy=policy, max_in_flight=(k + 1) * 8,
              inflight_updates=inflight)
    assert fa.can_admit(go, next_group, in_stream, loaded, oldest, load_due) == admit


@pytest.mark.parametrize("flags_, message", [
    (["--max_staleness", "-1"], "--max_staleness must be 0 (synchronous) or more"),
    (["--batch_size", "30", "--num_samples", "4"], "--batch_size 30 (completions a step) must be a whole number"),
    (["--max_in_flight", "15"], "--max_in_flight 15 is less than a step's 16 groups"),
    (["--stale_policy", "wait"], "invalid choice 'wait' for argument '--stale-policy'"),  # (tyro's spelling)
    (["--advantage", "ppo"], "invalid choice 'ppo' for argument '--advantage'"),
    (["--kv_on_update", "keep"], "--kv_on_update keep needs --inflight_updates"),
])
def test_bad_flags_get_one_clear_error(flags_, message, tmp_path, capsys):
    code, stderr = run_in_process("fully_async_grpo.py", "--model", "tiny", "--output_dir", str(tmp_path), *flags_,
                                  capsys=capsys)
    assert code == 2 and message in stderr, stderr


def stream_flags(chains_dir: str, out, *flags_: str) -> tuple:
    return ("--model", "tiny", "--tiny_dir", chains_dir, "--output_dir", str(out), "--eval_every", "0",
            "--num_eval_prompts", "16", "--num_final_eval_prompts", "32", *flags_)


def start_stream(chains_dir: str, out, *flags_: str) -> subprocess.Popen:
    return start_as_a_foreground_job("fully_async_grpo.py", *stream_flags(chains_dir, out, *flags_))


def stream_metrics(out) -> tuple[list, list]:
    return read_metrics(str(out), step_metric="staleness/mean", eval_metric="eval/pass_at_1")


def stopped(process: subprocess.Popen, code: int, children: list) -> str:
    """The learner exits with `code` within STOPS_WITHIN seconds, and nothing it started outlives it. Its stderr."""
    stopped_at = time.time()
    stderr = assert_clean_exit(process, stopped_at, code)
    assert time.time() - stopped_at < STOPS_WITHIN
    assert_all_gone(children)
    return stderr


SIX_STEPS = ("--total_episodes", "384")  # 6 steps of 16 groups of 4


def test_pace_sigterm_and_resume(chains_dir, tmp_path):
    """k = 2, pace: every group trained on is within 2 versions of the learner and none is discarded; the first step
    trains on the SFT weights' samples with the learner's own weights: ratio and importance weight 1 within float
    error. SIGTERM after step 3 saves a checkpoint at the step's end and exits 143 (nothing left running); the
    resumed run admits its groups again from the checkpoint's count and weights and ends at step 6, with every step
    logged once and the bound kept across the restart."""
    out, pace = tmp_path / "run", (*SIX_STEPS, "--max_staleness", "2", "--stale_policy", "pace", "--save_every", "100")
    process = start_stream(chains_dir, out, *pace)
    children = wait_for_training(process, str(out), steps=3, step_metric="staleness/mean")
    os.killpg(process.pid, signal.SIGTERM)
    assert "stopped by SIGTERM after the checkpoint" in stopped(process, 128 + signal.SIGTERM, children)
    saved = checkpoint.read(str(out))["loop"]
    result = run_script(*stream_flags(chains_dir, out, *pace), "--resume_from", str(out), script="fully_async_grpo.py")
    assert result.returncode == 0 and f"resumed at step {saved['version']}" in result.stdout, result.stderr[-3000:]
    steps, evals = stream_metrics(out)
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6] and saved["round"] == 16 * saved["version"]
    assert all(r["staleness/max"] <= 2 and r["rollouts/discarded"] == 0 for r in steps), steps
    assert steps[0]["staleness/max"] == 0 and max(r["staleness/max"] for r in steps) == 2  # (it reaches the bound)
    assert abs(steps[0]["policy/ratio_mean"] - 1) < 1e-5 and abs(steps[0]["is/weight_mean"] - 1) < 1e-5
    assert abs(steps[0]["is/weight_max"] - 1) < 1e-4
    assert [r["step"] for r in evals] == [0, 6]
    assert [r["eval/num_prompts"] for r in evals] == [32, 32]  # the baseline on the final evaluation's prompts


def test_drop_discards_what_arrives_too_stale_under_torchrun(chains_dir, tmp_path):
    """k = 1, drop, two learner processes: the generator samples as far ahead as the stream holds (4 batches: more
    than the bound's own room, 2, at which nothing would be discarded); what arrives more than 1 version behind the
    learner is discarded and counted, so every group trained on is within 1."""
    drop = (*SIX_STEPS, "--per_device_train_batch_size", "32", "--max_staleness", "1", "--stale_policy", "drop",
            "--max_in_flight", "64")
    result = subprocess.run([*TORCHRUN_2, os.path.join(REPO, "fully_async_grpo.py"),
                             *stream_flags(chains_dir, tmp_path, *drop)], capture_output=True, text=True, timeout=900,
                            cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    steps, evals = stream_metrics(tmp_path)
    assert len(steps) == 6 and all(r["staleness/max"] <= 1 for r in steps), [r["staleness/max"] for r in steps]
    assert steps[-1]["rollouts/discarded_total"] == sum(r["rollouts/discarded"] for r in steps) > 0
    assert steps[-1]["rollouts/accepted_total"] == 6 * 16 and evals[-1]["eval/num_prompts"] == 32


def test_k_zero_is_on_policy_and_a_dead_generator_stops_the_run(chains_dir, tmp_path):
    """k = 0: every step trains on groups its own version sampled (staleness 0), so the sampler's weight is 1 at
    every step, not only the first, and the generator is idle while the learner trains. Then the generator dies:
    the learner stops within seconds with its error."""
    process = start_stream(chains_dir, tmp_path, "--max_staleness", "0", "--total_episodes", "100000")
    children = wait_for_training(process, str(tmp_path), steps=3, step_metric="staleness/mean")
    generator_of(children).kill()
    stderr = stopped(process, 1, children)
    assert "error: the generator process exited unexpectedly (exit code -9)" in stderr, stderr[-3000:]
    steps, _ = stream_metrics(tmp_path)
    assert all(r["staleness/max"] == 0 for r in steps)
    assert all(abs(r["is/weight_mean"] - 1) < 1e-5 and abs(r["policy/ratio_mean"] - 1) < 1e-5 for r in steps)
    assert all(r["lag/kl"] < 1e-8 and r["lag/kl_token"] < 1e-8 for r in steps)  # (the lag, per completion and token)
    # (k = 0: the generator waits while the learner trains, and its idle time counts that wait)
    idle_seconds = steps[-1]["idle/generator_fraction"] * steps[-1]["time/elapsed"]
    assert idle_seconds > 0.8 * sum(r["time/training"] for r in steps[:-1]), steps


def test_ctrl_c_stops_the_stream(chains_dir, tmp_path):
    process = start_stream(chains_dir, tmp_path, "--max_staleness", "4", "--stale_policy", "drop",
                           "--total_episodes", "100000")
    children = wait_for_training(process, str(tmp_path), step_metric="staleness/mean")
    os.killpg(process.pid, signal.SIGINT)  # what a terminal does: SIGINT to the whole foreground group
    assert "interrupted" in stopped(process, 130, children)


def test_every_tokens_log_prob_is_its_own_versions(chains_dir, tmp_path):
    """In-flight weight updates (k = 2, B = 4 groups a step: versions arrive while completions sample): each
    completion's tokens are labelled with the versions that sampled them. `recompute`: every token's log-prob from the
    sampler equals its own version's, the prompt and prefix re-read under it, within 1e-4 (fp32 on a CPU; the largest
    gap measured is ~2e-5, while neighbouring versions differ by ~1e-3 at this learning rate), and mislabelled by one
    version the check fails. `keep`: the tokens of a completion's first version still match, those sampled after a
    load do not: the KV cache of their prefix is the older weights'."""
    tolerance, gaps = token_versions.TOLERANCE, {}
    for kv in ("recompute", "keep"):
        out = tmp_path / kv
        result = run_script(*stream_flags(chains_dir, out, "--total_episodes", "192", "--batch_size", "16",
                                          "--per_device_train_batch_size", "16", "--learning_rate", "1e-3",
                                          "--inflight_updates", "--kv_on_update", kv, "--record_rollouts"),
                            script="fully_async_grpo.py")
        assert result.returncode == 0, result.stderr[-3000:]
        steps, _ = stream_metrics(out)
        assert len(steps) == 12 and all(r["staleness/max"] <= 2 for r in steps)
        assert statistics.mean(r["inflight/multi_version_fraction"] for r in steps) > 0.2
        gaps[kv] = token_versions.token_gaps(str(out))
        assert gaps[kv]["first"].max() < tolerance and len(gaps[kv]["later"]) > 100, kv
    assert gaps["recompute"]["later"].max() < tolerance
    mislabelled = token_versions.token_gaps(str(tmp_path / "recompute"), mislabel=1)
    assert (mislabelled["first"] > tolerance).float().mean() > 0.3, mislabelled
    assert (gaps["keep"]["later"] > tolerance).float().mean() > 0.3
