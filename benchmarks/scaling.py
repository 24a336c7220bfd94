"""Does a larger policy tolerate stale data better? The paper's Figure 5 on the tiny world, and its hypothesis tested.

The paper runs Online DPO at N in {1, ..., 64} with policies and reward models of several sizes: with the reward model
fixed at the smallest, larger policies' off-policy points cluster near the on-policy optimum; with the policy fixed at
the smallest, larger reward models lower the KL but do not tighten the cluster. It suggests, without testing it, that
a larger policy moves less per step, so the same N is less off-policy. Here `tiny_world.build_sized` gives policies
and proxy reward models of three sizes (0.18M, 0.55M and 3.47M parameters) beside the tiny world, and this sweep runs
async_dpo.py (the off-policy sweep's settings: 16 prompts a step, 2,048 episodes, the tiny defaults, nothing tuned per
size) at each N for each policy size with the smallest proxy and for each proxy size with the smallest policy, three
seeds each. Every step logs how far the policy has moved since the weights that sampled its batch (`lag/kl`) and the
relative size of the step (`lag/update`); the table gives their means beside the final gold win rate. The control
for the hypothesis: the smallest policy with its learning rate scaled so that its mean `lag/update` at the smallest N
matches the largest policy's, at every N.

  scaling_frontier.png   final gold win rate against perplexity, one panel per sweep, colour = N
  scaling_by_lag.png     final gold win rate against the run's mean lag/kl, every size, sweep and the control

    python benchmarks/scaling.py            # 3 policy sizes + 2 more proxies + the control, x 4 N x 3 seeds
    python benchmarks/scaling.py --quick    # two sizes, N = 2, one seed, short runs: checks that it works, for CI
"""
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Optional

import tyro

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]
from off_policy import train  # noqa: E402
from stats import binomial_stderr, fmt, fmt_share, gain_kept, gap, mean_and_stderr, unpaired_gap  # noqa: E402

import tiny_world  # noqa: E402
from async_dpo import TINY_DEFAULTS  # noqa: E402


@dataclass
class Args:
    n_values: list[int] = field(default_factory=lambda: [1, 4, 16, 64])
    """N: mini-batches generated with one set of weights (--num_mini_batches)"""
    seeds: list[int] = field(default_factory=lambda: [1, 2, 3])
    """seeds per point"""
    batch_size: int = 16
    """prompts per optimizer step (benchmarks/off_policy.py's)"""
    total_episodes: int = 2048
    """training prompts per run (benchmarks/off_policy.py's)"""
    lr_control: bool = True
    """also run the smallest policy with its learning rate scaled to the largest policy's step size"""
    tiny_dir: str = tiny_world.SHIPPED["tldr"]
    """the tiny world the sizes are built beside (the shipped one)"""
    sized_dir: Optional[str] = None
    """the policies and proxies of several sizes, built there if missing (default: ~/.cache/async-rlhf/
    tldr-v3-sized, and with --quick tldr-v3-sized-quick: two sizes, quickly trained)"""
    plot_dir: str = HERE
    """where the two plots go"""
    runs_dir: Optional[str] = None
    """where each run's folder goes, kept so that a figure can be recomputed and a sweep resumed (a run already
    finished there is read back, not run again); default: benchmarks/runs/scaling (--quick: a temporary folder,
    deleted after)"""
    quick: bool = False
    """two sizes (a quick build), N = 2, one seed, 64 episodes, a final evaluation on 64 prompts"""


def report_size_statistic(results: dict, smallest: str, largest: str) -> None:
    """The statistic fixed before the runs: per seed, d = gold win rate at the largest N - at the smallest N (paired by
    seed), for every policy, proxy and learning rate; each point's gain kept over its own SFT policy (scored on the
    same prompts, with an interval that counts that baseline's error); and d_largest - d_smallest (Welch)."""
    n_values = sorted({n for _, _, n, _ in results})
    if len(n_values) < 2:
        return
    first, last = n_values[0], n_values[-1]
    finals = {key: [r["final"]["eval/gold_win_rate"] for r in rows] for key, rows in results.items()}
    print(f"\nd = gold win rate at N = {last} - at N = {first}, paired by seed; gain kept at N = {last} over the "
          "policy's own SFT (step 0, the same prompts), 95% interval\n\n| policy | proxy | lr | d | gain kept |\n"
          "|---|---|---|---|---|")
    d = {}
    for policy, proxy, n, kind in results:
        if n != last or (policy, proxy, first, kind) not in results:
            continue
        at_last, at_first = finals[policy, proxy, last, kind], finals[policy, proxy, first, kind]
        d[policy, proxy, kind] = [a - b for a, b in zip(at_last, at_first)]
        sft = [r["sft"] for r in results[policy, proxy, first, kind]]
        baseline = statistics.mean(e["eval/gold_win_rate"] for e in sft)
        kept = gain_kept(at_last, at_first, baseline, binomial_stderr(baseline, sft[0]["eval/num_prompts"]))
        print(f"| {policy} | {proxy} | {kind} | {gap(at_last, at_first)['text']} | {fmt_share(kept)} |")
    if (largest, smallest, "default") in d and (smallest, smallest, "default") in d:
        print(f"\nd_{largest} - d_{smallest} (proxy {smallest}, default lr; the hypothesis predicts > 0): "
              f"{unpaired_gap(d[largest, smallest, 'default'], d[smallest, smallest, 'default'])['text']}")


if __name__ == "__main__":
    args = tyro.cli(Args)
    extra = []
    if args.quick:
        args.n_values, args.seeds, args.total_episodes = [2], args.seeds[:1], 64
        extra = ["--num_final_eval_prompts", "64"]
    args.sized_dir = args.sized_dir or f"~/.cache/async-rlhf/tldr-v3-sized{'-quick' if args.quick else ''}"
    sweep_start = time.time()
    sized = tiny_world.build_sized(args.sized_dir, args.tiny_dir, quick=args.quick)
    sizes = list(sized["policy"])  # smallest first
    smallest, largest = sizes[0], sizes[-1]
    # (policy size, proxy size): every policy with the smallest proxy, every proxy with the smallest policy
    pairs = [(p, smallest) for p in sizes] + [(smallest, r) for r in sizes[1:]]
    keep_runs = args.runs_dir is not None or not args.quick
    runs_dir = args.runs_dir or (os.path.join(HERE, "runs", "scaling") if keep_runs else
                                 tempfile.mkdtemp(prefix="scaling_"))
    num_steps = args.total_episodes // args.batch_size
    default_lr = TINY_DEFAULTS["learning_rate"]  # async_dpo.py's tiny default, the same for every size

    def run(policy: str, proxy: str, n: int, seed: int, lr: float = default_lr) -> dict:
        name = f"policy-{policy}_proxy-{proxy}{'' if lr == default_lr else f'_lr{lr:.3g}'}_n{n}_seed{seed}"
        return train("async_dpo.py", [
            "--tiny_dir", args.tiny_dir, "--sft_model_path", sized["policy"][policy], "--reward_model_path",
            sized["proxy"][proxy], "--seed", str(seed), "--num_mini_batches", str(n), "--total_episodes",
            str(args.total_episodes), "--batch_size", str(args.batch_size), "--eval_every", "0",
            "--learning_rate", str(lr), *extra], os.path.join(runs_dir, name), num_steps,
            f"{name} ({time.time() - sweep_start:.0f} s so far)")

    try:
        results = {(p, r, n, "default"): [run(p, r, n, seed) for seed in args.seeds]
                   for p, r in pairs for n in args.n_values}
        control_lr = None
        if args.lr_control and largest != smallest:
            # the smallest policy's lr scaled by the ratio of the step sizes the two policies took at the smallest N
            first_n = min(args.n_values)
            step_size = {p: statistics.mean(r["update"] for r in results[p, smallest, first_n, "default"])
                         for p in (smallest, largest)}
            control_lr = default_lr * step_size[largest] / step_size[smallest]
            for n in args.n_values:
                results[smallest, smallest, n, "control"] = [run(smallest, smallest, n, s, control_lr)
                                                             for s in args.seeds]
    finally:
        if not keep_runs:
            shutil.rmtree(runs_dir, ignore_errors=True)

    # The table: the sizes (parameters, SFT gold win rate, proxy agreement), then one row per point
    report = sized["sizes"]
    print("\n| size | parameters | SFT gold win rate (build) | proxy's agreement with gold |\n|---|---|---|---|")
    for size in sizes:
        r = report[size]
        print(f"| {size} ({r['hidden_size']} wide, {r['layers']} layers) | {r['parameters'] / 1e6:.2f}M | "
              f"{r['sft_gold_win_rate']:.3f} | {r['proxy_gold_agreement']:.3f} |")
    print(f"\n{len(args.seeds)} seed(s) per row, mean ± standard error over seeds; "
          + (f"the control's learning rate: {control_lr:.3g} (the default's {default_lr:g} x the ratio of the "
             f"largest to the smallest policy's mean lag/update at N = {min(args.n_values)})" if control_lr else ""))
    print("\n| policy | proxy | lr | N | SFT gold win rate | gold win rate | perplexity | lag/kl | lag/update "
          "| time |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for (policy, proxy, n, kind), rows in results.items():
        print(f"| {policy} | {proxy} | {'x%.2f' % (control_lr / default_lr) if kind == 'control' else 'default'} | "
              f"{n} | {fmt([r['sft']['eval/gold_win_rate'] for r in rows])} | "
              f"{fmt([r['final']['eval/gold_win_rate'] for r in rows])} | "
              f"{fmt([r['final']['eval/perplexity'] for r in rows], 2)} | {fmt([r['lag'] for r in rows], 4)} | "
              f"{fmt([r['update'] for r in rows], 5)} | {statistics.mean(r['seconds'] for r in rows):.0f} s |")
    report_size_statistic(results, smallest, largest)
    print(f"\nwhole sweep: {(time.time() - sweep_start) / 60:.1f} min")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    markers = dict(zip(sizes, "os^"))
    n_color = {n: plt.cm.viridis(i / max(len(args.n_values) - 1, 1)) for i, n in enumerate(sorted(args.n_values))}

    def point(ax, x: list, y: list, **style) -> None:
        (x, x_err), (y, y_err) = mean_and_stderr(x), mean_and_stderr(y)
        ax.errorbar(x, y, xerr=x_err, yerr=y_err, linestyle="none", ecolor="gray", markersize=8, **style)

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, sweep in zip(axes, ("policy", "proxy")):
        for (policy, proxy, n, kind), rows in results.items():
            size = policy if sweep == "policy" else proxy
            if kind == "default" and (proxy == smallest if sweep == "policy" else policy == smallest):
                point(ax, [r["final"]["eval/perplexity"] for r in rows],
                      [r["final"]["eval/gold_win_rate"] for r in rows], marker=markers[size], color=n_color[n])
        ax.set(xlabel="perplexity under the SFT model", title=f"{sweep} sizes (the other: {smallest})")
    axes[0].set_ylabel("final gold win rate")
    handles = [plt.Line2D([], [], marker=m, color="gray", linestyle="none", label=s) for s, m in markers.items()]
    handles += [plt.Line2D([], [], marker="o", color=c, linestyle="none", label=f"N={n}") for n, c in n_color.items()]
    axes[1].legend(handles=handles, fontsize=8)
    fig.suptitle(f"Online DPO on the tiny world, sizes against N ({len(args.seeds)} seeds, mean ± s.e.)")
    fig.tight_layout()
    fig.savefig(os.path.join(args.plot_dir, "scaling_frontier.png"), dpi=90)

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for (policy, proxy, n, kind), rows in results.items():
        point(ax, [r["lag"] for r in rows], [r["final"]["eval/gold_win_rate"] for r in rows],
              marker=markers[policy], color=n_color[n], fillstyle="none" if kind == "control" else
              ("left" if proxy != smallest else "full"))
    ax.set_xscale("log")
    ax.set(xlabel="mean lag/kl over the run's steps", ylabel="final gold win rate",
           title="policy size (marker), N (colour); hollow: the lr control; half: a larger proxy")
    ax.title.set_fontsize(8)
    fig.tight_layout()
    fig.savefig(os.path.join(args.plot_dir, "scaling_by_lag.png"), dpi=90)
    print(f"plots saved to {args.plot_dir}/scaling_frontier.png and scaling_by_lag.png")
