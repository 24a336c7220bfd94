import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def shared_folder(tmp_path_factory, name: str) -> str:
    """A folder for a world that every test worker of this session shares (pytest-xdist gives each worker its own
    temporary folder under a common one; tiny_world's lock makes the first worker build it and the others wait)."""
    base = tmp_path_factory.getbasetemp()
    return str((base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "worlds" / name)


def pytest_configure(config) -> None:
    """Each test worker gets its own share of the cores (and everything it starts inherits it). Every script pins
    its learner to the first cores and its generator to the last one: two runs on the same cores would put both
    learners on one core and both generators on the other, each pair waiting on its own core while the other core
    idles. Measured on 2 cores: test_rloo.py and test_ppo.py 258 s with the cores shared, 164 s with one core each;
    the whole suite 1693 s and 1447 s."""
    worker, workers = os.environ.get("PYTEST_XDIST_WORKER"), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", 1))
    cores = sorted(os.sched_getaffinity(0))
    if worker and workers > 1:
        index = int(worker.removeprefix("gw"))
        share = cores[index * len(cores) // workers: (index + 1) * len(cores) // workers]
        os.sched_setaffinity(0, share or [cores[index % len(cores)]])


def pytest_collection_modifyitems(items: list) -> None:
    """Longest test files first (the two test workers, pytest.ini, each take whole files; their times are in the
    durations each run lists at its end): the next file goes to the worker that finishes first, so both end close
    together. The quick files fill in at the end."""
    first = ["test_benchmarks.py", "test_engines.py", "test_gsm8k.py", "test_lora.py", "test_ppo.py",
             "test_shutdown.py", "test_tiny_world.py", "test_end_to_end.py", "test_fully_async.py",
             "test_stream_benchmarks.py", "test_failures.py", "test_rloo.py", "test_agentic.py",
             "test_sync_baseline.py", "test_chat.py", "test_archives.py", "test_resume.py", "test_reward_tokenizer.py"]
    rank = {name: i for i, name in enumerate(first)}
    items.sort(key=lambda item: rank.get(item.path.name, len(first)))


def start_as_a_foreground_job(script: str, *flags: str) -> subprocess.Popen:
    """Start a script as a terminal starts a foreground job: in a process group of its own (a test signals the whole
    group, as Ctrl-C does) and with SIGINT's default action. A shell sets SIGINT to be ignored for what it starts in
    the background, every child inherits that, and Python then never raises KeyboardInterrupt: so the Ctrl-C tests
    reset it (then exec the script: the same process) and hold however the suite itself was started."""
    reset = "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])"
    command = [sys.executable, "-c", reset, sys.executable, os.path.join(REPO, script), *flags]
    return subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


@pytest.fixture(scope="session")
def tiny_dir() -> str:
    """The TL;DR world shipped in worlds/, checked file by file against its SHA256SUMS (the suite builds no world
    but the quick ones of the builder's tests)."""
    import tiny_world

    tiny_world.tldr_world(tiny_world.SHIPPED["tldr"])
    return tiny_world.SHIPPED["tldr"]


@pytest.fixture(scope="session")
def sized_dir(tmp_path_factory, tiny_dir) -> str:
    """Policies and proxies of two sizes beside the shipped world: the builder's quick build of them
    (tiny_world.build_sized), once per session, for the builder's test and the scaling benchmark's."""
    import tiny_world

    sized_dir = shared_folder(tmp_path_factory, "sized-quick")
    tiny_world.build_sized(sized_dir, tiny_dir, quick=True)
    return sized_dir


# Two learner processes; --standalone picks a free port, so two such runs (two test workers) never collide.
TORCHRUN_2 = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2")


def run_script(*flags: str, script: str = "async_dpo.py", timeout: float = 1800, env: dict | None = None,
               launcher: tuple = ()) -> subprocess.CompletedProcess:
    """Run one of the repository's scripts as a user would, returning its exit code and output. The default timeout
    only guards against a hang: the longest run (the GSM8k demo, 3.5 minutes on 2 idle cores) fits it on a machine
    several times slower."""
    return subprocess.run([*launcher, *([] if launcher else [sys.executable]), os.path.join(REPO, script), *flags],
                          capture_output=True, text=True, timeout=timeout, cwd=REPO, env={**os.environ, **(env or {})})


def shipped_math_world(kind: str) -> str:
    """A math world shipped in worlds/, checked file by file against its SHA256SUMS as the TL;DR world is."""
    import tiny_world

    tiny_world.math_world(tiny_world.SHIPPED[kind], kind)
    return tiny_world.SHIPPED[kind]


@pytest.fixture(scope="session")
def chains_dir() -> str:
    """The long-tailed chains world (fully_async_grpo.py's)."""
    return shipped_math_world("chains")


@pytest.fixture(scope="session")
def tools_dir() -> str:
    """The tool world (agentic_grpo.py's)."""
    return shipped_math_world("tools")


@pytest.fixture(scope="session")
def chat_tools_dir() -> str:
    """The tool world in chat form: calls as <tool_call> JSON, replies as tool turns (agentic_grpo.py's)."""
    return shipped_math_world("chat-tools")


@pytest.fixture(scope="session")
def gsm8k_dir() -> str:
    """The GSM8k miniature."""
    return shipped_math_world("gsm8k")


def run_in_process(script: str, *flags: str, capsys) -> tuple[int, str]:
    """A script's entry point, as its `if __name__ == "__main__":` runs it (flags parsed, resolve_args, launch.run of
    main), in this process: for input that must be refused before anything starts, without a process's start-up.
    Returns the exit code and what it wrote to stderr; any other exception fails the test with its traceback, as a
    user would have seen one."""
    import importlib
    import signal

    from plumbing import launch

    module = importlib.import_module(script.removesuffix(".py"))
    argv, on_sigterm = sys.argv, signal.getsignal(signal.SIGTERM)
    sys.argv = [script, *flags]
    try:
        launch.run(module.main, module.resolve_args(launch.parse_args(
            module.Args, module.TINY_DEFAULTS, getattr(module, "PRESET_DEFAULTS", None))))
    except SystemExit as stop:
        return stop.code, capsys.readouterr().err
    finally:
        sys.argv = argv
        signal.signal(signal.SIGTERM, on_sigterm)
    raise AssertionError(f"{script} {' '.join(flags)} ran to its end instead of refusing its input")
