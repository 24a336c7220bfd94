"""sync_baseline.py end to end (real vLLM on CPU), and with transformers' generate (benchmarks/sync_hf.py)."""
import json
import os

import pytest
from conftest import TORCHRUN_2, run_script
from test_end_to_end import EVAL_METRICS, STEP_METRICS, assert_win_rate_rises, read_metrics


@pytest.mark.slow
def test_sync_baseline_is_on_policy_and_learns(tiny_dir, tmp_path):
    out = tmp_path / "run"
    result = run_script("--model", "tiny", "--tiny_dir", tiny_dir, "--output_dir", str(out), "--total_episodes", "640",
                        "--eval_every", "10", script="sync_baseline.py")
    assert result.returncode == 0, result.stderr[-3000:]
    steps, evals = read_metrics(str(out))
    assert [r["staleness"] for r in steps] == [0] * 20  # generated with the very weights being trained
    assert all(set(STEP_METRICS) <= set(r) for r in steps)
    assert [r["step"] for r in evals] == [0, 10, 20] and all(set(EVAL_METRICS) <= set(r) for r in evals)
    # 20 steps learn: both win rates rise by several standard errors (the run's own; see assert_win_rate_rises), and
    # the proxy mean score rises (by how much depends on the build)
    assert_win_rate_rises(evals[0], evals[-1], "gold")
    assert_win_rate_rises(evals[0], evals[-1], "proxy")
    assert evals[-1]["eval/proxy_reward"] > evals[0]["eval/proxy_reward"]
    # the learner really waits for generation: nothing overlaps. (Except where it scores an evaluation, two steps
    # after one is requested, while the generator samples the next batch)
    after_eval = {r["step"] + 2 for r in evals}
    assert all(r["time/learner_wait"] >= 0.8 * r["time/generation"] for r in steps[1:] if r["step"] not in after_eval)
    # on-policy to the last bit: vLLM's log-probs of the pairs match the learner's at every step
    assert all(abs(r["logps/generator_gap"]) < 1e-4 and r["lag/kl"] < 1e-8 and r["lag/kl_token"] < 1e-8 for r in steps)


@pytest.mark.slow
def test_transformers_generation_under_torchrun_learns_and_saves_every_final_completion(tiny_dir, tmp_path):
    """benchmarks/sync_hf.py (sync_baseline.py with transformers' generate in the generator process, the paper's "why
    vLLM" comparison) on two learner ranks: on-policy at every step, its log-probs the learner's, learning, and the
    final evaluation's completions saved whole, every rank's prompts included (the backend used to sample each
    rank's share on that rank, and rank 0 crashed saving the others' completions as None)."""
    out = tmp_path / "run"
    result = run_script("--model", "tiny", "--tiny_dir", tiny_dir, "--output_dir", str(out), "--total_episodes", "640",
                        "--eval_every", "10", "--num_final_eval_prompts", "130",
                        script=os.path.join("benchmarks", "sync_hf.py"), launcher=TORCHRUN_2)
    assert result.returncode == 0, result.stderr[-3000:]
    steps, evals = read_metrics(str(out))
    assert [r["staleness"] for r in steps] == [0] * 20 and [r["step"] for r in evals] == [0, 10, 20]
    # (transformers' sampler: float32 as well; its per-token log-probs line up with the learner's token by token)
    assert all(abs(r["logps/generator_gap"]) < 1e-3 and r["lag/kl_token"] < 1e-8 for r in steps)
    assert_win_rate_rises(evals[0], evals[-1], "gold")
    completions = [json.loads(line) for line in open(out / "final_completions.jsonl")]
    assert len(completions) == 130 and all(isinstance(c["response"], str) and c["response_tokens"] > 0
                                           for c in completions)


@pytest.mark.slow
def test_sync_baseline_num_mini_batches_staleness_under_torchrun(tiny_dir, tmp_path):
    """N=2: two mini-batches generated with one set of weights, then two optimizer steps on them; on two learner
    ranks, every one of which takes the engine's "ready" message (not only the rank that owns the generator: a
    second rank used to read it as the first evaluation and fail)."""
    out = tmp_path / "run"
    result = run_script("--model", "tiny", "--tiny_dir", tiny_dir, "--output_dir", str(out), "--total_episodes",
                        "192", "--num_mini_batches", "2", "--num_eval_prompts", "16", "--eval_every", "2",
                        script="sync_baseline.py", launcher=TORCHRUN_2)
    assert result.returncode == 0, result.stderr[-3000:]
    steps, evals = read_metrics(str(out))
    assert [r["staleness"] for r in steps] == [0, 1, 0, 1, 0, 1] and [r["step"] for r in evals] == [0, 2, 4, 6]
    # the lag follows: KL(mu || pi) ~0 on the batch of the step's own weights, far above that one step later
    for key in ("lag/kl", "lag/kl_token"):
        fresh, stale = [r[key] for r in steps[::2]], [r[key] for r in steps[1::2]]
        assert max(fresh) < 1e-8 and min(stale) > 100 * max(fresh), (key, fresh, stale)
