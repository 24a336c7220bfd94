"""A picture of the schedule, from measurements: the generator's and the learner's phases over wall-clock time, one
pair of lanes per run, runs stacked on one time axis.

Every script logs, with each round's last step, when each phase started and ended (`timeline/*` in metrics.jsonl,
seconds since training began; the generator stamps its own phases with the same clock). Each bar is labelled with
the weight version that produced it (generator) or that it turns into the next one (learner), so the one-step lag
of the asynchronous run shows: the learner's bar for a batch sits beside the generator's bar for the next one. For
each run it also prints the line every script ends with: which side waited for the other, and the paper's knob.

    python benchmarks/timeline.py --run     # short async and sync runs with the overlap benchmark's model (~1 min)
    python benchmarks/timeline.py runs/a/metrics.jsonl runs/b/metrics.jsonl --labels async sync
"""
import json
import os
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Optional

import tyro

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.dirname(HERE))
from plumbing.metrics import regime  # noqa: E402

# phase: (lane, colour); the lanes are drawn top (generator) to bottom (learner)
PHASES = {
    "weight_load": ("generator", "tab:purple"), "generation": ("generator", "tab:blue"),
    "eval_generation": ("generator", "tab:cyan"), "learner_wait": ("learner", "lightgrey"),
    "weight_sync": ("learner", "tab:red"), "training": ("learner", "tab:orange"),
    "evaluation": ("learner", "tab:green"),
}


@dataclass
class Args:
    metrics: tyro.conf.Positional[list[str]] = field(default_factory=list)
    """metrics.jsonl files, one per run (or none with --run)"""
    labels: list[str] = field(default_factory=list)
    """a name per run (default: the file's folder)"""
    run: bool = False
    """first run async_dpo.py and sync_baseline.py briefly on the tiny world, then draw those two"""
    steps: tuple[int, int] = (3, 8)
    """the rounds to draw: from the first to the last step (inclusive), counted like `step`"""
    runs_dir: Optional[str] = None
    """where --run keeps its runs' folders (default: a temporary folder, removed afterwards)"""
    output: str = os.path.join(HERE, "timeline.png")
    """where the PNG goes"""


def bars(records: list[dict], first: int, last: int) -> list[tuple]:
    """(lane, phase, start, end, label) for every timed phase of the rounds whose steps lie in [first, last]. A
    generator bar is labelled with the weights that generate, a training bar with the weights it turns into the
    next ones (vA->vB): where the learner's vA->vB sits beside the generator's vA, the two overlap."""
    out, previous_step = [], 0
    for r in records:
        if first <= r["step"] <= last:
            for phase, (lane, _) in PHASES.items():
                start, end = r.get(f"timeline/{phase}_start"), r.get(f"timeline/{phase}_end")
                if start is not None and end is not None:
                    label = {"generation": f"v{r.get('generation_version')}", "eval_generation": f"eval v{r['step']}",
                             "training": f"v{previous_step}\u2192v{r['step']}"}.get(phase, "")
                    out.append((lane, phase, start, end, label))
        if "timeline/training_start" in r:  # a round's last step (evaluations have no training)
            previous_step = r["step"]
    return out


def draw(runs: dict, first: int, last: int, output: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    fig, axes = plt.subplots(len(runs), 1, figsize=(12, 1.9 * len(runs) + 0.8), sharex=True, squeeze=False)
    for ax, (name, records) in zip(axes[:, 0], runs.items()):
        drawn = bars(records, first, last)
        offset = min(start for _, _, start, _, _ in drawn)
        for lane, phase, start, end, label in drawn:
            y = 1 if lane == "generator" else 0
            ax.barh(y, end - start, left=start - offset, height=0.6, color=PHASES[phase][1], edgecolor="black",
                    linewidth=0.4)
            if label and end - start > 0.03:
                ax.text((start + end) / 2 - offset, y, label, ha="center", va="center", fontsize=7)
        rounds = [r for r in records if first <= r["step"] <= last and "timeline/training_end" in r]
        span = max(r["timeline/training_end"] for r in rounds) - offset
        ax.set_yticks([0, 1], ["learner", "generator"])
        ax.set_title(f"{name}: {len(rounds)} rounds in {span:.2f} s", fontsize=9, loc="left")
        ax.set_ylim(-0.6, 1.6)
    axes[-1, 0].set_xlabel("seconds (from the first drawn phase of each run)")
    fig.legend(handles=[Patch(color=colour, label=phase.replace("_", " ")) for phase, (_, colour) in PHASES.items()],
               loc="lower center", ncol=len(PHASES), fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(output, dpi=110)
    print(f"timeline saved to {output}")


def run_pair(folder: str, steps: int) -> dict:
    """A short async and sync run of `--model tiny` with the overlap benchmark's model, whose generation and
    training steps take about as long as each other (one vLLM core and one learner core)."""
    from overlap import Args as OverlapArgs
    from overlap import run_pipeline, tiny_world

    settings = OverlapArgs(steps=steps)
    model = tiny_world.build_untrained(settings.cache_dir, settings.hidden_size, settings.num_layers)
    for script in ("async_dpo.py", "sync_baseline.py"):
        run_pipeline(script, *model, settings, os.path.join(folder, script), "--missing_eos_penalty", "None")
    return {script: os.path.join(folder, script, "metrics.jsonl") for script in ("async_dpo.py", "sync_baseline.py")}


if __name__ == "__main__":
    args = tyro.cli(Args)
    with tempfile.TemporaryDirectory() as folder:
        paths: Optional[dict] = run_pair(args.runs_dir or folder, args.steps[1] + 2) if args.run else dict(zip(
            args.labels or [os.path.basename(os.path.dirname(os.path.abspath(p))) for p in args.metrics],
            args.metrics))
        if not paths:
            sys.exit("error: give metrics.jsonl files, or --run")
        runs = {name: [r for r in map(json.loads, open(path)) if "step" in r]  # (steps and evaluations)
                for name, path in paths.items()}
    for name, records in runs.items():
        if not any("timeline/training_start" in r for r in records):
            sys.exit(f"error: {paths[name]} has no timeline/* metrics (written by the scripts since they log them)")
        print(f"{name}: {regime(records)}")  # which side waited for the other, and the paper's knob for it
    draw(runs, *args.steps, args.output)
