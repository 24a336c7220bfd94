"""Every launch of a training script that README.md and docs/ give goes through start-up as that launch would run it:
its flags parsed, then resolve_args (every size and flag check a run makes before it loads anything) under torchrun's
environment for it (its --nproc_per_node, --nnodes and --node_rank; on several nodes the job's learners are the sum of
the block's launches) on nodes of 8 GPUs (the count faked: nothing touches a GPU). A documented command refused at
start-up fails here, naming its file and line."""
import glob
import importlib
import os
import re
import shlex
import sys

import pytest
import torch
from conftest import REPO

from plumbing import core, launch

SCRIPTS = ("async_dpo.py", "async_ppo.py", "async_rloo.py", "sync_baseline.py", "gsm8k_async_dpo.py",
           "fully_async_grpo.py", "agentic_grpo.py")
TORCHRUN_FLAGS = {"--nproc_per_node": 1, "--nnodes": 1, "--node_rank": 0}  # (and their defaults)


def shell_blocks(path: str) -> list:
    """The fenced blocks of a Markdown file, each a list of (line number, line), a continued line joined."""
    blocks, lines = [], None
    for number, line in enumerate(open(path).read().split("\n"), 1):
        if line.startswith("```"):
            blocks, lines = (blocks, []) if lines is None else (blocks + [lines], None)
        elif lines is not None and lines and lines[-1][1].endswith("\\"):
            lines[-1] = (lines[-1][0], lines[-1][1][:-1] + " " + line)
        elif lines is not None:
            lines.append((number, line))
    return blocks


def documented_launches() -> list:
    """(where, script, its flags, torchrun's flags) of every launch in a fenced block of README.md and docs/*.md."""
    launches = []
    for path in [os.path.join(REPO, "README.md"), *sorted(glob.glob(os.path.join(REPO, "docs", "*.md")))]:
        for lines in shell_blocks(path):
            found = []
            for number, line in lines:
                if not any(name in line for name in SCRIPTS):
                    continue
                words = shlex.split(re.sub(r"(^|\s)#.*", "", line).replace("$", ""))
                script = next((i for i, w in enumerate(words) if w in SCRIPTS), None)
                if script is None or not {"python", "torchrun"} & set(words[:script]):
                    continue
                torchrun = dict(TORCHRUN_FLAGS)
                for i, word in enumerate(words[:script]):
                    if word in torchrun:
                        torchrun[word] = int(words[i + 1])
                where = f"{os.path.relpath(path, REPO)}:{number}"
                found.append((where, words[script], words[script + 1:], torchrun))
            nodes = [f for f in found if f[3]["--nnodes"] > 1]
            for launch_ in nodes:  # (one job's launches: its learners on every node)
                launch_[3]["learners"] = sum(f[3]["--nproc_per_node"] for f in nodes if f[1] == launch_[1])
            launches += found
    return launches


LAUNCHES = documented_launches()


@pytest.mark.parametrize("where, script, flags, torchrun", LAUNCHES, ids=[launch_[0] for launch_ in LAUNCHES])
def test_a_documented_launch_passes_start_up(where, script, flags, torchrun, monkeypatch):
    learners = torchrun.get("learners", torchrun["--nproc_per_node"] * torchrun["--nnodes"])
    environment = dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE=str(learners),
                       LOCAL_WORLD_SIZE=str(torchrun["--nproc_per_node"]), GROUP_WORLD_SIZE=str(torchrun["--nnodes"]),
                       GROUP_RANK=str(torchrun["--node_rank"]))
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(core, "hub_snapshot", lambda flag, path, revision: path)  # (a hub revision: no download)
    if "--resume_from" in flags:  # (its run folder is the user's: the rest of the launch is checked)
        flags = flags[: flags.index("--resume_from")] + flags[flags.index("--resume_from") + 2:]
    monkeypatch.setattr(sys, "argv", [script, *flags])
    module = importlib.import_module(script[: -len(".py")])
    presets = getattr(module, "PRESET_DEFAULTS", None)
    try:
        module.resolve_args(launch.parse_args(module.Args, module.TINY_DEFAULTS, presets))
    except SystemExit as refused:
        pytest.fail(f"{where}: {script} {' '.join(flags)} is refused at start-up ({refused})")


def test_the_docs_give_launches_of_every_script_and_of_several_nodes():
    """The collection above finds what it should (a parser that found nothing would pass every test)."""
    assert {script for _, script, _, _ in LAUNCHES} >= {"async_dpo.py", "async_ppo.py", "fully_async_grpo.py"}
    assert any(torchrun["--nnodes"] > 1 for *_, torchrun in LAUNCHES)
    for streaming in ("fully_async_grpo.py", "agentic_grpo.py"):  # (one node and two)
        assert {torchrun["--nnodes"] for _, script, _, torchrun in LAUNCHES if script == streaming} >= {1, 2}
