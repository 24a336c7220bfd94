"""No pending item can block the learner's exit: a request far larger than a pipe's 64 KiB, stuck in the one-slot
queue because the generator is busy, must not hang the learner when the generator dies, on Ctrl-C, or at the end."""
import json
import os
import signal
import subprocess
import sys
import time
from typing import Optional

import psutil
import pytest
from conftest import REPO, start_as_a_foreground_job
from test_end_to_end import read_metrics
from test_failures import STOPS_WITHIN, assert_all_gone, generator_of

# A learner and a busy generator that never reads: the learner's queue feeder thread blocks on the full pipe.
PENDING_REQUEST = r"""
import multiprocessing as mp, sys, tempfile, time
sys.path.insert(0, sys.argv[1])
from plumbing.generator_io import Generator, put

def busy_generator(requests) -> None:
    time.sleep(600)

if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    requests, results = ctx.Queue(maxsize=1), ctx.Queue(maxsize=1)
    generator = ctx.Process(target=busy_generator, args=(requests,))
    generator.start()
    put(requests, dict(kind="eval", prompts=[[i % 1000] * 500 for i in range(512)]), generator)  # ~1 MB pickled
    time.sleep(1)
    generator.kill()
    Generator(generator, requests, results, tempfile.mkdtemp()).stop()
    print("stopped", flush=True)
"""


def test_stop_generator_exits_with_a_large_request_pending():
    started = time.time()
    result = subprocess.run([sys.executable, "-c", PENDING_REQUEST, REPO], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "stopped" in result.stdout, result.stderr[-3000:]
    assert time.time() - started < 60


@pytest.fixture(scope="module")
def long_prompts(tiny_dir, tmp_path_factory) -> str:
    """The tiny world's data with every post six times longer (~240 tokens a prompt): a request of 128 prompts
    (an evaluation's, or a training round's of 128) is then ~82 KB pickled, above a pipe's 64 KiB (256: 164 KB; at
    real scale: ~600 KB)."""
    folder = tmp_path_factory.mktemp("long") / "data"
    folder.mkdir()
    for split in ("train", "validation"):
        with open(os.path.join(tiny_dir, "data", f"{split}.jsonl")) as source, open(folder / f"{split}.jsonl",
                                                                                    "w") as target:
            for line in source:
                row = json.loads(line)
                row["query"] = " ".join([row["query"].split(" TL;DR:")[0]] * 5 + [row["query"]])
                target.write(json.dumps(row) + "\n")
    return str(folder)


def start_long_run(tiny_dir: str, dataset: str, out: str, *flags: str) -> subprocess.Popen:
    return start_as_a_foreground_job("async_dpo.py", "--model", "tiny", "--tiny_dir", tiny_dir, "--dataset", dataset,
                                     "--output_dir", out, "--max_prompt_length", "400", "--eval_every", "1",
                                     "--num_eval_prompts", "128", "--num_final_eval_prompts", "128", *flags)


def steps_logged(out: str) -> int:
    path = os.path.join(out, "metrics.jsonl")
    return open(path).read().count('"loss/dpo"') if os.path.exists(path) else 0


def pending_request(process: subprocess.Popen, out: str) -> list:
    """Once the learner has trained, freeze the generator (SIGSTOP: busy for as long as a real generation takes)
    and give the learner time to queue its next requests behind it, the evaluation's among them. Returns the
    process tree."""
    deadline = time.time() + 600
    while steps_logged(out) < 1:
        assert process.poll() is None, process.communicate()[1][-3000:]
        assert time.time() < deadline, "no training step within the timeout"
        time.sleep(0.2)
    children = psutil.Process(process.pid).children(recursive=True)
    generator_of(children).suspend()
    time.sleep(5)
    return children


def assert_clean_exit(process: subprocess.Popen, stopped_at: Optional[float], code: int) -> str:
    """The learner exits with `code` within a minute of `stopped_at` (seconds here; the margin is for slow machines;
    None: a normal end, timed from its last record by the caller) and prints no second failure. Returns its
    stderr."""
    try:
        _, stderr = process.communicate(timeout=150)
    except subprocess.TimeoutExpired:  # where it hangs: every thread's stack (plumbing/launch.py), then kill it
        os.kill(process.pid, signal.SIGUSR2)
        time.sleep(3)
        os.killpg(process.pid, signal.SIGKILL)
        raise AssertionError(f"the learner hung on exit; its threads:\n{process.communicate()[1][-8000:]}")
    assert process.returncode == code, stderr[-3000:]
    assert stopped_at is None or time.time() - stopped_at < 60
    assert "resource_tracker" not in stderr and "KeyError" not in stderr, stderr[-3000:]  # no second failure
    return stderr


# 128 prompts a round: the training requests are ~82 KB as the evaluations are, so whichever is queued fills the pipe
ENDLESS = ("--total_episodes", "100000", "--batch_size", "128")


def test_killed_generator_with_a_large_request_pending(tiny_dir, long_prompts, tmp_path):
    """The generator killed as `pkill -9 -f multiprocessing` would, with multiprocessing's resource tracker: the
    learner stops within seconds, and its console ends with the error and where vLLM's log is, nothing after them:
    no hint about sharing a GPU on a machine without one, and none of the KeyError tracebacks of the tracker that
    multiprocessing relaunches (into vLLM's log)."""
    process = start_long_run(tiny_dir, long_prompts, str(tmp_path), *ENDLESS)
    children = pending_request(process, str(tmp_path))
    assert generator_of(children) and len(children) == 2  # the generator and the resource tracker
    for child in children:
        child.kill()
    stopped_at = time.time()
    stderr = assert_clean_exit(process, stopped_at, 1)
    assert time.time() - stopped_at < STOPS_WITHIN
    assert stderr.strip().splitlines()[-2:] == ["error: the generator process exited unexpectedly (exit code -9)",
                                                f"vLLM's log: {tmp_path}/generator.log"], stderr[-3000:]
    assert "Traceback" not in stderr and "GPU" not in stderr
    assert "KeyError" in (tmp_path / "generator.log").read_text()  # (where the relaunched tracker wrote)
    assert_all_gone(children)


def test_ctrl_c_with_a_large_request_pending(tiny_dir, long_prompts, tmp_path):
    process = start_long_run(tiny_dir, long_prompts, str(tmp_path), *ENDLESS)
    children = pending_request(process, str(tmp_path))
    os.killpg(process.pid, signal.SIGINT)  # what a terminal does: SIGINT to the whole foreground group
    stopped_at = time.time()
    stderr = assert_clean_exit(process, stopped_at, 130)
    assert time.time() - stopped_at < STOPS_WITHIN and "interrupted" in stderr
    assert_all_gone(children)


def test_normal_end_with_evaluations_every_round(tiny_dir, long_prompts, tmp_path):
    """Every round requests a ~164 KB evaluation (256 long prompts), the last round's included: the run ends cleanly,
    having scored every evaluation it asked for. The one requested in the last round (step 3 of 4) takes far longer
    to generate than the round's training (4 prompts): the learner scores it before it rewrites the weight buffer
    for the final one."""
    process = start_long_run(tiny_dir, long_prompts, str(tmp_path), "--total_episodes", "16", "--batch_size", "4",
                             "--per_device_train_batch_size", "4", "--num_eval_prompts", "256")
    children = []  # the generator (and the resource tracker), seen while the run is going
    while process.poll() is None and len(children) < 2:
        children = psutil.Process(process.pid).children(recursive=True)
        time.sleep(0.2)
    assert generator_of(children), "the run ended before its generator was seen"
    metrics = tmp_path / "metrics.jsonl"
    assert_clean_exit(process, None, 0)
    assert time.time() - os.path.getmtime(metrics) < 60  # from its last record (the final evaluation) to its exit
    steps, evals = read_metrics(str(tmp_path))
    assert [r["step"] for r in evals] == [0, 1, 2, 3, 4]
    in_flight, final = evals[3], evals[4]
    assert in_flight["timeline/eval_generation_end"] > steps[-1]["timeline/training_end"]  # it was still running
    assert final["timeline/eval_queued_start"] >= in_flight["timeline/eval_generation_end"]
    assert_all_gone(children)
