"""How fast does agentic_grpo.py sample when its tool is slow? The same tiny run (the shipped tool world, k = 2,
`pace`) with a fast tool and with one that takes --tool_latency seconds a call (the same seeded path as a real slow
tool: the call sleeps in the tools' threads while the engine steps the other episodes), seeds interleaved. Prints,
per latency: the policy's tokens sampled per second of the run, the engine's overlap (the share of the time with a
call under way that it spent sampling other episodes), its idle share, and the seconds a blocking engine would have
spent waiting on its calls (their latencies summed).

Prediction, written before the first run: the tiny run is training-bound (at latency 0 the engine is idle ~40% of
the run), so a tool's latency hides in the engine's idle time: at 0.05 s a call the tokens per second stay within
10% of the fast tool's, at 0.2 s within 30%; a blocking engine would have waited ~1.6 calls an episode x 512
episodes x the latency (~160 s at 0.2 s) on a run of ~10 s.

    python benchmarks/slow_tools.py           # 3 latencies x 2 seeds, about 4 minutes on 2 cores
    python benchmarks/slow_tools.py --quick   # 2 latencies x 1 seed, short runs (the test's)
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field

import tyro

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class Args:
    latencies: list[float] = field(default_factory=lambda: [0.0, 0.05, 0.2])
    """seconds a tool call takes (0: the calculator as it is)"""
    seeds: list[int] = field(default_factory=lambda: [1, 2])
    """seeds, interleaved across the latencies"""
    episodes: int = 512
    """episodes a run trains on (64 a step)"""
    quick: bool = False
    """0 and 0.05 s, one seed, 128 episodes: checks that it runs, measures little"""


def run(latency: float, seed: int, episodes: int, folder: str) -> dict:
    """One run; its policy tokens per second, overlap, idle share and the calls' summed latency."""
    out = os.path.join(folder, f"{latency}-{seed}")
    subprocess.run([sys.executable, os.path.join(REPO, "agentic_grpo.py"), "--model", "tiny", "--seed", str(seed),
                    "--total_episodes", str(episodes), "--eval_every", "0", "--num_eval_prompts", "16",
                    "--num_final_eval_prompts", "16", "--tool_latency", str(latency), "--record_rollouts",
                    "--output_dir", out], check=True, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    steps = [r for r in map(json.loads, open(os.path.join(out, "metrics.jsonl"))) if "staleness/mean" in r]
    groups = [json.loads(line) for line in open(os.path.join(out, "rollouts.jsonl"))]
    tokens = sum(end - start for g in groups if g["fate"] == "trained" for spans in g["spans"]
                 for version, start, end in spans if version >= 0)
    calls = sum(r["tools/calls"] for r in steps)
    return dict(tokens_per_second=tokens / steps[-1]["time/elapsed"], overlap=steps[-1]["tools/overlap_fraction"],
                idle=statistics.mean(r["idle/generator_fraction"] for r in steps), blocking_seconds=calls * latency,
                seconds=steps[-1]["time/elapsed"])


def main(args: Args) -> None:
    if args.quick:
        args.latencies, args.seeds, args.episodes = [0.0, 0.05], [1], 128
    results = {latency: [] for latency in args.latencies}
    with tempfile.TemporaryDirectory() as folder:
        for seed in args.seeds:  # (interleaved: a slow spell of the machine hits every latency alike)
            for latency in args.latencies:
                results[latency].append(run(latency, seed, args.episodes, folder))
    fast = statistics.mean(r["tokens_per_second"] for r in results[args.latencies[0]])
    print("| tool latency (s) | policy tokens/s (each seed) | vs the fast tool | engine overlap | engine idle | "
          "run (s) | a blocking engine's wait (s) |")
    print("|---|---|---|---|---|---|---|")
    for latency, runs in results.items():
        rate = statistics.mean(r["tokens_per_second"] for r in runs)
        each = ", ".join(f"{r['tokens_per_second']:.0f}" for r in runs)
        print(f"| {latency:g} | {rate:.0f} ({each}) | "
              f"{rate / fast:.2f} | {statistics.mean(r['overlap'] for r in runs):.2f} | "
              f"{statistics.mean(r['idle'] for r in runs):.2f} | {statistics.mean(r['seconds'] for r in runs):.1f} | "
              f"{statistics.mean(r['blocking_seconds'] for r in runs):.0f} |")


if __name__ == "__main__":
    main(tyro.cli(Args))
