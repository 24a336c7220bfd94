"""The statistics every benchmark prints, in one place, so that no derived figure is worked by hand.

Seeds are few (three by default), so a mean's uncertainty is its standard error over seeds and a gap is judged
against the two-sided 95% threshold of the t-distribution with seeds - 1 degrees of freedom (4.30 for three seeds),
not against "2 standard errors". A share of two gains (a gain kept, a loss recovered) is a ratio of noisy figures
from the same seeds: its interval is Fieller's, over the seeds' paired numerators and denominators (the baseline's
binomial error included), at the same t threshold; unbounded when the denominator itself is not told from 0. A table
of many comparisons adds one line: which survive Holm's correction within the table (`holm_line`), or within the
set a pre-registration named, where there is one. A speed-up is judged on log seconds (`factor`: the ratio's
interval); a claim that one arm loses at most a stated margin, by a one-sided bound (`bound_against_margin`); a
comparison extended to more seeds because it was inconclusive, by a two-stage combination (`two_stage`); seeds that
all agree, by the sign-flip p beside t (`sign_flip_p`). Every ± these functions print is a standard error.
"""
import math
import random
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


def holm_line(comparisons: list[tuple[str, dict]], family: str = "within this table") -> str:
    """One line for a table of (label, `judged` result) rows: which survive Holm's correction at 5% family-wise
    within the table (comparisons not judged, one seed or no spread, count with p = 1). `family` names the family
    where it is not the whole table (a pre-registered set: the family its verdicts were registered in)."""
    if all(r["t"] is None for _, r in comparisons):
        return f"Holm {family}: no comparisons judged"
    survive = holm([p_value(r["t"], r["df"]) for _, r in comparisons])
    kept = [label for (label, _), ok in zip(comparisons, survive) if ok]
    return (f"Holm {family} ({len(comparisons)} comparisons, 5% family-wise): "
            + (f"{len(kept)} survive{'s' if len(kept) == 1 else ''}: {'; '.join(kept)}" if kept else "none survives"))


T_95_ONE_SIDED = {1: 6.314, 2: 2.920, 3: 2.353, 4: 2.132, 5: 2.015, 6: 1.943, 7: 1.895, 8: 1.860, 9: 1.833,
                  10: 1.812, 12: 1.782, 15: 1.753, 20: 1.725, 30: 1.697}  # one-sided 95% thresholds, by df


def t_95_one_sided(df: int) -> float:
    """The one-sided 95% threshold at `df` degrees of freedom (the next smaller tabled df: conservative)."""
    if df < 1:
        raise ValueError("a t threshold needs at least one degree of freedom (two seeds)")
    return 1.645 if df > 30 else T_95_ONE_SIDED[max(d for d in T_95_ONE_SIDED if d <= df)]


def sign_flip_p(differences: list[float]) -> float:
    """The exact two-sided sign-flip permutation p of paired differences' mean: the share of the 2^n ways of flipping
    their signs whose |sum| is at least the observed one. It needs no normal errors, but it cannot go below 2 / 2^n
    (0.25 at three seeds, 0.0625 at five): what seeds that all agree can show, and no more."""
    n, observed = len(differences), abs(sum(differences))
    flips = [abs(sum(d if mask >> i & 1 else -d for i, d in enumerate(differences))) for mask in range(2 ** n)]
    return sum(f >= observed * (1 - 1e-9) for f in flips) / 2 ** n


def bound_against_margin(values: list[float], baseline: list[float], margin: float, digits: int = 3) -> dict:
    """Is the paired difference values - baseline above `margin` (a loss allowed, stated in advance: e.g. -0.02)?
    Its one-sided 95% lower bound, mean - t se at the one-sided threshold for seeds - 1 degrees of freedom, against
    the margin: 'holds' when the bound is above it (a non-inferiority test at 5%), otherwise 'not shown'. A claim
    that two arms learn 'as well' needs this bound and a margin; a difference that is merely not significant is no
    such claim."""
    if len(values) != len(baseline):
        raise ValueError(f"a paired bound needs as many seeds on each side, got {len(values)} and {len(baseline)}")
    mean, se = mean_and_stderr([a - b for a, b in zip(values, baseline)])
    threshold = t_95_one_sided(len(values) - 1)
    low = mean - threshold * se
    holds = low > margin
    return dict(mean=mean, low=low, holds=holds,
                text=f"one-sided 95% lower bound {low:+.{digits}f} (threshold {threshold:.2f}) against the margin "
                     f"{margin:+.{digits}f}: " + ("holds" if holds else "not shown"))


def factor(ratios: list[float], digits: int = 2, unit: str = "seconds") -> dict:
    """A speed-up judged on the log scale, where a ratio of times is a difference: each seed's (or repeat's) ratio,
    the mean and standard error of their logs, the factor exp(mean) (the ratios' geometric mean) with its 95%
    interval exp(mean ± t se) at the two-sided threshold for n - 1 degrees of freedom, the t of the logs and the
    sign-flip p beside it. 'Inconclusive' where the interval includes 1."""
    logs = [math.log(r) for r in ratios]
    mean, se = mean_and_stderr(logs)
    value = math.exp(mean)
    if len(ratios) < 2:
        return dict(value=value, low=value, high=value, t=None, df=0, passes=False,
                    text=f"{value:.{digits}f}x (one seed)")
    threshold = t_95(len(ratios) - 1)
    if se <= 1e-12:
        return dict(value=value, low=value, high=value, t=None, df=len(ratios) - 1, passes=False,
                    text=f"{value:.{digits}f}x (every ratio the same: not judged)")
    low, high, t = math.exp(mean - threshold * se), math.exp(mean + threshold * se), mean / se
    passes = abs(t) > threshold
    return dict(value=value, low=low, high=high, t=t, df=len(ratios) - 1, passes=passes,
                text=f"{value:.{digits}f}x, 95% interval {low:.{digits}f}x to {high:.{digits}f}x (t = {t:.1f} on log "
                     f"{unit}, threshold {threshold:.2f}: {'passes' if passes else 'inconclusive'}; sign-flip p = "
                     f"{sign_flip_p(logs):.2f})")


def one_sided_p(t: float, df: int, predicted: int = 1) -> float:
    """The one-sided p of a t-statistic in the predicted direction (+1: above 0, -1: below)."""
    two_sided = p_value(t, df)
    return two_sided / 2 if t * predicted > 0 else 1 - two_sided / 2


def two_stage(values: list[float], baseline: list[float], first: int, predicted: int = 1) -> dict:
    """A paired comparison run on `first` seeds and, being inconclusive there, extended to the rest: judging all the
    seeds pooled then tests twice at 5% (false positives above 5%). The inverse-normal combination keeps 5%: each
    stage's paired t on its own seeds gives a one-sided p in the predicted direction, z_i its normal quantile, and
    Z = sqrt(n1 / n) z_1 + sqrt(n2 / n) z_2 (the weights fixed by the stages' seeds, not by their results); the
    combined p is reported two-sided (twice the one-sided, capped at 1), to match the two-sided 95% rule."""
    from statistics import NormalDist

    normal = NormalDist()
    d = [a - b for a, b in zip(values, baseline)]
    stages, parts = (d[:first], d[first:]), []
    if min(len(s) for s in stages) < 2:
        raise ValueError("each stage needs at least two seeds")
    z = 0.0
    for stage in stages:
        mean, se = mean_and_stderr(stage)
        t = mean / se if se > 0 else math.copysign(math.inf, mean)
        p = one_sided_p(t, len(stage) - 1, predicted)
        z += math.sqrt(len(stage) / len(d)) * normal.inv_cdf(1 - min(max(p, 1e-12), 1 - 1e-12))
        parts.append(f"t = {t:.1f}, one-sided p = {p:.3f}")
    p = min(1.0, 2 * (1 - normal.cdf(z)))
    return dict(p=p, passes=p < 0.05,
                text=f"seeds 1-{first}: {parts[0]}; seeds {first + 1}-{len(d)}: {parts[1]}; combined p = {p:.3f} "
                     f"(inverse normal, weights sqrt({first}/{len(d)}) and sqrt({len(d) - first}/{len(d)}), "
                     "two-sided): " + ("passes" if p < 0.05 else "inconclusive") + " at 5%")


def t_threshold(df: int, level: float) -> float:
    """The two-sided threshold of the t-distribution at `df` degrees of freedom for `level` (0.05: t_95's tabled
    value; any other level: the |t| whose p_value is `level`, by bisection)."""
    if level == 0.05:
        return t_95(df)
    low, high = 0.0, 1000.0
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if p_value(middle, df) > level else (low, middle)
    return high


def power(mean: float, sd: float, n: int, beyond: float = 0.0, level: float = 0.05, draws: int = 20000) -> float:
    """A design's power: the share of simulated n-seed experiments (paired differences normal with this mean and SD)
    whose two-sided (1 - level) t-interval lies wholly past `beyond` on the mean's side (beyond = 0: the effect
    shown; a margin: shown past it). Seeded, so a registration's figures reprint."""
    rng, threshold, shown, side = random.Random(0), t_threshold(n - 1, level), 0, 1 if mean > beyond else -1
    for _ in range(draws):  # (floats, not mean_and_stderr's exact statistics.stdev: 20x faster, the same shares)
        values = [rng.gauss(mean, sd) for _ in range(n)]
        m = math.fsum(values) / n
        se = math.sqrt(math.fsum((v - m) ** 2 for v in values) / (n - 1) / n)
        shown += side * (m - beyond) - threshold * se > 0
    return shown / draws
