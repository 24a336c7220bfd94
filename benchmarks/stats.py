"""The statistics every benchmark prints, in one place, so that no derived figure is worked by hand.

Seeds are few (three by default), so a mean's uncertainty is its standard error over seeds and a gap is judged
against the two-sided 95% threshold of the t-distribution with seeds - 1 degrees of freedom (4.30 for three seeds),
not against "2 standard errors". A share of two gains (a gain kept, a loss recovered) is a ratio of noisy figures:
its interval comes from the delta method over every term that carries noise, the baseline's binomial error
included, scaled by the same t threshold.
"""
import math
import statistics
from typing import Optional

T_95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
        12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042}  # two-sided 95% thresholds of the t-distribution, by df


def t_95(df: int) -> float:
    """The two-sided 95% threshold at `df` degrees of freedom (the next smaller tabled df: conservative)."""
    if df < 1:
        raise ValueError("a t threshold needs at least one degree of freedom (two seeds)")
    return 1.96 if df > 30 else T_95[max(d for d in T_95 if d <= df)]


def mean_and_stderr(values: list[float]) -> tuple[float, float]:
    """Mean, and its standard error over seeds (0 for one seed)."""
    return statistics.mean(values), statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0


def fmt(values: list[float], digits: int = 3) -> str:
    """mean ± standard error over seeds (the mean alone for one seed)."""
    mean, stderr = mean_and_stderr(values)
    return f"{mean:.{digits}f}" if len(values) == 1 else f"{mean:.{digits}f} ± {stderr:.{digits}f}"


def binomial_stderr(rate: float, n: int) -> float:
    """The standard error of one rate measured on n prompts (one evaluation's own noise)."""
    return math.sqrt(max(rate * (1 - rate), 0.0) / n)


def judged(mean: float, se: float, df: int, digits: int = 3, interval: bool = False) -> dict:
    """A gap's mean and standard error judged against the t threshold at `df` degrees of freedom: its t, the
    threshold, whether it passes, and the line the tables print (with its 95% interval if asked)."""
    if df < 1:
        return dict(mean=mean, se=0.0, t=None, threshold=None, passes=False, text=f"{mean:+.{digits}f} (one seed)")
    t = mean / se if se > 0 else math.copysign(math.inf, mean) if mean else 0.0
    threshold = t_95(df)
    passes = abs(t) > threshold
    text = (f"{mean:+.{digits}f} ± {se:.{digits}f} (t = {t:.1f}, threshold {threshold:.2f}: "
            f"{'passes' if passes else 'inconclusive'}"
            + (f"; 95% interval {mean - threshold * se:+.{digits}f} to {mean + threshold * se:+.{digits}f}"
               if interval else "") + ")")
    return dict(mean=mean, se=se, t=t, threshold=threshold, passes=passes, text=text)


def gap(values: list[float], baseline: list[float], digits: int = 3, interval: bool = False) -> dict:
    """The per-seed difference values - baseline (paired by seed), judged (see `judged`; `interval`: its 95%
    interval printed too)."""
    if len(values) != len(baseline):
        raise ValueError(f"a paired gap needs as many seeds on each side, got {len(values)} and {len(baseline)}")
    mean, se = mean_and_stderr([a - b for a, b in zip(values, baseline)])
    return judged(mean, se, len(values) - 1, digits, interval)


def unpaired_gap(values: list[float], baseline: list[float], digits: int = 3) -> dict:
    """mean(values) - mean(baseline) for two independent sets of seeds (Welch's standard error), judged against the t
    threshold at the smaller side's degrees of freedom (conservative, fixed in advance rather than estimated)."""
    (a, a_se), (b, b_se) = mean_and_stderr(values), mean_and_stderr(baseline)
    return judged(a - b, math.hypot(a_se, b_se), min(len(values), len(baseline)) - 1, digits, interval=True)


def ratio_interval(numerator: float, denominator: float, gradients_and_errors: list[tuple[float, float]],
                   df: int) -> Optional[tuple[float, float, float]]:
    """numerator / denominator with a t-scaled delta-method interval: `gradients_and_errors` holds, for every
    independent noisy term, the ratio's derivative by it and its standard error. None when the denominator is
    not positive (no gain to take a share of)."""
    if denominator <= 0:
        return None
    value = numerator / denominator
    half = (t_95(df) if df >= 1 else 0.0) * math.sqrt(sum((g * e) ** 2 for g, e in gradients_and_errors))
    return value, value - half, value + half


def gain_kept(values: list[float], reference: list[float], baseline: float, baseline_se: float) -> Optional[tuple]:
    """The share of the reference's gain over the baseline that `values` keep: (mean(values) - b) /
    (mean(reference) - b), with b the baseline (the SFT policy, scored on the same prompts as the final
    evaluations) and its binomial standard error; the interval carries both seed means' errors and b's."""
    (x, x_se), (r, r_se) = mean_and_stderr(values), mean_and_stderr(reference)
    kept, gain = x - baseline, r - baseline
    if gain <= 0:
        return None
    # d/dx = 1/gain, d/dr = -kept/gain^2, d/db = (kept - gain)/gain^2
    return ratio_interval(kept, gain, [(1 / gain, x_se), (-kept / gain ** 2, r_se),
                                       ((kept - gain) / gain ** 2, baseline_se)], len(values) - 1)


def recovered(corrected: list[float], uncorrected: list[float], reference: list[float]) -> Optional[tuple]:
    """The share of the loss from the reference (N = 1) to the uncorrected run that the correction wins back:
    (mean(corrected) - mean(uncorrected)) / (mean(reference) - mean(uncorrected)), with its interval."""
    (c, c_se), (u, u_se), (r, r_se) = (mean_and_stderr(v) for v in (corrected, uncorrected, reference))
    won, loss = c - u, r - u
    if loss <= 0:
        return None
    # d/dc = 1/loss, d/du = (won - loss)/loss^2, d/dr = -won/loss^2
    return ratio_interval(won, loss, [(1 / loss, c_se), ((won - loss) / loss ** 2, u_se), (-won / loss ** 2, r_se)],
                          len(corrected) - 1)


def fmt_share(share: Optional[tuple], none: str = "no gain") -> str:
    """A share and its interval in percent, or `none` when there is nothing to take a share of."""
    if share is None:
        return none
    value, low, high = share
    return f"{value:.0%} ({low:.0%} to {high:.0%})" if high > low else f"{value:.0%}"


def p_value(t: Optional[float], df: int) -> float:
    """The two-sided p of a t-statistic at `df` degrees of freedom: 2 P(T > |t|), the t density integrated by
    Simpson's rule (no statistics package needed; 1 for no t, 0 for an infinite one: seeds that did not vary)."""
    if t is None:
        return 1.0
    if math.isinf(t):
        return 0.0
    t, steps = abs(t), 20000
    scale = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)
    h = t / steps
    density = [scale * (1 + (i * h) ** 2 / df) ** (-(df + 1) / 2) for i in range(steps + 1)]
    area = h / 3 * (density[0] + density[-1] + 4 * sum(density[1:-1:2]) + 2 * sum(density[2:-1:2]))
    return max(0.0, 1 - 2 * area)


def holm(p_values: list[float], level: float = 0.05) -> list[bool]:
    """Holm's step-down procedure: which comparisons of a family survive at `level` family-wise (the smallest p
    against level / m, the next against level / (m - 1), ..., stopping at the first that fails)."""
    order = sorted(range(len(p_values)), key=p_values.__getitem__)
    survives = [False] * len(p_values)
    for rank, i in enumerate(order):
        if p_values[i] > level / (len(p_values) - rank):
            break
        survives[i] = True
    return survives
