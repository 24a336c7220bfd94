"""The statistics every benchmark prints, in one place, so that no derived figure is worked by hand.

Seeds are few (three by default), so a mean's uncertainty is its standard error over seeds and a gap is judged
against the two-sided 95% threshold of the t-distribution with seeds - 1 degrees of freedom (4.30 for three seeds),
not against "2 standard errors". A share of two gains (a gain kept, a loss recovered) is a ratio of noisy figures
from the same seeds: its interval is Fieller's, over the seeds' paired numerators and denominators (the baseline's
binomial error included), at the same t threshold; unbounded when the denominator itself is not told from 0. A table
of many comparisons adds one line: which survive Holm's correction within the table (`holm_line`).
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
        return dict(mean=mean, se=0.0, t=None, df=df, threshold=None, passes=False,
                    text=f"{mean:+.{digits}f} (one seed)")
    threshold = t_95(df)
    if se <= 1e-9 * max(abs(mean), 1e-3):  # (no spread, to float precision: an infinite t would read as a finding)
        return dict(mean=mean, se=0.0, t=None, df=df, threshold=threshold, passes=False,
                    text=f"{mean:+.{digits}f} (the seeds did not vary: not judged)")
    t = mean / se
    passes = abs(t) > threshold
    text = (f"{mean:+.{digits}f} ± {se:.{digits}f} (t = {t:.1f}, threshold {threshold:.2f}: "
            f"{'passes' if passes else 'inconclusive'}"
            + (f"; 95% interval {mean - threshold * se:+.{digits}f} to {mean + threshold * se:+.{digits}f}"
               if interval else "") + ")")
    return dict(mean=mean, se=se, t=t, df=df, threshold=threshold, passes=passes, text=text)


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


def fieller(numerators: list[float], denominators: list[float], common_se: float = 0.0) -> Optional[tuple]:
    """mean(numerators) / mean(denominators), each seed's numerator and denominator a pair, with Fieller's 95%
    interval: every ratio r at which mean(num - r den) is within the t threshold of 0, the variance of num - r den
    taken over the seeds (so terms a seed shares are paired, not treated as independent), plus (1 - r)^2 common_se^2
    for a baseline both subtract (its own binomial error). (value, low, high): low/high infinite when the
    denominator is not told from 0 at 95%; None when its mean is not positive (no gain to take a share of); the
    value alone (low = high) for one seed."""
    n = len(numerators)
    mean_num, mean_den = statistics.mean(numerators), statistics.mean(denominators)
    if mean_den <= 0:
        return None
    value = mean_num / mean_den
    if n < 2:
        return value, value, value
    t2 = t_95(n - 1) ** 2

    def covariance(x: list[float], y: list[float]) -> float:  # (of the means: over seeds, / n)
        mx, my = statistics.mean(x), statistics.mean(y)
        return sum((a - mx) * (b - my) for a, b in zip(x, y)) / (n - 1) / n

    c2 = common_se ** 2  # (r^2 a - 2 r b + c <= 0: the ratios inside)
    a = mean_den ** 2 - t2 * (covariance(denominators, denominators) + c2)
    b = mean_num * mean_den - t2 * (covariance(numerators, denominators) + c2)
    c = mean_num ** 2 - t2 * (covariance(numerators, numerators) + c2)
    if a <= 0:
        return value, -math.inf, math.inf
    root = math.sqrt(max(b * b - a * c, 0.0))  # (the ratio itself is inside, so only rounding makes it negative)
    return value, (b - root) / a, (b + root) / a


def gain_kept(values: list[float], reference: list[float], baseline: float, baseline_se: float) -> Optional[tuple]:
    """The share of the reference's gain over the baseline that `values` keep: (mean(values) - b) /
    (mean(reference) - b), with b the baseline (the SFT policy, scored on the same prompts as the final
    evaluations) and its binomial standard error; seeds paired (Fieller's interval, `fieller`)."""
    if len(values) != len(reference):
        raise ValueError(f"a share is paired by seed: got {len(values)} and {len(reference)} seeds")
    return fieller([x - baseline for x in values], [r - baseline for r in reference], baseline_se)


def recovered(corrected: list[float], uncorrected: list[float], reference: list[float]) -> Optional[tuple]:
    """The share of the loss from the reference (N = 1) to the uncorrected run that the correction wins back:
    (mean(corrected) - mean(uncorrected)) / (mean(reference) - mean(uncorrected)), seeds paired (`fieller`)."""
    if not len(corrected) == len(uncorrected) == len(reference):
        raise ValueError("a share is paired by seed: every side needs the same seeds")
    return fieller([c - u for c, u in zip(corrected, uncorrected)], [r - u for r, u in zip(reference, uncorrected)])


def fmt_share(share: Optional[tuple], none: str = "no gain") -> str:
    """A share and its interval in percent, or `none` when there is nothing to take a share of."""
    if share is None:
        return none
    value, low, high = share
    if math.isinf(high - low):
        return f"{value:.0%} (unbounded: what it divides by is not told from 0)"
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


def holm_line(comparisons: list[tuple[str, dict]]) -> str:
    """One line for a table of (label, `judged` result) rows: which survive Holm's correction at 5% family-wise
    within the table (comparisons not judged, one seed or no spread, count with p = 1)."""
    if all(r["t"] is None for _, r in comparisons):
        return "Holm within this table: no comparisons judged"
    survive = holm([p_value(r["t"], r["df"]) for _, r in comparisons])
    kept = [label for (label, _), ok in zip(comparisons, survive) if ok]
    return (f"Holm within this table ({len(comparisons)} comparisons, 5% family-wise): "
            + (f"{len(kept)} survive{'s' if len(kept) == 1 else ''}: {'; '.join(kept)}" if kept else "none survives"))
