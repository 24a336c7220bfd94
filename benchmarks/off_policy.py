"""Which algorithm tolerates stale data: the paper's Figure 3 on the tiny TL;DR world.

Each generation round produces N mini-batches with one set of weights (`--num_mini_batches N`), and the learner takes
one optimizer step per mini-batch, so a round's later mini-batches are further off-policy. In the paper's synchronous
terms the staleness within a round is 0..N-1 steps; our scripts are asynchronous, which adds the N steps of the round
trained while this one was generated: N..2N-1 (the first round, generated with the SFT weights, is 0..N-1).

The sweep runs async_dpo.py, async_ppo.py and async_rloo.py at each N with the same total episodes, seed and
hyperparameters as each script's `--model tiny` demo but for the batch: 16 prompts a step instead of 32, so that
N = 64 runs two rounds within the demo's budget (its 1,920 episodes rounded to 2,048 so that every N divides them);
no evaluation during training, the final one on the whole validation split. For PPO and RLOO it adds, at N = 16
and 64, the off-policy correction (`--recompute_old_logprobs --is_correction truncate`: the clip against the
learner's pi_old, each term weighted by min(pi_old / mu, 2)), and at the largest N the recomputed pi_old alone (the
paper code's). The paper's two controls run beside them: Best-of-2 SFT (`async_dpo.py --loss best_of_k_sft`, its
Figure 4) at every N, and CoPG-style RLOO (`async_rloo.py --loss copg`, its Figure 13) at N in {1, 4, 16}. It prints
a table of the final evaluations (mean ± standard error over seeds) with each run's mean lag (`lag/kl`, the KL from
the sampling weights to the learner's on the sampled completions, and `lag/update`, the relative size of a step),
the drops from the smallest N to the largest, the training reward's lowest eighth of each run (a collapse recovered
from before the final evaluation) and saves three plots:

  off_policy_frontier.png   gold win rate and gold mean score against perplexity, a marker per (algorithm, N)
  off_policy_by_n.png       final gold win rate and gold mean score against N, per algorithm
  off_policy_by_lag.png     final gold win rate against the mean lag each run measured (lag/kl), per algorithm

    python benchmarks/off_policy.py            # 5 learning rules x N in {1, ..., 64} x 3 seeds: hours on 2 cores
    python benchmarks/off_policy.py --quick    # DPO at N in {1, 2}, the rest at N = 2: one seed, for CI
    python benchmarks/off_policy.py --algorithms dpo bo2_sft dpo_no_reference dpo_linear --n_values 1 16 64 \
        --correction_n_values --no-recompute_at_largest_n   # why DPO tolerates stale data
"""
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Literal, Optional

import tyro

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path[:0] = [REPO, HERE]
from stats import binomial_stderr, fmt, fmt_share, gain_kept, gap, holm_line, mean_and_stderr, recovered, unpaired_gap  # noqa: E402

import tiny_world  # noqa: E402

SCRIPTS = {"dpo": ("async_dpo.py", []), "ppo": ("async_ppo.py", []), "rloo": ("async_rloo.py", []),  # (flags)
           "bo2_sft": ("async_dpo.py", ["--loss", "best_of_k_sft"]), "copg": ("async_rloo.py", ["--loss", "copg"]),
           "dpo_no_reference": ("benchmarks/dpo_variants.py", ["--variant", "no_reference"]),
           "dpo_linear": ("benchmarks/dpo_variants.py", ["--variant", "linear"])}
Algorithm = Literal["dpo", "ppo", "rloo", "bo2_sft", "copg", "dpo_no_reference", "dpo_linear"]
FINAL_METRICS = {"gold win rate": "eval/gold_win_rate", "gold score": "eval/gold_reward",
                 "perplexity": "eval/perplexity", "proxy score": "eval/proxy_reward"}


@dataclass
class Args:
    algorithms: list[Algorithm] = field(default_factory=lambda: ["dpo", "ppo", "rloo", "bo2_sft", "copg"])
    """which learning rules to sweep: async_dpo.py, async_ppo.py, async_rloo.py, and the controls Best-of-2 SFT
    (async_dpo.py --loss best_of_k_sft) and CoPG-style RLOO (async_rloo.py --loss copg); also, not by default, DPO's
    loss without its reference or without its sigmoid (benchmarks/dpo_variants.py)"""
    n_values: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64])
    """N: mini-batches generated with one set of weights (--num_mini_batches); each must divide the episodes"""
    batch_size: int = 16
    """prompts per optimizer step (the demos': 32; 16 gives N = 64 two rounds within the demos' budget)"""
    seeds: list[int] = field(default_factory=lambda: [1, 2, 3])
    """seeds per (algorithm, N)"""
    total_episodes: int = 2048
    """training prompts per run, the same at every N (the demos' 1,920 rounded to a multiple of 64 x 16)"""
    learning_rate: Optional[float] = None
    """every run's learning rate (default: each script's tiny default, 1e-4); a run's folder names it when set"""
    recompute_at_largest_n: bool = True
    """also run PPO and RLOO with --recompute_old_logprobs at the largest N"""
    copg_n_values: list[int] = field(default_factory=lambda: [1, 4, 16])
    """N at which CoPG-style RLOO runs (the paper's Figure 13: N in {1, 4, 16})"""
    correction_n_values: list[int] = field(default_factory=lambda: [16, 64])
    """N at which PPO and RLOO also run with --recompute_old_logprobs --is_correction truncate"""
    tiny_dir: str = tiny_world.SHIPPED["tldr"]
    """the tiny world (built there if missing)"""
    plot_dir: str = HERE
    """where the three plots go"""
    runs_dir: Optional[str] = None
    """where each run's folder (metrics.jsonl, generator log) goes, kept so that a figure can be recomputed and a
    sweep resumed (a run already finished there is read back, not run again); default: benchmarks/runs/off_policy
    (--quick: a temporary folder, deleted after)"""
    quick: bool = False
    """one seed, 128 episodes, evaluations on 64 prompts, of what --algorithms and --n_values ask (by default
    async_dpo.py at N in {1, 2}; corrected RLOO, Best-of-2 SFT, CoPG and DPO without its sigmoid at N = 2): checks
    that the benchmark works, measures nothing"""


IS_METRICS = ("is/weight_min", "is/weight_max", "is/ess_fraction", "is/changed_fraction")
VARIANTS = {  # name: (flags, label in the table)
    "plain": ([], ""),
    "recompute": (["--recompute_old_logprobs"], " (recompute pi_old)"),
    "corrected": (["--recompute_old_logprobs", "--is_correction", "truncate"], " (recompute + truncated IS)"),
}


def sweep_folder(runs_dir: Optional[str], sweep: str, quick: bool) -> tuple[str, bool]:
    """Where a sweep's run folders go, and whether they are kept: --runs_dir, else benchmarks/runs/<sweep> (kept, so
    that a figure can be recomputed and a sweep resumed), or with --quick a temporary folder, deleted after."""
    keep = runs_dir is not None or not quick
    return runs_dir or (os.path.join(HERE, "runs", sweep) if keep else tempfile.mkdtemp(prefix=f"{sweep}_")), keep


def finished(metrics_path: str, num_steps: int) -> bool:
    """Whether a run's metrics end with its final evaluation, after its last step."""
    lines = open(metrics_path).read().splitlines() if os.path.exists(metrics_path) else []
    last = json.loads(lines[-1]) if lines and lines[-1] else {}
    return "eval/gold_win_rate" in last and last.get("step") == num_steps


def train(script: str, flags: list[str], output_dir: str, num_steps: int, label: str) -> dict:
    """One run of `script --model tiny` with `flags` (announced with `label`), or, finished before in `output_dir`,
    read back (a sweep run again goes on where it stopped; a run stopped half-way starts again); returns what
    read_run reads."""
    if finished(os.path.join(output_dir, "metrics.jsonl"), num_steps):
        return read_run(output_dir)
    print(label, flush=True)
    shutil.rmtree(output_dir, ignore_errors=True)
    result = subprocess.run([sys.executable, os.path.join(REPO, script), "--model", "tiny", "--output_dir", output_dir,
                             *flags], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if result.returncode != 0:
        sys.exit(f"{script} {' '.join(flags)} failed:\n{result.stderr[-3000:]}")
    return read_run(output_dir)


def read_run(output_dir: str) -> dict:
    """A run's final evaluation, the staleness and mean lag of its steps, its last step's KL to the SFT policy
    (`objective/kl`, where the script logs it), and its time from the first step to the final evaluation
    (time/elapsed)."""
    records = [json.loads(line) for line in open(os.path.join(output_dir, "metrics.jsonl"))]
    evals = [r for r in records if "eval/gold_win_rate" in r]
    steps = [r for r in records if "staleness" in r]
    weights = {key: [r[key] for r in steps] for key in IS_METRICS if key in steps[0]}  # (corrected runs)
    ties = [r["pairs/tie_fraction"] for r in steps if "pairs/tie_fraction" in r]  # (DPO and its controls)
    rewards, n = [r["reward/mean"] for r in steps], len(steps)
    eighths = [statistics.mean(rewards[i * n // 8:(i + 1) * n // 8] or rewards) for i in range(8)]  # (n < 8: all)
    return dict(sft=evals[0], final=evals[-1], staleness=[r["staleness"] for r in steps], weights=weights,
                ties=statistics.mean(ties) if ties else None, reward_eighths=eighths,
                lag=statistics.mean(r["lag/kl"] for r in steps),
                update=statistics.mean(r["lag/update"] for r in steps), seconds=evals[-1]["time/elapsed"],
                kl=steps[-1].get("objective/kl"))


def ties_of(seeds: list[dict]) -> str:
    """The mean share of prompts whose completions all tied (no pair, no best: left out), over steps and seeds."""
    ties = [r["ties"] for r in seeds if r["ties"] is not None]
    return f"{statistics.mean(ties):.1%}" if ties else ""


def report_drops(table: dict, first_n: int, last_n: int) -> None:
    """The loss from N = first_n to N = last_n in gold win rate, per rule (paired by seed), and each rule's against
    the first rule's (Welch): a gain kept divides by a noisy N = 1 gain, the drop itself does not."""
    rules = [(a, v) for a, n, v in table if n == last_n and (a, first_n, "plain") in table]
    if not rules or first_n == last_n:
        return
    drops = {rule: [x - y for x, y in zip(table[rule[0], last_n, rule[1]]["gold win rate"],
                                          table[rule[0], first_n, "plain"]["gold win rate"])] for rule in rules}
    first, judgements = rules[0], []
    print(f"\nThe drop in gold win rate from N = {first_n} to N = {last_n} (paired by seed), and each rule's drop "
          f"against {first[0]}'s (Welch):\n\n| rule | drop | against {first[0]} |\n|---|---|---|")
    for (algorithm, variant), drop in drops.items():
        base = table[algorithm, first_n, "plain"]["gold win rate"]
        against = None if (algorithm, variant) == first else unpaired_gap(drop, drops[first])
        drop_gap = gap(table[algorithm, last_n, variant]["gold win rate"], base)
        name = f"{algorithm}{VARIANTS[variant][1]}"
        judgements += [(f"{name} drop", drop_gap)] + ([(f"{name} - {first[0]}", against)] if against else [])
        print(f"| {name} | {drop_gap['text']} | {against['text'] if against else ''} |")
    print(f"\n{holm_line(judgements)}")


def report_dips(runs: dict, points: list[tuple], seeds: list[int]) -> None:
    """The training reward (`reward/mean`: the reward model's score of the sampled completions, the missing-EOS
    penalty included) over each eighth of a run's steps: its first eighth, its lowest and its last, so that a
    collapse the policy recovers from before the final evaluation still shows."""
    print("\nThe training reward over the run, the mean of each eighth of its steps (mean ± s.e. over seeds):\n\n"
          "| rule | N | first eighth | lowest eighth | last eighth |\n|---|---|---|---|---|")
    for algorithm, n, variant in points:
        eighths = [runs[algorithm, n, variant, s]["reward_eighths"] for s in seeds]
        print(f"| {algorithm}{VARIANTS[variant][1]} | {n} | {fmt([e[0] for e in eighths])} | "
              f"{fmt([min(e) for e in eighths])} | {fmt([e[-1] for e in eighths])} |")


def report_corrections(table: dict, variants: list[tuple], first_n: int) -> None:
    """Each corrected (or pi_old-only) point against the uncorrected run at the same N, paired by seed, and the share
    of the loss from N = first_n to that N that it wins back, with its 95% interval."""
    rows = [(a, n, v) for a, n, v in variants if (a, n, "plain") in table]
    if not rows:
        return
    print(f"\nThe corrections against the uncorrected run at the same N (paired by seed) and the share of the loss "
          f"from N = {first_n} to that N they win back (recovered):")
    print("\n| rule | N | metric | uncorrected | corrected | gap | recovered |\n|---|---|---|---|---|---|---|")
    judgements = []
    for algorithm, n, variant in rows:
        for metric in ("gold win rate", "gold score"):
            plain, values = table[algorithm, n, "plain"][metric], table[algorithm, n, variant][metric]
            reference = table.get((algorithm, first_n, "plain"))
            share = fmt_share(recovered(values, plain, reference[metric]), "no loss") if reference else ""
            judgements.append((f"{algorithm}{VARIANTS[variant][1]} N = {n} {metric}", gap(values, plain)))
            print(f"| {algorithm}{VARIANTS[variant][1]} | {n} | {metric} | {fmt(plain)} | {fmt(values)} | "
                  f"{judgements[-1][1]['text']} | {share} |")
    print(f"\n{holm_line(judgements)}")


if __name__ == "__main__":
    args = tyro.cli(Args)
    os.makedirs(args.plot_dir, exist_ok=True)  # before the sweep, so a path that cannot be made fails at once
    as_asked = (args.algorithms, args.n_values) != (Args().algorithms, Args().n_values)  # (not the defaults)
    if args.quick:  # short runs of one seed: what is asked, or by default DPO at N in {1, 2} and the rest at N = 2
        args.seeds, args.total_episodes = args.seeds[:1], 128
        if not as_asked:
            args.algorithms, args.n_values = ["dpo"], [1, 2]
    for n in args.n_values:
        if n <= 0 or args.total_episodes % (args.batch_size * n):
            sys.exit(f"--n_values: each N must be positive and divide --total_episodes {args.total_episodes} into "
                     f"rounds of N x {args.batch_size} prompts; {n} does not")
    points = [(a, n, "plain") for a in args.algorithms for n in args.n_values
              if a != "copg" or n in args.copg_n_values]
    points += [(a, n, "corrected") for a in args.algorithms if a in ("ppo", "rloo") for n in args.correction_n_values
               if n in args.n_values]
    if args.recompute_at_largest_n:
        points += [(a, max(args.n_values), "recompute") for a in args.algorithms if a in ("ppo", "rloo")]
    if args.quick and not as_asked:  # and the corrected variant and the two controls once
        points = [(a, n, v) for a, n, v in points if v == "plain"]
        points += [("rloo", 2, "corrected"), ("bo2_sft", 2, "plain"), ("copg", 2, "plain"), ("dpo_linear", 2, "plain")]

    # (--quick: the evaluations on 64 prompts, the first and the final)
    quick_evaluations = ["--num_eval_prompts", "64", "--num_final_eval_prompts", "64"] if args.quick else []
    lr_flags = [] if args.learning_rate is None else ["--learning_rate", str(args.learning_rate)]
    lr_suffix = "" if args.learning_rate is None else f"_lr{args.learning_rate:g}"
    runs_dir, keep_runs = sweep_folder(args.runs_dir, "off_policy", args.quick)
    runs, sweep_start = {}, time.time()
    try:
        for index, (algorithm, n, variant) in enumerate(points):
            for seed in args.seeds:
                name = f"{algorithm}{'' if variant == 'plain' else '_' + variant}_n{n}_seed{seed}{lr_suffix}"
                script, flags = SCRIPTS[algorithm]
                runs[algorithm, n, variant, seed] = train(script, [
                    "--tiny_dir", args.tiny_dir, "--seed", str(seed), "--num_mini_batches", str(n), "--total_episodes",
                    str(args.total_episodes), "--batch_size", str(args.batch_size), "--eval_every", "0", *flags,
                    *VARIANTS[variant][0], *lr_flags, *quick_evaluations], os.path.join(runs_dir, name),
                    args.total_episodes // args.batch_size,
                    f"[{index + 1}/{len(points)}] {name} ({time.time() - sweep_start:.0f} s so far)")
    finally:
        if not keep_runs:
            shutil.rmtree(runs_dir, ignore_errors=True)

    # The SFT policy, scored at step 0 of every run on the final evaluations' prompts: the baseline of every gain
    num_final = next(iter(runs.values()))["final"]["eval/num_prompts"]
    if any(r["sft"]["eval/num_prompts"] != num_final for r in runs.values()):
        sys.exit("a run scored its SFT policy on other prompts than its final evaluation: rerun it (the scripts now "
                 "score step 0 on the final evaluation's prompts)")
    sft = {key: statistics.mean(r["sft"][key] for r in runs.values()) for key in FINAL_METRICS.values()}
    sft_se = binomial_stderr(sft["eval/gold_win_rate"], num_final)
    print(f"\nSFT policy on the final evaluations' {num_final} prompts (mean of every run's step 0): gold win rate "
          f"{sft['eval/gold_win_rate']:.3f} (binomial stderr {sft_se:.3f}), gold score {sft['eval/gold_reward']:.3f}, "
          f"perplexity {sft['eval/perplexity']:.3f}; {len(args.seeds)} seed(s) per row, mean ± standard error over "
          f"seeds (one win rate's own binomial stderr is at most {math.sqrt(0.25 / num_final):.3f}). Gain kept: the "
          f"share of the rule's N = {min(args.n_values)} gain over the SFT policy's win rate, with a 95% interval "
          f"(t over seeds, the baseline's binomial error included)")
    print("\n| algorithm | N | staleness | gold win rate | gain kept | gold score | perplexity | proxy score | lag/kl "
          "| lag/update | ties | time |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    table, lags, first_n = {}, {}, min(args.n_values)
    for algorithm, n, variant in points:
        seeds = [runs[algorithm, n, variant, s] for s in args.seeds]
        table[algorithm, n, variant] = {name: [r["final"][key] for r in seeds] for name, key in FINAL_METRICS.items()}
        lags[algorithm, n, variant] = [r["lag"] for r in seeds]
        staleness = sorted({s for r in seeds for s in r["staleness"]})
        reference = table.get((algorithm, first_n, "plain"))
        kept = "" if reference is None or (n, variant) == (first_n, "plain") else fmt_share(gain_kept(
            table[algorithm, n, variant]["gold win rate"], reference["gold win rate"], sft["eval/gold_win_rate"],
            sft_se))
        columns = [fmt(values, 2 if name == "perplexity" else 3)
                   for name, values in table[algorithm, n, variant].items()]
        print(f"| {algorithm}{VARIANTS[variant][1]} | {n} | {staleness[0]}..{staleness[-1]} | {columns[0]} | {kept} | "
              + " | ".join(columns[1:]) + f" | {fmt([r['lag'] for r in seeds], 4)} | "
              f"{fmt([r['update'] for r in seeds], 5)} | {ties_of(seeds)} | "
              f"{statistics.mean(r['seconds'] for r in seeds):.0f} s |")
    report_drops(table, first_n, max(args.n_values))
    report_dips(runs, points, args.seeds)
    report_corrections(table, [(a, n, v) for a, n, v in points if v != "plain"], first_n)
    corrected = [(a, n) for a, n, v in points if v == "corrected"]
    if corrected:
        print("\nThe sampler's importance weights w of the corrected runs, over every step of every seed:")
        for algorithm, n in corrected:
            weights = [runs[algorithm, n, "corrected", s]["weights"] for s in args.seeds]
            print(f"  {algorithm} N = {n}: w from {min(min(w['is/weight_min']) for w in weights):.2f} to "
                  f"{max(max(w['is/weight_max']) for w in weights):.2f}, ESS at least "
                  f"{min(min(w['is/ess_fraction']) for w in weights):.1%} of n, the cap changed at most "
                  f"{max(max(w['is/changed_fraction']) for w in weights):.1%} of a step's terms")
    print(f"\nwhole sweep: {(time.time() - sweep_start) / 60:.1f} min")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    markers = {"dpo": "o", "ppo": "s", "rloo": "^", "bo2_sft": "D", "copg": "v", "dpo_no_reference": "P",
               "dpo_linear": "X"}
    colors = plt.cm.viridis
    fill = {"plain": "full", "recompute": "none", "corrected": "left"}
    n_color = {n: colors(i / max(len(args.n_values) - 1, 1)) for i, n in enumerate(sorted(args.n_values))}
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, metric in zip(axes, ("gold win rate", "gold score")):
        for (algorithm, n, variant), values in table.items():
            (x, x_err), (y, y_err) = mean_and_stderr(values["perplexity"]), mean_and_stderr(values[metric])
            ax.errorbar(x, y, xerr=x_err, yerr=y_err, marker=markers[algorithm], markersize=8, color=n_color[n],
                        fillstyle=fill[variant], ecolor="gray", linestyle="none")
        ax.plot(sft["eval/perplexity"], sft[FINAL_METRICS[metric]], "k*", markersize=12)
        ax.set(xlabel="perplexity of the summaries under the SFT model", ylabel=f"final {metric}")
    handles = [plt.Line2D([], [], marker=m, color="gray", linestyle="none", label=a) for a, m in markers.items()
               if a in args.algorithms]
    handles += [plt.Line2D([], [], marker="o", color=c, linestyle="none", label=f"N={n}") for n, c in n_color.items()]
    handles += [plt.Line2D([], [], marker="o", color="gray", fillstyle=fill[v], linestyle="none",
                           label=VARIANTS[v][1].strip(" ()")) for v in ("recompute", "corrected")]
    handles += [plt.Line2D([], [], marker="*", color="k", linestyle="none", label="SFT")]
    axes[1].legend(handles=handles, fontsize=8, loc="best")
    fig.suptitle(f"Off-policy tolerance on the tiny world ({len(args.seeds)} seeds, mean ± s.e.)")
    fig.tight_layout()
    fig.savefig(os.path.join(args.plot_dir, "off_policy_frontier.png"), dpi=90)

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, metric in zip(axes, ("gold win rate", "gold score")):
        for i, algorithm in enumerate(args.algorithms):
            at = [n for n in args.n_values if (algorithm, n, "plain") in table]  # (CoPG: its own N)
            means = [mean_and_stderr(table[algorithm, n, "plain"][metric]) for n in at]
            ax.errorbar(at, [m for m, _ in means], yerr=[e for _, e in means], marker=markers[algorithm],
                        color=f"C{i}", capsize=3, label=algorithm)
            for variant, shift in (("recompute", 1.1), ("corrected", 0.9)):
                at = [n for n in args.n_values if (algorithm, n, variant) in table]
                means = [mean_and_stderr(table[algorithm, n, variant][metric]) for n in at]
                if at:
                    ax.errorbar([n * shift for n in at], [m for m, _ in means], yerr=[e for _, e in means],
                                marker=markers[algorithm], color=f"C{i}", fillstyle=fill[variant], capsize=3,
                                linestyle="none", label=f"{algorithm}{VARIANTS[variant][1]}")
        ax.axhline(sft[FINAL_METRICS[metric]], color="k", linestyle=":", label="SFT")
        ax.set_xscale("log", base=2)
        ax.set(xlabel="N (mini-batches per generation round)", ylabel=f"final {metric}")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(args.plot_dir, "off_policy_by_n.png"), dpi=90)

    # The same points against the lag each run measured (its mean lag/kl) instead of N
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for i, algorithm in enumerate(args.algorithms):
        at = [n for n in args.n_values if (algorithm, n, "plain") in table]
        lag = [mean_and_stderr(lags[algorithm, n, "plain"]) for n in at]
        win = [mean_and_stderr(table[algorithm, n, "plain"]["gold win rate"]) for n in at]
        ax.errorbar([m for m, _ in lag], [m for m, _ in win], xerr=[e for _, e in lag], yerr=[e for _, e in win],
                    marker=markers[algorithm], color=f"C{i}", capsize=3, label=algorithm)
    ax.axhline(sft["eval/gold_win_rate"], color="k", linestyle=":", label="SFT")
    ax.set_xscale("log")
    ax.set(xlabel="mean lag/kl over the run's steps (KL(mu || pi) on the sampled completions)",
           ylabel="final gold win rate")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(args.plot_dir, "off_policy_by_lag.png"), dpi=90)
    print(f"plots saved to {args.plot_dir}/off_policy_frontier.png, off_policy_by_n.png and off_policy_by_lag.png")
