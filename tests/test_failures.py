"""A dead or crashing generator stops the learner promptly with a clear error; SIGTERM leaves no process behind.
(A killed generator and Ctrl-C, with a large request stuck in the queue besides: tests/test_shutdown.py.)

The time limits leave room for a machine several times slower than 2 idle cores, where the learner stops about 4 s
after the generator dies or Ctrl-C, and the first optimizer step comes about 30 s after the start."""
import os
import signal
import subprocess
import time

import psutil
import pytest
from conftest import REPO, TORCHRUN_2, run_script, start_as_a_foreground_job

from plumbing import core

STOPS_WITHIN = 30  # seconds from a dead generator or Ctrl-C to the learner's exit (about 4 s on 2 idle cores)


def start(tiny_dir: str, out: str, *flags: str) -> subprocess.Popen:
    return start_as_a_foreground_job("async_dpo.py", "--model", "tiny", "--tiny_dir", tiny_dir, "--output_dir", out,
                                     *flags)


def wait_for_training(process: subprocess.Popen, out: str, timeout: float = 600, steps: int = 1,
                      step_metric: str = "loss/dpo") -> list:
    """Wait until the learner has logged `steps` optimizer steps (records with `step_metric`); return its process
    tree."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        path = os.path.join(out, "metrics.jsonl")
        if os.path.exists(path) and open(path).read().count(f'"{step_metric}"') >= steps:
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


def test_the_generator_ignores_sigterm_and_the_learner_exits_on_it_at_once(tiny_dir, tmp_path):
    """A scheduler signals the whole process group, and the learner decides what follows (with --save_every it
    may need the generator for the evaluations it scores before saving): the generator alone ignores SIGTERM and
    keeps serving. Then SIGTERM to the whole group, without --save_every: the learner exits with 143 at once, with
    no checkpoint, and nothing it started outlives it."""
    def sigterm(process: subprocess.Popen, children: list) -> None:
        generator_of(children).send_signal(signal.SIGTERM)
        logged = open(tmp_path / "metrics.jsonl").read().count('"loss/dpo"')
        time.sleep(5)
        assert generator_of(children).is_running() and process.poll() is None
        assert open(tmp_path / "metrics.jsonl").read().count('"loss/dpo"') > logged  # it went on generating
        os.killpg(process.pid, signal.SIGTERM)

    elapsed, code, stderr = stop_mid_training(tiny_dir, str(tmp_path), sigterm)
    assert elapsed < STOPS_WITHIN and code == 128 + signal.SIGTERM, stderr[-3000:]
    assert not (tmp_path / "checkpoint").exists()


def run_two_ranks(program: str, folder) -> str:
    """One of tests/two_ranks.py's programs on two torchrun ranks; returns what they printed."""
    result = subprocess.run([*TORCHRUN_2, os.path.join(REPO, "tests", "two_ranks.py"), program, str(folder)],
                            capture_output=True, text=True, timeout=240, cwd=REPO)
    return result.stdout + result.stderr


def test_a_generator_death_noticed_while_sending_stops_every_rank(tmp_path):
    """Rank 0 finds the generator dead while it sends a request, where rank 1 is not with it (it has nothing to send
    and goes on to a training step's reduction): the error reaches both at the next collect, which every rank
    passes, and both stop with it. (Rank 0 used to broadcast the error from where it was: rank 1, in another
    collective, never received it, and both hung.)"""
    output = run_two_ranks("generator_dies_during_a_request", tmp_path)
    assert "rank 0 sent its request" in output and "rank 1 sent its request" in output, output[-3000:]
    assert "error: the generator process exited unexpectedly" in output
    assert "error: rank 0 stopped: the generator process exited unexpectedly" in output
    assert "went on without the generator" not in output and output.count("exited after") == 2


def test_sigterm_seen_by_one_rank_during_a_save_stops_both(tmp_path):
    """SIGTERM reached rank 0 alone while a checkpoint was written: the ranks decide to stop after it together."""
    output = run_two_ranks("sigterm_during_a_save", tmp_path)
    assert "rank 0 stopped with exit code 143" in output and "rank 1 stopped with exit code 143" in output, \
        output[-3000:]
    assert "went on after the save" not in output


def test_the_generator_inherits_none_of_torchruns_variables(tmp_path):
    """torchrun describes the learners' job in each learner's environment; a generator that inherited it would set
    vLLM's own one-process group up as a member of that job (TORCHELASTIC_USE_AGENT_STORE: waiting on a store
    server that is not there). Every variable torchrun adds, found by comparing a learner's environment with the
    one torchrun was started in, is gone from the generator's, but for the two settings a user may have made and
    the terminal's size (COLUMNS, LINES: an import in torchrun's own process writes them, and every child has them)."""
    import json

    output = run_two_ranks("generator_environment", tmp_path)
    learner, generator = (json.loads((tmp_path / name).read_text()) for name in ("env0.json", "generator.json"))
    added = set(learner) - set(os.environ) - {"OMP_NUM_THREADS", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "COLUMNS", "LINES"}
    assert {"RANK", "WORLD_SIZE", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE"} <= added, output[-3000:]
    assert not added & set(generator), sorted(added & set(generator))


def test_the_process_group_is_torn_down_on_every_exit(tmp_path):
    """A flag refused after the process group is up (SystemExit) and an out-of-memory error both leave launch.run
    with the group destroyed, and the group waits COLLECTIVE_TIMEOUT in a collective, not torch's default."""
    output = run_two_ranks("teardown_on_every_exit", tmp_path)
    assert "rank 0 stopped with SystemExit" in output and "rank 1 stopped with OutOfMemoryError" in output, \
        output[-3000:]
    assert output.count("process group left up: False") == 2, output[-3000:]
    assert output.count(f"group timeout {core.COLLECTIVE_TIMEOUT}") == 2, output[-3000:]


@pytest.mark.parametrize("gpus, learners, shares", [(0, 1, False), (0, 2, False), (1, 1, True), (2, 2, True),
                                                    (4, 4, True), (2, 1, False), (4, 3, False), (8, 7, False)])
def test_every_rank_takes_the_generators_ready_at_the_same_point(gpus, learners, shares):
    """Learner rank 0 shares GPU 0 with vLLM when the node has no spare GPU per learner; every rank then takes the
    generator's "ready" before loading its models, else after. The answer depends on the node's GPUs and learners
    alone, so every rank computes the same one (rank 0 alone used to wait for "ready" first, and rank 1 waited in
    DDP's set-up while rank 0 waited for it)."""
    assert core.shares_gpu0(gpus, learners) == shares


def test_two_nodes_leave_gpu_0_of_node_0_to_vllm_and_no_rank_shares_it():
    """Across nodes (torchrun --nnodes 2), node 0 keeps GPU 0 for vLLM: no rank shares it, so every rank takes the
    generator's "ready" at the same point (after loading its models). The same 8 learners on one node would share
    GPU 0 (the one-node rule above)."""
    assert not core.shares_gpu0(8, 7, nodes=2) and not core.shares_gpu0(8, 8, nodes=2)
    assert core.shares_gpu0(8, 8, nodes=1)


def test_ranks_whose_clocks_straddle_a_second_log_to_one_folder(tmp_path):
    """The default --output_dir, runs/{run_name}, is named from the clock; rank 1 resolves its flags a second after
    rank 0, yet both log (and would write their checkpoint shards) to rank 0's folder, broadcast at the start."""
    output = run_two_ranks("one_run_name", tmp_path)
    resolved, logs_to = zip(*[(tmp_path / f"rank{rank}.txt").read_text().split() for rank in (0, 1)])
    assert resolved[0] != resolved[1], output[-3000:]  # (their own clocks differ)
    assert logs_to == (resolved[0], resolved[0]), output[-3000:]  # rank 0's, the earlier one
    assert os.path.isfile(tmp_path / resolved[0] / "metrics.jsonl")


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
