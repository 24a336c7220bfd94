"""The paper's central comparison on CPU: async_dpo.py against sync_baseline.py, same model, seed and steps.

Runs three configurations on the overlap benchmark's model (generation and training each take ~0.5 s a step):
  async      async_dpo.py: vLLM generator on one core, learner on the other, overlapped
  sync-vllm  sync_baseline.py: the same layout, in lockstep (the paper's baseline for its GSM8k and Llama runs)
  sync-hf    benchmarks/sync_hf.py: sync_baseline.py with transformers generate, every core for both phases
and prints per-step times, speedup = sync step / async step, ideal = (generation + training) / max(generation,
training) from the sync run, the share of the ideal gain reached, final rewards and win rates, and saves a plot of
reward against wall-clock time.

    python benchmarks/async_vs_sync.py              # ~5 minutes on 2 cores
    python benchmarks/async_vs_sync.py --repeats 3  # each configuration 3 times, interleaved: the speed-ups' spread
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
from stats import factor, fmt, gap  # noqa: E402


@dataclass
class Args(OverlapArgs):
    steps: int = 40
    """optimizer steps per run"""
    plot_path: str = os.path.join(os.path.dirname(os.path.abspath(__file__)), "async_vs_sync.png")
    """where the reward-against-time plot goes"""
    runs_dir: Optional[str] = None
    """keep each run's folder here, `{runs_dir}/{run}` (default: temporary folders, removed afterwards)"""
    repeats: int = 1
    """runs of each configuration, interleaved (async, sync-vllm, sync-hf, then again), so that the machine's drift
    falls on all three alike; the speed-ups are then printed per repeat and as mean ± s.e."""


CONFIGS = {  # name: (script, extra flags). No EOS penalty: the untrained model never stops before the length cap.
    "async": ("async_dpo.py", ["--missing_eos_penalty", "None"]),
    "sync-vllm": ("sync_baseline.py", ["--missing_eos_penalty", "None"]),
    "sync-hf": (os.path.join("benchmarks", "sync_hf.py"), ["--missing_eos_penalty", "None"]),
}

if __name__ == "__main__":
    args = tyro.cli(Args)
    if args.repeats < 1:
        sys.exit(f"--repeats must be at least 1, got {args.repeats}")
    model = tiny_world.build_untrained(args.cache_dir, args.hidden_size, args.num_layers)
    runs = {name: [] for name in CONFIGS}  # (each configuration's runs, in repeat order)
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for name, (script, extra) in CONFIGS.items():
                folder = name if args.repeats == 1 else f"{name}_{repeat + 1}"
                print(f"running {folder} ...", flush=True)
                runs[name].append(run_pipeline(script, *model, args, os.path.join(args.runs_dir or tmp, folder),
                                               *extra))

    summaries = {name: [] for name in CONFIGS}
    print(f"\n{'run':<12} {'generation':>10} {'training':>9} {'step':>7} {'reward(last 10)':>15} {'eval reward':>11} "
          f"{'eval win rate':>13}")
    for name, repeats in runs.items():
        for repeat, records in enumerate(repeats):
            steps = [r for r in records if "time/step" in r][args.warmup_steps:]
            evals = [r for r in records if "eval/proxy_win_rate" in r]
            summaries[name].append(s := dict(
                generation=mean([r["time/generation"] for r in steps]),
                training=mean([r["time/training"] for r in steps]), step=mean([r["time/step"] for r in steps]),
                reward=mean([r["reward/mean"] for r in records if "reward/mean" in r][-10:]),
                eval_reward=evals[-1]["eval/proxy_reward"], win_rate=evals[-1]["eval/proxy_win_rate"]))
            label = name if args.repeats == 1 else f"{name} #{repeat + 1}"
            print(f"{label:<12} {s['generation']:>9.3f}s {s['training']:>8.3f}s {s['step']:>6.3f}s "
                  f"{s['reward']:>15.3f} {s['eval_reward']:>11.3f} {s['win_rate']:>13.3f}")
    pairs = list(zip(summaries["async"], summaries["sync-vllm"], summaries["sync-hf"]))
    speedups = [sync["step"] / fast["step"] for fast, sync, _ in pairs]
    ideals = [(sync["generation"] + sync["training"]) / max(sync["generation"], sync["training"])
              for _, sync, _ in pairs]
    against_hf = [hf["step"] / fast["step"] for fast, _, hf in pairs]
    speedup, ideal = mean(speedups), mean(ideals)
    print(f"\nspeedup={speedup:.2f} ideal={ideal:.2f} share_of_ideal={(speedup - 1) / (ideal - 1):.2f}")
    print(f"speedup_vs_sync_hf={mean(against_hf):.2f}  (synchronous, transformers generate, all cores for both "
          "phases)")
    if args.repeats > 1:
        print(f"over {args.repeats} interleaved repeats (mean ± s.e.): speedup {fmt(speedups, 2)} (each: "
              + ", ".join(f"{x:.2f}" for x in speedups) + f"); against sync-hf {fmt(against_hf, 2)} (each: "
              + ", ".join(f"{x:.2f}" for x in against_hf) + "); seconds a step, sync-hf - async, paired by repeat: "
              + gap([hf["step"] for _, _, hf in pairs], [fast["step"] for fast, _, _ in pairs], interval=True)["text"])
        print(f"the speed-ups on log seconds a step: over sync-vllm {factor(speedups)['text']}; over sync-hf "
              f"{factor(against_hf)['text']}")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, repeats in runs.items():  # (the first repeat)
        steps = [r for r in repeats[0] if "reward/mean" in r]
        window = [[r["reward/mean"] for r in steps[max(0, i - 9): i + 1]] for i in range(len(steps))]
        ax.plot([r["time/elapsed"] for r in steps], [mean(w) for w in window], label=name)
    ax.set_xlabel("wall-clock time since the run started training (s)")
    ax.set_ylabel("training reward, mean of the last 10 steps")
    ax.set_title(f"Online DPO on CPU, {args.steps} steps each")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.plot_path, dpi=100)
    print(f"plot saved to {args.plot_path}")
