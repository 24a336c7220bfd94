"""Does dropping stale data starve the long, hard problems? The experiment of docs/drop_bias.md (pre-registered
there, with its power analysis, before the runs).

`fully_async_grpo.py --model tiny` on the chains world, where difficulty and length go together (a chain of more
steps has a longer answer; the SFT policy solves 0.44 of one-step chains, 0.12 of three or four steps, none of five
or more). Arms, at k = 2 and k = 8: `pace` (keeps everything it admits), `drop` with room to discard (twice the
bound's room, 2 (k + 1) B: at the default room `drop` is `pace`) and `head` in flight (AReaL's rule). The demo's
hyperparameters, 48 steps of B = 16 groups, every group recorded (--record_rollouts), the final policy saved.

Per run: the share of the groups admitted whose problem is hard (3 steps or more) against the share trained on, and
the same by difficulty (1, 2, 3+ steps) and by completion length; the bias, trained minus admitted; greedy pass@1 by
difficulty after training (the saved policy, transformers' greedy decoding, the 400 test problems); seconds a step.
Comparisons paired by seed against `pace` at the same k, judged on the t-distribution's two-sided 95% threshold, with
Holm over each registered family. Runs go seed by seed, every arm in turn; a finished run is read, not run again.

    python benchmarks/drop_bias.py --pilot    # pace and drop at k = 2, seeds 101 and 102: the power analysis's input
    python benchmarks/drop_bias.py            # the registered design: 6 arms x seeds 1-4, about 32 minutes
    python benchmarks/drop_bias.py --quick    # one short run: checks it, measures nothing
"""
import functools
import json
import math
import os
import statistics
import sys
from dataclasses import dataclass, field

import tyro

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # (the benchmarks' helpers, and tiny_world and plumbing)
from fully_async import B, folder_name, stream  # noqa: E402
from fully_async_demo import run as run_once  # noqa: E402
from stats import gap, holm_line, judged, mean_and_stderr, power  # noqa: E402

STEPS = 48  # optimizer steps a run (B = 16 groups of K = 4)
HARD = 3  # a problem of this many steps or more is hard
MARGIN = 0.02  # a bias in the hard share smaller than this (2 points of ~26) is not material (registered)
CLASSES = ("1", "2", "3+")
ARMS = {f"k = {k}, {policy}": stream(k, policy, *(("--inflight_updates",) if policy == "head" else ()))
        for k in (2, 8) for policy in ("pace", "drop", "head")}
PILOT = ("k = 2, pace", "k = 2, drop")


@dataclass
class Args:
    seeds: list[int] = field(default_factory=lambda: [1, 2, 3, 4])
    """the registered design's seeds (docs/drop_bias.md: chosen by the power analysis)"""
    pilot: bool = False
    """`pace` and `drop` at k = 2 on seeds 101 and 102, and the power analysis from them"""
    quick: bool = False
    """one short run (k = 2 `drop`, 4 steps): checks that the benchmark runs, measures nothing"""
    runs_dir: str = os.path.join(HERE, "runs", "drop_bias")
    """where every run keeps its folder (a finished run is read, not run again)"""
    plot_dir: str = HERE
    """where drop_bias.png goes (the shares admitted and trained, by difficulty)"""


def difficulty(steps: int) -> str:
    return "3+" if steps >= HARD else str(steps)


def problems_by_prompt() -> dict:
    """The chains world's training problems' steps, by their prompt's ids as the script tokenises them."""
    from transformers import AutoTokenizer

    import tiny_world
    from plumbing import core

    sft, data, _ = tiny_world.math_world(tiny_world.SHIPPED["chains"], "chains")
    tokenizer = AutoTokenizer.from_pretrained(sft)
    rows = [json.loads(line) for line in open(os.path.join(data, "train.jsonl"))]
    prompts = core.tokenize_prompts(tokenizer, [tiny_world.MATH_PROMPT.format(question=r["question"]) for r in rows],
                                    192)
    return {tuple(p): r["steps"] for p, r in zip(prompts, rows)}


def mix(folder: str, steps_of: dict) -> dict:
    """A run's admitted and trained groups: the hard share of each and their difference (the bias), each
    difficulty's, the completions' mean length, the share discarded."""
    groups = [json.loads(line) for line in open(os.path.join(folder, "rollouts.jsonl"))]
    kinds = [difficulty(steps_of[tuple(g["prompt"])]) for g in groups]
    trained = [i for i, g in enumerate(groups) if g["fate"] == "trained"]

    def share(indices: list, kind: str) -> float:
        return sum(kinds[i] == kind for i in indices) / len(indices)

    def length(indices: list) -> float:
        return statistics.mean(len(r) for i in indices for r in groups[i]["responses"])

    admitted = list(range(len(groups)))
    return dict(hard_admitted=share(admitted, "3+"), hard_trained=share(trained, "3+"),
                bias=share(trained, "3+") - share(admitted, "3+"),
                **{f"trained_{c}": share(trained, c) for c in CLASSES},
                **{f"admitted_{c}": share(admitted, c) for c in CLASSES},
                length_admitted=length(admitted), length_trained=length(trained),
                discarded=sum(g["fate"] == "discarded" for g in groups) / len(groups))


def pass_by_difficulty(folder: str) -> dict:
    """Greedy pass@1 of the run's saved policy on the 400 test problems, by difficulty (transformers' greedy)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import tiny_world

    rows = [json.loads(line) for line in open(os.path.join(tiny_world.SHIPPED["chains"], "data", "test.jsonl"))]
    model = os.path.join(folder, "model")
    policy, tokenizer = AutoModelForCausalLM.from_pretrained(model).eval(), AutoTokenizer.from_pretrained(model)
    _, right = tiny_world.greedy_answers(policy, tokenizer, rows, 128)
    return {c: statistics.mean(ok for r, ok in zip(rows, right) if difficulty(r["steps"]) == c) for c in CLASSES}


def run_arm(name: str, seed: int, args: Args, steps_of) -> dict:
    steps = 4 if args.quick else STEPS
    folder = folder_name(name, seed)
    train, evals, _ = run_once(folder, args, "--seed", str(seed), *ARMS[name], "--total_episodes",
                               str(steps * B * 4), "--eval_every", "0", "--record_rollouts", "--record_every",
                               str(steps), "--save_model", *(("--num_final_eval_prompts", "32") if args.quick else ()))
    path = os.path.join(args.runs_dir, folder)
    cached = os.path.join(path, "drop_bias.json")  # (the per-run figures, computed once)
    if not os.path.exists(cached):
        with open(cached, "w") as f:
            json.dump(dict(**mix(path, steps_of()), pass_at_1=pass_by_difficulty(path)), f)
    figures = json.load(open(cached))
    return dict(figures, seconds_per_step=train[-1]["time/elapsed"] / len(train), eval=evals[-1]["eval/pass_at_1"])


def report_pilot(results: dict) -> None:
    biases = {name: [r["bias"] for r in runs.values()] for name, runs in results.items()}
    differences = [d - p for d, p in zip(biases["k = 2, drop"], biases["k = 2, pace"])]
    mean, sd = statistics.mean(differences), statistics.stdev(differences)
    print(f"pilot (seeds {list(next(iter(results.values())))}): the hard share's bias (trained - admitted), per seed: "
          + "; ".join(f"{name} {', '.join(f'{b:+.3f}' for b in values)}" for name, values in biases.items()))
    print(f"  drop - pace, paired: mean {mean:+.4f}, SD {sd:.4f} (one degree of freedom: a rough SD)")
    for times in (1, 2, 4):  # (the SD of one degree of freedom is rough: the design is sized on a larger one)
        print(f"  at {times}x the pilot's SD ({times * sd:.4f}), the power to show the pilot's effect below 0 / below "
              f"-{MARGIN} (materially): " + ", ".join(
                  f"n = {n}: {power(mean, times * sd, n):.2f} / {power(mean, times * sd, n, -MARGIN):.2f}"
                  for n in (3, 4, 5)))
    print(f"  an effect at the margin ({-MARGIN}) shown below 0, at 2x the pilot's SD: "
          + ", ".join(f"n = {n}: {power(-MARGIN, 2 * sd, n):.2f}" for n in (3, 4, 5)))


def report(results: dict, seeds: list) -> None:
    print(f"\nThe mix (mean ± s.e. over seeds {seeds}; hard: {HARD}+ steps):")
    print("| arm | hard share admitted | trained | bias (trained - admitted) | trained 1 / 2 / 3+ | mean length "
          "admitted / trained | discarded | s a step |")
    print("|---|---|---|---|---|---|---|---|")
    for name, runs in results.items():
        values = list(runs.values())

        def each(key: str, digits: int = 3) -> str:
            m, se = mean_and_stderr([r[key] for r in values])
            return f"{m:.{digits}f} ± {se:.{digits}f}"

        print(f"| {name} | {each('hard_admitted')} | {each('hard_trained')} | {each('bias')} | "
              + " / ".join(f"{statistics.mean(r[f'trained_{c}'] for r in values):.3f}" for c in CLASSES)
              + f" | {each('length_admitted', 1)} / {each('length_trained', 1)} | {each('discarded', 2)} | "
              f"{each('seconds_per_step', 2)} |")
    family, rows = [], []
    for k in (2, 8):
        base = [r["bias"] for r in results[f"k = {k}, pace"].values()]
        for policy in ("drop", "head"):
            name = f"k = {k}, {policy}"
            family.append((f"{name} - pace", gap([r["bias"] for r in results[name].values()], base, interval=True)))
            rows.append(name)
    print("\nThe bias against `pace`'s, paired by seed (primary: k = 2, drop; margin ±0.02):")
    for (label, result), name in zip(family, rows):
        print(f"  {label}: {result['text']} -> {verdict(result)}")
    print(f"  {holm_line(family, 'over the four registered bias comparisons')}")
    print("\nGreedy pass@1 after training by difficulty (1 / 2 / 3+ steps; the run's own evaluation, all 400), and on "
          "the hard problems against `pace`, paired:")
    hard_family = []
    for name, runs in results.items():
        values = list(runs.values())
        by = " / ".join(f"{statistics.mean(r['pass_at_1'][c] for r in values):.3f}" for c in CLASSES)
        line = f"  {name}: {by} ({statistics.mean(r['eval'] for r in values):.3f})"
        if not name.endswith("pace"):
            base = results[name.replace("drop", "pace").replace("head", "pace")]
            hard_family.append((f"{name} - pace, 3+", gap([r["pass_at_1"]["3+"] for r in values],
                                                          [r["pass_at_1"]["3+"] for r in base.values()],
                                                          interval=True)))
            line += f"; 3+ against pace: {hard_family[-1][1]['text']}"
        print(line)
    print(f"  {holm_line(hard_family, 'over the four registered pass@1 comparisons on the hard problems')}")
    print("\nSeconds a step against `pace` (log seconds, paired; the factor with its 95% interval):")
    for name, runs in results.items():
        if name.endswith("pace"):
            continue
        base = results[name.replace("drop", "pace").replace("head", "pace")]
        logs = [math.log(r["seconds_per_step"] / b["seconds_per_step"]) for r, b in zip(runs.values(),
                                                                                          base.values())]
        m, se = mean_and_stderr(logs)
        result = judged(m, se, len(logs) - 1)
        low, high = (math.exp(m - result["threshold"] * se), math.exp(m + result["threshold"] * se)) \
            if result["threshold"] else (math.exp(m), math.exp(m))
        t = "not judged" if result["t"] is None else f"{result['t']:.1f}"
        print(f"  {name} / pace: {math.exp(m):.2f}x, 95% interval {low:.2f}x to {high:.2f}x (t on log seconds: {t})")


def plot(results: dict, path: str) -> None:
    """Each arm's share of groups by difficulty, admitted against trained (mean over seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(CLASSES), figsize=(4 * len(CLASSES), 3.5), sharey=False)
    names = list(results)
    for ax, c in zip(axes, CLASSES):
        for offset, (side, colour) in enumerate((("admitted", "tab:gray"), ("trained", "tab:blue"))):
            values = [statistics.mean(r[f"{side}_{c}"] for r in results[name].values()) for name in names]
            ax.bar([i + 0.4 * offset for i in range(len(names))], values, 0.4, color=colour, label=side)
        ax.set_xticks([i + 0.2 for i in range(len(names))], names, rotation=45, ha="right", fontsize=8)
        ax.set_title(f"{c} step{'' if c == '1' else 's'}: share of the groups")
    axes[0].legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    print(f"\nsaved {path}")


def verdict(result: dict) -> str:
    """The registered rule: shown below 0 and past the margin: `biases the mix, materially`; shown below 0 within
    it: `biases the mix, not materially`; its interval inside ±margin: `no material bias`; else `inconclusive`."""
    if result["t"] is None:
        return "not judged"
    reach = result["threshold"] * result["se"]
    low, high = result["mean"] - reach, result["mean"] + reach
    if high < -MARGIN:
        return "biases the mix (fewer hard problems), materially"
    if high < 0:
        return "biases the mix (fewer hard problems), the bias not shown past the margin"
    if low > 0:
        return "biases the mix towards hard problems"
    if -MARGIN < low and high < MARGIN:
        return "no material bias (the interval within the margin)"
    return "inconclusive"


def main(args: Args) -> None:
    steps_of = functools.cache(problems_by_prompt)  # (read only for a run not yet summed up: a reprint needs none)
    names = PILOT if args.pilot else ("k = 2, drop",) if args.quick else tuple(ARMS)
    seeds = [101, 102] if args.pilot else args.seeds[:1] if args.quick else args.seeds
    results = {name: {} for name in names}
    for seed in seeds:  # (seed by seed, every arm in turn: the machine's drift falls on every arm alike)
        for name in names:
            results[name][seed] = run_arm(name, seed, args, steps_of)
    if args.quick:
        print(json.dumps(results, indent=1))
    elif args.pilot:
        report_pilot(results)
    else:
        report(results, seeds)
        plot(results, os.path.join(args.plot_dir, "drop_bias.png"))


if __name__ == "__main__":
    main(tyro.cli(Args))
