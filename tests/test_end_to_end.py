"""The tiny configuration end to end, as a user runs it: real vLLM on CPU, real transformers models, real
`datasets` loading of the files the tiny configuration writes."""
import glob
import json
import os
import sys

import pytest
from conftest import run_script

STEP_METRICS = ["step", "episode", "staleness", "time/generation", "time/training", "time/weight_sync",
                "time/learner_wait", "time/step", "reward/mean", "reward/chosen", "reward/rejected", "loss/dpo",
                "logps/chosen", "logps/rejected", "eos/fraction", "lr"]
EVAL_METRICS = ["eval/win_rate", "eval/reward", "eval/perplexity"]


def read_metrics(output_dir: str) -> tuple[list, list]:
    records = [json.loads(line) for line in open(os.path.join(output_dir, "metrics.jsonl"))]
    return [r for r in records if "loss/dpo" in r], [r for r in records if "eval/win_rate" in r]


def test_tiny_demo_learns_with_staleness_one(tiny_dir, tmp_path):
    """The README's demo (the tiny defaults), with wandb in offline mode and the model saved."""
    out = tmp_path / "run"
    result = run_script("--model", "tiny", "--tiny_dir", tiny_dir, "--output_dir", str(out), "--track",
                        "--save_model", env={"WANDB_MODE": "offline"})
    assert result.returncode == 0, result.stderr[-3000:]
    steps, evals = read_metrics(str(out))
    assert [r["step"] for r in steps] == list(range(1, 61))
    assert all(set(STEP_METRICS) <= set(r) for r in steps)
    # The learner trains on the batch the previous weights generated: staleness 0 for the first batch, then 1
    assert [r["staleness"] for r in steps] == [0] + [1] * 59
    assert [r["step"] for r in evals] == [0, 15, 30, 45, 60]
    assert all(set(EVAL_METRICS) <= set(r) and len(r["eval/samples"]) == 3 for r in evals)
    # Rewards rise: on held-out prompts and in training
    assert evals[-1]["eval/reward"] > evals[0]["eval/reward"] + 0.1
    assert evals[-1]["eval/win_rate"] > evals[0]["eval/win_rate"]
    first, last = (sum(r["reward/mean"] for r in rs) / len(rs) for rs in (steps[:10], steps[-10:]))
    assert last > first + 0.05
    # Saved model loads; the wandb run was written offline
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoModelForCausalLM.from_pretrained(out / "model")
    AutoTokenizer.from_pretrained(out / "model")
    assert glob.glob(str(out / "wandb" / "offline-run-*" / "*.wandb"))
    assert "eval @ step 60" in result.stderr + result.stdout


def test_torchrun_two_learner_processes(tiny_dir, tmp_path):
    """DDP with two learner ranks on CPU (gloo); rank 0 owns the generator and shares batches."""
    out = tmp_path / "run"
    result = run_script("--model", "tiny", "--tiny_dir", tiny_dir, "--output_dir", str(out), "--total_episodes",
                        "192", "--eval_every", "3", "--num_eval_prompts", "16",
                        launcher=(sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"))
    assert result.returncode == 0, result.stderr[-3000:]
    steps, evals = read_metrics(str(out))
    assert [r["staleness"] for r in steps] == [0] + [1] * 5
    assert all(set(STEP_METRICS) <= set(r) for r in steps)
    assert [r["step"] for r in evals] == [0, 3, 6]
    assert all(0.0 <= r["eval/win_rate"] <= 1.0 for r in evals)


@pytest.mark.parametrize("num_mini_batches, staleness", [(2, [0, 1, 2, 3, 2, 3])])
def test_num_mini_batches_staleness(tiny_dir, tmp_path, num_mini_batches, staleness):
    """N mini-batches share one set of generating weights, so staleness climbs within a round."""
    out = tmp_path / "run"
    result = run_script("--model", "tiny", "--tiny_dir", tiny_dir, "--output_dir", str(out), "--total_episodes",
                        "192", "--num_mini_batches", str(num_mini_batches), "--num_eval_prompts", "16")
    assert result.returncode == 0, result.stderr[-3000:]
    steps, _ = read_metrics(str(out))
    assert [r["staleness"] for r in steps] == staleness
