"""A dead or crashing generator stops the learner promptly with a clear error; Ctrl-C leaves no process behind.

The time limits leave room for a machine several times slower than 2 idle cores, where the learner stops about 4 s
after the generator dies or Ctrl-C, and the first optimizer step comes about 30 s after the start."""
import os
import signal
import subprocess
import time

import psutil
from conftest import run_script, start_as_a_foreground_job

STOPS_WITHIN = 30  # seconds from a dead generator or Ctrl-C to the learner's exit (about 4 s on 2 idle cores)


def start(tiny_dir: str, out: str, *flags: str) -> subprocess.Popen:
    return start_as_a_foreground_job("async_dpo.py", "--model", "tiny", "--tiny_dir", tiny_dir, "--output_dir", out,
                                     *flags)


def wait_for_training(process: subprocess.Popen, out: str, timeout: float = 600) -> list:
    """Wait until the learner has logged an optimizer step; return its process tree."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        path = os.path.join(out, "metrics.jsonl")
        if os.path.exists(path) and '"loss/dpo"' in open(path).read():
            return psutil.Process(process.pid).children(recursive=True)
        assert process.poll() is None, process.communicate()[1][-3000:]
        time.sleep(0.2)
    raise AssertionError("no training step within the timeout")


def generator_of(children: list) -> psutil.Process:
    return next(c for c in children if "multiprocessing.spawn" in " ".join(c.cmdline()))


def assert_all_gone(processes: list, timeout: float = 30) -> None:
    _, alive = psutil.wait_procs(processes, timeout=timeout)
    assert not alive, f"left behind: {[p.cmdline() for p in alive]}"


def stop_mid_training(tiny_dir: str, out: str, stop) -> tuple[float, int, str]:
    """Start a long run, call `stop(process, children)` once it trains, and return how long the learner then took
    to exit, its exit code and its stderr. Nothing it started may outlive it."""
    process = start(tiny_dir, out, "--total_episodes", "100000")
    children = wait_for_training(process, out)
    stop(process, children)
    stopped_at = time.time()
    _, stderr = process.communicate(timeout=300)
    elapsed = time.time() - stopped_at
    assert_all_gone(children)
    return elapsed, process.returncode, stderr


def test_killed_generator_stops_the_learner(tiny_dir, tmp_path):
    def kill_generator(_, children: list) -> None:
        generator_of(children).kill()

    elapsed, code, stderr = stop_mid_training(tiny_dir, str(tmp_path), kill_generator)
    assert elapsed < STOPS_WITHIN and code == 1
    assert "generator process exited unexpectedly" in stderr


def test_crashing_generator_reports_its_error(tiny_dir, tmp_path):
    """A model vLLM cannot serve on CPU (head size 16) but transformers can train: the engine's own error reaches
    the user and the learner exits, no hang."""
    from transformers import AutoTokenizer, GPTNeoXConfig, GPTNeoXForCausalLM, GPTNeoXForSequenceClassification

    tokenizer = AutoTokenizer.from_pretrained(os.path.join(tiny_dir, "sft"))
    config = GPTNeoXConfig(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                           intermediate_size=128, eos_token_id=tokenizer.eos_token_id, num_labels=1)
    for name, model_class in (("sft", GPTNeoXForCausalLM), ("reward", GPTNeoXForSequenceClassification)):
        model_class(config).save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)
    started = time.time()
    result = run_script("--model", "tiny", "--tiny_dir", tiny_dir, "--output_dir", str(tmp_path / "run"),
                        "--sft_model_path", str(tmp_path / "sft"), "--reward_model_path", str(tmp_path / "reward"),
                        timeout=600)
    assert result.returncode == 1
    assert "the generator process failed" in result.stderr
    assert "Traceback" in result.stderr.split("the generator process failed")[1]  # the engine's own traceback
    assert time.time() - started < 300  # (15 s on 2 idle cores: start-up, then the engine's failure)


def test_ctrl_c_shuts_everything_down(tiny_dir, tmp_path):
    def ctrl_c(process: subprocess.Popen, _) -> None:
        os.killpg(process.pid, signal.SIGINT)  # what a terminal does: SIGINT to the whole foreground group

    elapsed, code, stderr = stop_mid_training(tiny_dir, str(tmp_path), ctrl_c)
    assert elapsed < STOPS_WITHIN and code == 130
    assert "interrupted" in stderr
