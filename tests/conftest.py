import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> str:
    """The tiny CPU configuration's models, tokenizer and dataset, built once per test session (or, for quicker
    local iterations, taken from the folder in ASYNC_RLHF_TEST_TINY_DIR, where it is built if missing)."""
    import tiny_world

    tiny_dir = os.environ.get("ASYNC_RLHF_TEST_TINY_DIR") or str(tmp_path_factory.mktemp("tiny") / "cache" / "assets")
    tiny_world.build_tldr(tiny_dir)
    return tiny_dir


def run_script(*flags: str, script: str = "async_dpo.py", timeout: float = 1800, env: dict | None = None,
               launcher: tuple = ()) -> subprocess.CompletedProcess:
    """Run one of the repository's scripts as a user would, returning its exit code and output. The default timeout
    only guards against a hang: the longest run (the GSM8k demo, 3.5 minutes on 2 idle cores) fits it on a machine
    several times slower."""
    return subprocess.run([*launcher, *([] if launcher else [sys.executable]), os.path.join(REPO, script), *flags],
                          capture_output=True, text=True, timeout=timeout, cwd=REPO, env={**os.environ, **(env or {})})


@pytest.fixture(scope="session")
def gsm8k_dir(tmp_path_factory) -> str:
    """The GSM8k miniature (ASYNC_RLHF_TEST_GSM8K_DIR reuses a built one, as ASYNC_RLHF_TEST_TINY_DIR does)."""
    import tiny_world

    gsm8k_dir = os.environ.get("ASYNC_RLHF_TEST_GSM8K_DIR") or str(tmp_path_factory.mktemp("gsm8k") / "world")
    tiny_world.build_gsm8k(gsm8k_dir)
    return gsm8k_dir
