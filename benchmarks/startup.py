"""How long a run takes to reach its first training step, and where those seconds go.

Starts a script as a user does (`python async_dpo.py --model tiny`: the README's demo, by default), watches its
metrics.jsonl and stops it once its first optimizer step is logged: the seconds from the launch to that step,
measured from outside (so that any checkout's scripts can be timed alike, --repo), and the breakdown the run prints
at its first step (plumbing/metrics.py: the imports, the data, the models, vLLM's own process, the SFT policy's
evaluation). Repeats are interleaved across --repo folders, so that a drift in the machine's speed falls on each
alike; --cores pins every run to that many cores (1: what each of the test suite's two workers has).

    python benchmarks/startup.py                               # the demo, 3 repeats, all cores
    python benchmarks/startup.py --cores 1 --repeats 5         # as the test suite runs it
    python benchmarks/startup.py --repo . /tmp/older-checkout  # this checkout against another, interleaved
"""
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Optional

import tyro

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


@dataclass
class Args:
    script: str = "async_dpo.py"
    """the script to start"""
    flags: list[str] = field(default_factory=lambda: ["--model", "tiny"])
    """its flags (default: the README's demo)"""
    repo: list[str] = field(default_factory=lambda: [REPO])
    """checkouts whose script to time, each repeat in turn"""
    repeats: int = 3
    """runs of each checkout's script"""
    cores: Optional[int] = None
    """pin each run to its first this many cores (default: all)"""
    timeout: float = 600.0
    """seconds to wait for a first step before giving up on a run"""


def first_step(repo: str, args: Args) -> tuple[float, str]:
    """One run: the seconds from its launch to its first logged optimizer step, and its start-up line (empty when
    its code prints none)."""
    out = tempfile.mkdtemp(prefix="startup-")
    cores = sorted(os.sched_getaffinity(0))[: args.cores] if args.cores else None
    command = [sys.executable, os.path.join(repo, args.script), *args.flags, "--output_dir", out]
    started = time.time()
    process = subprocess.Popen(command, cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True, preexec_fn=(lambda: os.sched_setaffinity(0, cores))
                               if cores else None)
    metrics, seconds = os.path.join(out, "metrics.jsonl"), None
    while seconds is None and process.poll() is None and time.time() - started < args.timeout:
        if os.path.exists(metrics):
            for line in open(metrics).read().splitlines():
                record = json.loads(line) if line.endswith("}") else {}
                if record.get("step", 0) >= 1 and not any(key.startswith("eval/") for key in record):
                    seconds = time.time() - started
                    break
        time.sleep(0.05)
    time.sleep(1.0)  # (the start-up line is printed as the first step is logged)
    os.killpg(process.pid, 9)
    console = process.communicate()[0]
    if seconds is None:
        raise SystemExit(f"{' '.join(command)}: no first step within {args.timeout:.0f} s:\n{console[-3000:]}")
    return seconds, next((line for line in console.replace("\r", "\n").splitlines()
                          if line.startswith("start-up: ")), "")


def phases(line: str) -> dict:
    """The start-up line's phases, {name: seconds}; what a phase's parentheses hold as `phase: part`."""
    found, last, inner = {}, "", ""
    for piece in re.split(r"(\((?:its process: )?|\))", line.split(" after the start: ", 1)[-1]):
        if piece.startswith("("):
            inner = f"{last}: "
        elif piece == ")":
            inner = ""
        for name, seconds in re.findall(r"([^,()]+?) ([\d.]+) s", piece):
            found[inner + name.strip(" ,")] = float(seconds)
            last = last if inner else name.strip(" ,")
    return found


if __name__ == "__main__":
    args = tyro.cli(Args)
    runs = {repo: [] for repo in args.repo}
    for repeat in range(args.repeats):
        for repo in args.repo:
            seconds, line = first_step(os.path.abspath(repo), args)
            runs[repo].append((seconds, line))
            print(f"[{repeat + 1}/{args.repeats}] {repo}: first step after {seconds:.1f} s", flush=True)
            if line:
                print(f"  {line}", flush=True)
    print(f"\n{args.script} {' '.join(args.flags)}, {args.cores or len(os.sched_getaffinity(0))} core(s), "
          f"{args.repeats} runs each: seconds from the launch to the first optimizer step (mean ± s.d.)")
    for repo, results in runs.items():
        times = [seconds for seconds, _ in results]
        spread = statistics.stdev(times) if len(times) > 1 else 0.0
        print(f"| {repo} | {statistics.mean(times):.1f} ± {spread:.1f} s |")
        printed = [phases(line) for _, line in results if line]
        if printed:
            names = [name for name in printed[0] if all(name in p for p in printed)]
            print("  its phases (mean): " + ", ".join(
                f"{name} {statistics.mean(p[name] for p in printed):.1f} s" for name in names))
