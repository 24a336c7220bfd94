"""The paper's central comparison on CPU: async_dpo.py against sync_baseline.py, same model, seed and steps.

Runs three configurations on the overlap benchmark's model (generation and training each take ~0.5 s a step):
  async      async_dpo.py: vLLM generator on one core, learner on the other, overlapped
  sync-vllm  sync_baseline.py: the same layout, in lockstep (the paper's baseline for its GSM8k and Llama runs)
  sync-hf    benchmarks/sync_hf.py: sync_baseline.py with transformers generate, every core for both phases
and prints per-step times, speedup = sync step / async step, ideal = (generation + training) / max(generation,
training) from the sync run, the share of the ideal gain reached, final rewards and win rates, and saves a plot of
reward against wall-clock time.

    python benchmarks/async_vs_sync.py              # ~5 minutes on 2 cores
"""
import os
import sys
import tempfile
from dataclasses import dataclass
from typing import Optional

import tyro

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from overlap import Args as OverlapArgs  # noqa: E402
from overlap import mean, run_pipeline, tiny_world  # noqa: E402


@dataclass
class Args(OverlapArgs):
    steps: int = 40
    """optimizer steps per run"""
    plot_path: str = os.path.join(os.path.dirname(os.path.abspath(__file__)), "async_vs_sync.png")
    """where the reward-against-time plot goes"""
    runs_dir: Optional[str] = None
    """keep each run's folder here, `{runs_dir}/{run}` (default: temporary folders, removed afterwards)"""


CONFIGS = {  # name: (script, extra flags). No EOS penalty: the untrained model never stops before the length cap.
    "async": ("async_dpo.py", ["--missing_eos_penalty", "None"]),
    "sync-vllm": ("sync_baseline.py", ["--missing_eos_penalty", "None"]),
    "sync-hf": (os.path.join("benchmarks", "sync_hf.py"), ["--missing_eos_penalty", "None"]),
}

if __name__ == "__main__":
    args = tyro.cli(Args)
    model = tiny_world.build_untrained(args.cache_dir, args.hidden_size, args.num_layers)
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (script, extra) in CONFIGS.items():
            print(f"running {name} ...", flush=True)
            runs[name] = run_pipeline(script, *model, args, os.path.join(args.runs_dir or tmp, name), *extra)

    summary = {}
    print(f"\n{'run':<10} {'generation':>10} {'training':>9} {'step':>7} {'reward(last 10)':>15} {'eval reward':>11} "
          f"{'eval win rate':>13}")
    for name, records in runs.items():
        steps = [r for r in records if "time/step" in r][args.warmup_steps:]
        evals = [r for r in records if "eval/proxy_win_rate" in r]
        summary[name] = dict(generation=mean([r["time/generation"] for r in steps]),
                             training=mean([r["time/training"] for r in steps]),
                             step=mean([r["time/step"] for r in steps]),
                             reward=mean([r["reward/mean"] for r in records if "reward/mean" in r][-10:]),
                             eval_reward=evals[-1]["eval/proxy_reward"], win_rate=evals[-1]["eval/proxy_win_rate"])
        s = summary[name]
        print(f"{name:<10} {s['generation']:>9.3f}s {s['training']:>8.3f}s {s['step']:>6.3f}s {s['reward']:>15.3f}"
              f" {s['eval_reward']:>11.3f} {s['win_rate']:>13.3f}")
    sync, fast = summary["sync-vllm"], summary["async"]
    speedup = sync["step"] / fast["step"]
    ideal = (sync["generation"] + sync["training"]) / max(sync["generation"], sync["training"])
    print(f"\nspeedup={speedup:.2f} ideal={ideal:.2f} share_of_ideal={(speedup - 1) / (ideal - 1):.2f}")
    print(f"speedup_vs_sync_hf={summary['sync-hf']['step'] / fast['step']:.2f}  (synchronous, transformers generate, "
          f"all cores for both phases)")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, records in runs.items():
        steps = [r for r in records if "reward/mean" in r]
        window = [[r["reward/mean"] for r in steps[max(0, i - 9): i + 1]] for i in range(len(steps))]
        ax.plot([r["time/elapsed"] for r in steps], [mean(w) for w in window], label=name)
    ax.set_xlabel("wall-clock time since the run started training (s)")
    ax.set_ylabel("training reward, mean of the last 10 steps")
    ax.set_title(f"Online DPO on CPU, {args.steps} steps each")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.plot_path, dpi=100)
    print(f"plot saved to {args.plot_path}")
