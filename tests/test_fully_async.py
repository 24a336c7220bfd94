"""fully_async_grpo.py: the advantages, the loss and its aggregation worked by hand, the admission bound, bad flags,
and the stream end to end with a real vLLM engine stepped by hand: the staleness never above k (drop: by discarding;
pace: by never sampling what would arrive staler), k = 0 on-policy, the first step's ratio and weight 1."""
import json
import math
import os
import signal
import statistics
import subprocess
import time
from types import SimpleNamespace

import datasets
import pytest
import torch
from conftest import REPO, TORCHRUN_2, run_in_process, run_script, start_as_a_foreground_job
from test_end_to_end import read_metrics
from test_failures import STOPS_WITHIN, assert_all_gone, wait_for_training
from test_shutdown import assert_clean_exit

import fully_async_grpo as fa
from benchmarks import token_versions
from plumbing import checkpoint


def flags(**overrides) -> SimpleNamespace:
    return SimpleNamespace(**{**dict(advantage="grpo", cliprange=0.2, is_cap=2.0, is_correction="tis",
                                     response_length=4), **overrides})


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


@pytest.mark.parametrize("advantage", ["grpo", "dr_grpo", "rloo"])
def test_a_tied_group_gets_exactly_zero_for_real_valued_rewards(advantage):
    """A fork's reward model or partial credit gives real-valued rewards: a group whose K rewards tie must get
    advantages of exactly 0 at any K (the float32 mean of K equal values can be an ulp off, and GRPO's division by
    a std of an ulp turned that into up to +-0.5: K = 3 rewards of 2.9 gave -0.18 each), and a group with a real
    difference keeps its sign."""
    torch.manual_seed(0)
    values = torch.cat([torch.linspace(-3, 3, 601), torch.randn(200) * 100, torch.tensor([2.9, 0.1, 1 / 3])])
    for k in (2, 3, 4, 5, 7, 8, 16):
        tied = fa.group_advantages(values[:, None].expand(-1, k).contiguous(), flags(advantage=advantage))
        assert (tied == 0).all(), (k, tied.abs().max().item())
        rewards = values[:, None].repeat(1, k)
        rewards[:, 0] += 1.0  # one completion better than the rest
        assert (fa.group_advantages(rewards, flags(advantage=advantage))[:, 0] > 0).all(), k


def test_the_clipped_weighted_loss_at_and_beyond_the_clip():
    """Per token: -w min(r A, clip(r) A), r = pi / pi_prox, w = min(pi_prox / mu, cap), a constant. At r = 1 the term
    is -w A; beyond the clip (r = e^0.5 with A > 0) the term is flat at -w (1.2) A and has no gradient; w is 1 when
    pi_prox is mu (`behaviour`), truncated at the cap, and 0 on padding."""
    logprobs = torch.tensor([[0.0, 0.5, 0.0]], requires_grad=True)
    proximal, behaviour = torch.zeros(1, 3), torch.tensor([[0.0, 0.0, -3.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    losses, ratio, weight, clipped, _ = fa.grpo_loss(logprobs, proximal, behaviour, torch.tensor([2.0]), mask, flags())
    torch.testing.assert_close(losses.detach(), torch.tensor([[-2.0, -2.0 * 1.2, 0.0]]))
    assert clipped.tolist() == [[False, True, False]] and weight.tolist() == [[1.0, 1.0, 0.0]]
    losses.sum().backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-2.0, 0.0, 0.0]]))  # d(-w r A)/d logp = -w r A at r = 1
    _, _, weight, _, _ = fa.grpo_loss(torch.zeros(1, 3), proximal, torch.tensor([[-0.2, 1.0, -5.0]]),
                                      torch.tensor([1.0]), torch.ones(1, 3), flags())
    torch.testing.assert_close(weight, torch.tensor([[math.exp(0.2), math.exp(-1.0), 2.0]]))  # (the last: e^5, cut)


def test_the_corrections_worked_by_hand():
    """w = pi_prox / mu per token, for log w = 2, 0.5, -0.5 and -2 with C = 2 (log C = 0.69): TIS truncates it at C
    (2, e^0.5, e^-0.5, e^-2), MIS masks the tokens above C (0, e^0.5, e^-0.5, e^-2), IcePop masks those outside
    [1/C, C] (0, e^0.5, e^-0.5, 0), `none` is 1; each says which tokens it changed."""
    proximal, behaviour = torch.zeros(1, 4), -torch.tensor([[2.0, 0.5, -0.5, -2.0]])
    w = [math.exp(2.0), math.exp(0.5), math.exp(-0.5), math.exp(-2.0)]
    expected = {"tis": ([2.0, w[1], w[2], w[3]], [True, False, False, False]),
                "mis": ([0.0, w[1], w[2], w[3]], [True, False, False, False]),
                "icepop": ([0.0, w[1], w[2], 0.0], [True, False, False, True]),
                "none": ([1.0] * 4, [True, True, True, True])}
    for correction, (weights, changed) in expected.items():
        weight, corrected = fa.importance_weight(proximal, behaviour, flags(is_correction=correction))
        torch.testing.assert_close(weight, torch.tensor([weights]), msg=correction)
        assert corrected.tolist() == [changed], correction
    with pytest.raises(ValueError, match="unknown --is_correction cis"):
        fa.importance_weight(proximal, behaviour, flags(is_correction="cis"))


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
    (["--proximal", "behaviour", "--is_cap", "3"], "--is_correction and --is_cap act on w = pi_prox / mu"),
    (["--proximal", "behaviour", "--is_correction", "mis"], "which is 1 under --proximal behaviour"),
    (["--is_correction", "none"], "--is_correction none with --proximal recompute and --max_staleness 2"),
    (["--num_mini_batches", "3"], "--num_mini_batches 3 x --per_device_train_batch_size 64 must divide the 64"),
    (["--prompt_format", "Q: {problem}"], "has no {question}"),
    (["--lora_rank", "8", "--inflight_updates"], "--inflight_updates with --lora_rank"),
    (["--num_generators", "0"], "--num_generators must be at least 1"),
    (["--generator_nodes", "2"], "--generator_nodes 2: the job has 1 node(s) (torchrun --nnodes)"),
    (["--num_generators", "49"], "--num_generators 49: 49 engines, but the stream holds at most --max_in_flight 48"),
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
    resumed run admits again every group not taken (groups are taken as they finish: a long one may still be
    sampling while later ones were taken) with the checkpoint's weights, and ends at step 6, with every step logged
    once, the bound kept across the restart, and every index trained once (resuming from the count taken trained a
    later index twice and a long one never)."""
    out, pace = tmp_path / "run", (*SIX_STEPS, "--max_staleness", "2", "--stale_policy", "pace", "--save_every", "100",
                                   "--record_rollouts")
    process = start_stream(chains_dir, out, *pace)
    children = wait_for_training(process, str(out), steps=3, step_metric="staleness/mean")
    os.killpg(process.pid, signal.SIGTERM)
    assert "stopped by SIGTERM after the checkpoint" in stopped(process, 128 + signal.SIGTERM, children)
    saved = checkpoint.read(str(out))["loop"]
    result = run_script(*stream_flags(chains_dir, out, *pace), "--resume_from", str(out), script="fully_async_grpo.py")
    assert result.returncode == 0 and f"resumed at step {saved['version']}" in result.stdout, result.stderr[-3000:]
    steps, evals = stream_metrics(out)
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6] and saved["round"][0] == 16 * saved["version"]
    groups = [json.loads(line) for line in open(out / "rollouts.jsonl")]
    trained = [g["index"] for g in groups if g["fate"] == "trained"]
    assert len(trained) == len(set(trained)) == 6 * 16, "an index trained twice across the restart"
    # (the first run's trained groups and every group the resumed run admitted: each index once, none skipped)
    assert sorted(g["index"] for g in groups) == list(range(len(groups)))
    assert all(r["staleness/max"] <= 2 and r["rollouts/discarded"] == 0 for r in steps), steps
    assert steps[0]["staleness/max"] == 0 and max(r["staleness/max"] for r in steps) == 2  # (it reaches the bound)
    assert abs(steps[0]["policy/ratio_mean"] - 1) < 1e-5 and abs(steps[0]["is/weight_mean"] - 1) < 1e-5
    assert abs(steps[0]["is/weight_max"] - 1) < 1e-4
    assert [r["step"] for r in evals] == [0, 6]
    assert [r["eval/num_prompts"] for r in evals] == [32, 32]  # the baseline on the final evaluation's prompts


@pytest.mark.slow
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


# k = 0, a dead engine and Ctrl-C: tests/test_engines.py, with two engines


@pytest.mark.slow
def test_every_tokens_log_prob_is_its_own_versions(chains_dir, tmp_path):
    """In-flight weight updates (k = 2, B = 2 groups a step: versions arrive while completions sample): each
    completion's tokens are labelled with the versions that sampled them. `recompute`: every token's log-prob from the
    sampler equals its own version's, the prompt and prefix re-read under it, within 1e-4 (fp32 on a CPU; the largest
    gap measured is ~2e-5, while neighbouring versions differ by ~1e-3 at this learning rate), and mislabelled by one
    version the check fails. `keep`: the tokens of a completion's first version still match, those sampled after a
    load do not: the KV cache of their prefix is the older weights'. (`keep` records every other version only,
    --record_every 2: the audit leaves out the tokens of the versions not kept; the run says what it will write.
    `recompute` logs the engine step after each load, which re-reads the preempted sequences.)"""
    tolerance, gaps = token_versions.TOLERANCE, {}
    for kv in ("recompute", "keep"):
        out, every = tmp_path / kv, 2 if kv == "keep" else 1
        result = run_script(*stream_flags(chains_dir, out, "--total_episodes", "64", "--batch_size", "8",
                                          "--per_device_train_batch_size", "8", "--learning_rate", "1e-3",
                                          "--inflight_updates", "--kv_on_update", kv, "--record_rollouts",
                                          "--record_every", str(every)),
                            script="fully_async_grpo.py")
        assert result.returncode == 0, result.stderr[-3000:]
        assert f"--record_rollouts: {8 // every + 1} versions of" in result.stdout, result.stdout[-2000:]
        kept = sorted(int(name[: -len(".pt")]) for name in os.listdir(out / "versions") if name.endswith(".pt"))
        assert kept == list(range(0, 9, every)), kept
        steps, _ = stream_metrics(out)
        assert len(steps) == 8 and all(r["staleness/max"] <= 2 for r in steps)
        assert any("weights/reprefill_seconds" in r for r in steps) == (kv == "recompute")
        assert statistics.mean(r["inflight/multi_version_fraction"] for r in steps) > 0.2
        gaps[kv] = token_versions.token_gaps(str(out))
        assert gaps[kv]["first"].max() < tolerance and len(gaps[kv]["later"]) > 100, kv
    assert gaps["recompute"]["later"].max() < tolerance
    mislabelled = token_versions.token_gaps(str(tmp_path / "recompute"), mislabel=1)
    assert (mislabelled["first"] > tolerance).float().mean() > 0.3, mislabelled
    assert (gaps["keep"]["later"] > tolerance).float().mean() > 0.3


def a_real_batch(chains_dir: str, tmp_path, **overrides) -> tuple:
    """The chains world's SFT policy, a learner's Args, and a batch of 2 groups of K = 4 as make_rollout lays them
    out: real problems, their reference solutions as the completions, one advantage each, and the policy's own
    log-probs as both the sampler's and the proximal policy's (staleness 0)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from plumbing import core

    args = fa.resolve_args(fa.Args(model="tiny", **{**fa.TINY_DEFAULTS, "batch_size": 8, "num_samples": 4,
                                                     "per_device_train_batch_size": 4, **overrides},
                                   output_dir=str(tmp_path)))
    sft, data, _ = fa.tiny_world.math_world(chains_dir, "chains")
    tokenizer = AutoTokenizer.from_pretrained(sft)
    rows = datasets.Dataset.from_json(os.path.join(data, "train.jsonl")).select(range(8))
    run = core.Run(torch.device("cpu"), torch.autocast("cpu", enabled=False), *core.special_ids(tokenizer))
    prompts = fa.tokenize_prompts(tokenizer, rows, args)
    responses = [tokenizer(" " + answer, add_special_tokens=False)["input_ids"] for answer in rows["answer"]]
    policy = core.train_without_dropout(AutoModelForCausalLM.from_pretrained(sft), False)
    width = max(map(len, responses))
    own = fa.logprobs_in_chunks(policy, prompts, responses, args.temperature, 8, run)
    rollout = dict(prompts=prompts, responses=responses, rewards=torch.zeros(8), ended=torch.ones(8),
                   response_mask=torch.tensor([[1.0] * len(r) + [0.0] * (width - len(r)) for r in responses]),
                   advantages=torch.tensor([1.0, -1.0] * 4), behaviour_logprobs=own, proximal_logprobs=own.clone())
    return policy, args, run, rollout


def test_the_loss_reads_the_rollouts_own_mask(chains_dir, tmp_path):
    """A fork that masks tokens in the rollout (a tool's output, an observation) trains on none of them: the last
    three tokens of every completion masked, two batches that differ only in those tokens take the same step (they
    come last, so nothing before them reads them). Unmasked, the same two batches take different steps."""
    import copy

    policy, args, run, rollout = a_real_batch(chains_dir, tmp_path)

    def step(masked: bool, changed: bool) -> list:
        batch = {key: copy.deepcopy(value) for key, value in rollout.items()}
        for i, tokens in enumerate(batch["responses"]):
            if changed:
                tokens[-3:] = [(t + 7) % 300 + 1 for t in tokens[-3:]]
            if masked:
                batch["response_mask"][i, len(tokens) - 3: len(tokens)] = 0.0
        model = copy.deepcopy(policy)
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        fa.grpo_update(model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0), batch, args,
                       run)
        return [p.detach().clone() for p in model.parameters()]

    for one, other in zip(step(masked=True, changed=False), step(masked=True, changed=True)):
        torch.testing.assert_close(one, other, rtol=0, atol=1e-6)
    assert any(not torch.allclose(one, other, atol=1e-6) for one, other in zip(
        step(masked=False, changed=False), step(masked=False, changed=True)))


@pytest.mark.parametrize("num_mini_batches", [1, 2])
def test_the_clip_acts_under_recompute_from_the_second_mini_batch(chains_dir, tmp_path, num_mini_batches):
    """pi_prox is the learner at the batch's start: with one optimizer step a batch the ratio pi / pi_prox is 1
    when the loss is taken and the clip fraction is exactly 0; with m = 2 the second mini-batch's ratio has moved
    with the first step, and the clip acts."""
    policy, args, run, rollout = a_real_batch(chains_dir, tmp_path, num_mini_batches=num_mini_batches)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    stats = fa.grpo_update(policy, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0), rollout,
                           args, run)
    if num_mini_batches == 1:
        assert stats["policy/clipfrac"] == 0.0 and stats["policy/ratio_max"] == pytest.approx(1.0, abs=1e-5)
    else:
        assert stats["policy/clipfrac"] > 0.05, stats
