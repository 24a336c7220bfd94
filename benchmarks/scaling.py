"""Does a larger policy tolerate stale data better? The paper's Figure 5 on the tiny world, decided by a statistic
fixed before the runs.

The paper runs Online DPO at N in {1, ..., 64} with policies and reward models of several sizes: with the reward model
fixed at the smallest, larger policies' off-policy points cluster near the on-policy optimum; with the policy fixed,
larger reward models lower the KL but do not tighten the cluster. It suggests, without testing it, that a larger
policy moves less per step, so the same N is less off-policy. `tiny_world.build_sized` gives policies and proxy
reward models of three sizes (0.18M, 0.55M and 3.47M parameters) beside the tiny world, the SFT policies chosen in one
narrow band of gold win rate and every proxy trained on every size's samples. This sweep runs async_dpo.py (16
prompts a step, the tiny defaults but the learning rate) for each policy size:

  1. tuning: N = 1 at each learning rate of --lr_grid, in each reward arm; the best final gold win rate (mean over
     seeds) is the size's learning rate in that arm;
  2. the sizes at every N with their tuned learning rates, in two reward arms: the gold reward model itself (no proxy
     to over-optimise) and one proxy (--proxy_size, the paper's smallest) trained on every size's samples;
  3. lag-matched (proxy arm): each size's learning rate rescaled so that its mean lag/kl at N = 16 is the middle
     size's (the lag grows as the square of the step: lr x sqrt(target / lag)), at every N;
  4. the reward-model panel: the middle policy (for which every proxy's pairs hold its own samples) with each proxy
     size at every N, at its tuned proxy-arm learning rate.

Every step logs the lag (`lag/kl`, `lag/update`). The statistic, per size, arm and seed: d = gold win rate at the
largest N - at N = 1 (paired by seed); the verdict rule (d_largest - d_smallest past the t threshold, Welch, in both
reward arms) is in docs/results.md, written before the runs.

  scaling_by_n.png     final gold win rate against N, one panel per arm, a line per size
  scaling_by_lag.png   final gold win rate against the run's mean lag/kl, every point

    python benchmarks/scaling.py            # 3 sizes x (2 arms x 3 lrs at N = 1 + N = 16, 64 + lag-matched) x 3 seeds
    python benchmarks/scaling.py --quick    # two sizes, the gold arm, N in {1, 2}, one seed, short runs: for CI
"""
import math
import os
import shutil
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Optional

import tyro

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]
from off_policy import finished, sweep_folder, train  # noqa: E402
from stats import binomial_stderr, fmt, fmt_share, gain_kept, gap, holm_line, mean_and_stderr, unpaired_gap  # noqa: E402

import tiny_world  # noqa: E402


@dataclass
class Args:
    n_values: list[int] = field(default_factory=lambda: [1, 16, 64])
    """N: mini-batches generated with one set of weights (--num_mini_batches); the first must be 1 (the tuning's)"""
    lr_grid: list[float] = field(default_factory=lambda: [3e-5, 1e-4, 3e-4])
    """learning rates tried at N = 1 for every size and reward arm (the tiny default, 1e-4, in the middle)"""
    rewards: list[str] = field(default_factory=lambda: ["gold", "proxy"])
    """reward arms: `gold` (the world's gold reward model as the reward) and `proxy` (--proxy_size's proxy)"""
    proxy_size: str = "small"
    """the proxy arm's reward model: the paper fixes the smallest"""
    lag_matched: bool = True
    """also the lag-matched arm (proxy): learning rates set so that lag/kl at N = 16 is equal across sizes"""
    reward_model_panel: bool = True
    """also the middle policy with each proxy size (the paper's right panel)"""
    seeds: list[int] = field(default_factory=lambda: [1, 2, 3])
    """seeds per point"""
    batch_size: int = 16
    """prompts per optimizer step (benchmarks/off_policy.py's)"""
    total_episodes: int = 2048
    """training prompts per run (benchmarks/off_policy.py's)"""
    tiny_dir: str = tiny_world.SHIPPED["tldr"]
    """the tiny world the sizes are built beside (the shipped one)"""
    sized_dir: Optional[str] = None
    """the policies and proxies of several sizes, built there if missing (default: ~/.cache/async-rlhf/
    tldr-v3-sized-v2, and with --quick tldr-v3-sized-v2-quick: two sizes, quickly trained)"""
    plot_dir: str = HERE
    """where the two plots go"""
    runs_dir: Optional[str] = None
    """where each run's folder goes, kept so that a figure can be recomputed and a sweep resumed (a run already
    finished there is read back, not run again); default: benchmarks/runs/scaling (--quick: a temporary folder,
    deleted after)"""
    quick: bool = False
    """two sizes (a quick build), the gold arm only, N in {1, 2} (or --n_values), one learning rate, one seed, 64
    episodes, a final evaluation on 64 prompts"""
    sizes: list[str] = field(default_factory=list)
    """the policy sizes the sweep trains, of the built ones (default: every one; the proxies are every size's)"""
    reprint: bool = False
    """print the tables of a sweep whose runs are all in --runs_dir (docs/runs/scaling.tar.xz unpacked), without the
    sized build: the sizes' table, which is the build's, is left out, and a run missing there is an error"""


def lag_matched_lr(lr: float, lag: float, target_lag: float) -> float:
    """The learning rate that moves a policy whose mean lag/kl is `lag` at `lr` to `target_lag`: for small steps
    the KL between two nearby policies grows as the square of the step, so the step scales as sqrt(target / lag)."""
    if lag <= 0 or target_lag <= 0:
        raise ValueError(f"a lag must be positive to match it (got {lag} and {target_lag})")
    return lr * math.sqrt(target_lag / lag)


def report_size_statistic(results: dict, smallest: str, largest: str) -> None:
    """The statistic fixed before the runs: per seed, d = gold win rate at the largest N - at the smallest N (paired by
    seed), for every policy, reward and arm; each point's gain kept over its own SFT policy (scored on the same
    prompts, with an interval that counts that baseline's error); and d_largest - d_smallest (Welch) in each arm. The
    same d on the gold score (continuous: it also sees how far a summary is from winning), beside it, not instead."""
    n_values = sorted({n for _, _, n, _ in results})
    if len(n_values) < 2:
        return
    first, last = n_values[0], n_values[-1]
    metrics = {"win rate": "eval/gold_win_rate", "gold score": "eval/gold_reward"}
    finals = {(metric, *key): [r["final"][name] for r in rows] for key, rows in results.items()
              for metric, name in metrics.items()}
    print(f"\nd = gold win rate (and gold score) at N = {last} - at N = {first}, paired by seed; gain kept at N = "
          f"{last} over the policy's own SFT (step 0, the same prompts), 95% interval\n\n| policy | reward | arm | "
          "SFT gold score | d, win rate | gain kept | d, gold score |\n|---|---|---|---|---|---|---|")
    d, judgements = {}, []
    for policy, reward, n, arm in results:
        if n != last or (policy, reward, first, arm) not in results:
            continue
        gaps = {}
        for metric in metrics:
            at_last, at_first = finals[metric, policy, reward, last, arm], finals[metric, policy, reward, first, arm]
            d[metric, policy, reward, arm] = [a - b for a, b in zip(at_last, at_first)]
            gaps[metric] = gap(at_last, at_first)
            judgements.append((f"d {metric}, {policy}, {reward}, {arm}", gaps[metric]))
        sft = [r["sft"] for r in results[policy, reward, first, arm]]
        baseline = statistics.mean(e["eval/gold_win_rate"] for e in sft)
        kept = gain_kept(finals["win rate", policy, reward, last, arm], finals["win rate", policy, reward, first, arm],
                         baseline, binomial_stderr(baseline, sft[0]["eval/num_prompts"]))
        print(f"| {policy} | {reward} | {arm} | {fmt([e['eval/gold_reward'] for e in sft])} | "
              f"{gaps['win rate']['text']} | {fmt_share(kept)} | {gaps['gold score']['text']} |")
    for reward, arm in dict.fromkeys((reward, arm) for _, _, reward, arm in d):
        for metric in metrics:
            if (metric, largest, reward, arm) in d and (metric, smallest, reward, arm) in d:
                between = unpaired_gap(d[metric, largest, reward, arm], d[metric, smallest, reward, arm])
                judgements.append((f"d_{largest} - d_{smallest}, {metric}, {reward}, {arm}", between))
                print(f"\nd_{largest} - d_{smallest} on the {metric} ({reward}, {arm}; the hypothesis predicts > 0): "
                      f"{between['text']}")
    print(f"\n{holm_line(judgements)}")


def report_kl(results: dict) -> None:
    """The KL to the SFT policy at each run's last step (`objective/kl`, the sampled estimate the scripts log; the
    axis the paper's Figure 5 plots), by policy, reward and arm across N."""
    n_values = sorted({n for _, _, n, _ in results})
    print("\nKL(pi || pi_SFT) at the last step (`objective/kl`, mean ± s.e. over seeds):\n\n| policy | reward | arm | "
          + " | ".join(f"N = {n}" for n in n_values) + " |\n|---|---|---|" + "---|" * len(n_values))
    for policy, reward, arm in dict.fromkeys((p, r, a) for p, r, _, a in results):
        kls = [[row["kl"] for row in results.get((policy, reward, n, arm), [])] for n in n_values]
        cells = [fmt(values, 2) if values and None not in values else "" for values in kls]
        print(f"| {policy} | {reward} | {arm} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    args = tyro.cli(Args)
    os.makedirs(args.plot_dir, exist_ok=True)  # before the sweep, so a path that cannot be made fails at once
    extra = []
    if args.quick:  # (--n_values as asked, or by default 1 and 2)
        args.n_values = [1, 2] if args.n_values == Args().n_values else args.n_values
        args.seeds, args.total_episodes, args.lr_grid = args.seeds[:1], 64, [1e-4]
        args.rewards, args.lag_matched, args.reward_model_panel = ["gold"], False, False
        extra = ["--num_final_eval_prompts", "64"]
    if args.n_values[0] != 1:
        sys.exit(f"--n_values must start at 1 (the tuning's N and the statistic's baseline), got {args.n_values}")
    for reward in args.rewards:
        if reward not in ("gold", "proxy"):
            sys.exit(f"--rewards {reward}: unknown; gold or proxy")
    args.sized_dir = args.sized_dir or f"~/.cache/async-rlhf/tldr-v3-sized-v2{'-quick' if args.quick else ''}"
    sweep_start = time.time()
    if args.reprint:  # (the runs name their models by size alone: no build is read)
        sizes = list(tiny_world.SIZES)[: 2 if args.quick else None]
        sized = {kind: {size: f"(the sized build's {kind}-{size})" for size in sizes} for kind in ("policy", "proxy")}
    else:
        sized = tiny_world.build_sized(args.sized_dir, args.tiny_dir, quick=args.quick)
    sizes = list(sized["policy"])  # smallest first
    policies = [size for size in sizes if size in (args.sizes or sizes)]  # (the sizes the sweep trains)
    if len(policies) != len(args.sizes or sizes):
        sys.exit(f"--sizes {' '.join(args.sizes)}: the built sizes are {sizes}")
    smallest, middle, largest = policies[0], policies[len(policies) // 2], policies[-1]
    if args.proxy_size not in sizes:
        sys.exit(f"--proxy_size {args.proxy_size}: not one of the built sizes {sizes}")
    runs_dir, keep_runs = sweep_folder(args.runs_dir, "scaling", args.quick)
    num_steps = args.total_episodes // args.batch_size
    reward_names = {"gold": "gold", "proxy": f"proxy-{args.proxy_size}"}

    def run(policy: str, reward: str, n: int, seed: int, lr: float) -> dict:
        """reward: `gold` or `proxy-SIZE`."""
        path = (os.path.join(os.path.expanduser(args.tiny_dir), "gold") if reward == "gold" else
                sized["proxy"][reward.removeprefix("proxy-")])
        name = f"policy-{policy}_{reward}_lr{lr:.3g}_n{n}_seed{seed}"
        if args.reprint and not finished(os.path.join(runs_dir, name, "metrics.jsonl"), num_steps):
            sys.exit(f"--reprint: {name} is not a finished run in {runs_dir}")
        return train("async_dpo.py", [
            "--tiny_dir", args.tiny_dir, "--sft_model_path", sized["policy"][policy], "--reward_model_path", path,
            "--seed", str(seed), "--num_mini_batches", str(n), "--total_episodes", str(args.total_episodes),
            "--batch_size", str(args.batch_size), "--eval_every", "0", "--learning_rate", str(lr), *extra],
            os.path.join(runs_dir, name), num_steps, f"{name} ({time.time() - sweep_start:.0f} s so far)")

    def final_win(rows: list) -> float:
        return statistics.mean(r["final"]["eval/gold_win_rate"] for r in rows)

    results, tuned, grid = {}, {}, {}  # results[(policy, reward, N, arm)]: the seeds' runs; tuned[(policy, reward)]
    try:
        for arm_reward in args.rewards:  # 1. tuning at N = 1, then 2. every N at the tuned learning rate
            reward = reward_names[arm_reward]
            for policy in policies:
                grid[policy, reward] = {lr: [run(policy, reward, 1, s, lr) for s in args.seeds] for lr in args.lr_grid}
                tuned[policy, reward] = max(args.lr_grid, key=lambda lr: final_win(grid[policy, reward][lr]))
                lr = tuned[policy, reward]
                results[policy, reward, 1, "tuned"] = grid[policy, reward][lr]
                for n in args.n_values[1:]:
                    results[policy, reward, n, "tuned"] = [run(policy, reward, n, s, lr) for s in args.seeds]
        matched = {}
        if args.lag_matched and "proxy" in args.rewards and 16 in args.n_values:  # 3. lag-matched
            reward = reward_names["proxy"]
            lag = {p: statistics.mean(r["lag"] for r in results[p, reward, 16, "tuned"]) for p in policies}
            for policy in policies:
                matched[policy] = lag_matched_lr(tuned[policy, reward], lag[policy], lag[middle])
                for n in args.n_values:
                    results[policy, reward, n, "lag-matched"] = [run(policy, reward, n, s, matched[policy])
                                                                 for s in args.seeds]
        if args.reward_model_panel and "proxy" in args.rewards:  # 4. the middle policy with every proxy
            for proxy in sizes:
                reward = f"proxy-{proxy}"
                for n in args.n_values:
                    results.setdefault((middle, reward, n, "tuned"), [
                        run(middle, reward, n, s, tuned[middle, reward_names["proxy"]]) for s in args.seeds])
    finally:
        if not keep_runs:
            shutil.rmtree(runs_dir, ignore_errors=True)

    # The sizes (parameters, SFT gold win rate, the proxies' agreement on each size's samples), the tuning, the points
    if args.reprint:
        print("\n(--reprint: the sizes' table is the sized build's, not the runs': left out)")
    else:
        report = sized["sizes"]
        print("\n| size | parameters | SFT gold win rate (build) | proxy's agreement with gold: on every size's "
              "samples | " + " | ".join(f"on {s}'s" for s in sizes) + " |\n|---|---|---|---|" + "---|" * len(sizes))
        for size in sizes:
            r = report[size]
            print(f"| {size} ({r['hidden_size']} wide, {r['layers']} layers) | {r['parameters'] / 1e6:.2f}M | "
                  f"{r['sft_gold_win_rate']:.3f} | {r['proxy_gold_agreement']:.3f} | "
                  + " | ".join(f"{r['proxy_gold_agreement_on'][s]:.3f}" for s in sizes) + " |")
    print(f"\nTuning at N = 1 (final gold win rate, mean ± s.e. over {len(args.seeds)} seed(s); the best is kept):\n\n"
          "| policy | reward | " + " | ".join(f"lr {lr:g}" for lr in args.lr_grid) + " | tuned |\n|---|---|"
          + "---|" * (len(args.lr_grid) + 1))
    for (policy, reward), by_lr in grid.items():
        print(f"| {policy} | {reward} | " + " | ".join(fmt([r["final"]["eval/gold_win_rate"] for r in rows])
                                                       for rows in by_lr.values()) + f" | {tuned[policy, reward]:g} |")
    if matched:
        print("\nlag-matched learning rates (lag/kl at N = 16 set to the middle size's): "
              + ", ".join(f"{p} {lr:.3g}" for p, lr in matched.items()))
    print(f"\n{len(args.seeds)} seed(s) per row, mean ± standard error over seeds\n\n| policy | reward | arm | N | "
          "SFT gold win rate | gold win rate | reward's win rate | ends (EOS) | perplexity | lag/kl | lag/update | "
          "time |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|")
    for (policy, reward, n, arm), rows in results.items():
        print(f"| {policy} | {reward} | {arm} | {n} | {fmt([r['sft']['eval/gold_win_rate'] for r in rows])} | "
              f"{fmt([r['final']['eval/gold_win_rate'] for r in rows])} | "
              f"{fmt([r['final']['eval/proxy_win_rate'] for r in rows])} | "
              f"{fmt([r['final']['eval/eos_fraction'] for r in rows], 2)} | "
              f"{fmt([r['final']['eval/perplexity'] for r in rows], 2)} | {fmt([r['lag'] for r in rows], 4)} | "
              f"{fmt([r['update'] for r in rows], 5)} | {statistics.mean(r['seconds'] for r in rows):.0f} s |")
    report_size_statistic(results, smallest, largest)
    report_kl(results)
    print(f"\nwhole sweep: {(time.time() - sweep_start) / 60:.1f} min")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    markers = dict(zip(sizes, "os^"))
    arms = list(dict.fromkeys((reward, arm) for _, reward, _, arm in results))
    fig, axes = plt.subplots(1, len(arms), figsize=(4.5 * len(arms), 4), sharey=True, squeeze=False)
    for ax, (reward, arm) in zip(axes[0], arms):
        for i, policy in enumerate(sizes):
            at = [n for n in args.n_values if (policy, reward, n, arm) in results]
            if at:
                means = [mean_and_stderr([r["final"]["eval/gold_win_rate"] for r in results[policy, reward, n, arm]])
                         for n in at]
                ax.errorbar(at, [m for m, _ in means], yerr=[e for _, e in means], marker=markers[policy],
                            color=f"C{i}", capsize=3, label=policy)
        ax.set_xscale("log", base=2)
        ax.set(xlabel="N", title=f"{reward}, {arm}")
        ax.title.set_fontsize(9)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("final gold win rate")
    fig.suptitle(f"Online DPO on the tiny world, sizes against N ({len(args.seeds)} seeds, mean ± s.e.)")
    fig.tight_layout()
    fig.savefig(os.path.join(args.plot_dir, "scaling_by_n.png"), dpi=90)

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for (policy, reward, n, arm), rows in results.items():
        (x, x_err), (y, y_err) = (mean_and_stderr(v) for v in ([r["lag"] for r in rows],
                                                                 [r["final"]["eval/gold_win_rate"] for r in rows]))
        ax.errorbar(x, y, xerr=x_err, yerr=y_err, linestyle="none", ecolor="gray", markersize=7,
                    marker=markers[policy], color=f"C{sizes.index(policy)}",
                    fillstyle="none" if reward == "gold" else ("left" if arm == "lag-matched" else "full"))
    ax.set_xscale("log")
    ax.set(xlabel="mean lag/kl over the run's steps", ylabel="final gold win rate",
           title="policy size (marker); hollow: gold reward; half: lag-matched; full: proxy, tuned")
    ax.title.set_fontsize(8)
    fig.tight_layout()
    fig.savefig(os.path.join(args.plot_dir, "scaling_by_lag.png"), dpi=90)
    print(f"plots saved to {args.plot_dir}/scaling_by_n.png and scaling_by_lag.png")
