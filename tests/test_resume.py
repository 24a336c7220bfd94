"""Exact resume (--save_every, --resume_from): a run stopped by SIGTERM, with what a crash after its checkpoint
leaves behind, continues from its checkpoint and gives the metrics of the run that never stopped, step by step, with
the same evaluations (LoRA-DPO here; PPO resumed into another folder: test_ppo.py; two DDP ranks:
test_end_to_end.py); a checkpoint of another run, a damaged one or none is refused with a one-line error."""
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import REPO, run_in_process, run_script

from plumbing import checkpoint, launch

RUN = ("--model", "tiny", "--total_episodes", "192", "--eval_every", "2", "--num_eval_prompts", "32",
       "--num_final_eval_prompts", "64")
LORA = ("--lora_rank", "8", "--learning_rate", "1e-3")  # (the checkpoint holds the adapter and its AdamW state)
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


def run_and_stop(script: str, out, after_steps: int, *flags: str, launcher: tuple = ()) -> str:
    """Start a run of `script` with `flags` (--save_every 100: no checkpoint of its own within 6 steps), send it
    SIGTERM once `after_steps` steps are logged, as a scheduler would; it saves a checkpoint at the round's end and
    stops. Returns stderr."""
    command = [*launcher, *([] if launcher else [sys.executable]), os.path.join(REPO, script), *flags,
               "--output_dir", str(out), "--save_every", "100"]
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "WANDB_MODE": "offline"})
    metrics = out / "metrics.jsonl"
    while process.poll() is None and (not metrics.exists() or open(metrics).read().count("staleness") < after_steps):
        time.sleep(0.1)
    process.send_signal(signal.SIGTERM)  # (torchrun passes it on to its workers)
    _, stderr = process.communicate(timeout=900)
    assert (out / "checkpoint" / "state.pt").exists(), stderr[-3000:]
    assert launcher or process.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    assert "stopped by SIGTERM after the checkpoint" in stderr, stderr[-3000:]
    assert len([r for r in records(out) if "staleness" in r]) < 6  # it did stop early
    return stderr


@pytest.fixture(scope="module")
def straight_run(tiny_dir, tmp_path_factory):
    """LoRA-DPO's 6-step run straight through, saving a checkpoint every 2 steps (at steps 2 and 4)."""
    out = tmp_path_factory.mktemp("straight")
    result = run_script(*RUN, *LORA, "--tiny_dir", tiny_dir, "--output_dir", str(out), "--save_every", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "checkpoint at step 4" in result.stderr + result.stdout
    return out


@pytest.mark.slow
def test_stopped_by_sigterm_and_resumed_is_the_run_that_never_stopped(tiny_dir, tmp_path, straight_run):
    """LoRA-DPO (the checkpoint holds what trains: the adapter and its AdamW state; the frozen base is the SFT
    checkpoint's), with --track (wandb offline), stopped by SIGTERM after 2 steps. Then what a crash after the
    checkpoint leaves: the records logged after it (the straight run's steps beyond the checkpoint, appended to its
    metrics.jsonl: the resumed run must cut them back and write them again, once), a half-written `checkpoint.new`,
    and part of a `checkpoint.old` (a save renames `checkpoint` to `.old`, the new one into place, then deletes
    `.old`: killed during that deletion, it leaves part of `.old` behind). Resumed in place with a save every step:
    every step and evaluation equals the straight run's exactly, its saves work (the first used to fail on such a
    `.old`, as would every one after it), and the wandb run continues (by its id)."""
    run_and_stop("async_dpo.py", tmp_path, 2, *RUN, *LORA, "--tiny_dir", tiny_dir, "--track")
    saved = checkpoint.read(str(tmp_path))["loop"]["version"]
    later = [line for line in open(straight_run / "metrics.jsonl") if json.loads(line).get("step", 0) > saved]
    assert later, "the run stopped after every step"
    with open(tmp_path / "metrics.jsonl", "a") as metrics:
        metrics.writelines(later)
    (tmp_path / "checkpoint.new").mkdir()
    (tmp_path / "checkpoint.new" / "state.pt").write_bytes(b"half written")
    shutil.copytree(tmp_path / "checkpoint" / "learner", tmp_path / "checkpoint.old" / "learner")  # half deleted
    result = run_script(*RUN, *LORA, "--tiny_dir", tiny_dir, "--save_every", "1", "--resume_from", str(tmp_path),
                        "--track", env={"WANDB_MODE": "offline"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resumed at step {saved} (round {saved})" in result.stdout
    assert f"checkpoint at step {saved + 1}" in result.stderr + result.stdout
    assert sorted(os.listdir(tmp_path / "checkpoint")) == ["learner", "state.pt"]
    assert not (tmp_path / "checkpoint.old").exists() and not (tmp_path / "checkpoint.new").exists()
    assert_same_run(straight_run, tmp_path, COMPARED["async_dpo.py"])
    wandb_runs = sorted(os.listdir(tmp_path / "wandb"))
    wandb_runs = [name for name in wandb_runs if name.startswith("offline-run-")]
    assert len(wandb_runs) == 2 and len({name.rsplit("-", 1)[1] for name in wandb_runs}) == 1, wandb_runs


# Resumed into another --output_dir (PPO): test_ppo.py; two DDP ranks stopped and resumed: test_end_to_end.py


@pytest.mark.parametrize("flags, message", [
    (("--beta", "0.2"), "its run had --beta 0.1, this one has 0.2"),
    (("--total_episodes", "256"), "--total_episodes"),
])
def test_a_checkpoint_of_another_run_is_refused(tiny_dir, tmp_path, straight_run, flags, message, capsys):
    """Refused before anything is written: metrics.jsonl and the checkpoint stay as they were."""
    shutil.copytree(straight_run, tmp_path, dirs_exist_ok=True)
    before = (tmp_path / "metrics.jsonl").read_bytes()
    code, stderr = run_in_process("async_dpo.py", *RUN, *LORA, "--resume_from", str(tmp_path), *flags,
                                  capsys=capsys)
    assert code == 2 and message in stderr, stderr
    assert (tmp_path / "metrics.jsonl").read_bytes() == before


def test_a_damaged_or_missing_checkpoint_gets_a_clear_error(tiny_dir, tmp_path, capsys):
    """No checkpoint at --resume_from: refused at the start. A checkpoint whose learner shard was cut short (a
    truncated copy): resume stops with "damaged checkpoint" and the error's cause, before metrics.jsonl is touched."""
    code, stderr = run_in_process("async_dpo.py", *RUN, "--resume_from", str(tmp_path / "nothing"), capsys=capsys)
    assert code == 2 and "no checkpoint there" in stderr, stderr
    policy, optimizer, scheduler = a_trained_policy(tiny_dir)
    from async_dpo import Args

    args = Args(output_dir=str(tmp_path / "run"), save_every=1)
    os.makedirs(args.output_dir)
    with open(tmp_path / "run" / "metrics.jsonl", "a") as metrics:
        metrics.write(json.dumps({"step": 1}) + "\n")
        checkpoint.save(args, (1, 1, 0, 0, []), None, policy, optimizer, scheduler, torch.zeros(3), metrics)
    before = (tmp_path / "run" / "metrics.jsonl").read_bytes()
    shard = next((tmp_path / "run" / "checkpoint" / "learner").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:1000])  # a truncated copy
    args.resume_from = str(tmp_path / "run")
    with open(tmp_path / "run" / "metrics.jsonl", "a") as metrics, pytest.raises(SystemExit) as stopped:
        checkpoint.resume(args, *a_trained_policy(tiny_dir), None, metrics)
    assert stopped.value.code == 2 and "damaged checkpoint" in capsys.readouterr().err
    assert (tmp_path / "run" / "metrics.jsonl").read_bytes() == before


def a_trained_policy(tiny_dir: str) -> tuple:
    """The tiny world's SFT policy after one AdamW step, its optimizer and a scheduler: what a checkpoint holds."""
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(os.path.join(tiny_dir, "sft"))
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    policy(torch.tensor([[1, 2, 3]])).logits.sum().backward()
    optimizer.step()
    return policy, optimizer, scheduler


def test_sigterm_during_a_save_lets_it_finish_then_exits(tiny_dir, tmp_path):
    """The SIGTERM handler only raises a flag: a signal that arrives while a checkpoint is written (here, before
    the call) changes nothing in it; the save completes, is renamed into place whole, and then the run stops."""
    policy, optimizer, scheduler = a_trained_policy(tiny_dir)
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
