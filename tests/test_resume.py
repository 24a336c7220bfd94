"""Exact resume (--save_every, --resume_from): a run stopped by SIGTERM, or whose later records a crash left
behind, continues from its checkpoint and gives the metrics of the run that never stopped, step by step, with the
same evaluations; a checkpoint of another run, a damaged one or none is refused with a one-line error."""
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from conftest import REPO, TORCHRUN_2, run_in_process, run_script

from plumbing import checkpoint, launch

RUN = ("--model", "tiny", "--total_episodes", "192", "--eval_every", "2", "--num_eval_prompts", "32",
       "--num_final_eval_prompts", "64")
COMPARED = {"async_dpo.py": ("loss/dpo", "logps/chosen", "logps/rejected", "reward/mean", "logps/generator_gap"),
            "async_ppo.py": ("loss/policy", "loss/value", "objective/kl", "policy/ratio_mean", "reward/mean")}


def records(folder) -> list[dict]:
    return [json.loads(line) for line in open(os.path.join(folder, "metrics.jsonl"))]


def assert_same_run(straight, resumed, keys: tuple, rel: float = 0.0) -> None:
    """Every step and evaluation of `straight` is in `resumed` once, in order, with the same values: exactly
    equal in one process (the default), within `rel` across two ranks."""
    a, b = records(straight), records(resumed)
    for kind in ("staleness", "eval/num_prompts"):
        steps_a, steps_b = [r for r in a if kind in r], [r for r in b if kind in r]
        assert [r["step"] for r in steps_b] == [r["step"] for r in steps_a]  # none missing, none twice
        for x, y in zip(steps_a, steps_b):
            compared = (*keys, "staleness", "generation_version", "lr") if kind == "staleness" else \
                [k for k in x if k.startswith("eval/") and k != "eval/samples"]
            for key in compared:
                assert y[key] == pytest.approx(x[key], rel=rel, abs=rel), (x["step"], key)


def run_and_stop(script: str, tiny_dir: str, out, after_steps: int, *flags: str, launcher: tuple = ()) -> str:
    """Start a run (--save_every 100: no checkpoint of its own within 6 steps), send it SIGTERM once `after_steps`
    steps are logged, as a scheduler would; it saves a checkpoint at the round's end and stops. Returns stderr."""
    command = [*launcher, *([] if launcher else [sys.executable]), os.path.join(REPO, script), *RUN, "--tiny_dir",
               tiny_dir, "--output_dir", str(out), "--save_every", "100", *flags]
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "WANDB_MODE": "offline"})
    metrics = out / "metrics.jsonl"
    while process.poll() is None and (not metrics.exists() or open(metrics).read().count("staleness") < after_steps):
        time.sleep(0.1)
    process.send_signal(signal.SIGTERM)  # (torchrun passes it on to its workers)
    _, stderr = process.communicate(timeout=900)
    assert (out / "checkpoint" / "state.pt").exists(), stderr[-3000:]
    assert launcher or process.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    return stderr


@pytest.fixture(scope="module")
def straight_runs(tiny_dir, tmp_path_factory) -> dict:
    """Each script's 6-step run straight through, saving a checkpoint every 2 steps (at steps 2 and 4)."""
    runs = {}
    for script in COMPARED:
        out = tmp_path_factory.mktemp(script[:-3])
        result = run_script(*RUN, "--tiny_dir", tiny_dir, "--output_dir", str(out), "--save_every", "2",
                            script=script)
        assert result.returncode == 0, result.stderr[-3000:]
        assert "checkpoint at step 4" in result.stderr + result.stdout
        runs[script] = out
    return runs


@pytest.mark.parametrize("script", list(COMPARED))
def test_stopped_by_sigterm_and_resumed_is_the_run_that_never_stopped(script, tiny_dir, tmp_path, straight_runs):
    """With --track (wandb offline), the resumed run continues the stopped run's wandb run, by its id."""
    stderr = run_and_stop(script, tiny_dir, tmp_path, 2, "--track")
    assert "stopped by SIGTERM after the checkpoint" in stderr
    assert len([r for r in records(tmp_path) if "staleness" in r]) < 6  # it did stop early
    result = run_script(*RUN, "--tiny_dir", tiny_dir, "--save_every", "100", "--resume_from", str(tmp_path),
                        "--track", script=script, env={"WANDB_MODE": "offline"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed at step" in result.stdout
    assert_same_run(straight_runs[script], tmp_path, COMPARED[script])
    wandb_runs = sorted(os.listdir(tmp_path / "wandb"))
    wandb_runs = [name for name in wandb_runs if name.startswith("offline-run-")]
    assert len(wandb_runs) == 2 and len({name.rsplit("-", 1)[1] for name in wandb_runs}) == 1, wandb_runs


def test_resume_cuts_back_what_was_logged_after_the_checkpoint_and_its_saves_work(tiny_dir, tmp_path, straight_runs):
    """A run that died after writing steps 5 and 6 (and its final evaluation) but before another checkpoint: the
    resumed run rewrites them from step 4's checkpoint. Left-overs of interrupted saves are ignored: a half-written
    `checkpoint.new`, and part of a `checkpoint.old` (a save renames `checkpoint` to `.old`, the new one into place,
    then deletes `.old`: killed during that deletion, it leaves part of `.old` behind). The resumed run's own saves
    work (the first one used to fail on such a `.old`, as would every one after it)."""
    shutil.copytree(straight_runs["async_dpo.py"], tmp_path, dirs_exist_ok=True)
    (tmp_path / "checkpoint.new").mkdir()
    (tmp_path / "checkpoint.new" / "state.pt").write_bytes(b"half written")
    shutil.copytree(tmp_path / "checkpoint" / "learner", tmp_path / "checkpoint.old" / "learner")  # half deleted
    result = run_script(*RUN, "--tiny_dir", tiny_dir, "--resume_from", str(tmp_path / "checkpoint"), "--save_every",
                        "1")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed at step 4 (round 4)" in result.stdout
    assert "checkpoint at step 5" in result.stderr + result.stdout
    assert sorted(os.listdir(tmp_path / "checkpoint")) == ["learner", "state.pt"]
    assert not (tmp_path / "checkpoint.old").exists()
    assert_same_run(straight_runs["async_dpo.py"], tmp_path, COMPARED["async_dpo.py"])


def test_resumed_into_another_output_dir(tiny_dir, tmp_path, straight_runs):
    """--output_dir elsewhere than the resumed run's folder: metrics.jsonl there starts with the records the
    checkpoint covers, copied from the resumed run (the file used to be extended with NUL bytes), and continues."""
    before = (straight_runs["async_dpo.py"] / "metrics.jsonl").read_bytes()
    result = run_script(*RUN, "--tiny_dir", tiny_dir, "--resume_from", str(straight_runs["async_dpo.py"]),
                        "--output_dir", str(tmp_path / "elsewhere"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert b"\0" not in (tmp_path / "elsewhere" / "metrics.jsonl").read_bytes()
    assert_same_run(straight_runs["async_dpo.py"], tmp_path / "elsewhere", COMPARED["async_dpo.py"])
    assert (straight_runs["async_dpo.py"] / "metrics.jsonl").read_bytes() == before  # the resumed run's untouched


def test_resume_under_torchrun(tiny_dir, tmp_path, straight_runs):
    """Two DDP learner ranks stopped by SIGTERM (every rank agrees on the round to save at) and resumed: the same
    trajectory as one process straight through (to the tolerance two ranks give). Each rank's RNG states are saved
    and restored as its own."""
    run_and_stop("async_dpo.py", tiny_dir, tmp_path, 2, launcher=TORCHRUN_2)
    import torch

    saved = torch.load(tmp_path / "checkpoint" / "state.pt", weights_only=False)
    assert len([r for r in records(tmp_path) if "staleness" in r]) < 6  # it did stop early
    assert [set(states) for states in saved["rng"]] == [{"python", "numpy", "torch", "cuda"}] * 2
    result = run_script(*RUN, "--tiny_dir", tiny_dir, "--resume_from", str(tmp_path), "--save_every", "100",
                        launcher=TORCHRUN_2)
    assert result.returncode == 0, result.stderr[-3000:]
    assert_same_run(straight_runs["async_dpo.py"], tmp_path, ("reward/mean", "loss/dpo", "logps/chosen"), rel=1e-3)


@pytest.mark.parametrize("flags, message", [
    (("--beta", "0.2"), "its run had --beta 0.1, this one has 0.2"),
    (("--total_episodes", "256"), "--total_episodes"),
])
def test_a_checkpoint_of_another_run_is_refused(tiny_dir, tmp_path, straight_runs, flags, message, capsys):
    """Refused before anything is written: metrics.jsonl and the checkpoint stay as they were."""
    shutil.copytree(straight_runs["async_dpo.py"], tmp_path, dirs_exist_ok=True)
    before = (tmp_path / "metrics.jsonl").read_bytes()
    code, stderr = run_in_process("async_dpo.py", *RUN, "--resume_from", str(tmp_path), *flags, capsys=capsys)
    assert code == 2 and message in stderr, stderr
    assert (tmp_path / "metrics.jsonl").read_bytes() == before


def test_a_damaged_or_missing_checkpoint_gets_a_clear_error(tiny_dir, tmp_path, straight_runs, capsys):
    code, stderr = run_in_process("async_dpo.py", *RUN, "--resume_from", str(tmp_path / "nothing"), capsys=capsys)
    assert code == 2 and "no checkpoint there" in stderr, stderr
    shutil.copytree(straight_runs["async_dpo.py"], tmp_path / "run")
    before = (tmp_path / "run" / "metrics.jsonl").read_bytes()
    shard = next((tmp_path / "run" / "checkpoint" / "learner").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:1000])  # a truncated copy
    result = run_script(*RUN, "--tiny_dir", tiny_dir, "--resume_from", str(tmp_path / "run"))
    assert result.returncode == 2 and "damaged checkpoint" in result.stderr, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert (tmp_path / "run" / "metrics.jsonl").read_bytes() == before


def test_sigterm_during_a_save_lets_it_finish_then_exits(tiny_dir, tmp_path):
    """The SIGTERM handler only raises a flag: a signal that arrives while a checkpoint is written (here, before
    the call) changes nothing in it; the save completes, is renamed into place whole, and then the run stops."""
    import torch
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(os.path.join(tiny_dir, "sft"))
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    policy(torch.tensor([[1, 2, 3]])).logits.sum().backward()
    optimizer.step()
    from async_dpo import Args

    args = Args(output_dir=str(tmp_path), save_every=1)
    metrics = open(tmp_path / "metrics.jsonl", "a")
    loop = (1, 1, 0, 0, [])  # round, version, buffer version, last evaluation, pending evaluations
    old_handler = signal.signal(signal.SIGTERM, functools.partial(launch.on_sigterm, 1))  # (the scripts')
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        with pytest.raises(SystemExit) as stopped:
            checkpoint.save(args, loop, None, policy, optimizer, scheduler, torch.zeros(3), metrics)
    finally:
        signal.signal(signal.SIGTERM, old_handler)
        checkpoint.TERM.clear()
    assert stopped.value.code == 128 + signal.SIGTERM
    assert sorted(os.listdir(tmp_path)) == ["checkpoint", "metrics.jsonl"]  # no .new or .old left behind
    saved = torch.load(tmp_path / "checkpoint" / "state.pt", weights_only=False)
    assert saved["loop"]["version"] == 1 and saved["scheduler"] == scheduler.state_dict()
