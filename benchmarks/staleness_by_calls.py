"""Does staleness cost more the more turns an episode takes? The experiment of docs/agentic.md, "Staleness across
1, 2 and 4 calls" (registered there, with its pilot and power analysis, before the design's runs).

`agentic_grpo.py --model tiny --tiny_dir worlds/calls-v1`: problems of 1, 2 or 4 calculator calls, a third each,
every one solved by the SFT policy at a useful rate; the agentic experiment's slow, long-tailed tool in every run;
96 steps at the learning rate the pilot chose. Three arms, the same seeds (paired: a seed's runs share the prompt
order and the SFT weights):
  k0       --max_staleness 0: synchronous, no version loads while an episode runs
  turns    --max_staleness 8: a version loads between any two turns (the script's default), so an episode's later
           turns are sampled by newer versions than its first
  matched  --episode_atomic at the bound MATCHED_BOUND: one version an episode, its bound chosen on the pilot so that
           its tokens are as stale, on average (`staleness/token_mean`), as `turns`'s at k = 8: the control matched
           on staleness (at the same bound an atomic arm is staler than `turns`, whose bound counts from an
           episode's oldest token)
The outcome is the final policy's greedy pass@1 by the problem's number of calls (transformers, every call through
the calculator, the 400 test problems: tiny_world.tool_report), computed once from the saved policy.

    python benchmarks/staleness_by_calls.py --pilot   # k = 0's gain by learning rate, steps and K (seed 101); once
                                                      # one gains 0.1: the matched bound and the power (101-102);
                                                      # (the runs: docs/runs/staleness_by_calls.tar.xz)
    python benchmarks/staleness_by_calls.py           # the registered design
    python benchmarks/staleness_by_calls.py --quick   # one short run: checks it runs, measures nothing
"""
import json
import os
import statistics
import sys
from dataclasses import dataclass, field

import tyro

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path[:0] = [REPO, HERE]
from agentic import TOOL, run  # noqa: E402
from stats import fmt, gap, holm_line, power  # noqa: E402

import tiny_world  # noqa: E402

WORLD = tiny_world.SHIPPED["calls"]
LEARNING_RATES = (1e-4, 3e-4, 1e-3)  # the pilot's, tried in order until k = 0 gains 0.1 of pass@1 over SFT
WIDE_LEARNING_RATES = (1e-4, 2e-4)  # then K = 8 for 384 steps at these
TARGET_GAIN = 0.1  # (the issue's: drift per version large enough that RL moves the policy)
TURNS_BOUND = 8
MARGIN = 0.05  # the interaction's margin, in pass@1 (a third of the 4-call problems' SFT rate)
LEARNING_RATE = None  # registered from the pilot (docs/agentic.md)
MATCHED_BOUND = None  # registered from the pilot


@dataclass
class Args:
    seeds: list[int] = field(default_factory=lambda: [1, 2, 3, 4])
    """the registered design's seeds (docs/agentic.md: chosen by the power analysis)"""
    pilot: bool = False
    """the pilot: k = 0's gain by learning rate, steps and group size (seed 101); once one gains TARGET_GAIN, the
    matched bound and the power analysis (seeds 101 and 102)"""
    runs_dir: str = os.path.join(HERE, "runs", "staleness_by_calls")
    """where every run keeps its folder (a finished run is read, not run again)"""
    quick: bool = False
    """one short run (turns at k = 8, seed 1): checks that the benchmark runs, measures nothing"""


def arm_flags(arm: str, learning_rate: float, matched_bound: int) -> tuple:
    if arm == "k0":
        return "--max_staleness", "0", "--learning_rate", str(learning_rate)
    if arm == "turns":
        return "--max_staleness", str(TURNS_BOUND), "--learning_rate", str(learning_rate)
    if arm == "matched":
        return "--max_staleness", str(matched_bound), "--episode_atomic", "--learning_rate", str(learning_rate)
    raise ValueError(f"unknown arm {arm!r}: k0, turns or matched")


def calls_run(name: str, seed: int, args: Args, flags: tuple) -> dict:
    """One run (its folder in runs_dir/name), and its final policy's greedy pass@1 by calls (cached there)."""
    result = run(name, args, "--tiny_dir", WORLD, "--seed", str(seed), "--eval_every", "0", "--save_model", *TOOL,
                 *flags)
    cached = os.path.join(args.runs_dir, name, "by_calls.json")
    if not os.path.exists(cached):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = os.path.join(args.runs_dir, name, "model")
        policy, tokenizer = AutoModelForCausalLM.from_pretrained(model).eval(), AutoTokenizer.from_pretrained(model)
        rows = [json.loads(line) for line in open(os.path.join(WORLD, "data", "test.jsonl"))]
        with open(cached, "w") as f:
            json.dump(tiny_world.tool_report(policy, tokenizer, rows), f)
    report = json.load(open(cached))
    return dict(result, pass_at_1=report["sft_test_pass_at_1"], by_calls=report["sft_pass_at_1_by_steps"])


def sft_figures() -> dict:
    report = json.load(open(os.path.join(WORLD, "world.json")))
    return dict(pass_at_1=report["sft_test_pass_at_1"], by_calls=report["sft_pass_at_1_by_steps"])


def describe(label: str, runs: list) -> None:
    print(f"| {label} | {fmt([r['pass_at_1'] for r in runs])} | "
          + " | ".join(fmt([r["by_calls"][c] for r in runs]) for c in ("1", "2", "4"))
          + f" | {fmt([r['token_staleness'] for r in runs], 2)} | {fmt([r['spanning'] for r in runs], 3)} | "
          f"{fmt([r['lag'] for r in runs], 5)} | {statistics.mean(r['seconds'] for r in runs):.0f} |")


def interaction(a: list, b: list) -> list:
    """Per seed: (a - b on the 4-call problems) - (a - b on the 1-call problems)."""
    return [(x["by_calls"]["4"] - y["by_calls"]["4"]) - (x["by_calls"]["1"] - y["by_calls"]["1"])
            for x, y in zip(a, b)]


def pilot(args: Args) -> None:
    seeds, sft = [101, 102], sft_figures()
    print(f"SFT greedy pass@1 {sft['pass_at_1']:.3f}; by calls 1 / 2 / 4: "
          + " / ".join(f"{sft['by_calls'][c]:.3f}" for c in ("1", "2", "4")))
    chosen = None
    for lr in LEARNING_RATES:
        k0 = calls_run(f"pilot_lr{lr:g}_k0_seed{seeds[0]}", seeds[0], args, arm_flags("k0", lr, 0))
        print(f"  learning rate {lr:g}, k = 0, seed {seeds[0]}: pass@1 {k0['pass_at_1']:.3f} (gain "
              f"{k0['pass_at_1'] - sft['pass_at_1']:+.3f}); lag/kl_token {k0['lag']:.5f}", flush=True)
        if k0["pass_at_1"] - sft["pass_at_1"] >= TARGET_GAIN:
            chosen = lr
            break
    if chosen is None:
        return curve(args, sft, seeds[0])
    runs = {arm: [calls_run(f"pilot_lr{chosen:g}_{arm}_seed{s}", s, args, arm_flags(arm, chosen, 0))
                  for s in seeds] for arm in ("k0", "turns")}
    matched = round(statistics.mean(r["token_staleness"] for r in runs["turns"]))
    runs["matched"] = [calls_run(f"pilot_lr{chosen:g}_matched{matched}_seed{s}", s, args,
                                 arm_flags("matched", chosen, matched)) for s in seeds]
    print(f"\nthe pilot at learning rate {chosen:g} (seeds {seeds}; the matched bound {matched}: the rounded mean "
          f"token staleness of turns at k = {TURNS_BOUND}):\n")
    header(runs)
    primary = interaction(runs["turns"], runs["k0"])
    mean, sd = statistics.mean(primary), statistics.stdev(primary)
    print(f"\nthe primary interaction per seed, (turns - k0) on 4 calls - on 1 call: "
          f"{', '.join(f'{d:+.4f}' for d in primary)}; mean {mean:+.4f}, SD {sd:.4f} (one degree of freedom)")
    for times in (1, 2):
        print(f"  at {times}x the pilot's SD ({times * sd:.4f}), the power to show an interaction of the margin "
              f"(-{MARGIN}) below 0: " + ", ".join(f"n = {n}: {power(-MARGIN, times * sd, n):.2f}"
                                                   for n in (3, 4, 6, 8)))


def curve(args: Args, sft: dict, seed: int) -> None:
    """No learning rate of the search gained TARGET_GAIN in 96 steps: the search's best (1e-4) for four times the
    steps at k = 0, evaluated every 48 steps (the script's own greedy pass@1, vLLM; no tool latency: at k = 0 it
    changes the clock, not what is learned), to see whether more steps would."""
    name = f"pilot_curve_lr{LEARNING_RATES[0]:g}_k0_seed{seed}"
    run(name, args, "--tiny_dir", WORLD, "--seed", str(seed), "--max_staleness", "0", "--learning_rate",
        str(LEARNING_RATES[0]), "--total_episodes", str(4 * 6144), "--eval_every", "48")
    records = [json.loads(line) for line in open(os.path.join(args.runs_dir, name, "metrics.jsonl"))]
    evals = [r for r in records if "eval/pass_at_1" in r]
    print(f"\nno learning rate of {LEARNING_RATES} gained {TARGET_GAIN} in 96 steps; at {LEARNING_RATES[0]:g} for 384 "
          f"steps (k = 0, seed {seed}), greedy pass@1 every 48 steps: " + ", ".join(
              f"{e['step']}: {e['eval/pass_at_1']:.3f}" for e in evals)
          + f"; the best gain {max(e['eval/pass_at_1'] for e in evals) - sft['pass_at_1']:+.3f}")
    # A larger group, the same prompts: K = 8 at the best learning rate, 96 steps of 16 groups (the advantage gets
    # twice the samples a prompt)
    wide = calls_run(f"pilot_lr{LEARNING_RATES[0]:g}_K8_k0_seed{seed}", seed, args, (
        *arm_flags("k0", LEARNING_RATES[0], 0), "--num_samples", "8", "--batch_size", "128", "--total_episodes",
        str(96 * 128)))
    print(f"K = 8 at {LEARNING_RATES[0]:g} for 96 steps of 16 groups (k = 0, seed {seed}): pass@1 "
          f"{wide['pass_at_1']:.3f} (gain {wide['pass_at_1'] - sft['pass_at_1']:+.3f}); by calls 1 / 2 / 4: "
          + " / ".join(f"{wide['by_calls'][c]:.3f}" for c in ("1", "2", "4")))
    best = max(max(e["eval/pass_at_1"] for e in evals), wide["pass_at_1"]) - sft["pass_at_1"]
    if best < TARGET_GAIN:
        best = max(best, *(wide_curve(args, sft, seed, lr) for lr in WIDE_LEARNING_RATES))
    if best < TARGET_GAIN:
        print(f"k = 0 gains less than {TARGET_GAIN} at every configuration tried: the design is not registered "
              "(docs/agentic.md)")
    else:
        print("a configuration reaches it: the design takes it (docs/agentic.md)")


def wide_curve(args: Args, sft: dict, seed: int, lr: float) -> float:
    """K = 8 (16 groups a step) at k = 0 for 384 steps, evaluated every 48 (vLLM greedy, no tool latency): its
    best gain over SFT."""
    name = f"pilot_curve_lr{lr:g}_K8_k0_seed{seed}"
    run(name, args, "--tiny_dir", WORLD, "--seed", str(seed), "--max_staleness", "0", "--learning_rate", str(lr),
        "--num_samples", "8", "--batch_size", "128", "--total_episodes", str(384 * 128), "--eval_every", "48")
    records = [json.loads(line) for line in open(os.path.join(args.runs_dir, name, "metrics.jsonl"))]
    evals = [r for r in records if "eval/pass_at_1" in r]
    best = max(e["eval/pass_at_1"] for e in evals) - sft["pass_at_1"]
    print(f"K = 8 at {lr:g} for 384 steps of 16 groups (k = 0, seed {seed}), greedy pass@1 every 48 steps: "
          + ", ".join(f"{e['step']}: {e['eval/pass_at_1']:.3f}" for e in evals) + f"; the best gain {best:+.3f}")
    return best


def header(runs: dict) -> None:
    print("| arm | pass@1 | 1 call | 2 calls | 4 calls | token staleness | episodes over 2+ versions | lag/kl_token "
          "| seconds |\n|---|---|---|---|---|---|---|---|---|")
    for arm, values in runs.items():
        describe(arm, values)


def main(args: Args) -> None:
    if args.pilot:
        return pilot(args)
    if LEARNING_RATE is None or MATCHED_BOUND is None:
        sys.exit("the design is registered after its pilot: run --pilot first (docs/agentic.md)")
    arms = ("turns",) if args.quick else ("k0", "turns", "matched")
    runs = {arm: [] for arm in arms}
    for seed in args.seeds[:1] if args.quick else args.seeds:  # (interleaved: seed by seed, every arm in turn)
        for arm in arms:
            runs[arm].append(calls_run(f"{arm}_seed{seed}", seed, args,
                                       arm_flags(arm, LEARNING_RATE, MATCHED_BOUND)))
    sft = sft_figures()
    print(f"\nSFT greedy pass@1 {sft['pass_at_1']:.3f}; by calls 1 / 2 / 4: "
          + " / ".join(f"{sft['by_calls'][c]:.3f}" for c in ("1", "2", "4")))
    header(runs)
    if args.quick:
        return
    comparisons = [("primary: (turns - k0) on 4 calls - on 1 call", interaction(runs["turns"], runs["k0"])),
                   ("(turns - matched) on 4 calls - on 1 call", interaction(runs["turns"], runs["matched"]))]
    judged = [(label, gap(values, [0.0] * len(values), interval=True)) for label, values in comparisons]
    print("\nthe registered comparisons (paired by seed, two-sided 95% t):")
    for label, result in judged:
        print(f"  {label}: {result['text']}")
    print(f"  {holm_line(judged, 'over the two registered')}")


if __name__ == "__main__":
    main(tyro.cli(Args))
