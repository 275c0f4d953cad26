"""The statistics of ``passrate-jax study``, as pure numpy functions of per-seed numbers (tested on
synthetic runs with known answers in tests/test_study.py and tests/test_study_stats.py).

Time to a target is a censored observation: a run that never reaches the target tells us only that it
needs *more than* what it spent (its value at its last evaluation, ``observed = False``). Nothing is
dropped:

- per method, :func:`km_median` is the Kaplan-Meier median over seeds (when fewer than half of the
  seeds' survival mass reaches the target it is "more than" the largest time, not a number);
- against a baseline, every seed gives an interval for its log factor (:func:`log_factor_bounds`): a
  point when both runs reached the target, a one-sided bound when one was censored (a miss counted as
  "more than the run"), unbounded when both were; :func:`paired_interval` returns the interval of the
  mean over seeds, the lower end from the lower bounds and the upper end from the upper bounds.

**Why a t-interval and not a bootstrap.** A study has 5-8 seeds. A percentile bootstrap over 5 seeds
has only 126 distinct resamples and its interval is too narrow: on synthetic seeds with a known mean it
covers that mean about 85% of the time at a nominal 95% (tests/test_study_stats.py measures it). The
Student t-interval on the per-seed log factors (and on per-seed accuracy differences) is exact for
normal per-seed values and close to nominal for the mildly skewed ones a study sees; it is the interval
a reviewer expects from few paired seeds. Factors are geometric means over seeds of per-seed factors
(the mean of logs), so a seed with a 2x gain and a seed with a 0.5x loss average to 1x.

**Multiplicity.** The claims table tests many claims at once. Each claim gives two one-sided p-values
(:func:`claim_p_values`: the data support the claim / the data refute it), and :func:`holm` adjusts all
of them together (Holm's step-down over the whole table: familywise error at most ``ALPHA``).
:func:`verdict` reads the adjusted p-values. The per-comparison tables show unadjusted 95% intervals.
"""

from __future__ import annotations

import numpy as np
from scipy import stats as sps

LEVEL = 0.95
ALPHA = 1.0 - LEVEL
VERDICTS = ("reproduced", "not reproduced in this regime", "inconclusive", "premise not met")


def km_curve(times, observed) -> tuple[np.ndarray, np.ndarray]:
    """Kaplan-Meier survival S(t) just after each distinct event time: (event times, S). At a tie an
    event precedes a censoring (a run censored at t was still at risk at t)."""
    t, obs = np.asarray(times, float), np.asarray(observed, bool)
    event_times = np.unique(t[obs])
    surv, s = [], 1.0
    for u in event_times:
        at_risk = np.sum(t >= u)
        s *= 1.0 - np.sum((t == u) & obs) / at_risk
        surv.append(s)
    return event_times, np.asarray(surv)


def km_median(times, observed) -> tuple[float, bool]:
    """(median, reached). The Kaplan-Meier median: the first event time with S(t) <= 0.5. When S stays
    above 0.5, the median is only known to exceed the largest time: returns (that time, False)."""
    event_times, surv = km_curve(times, observed)
    below = np.flatnonzero(surv <= 0.5 + 1e-12)
    if len(below):
        return float(event_times[below[0]]), True
    return float(np.max(times)) if len(times) else float("nan"), False


def log_factor_bounds(base, base_observed, method, method_observed) -> tuple[np.ndarray, np.ndarray]:
    """Per seed, bounds (lo, hi) of log(base / method) for a cost (rollouts, steps, seconds) where a
    censored value is a lower bound of the true cost. Both observed: lo = hi. Method censored at C:
    its cost is > C, so the factor is < base / C (hi) and unbounded below. Baseline censored at C: the
    factor is > C / method (lo), unbounded above. Both censored: (-inf, inf)."""
    b, m = np.asarray(base, float), np.asarray(method, float)
    bo, mo = np.asarray(base_observed, bool), np.asarray(method_observed, bool)
    with np.errstate(divide="ignore"):
        point = np.log(b) - np.log(m)
    lo = np.where(mo, point, -np.inf)
    hi = np.where(bo, point, np.inf)
    return lo, hi


def _t_interval(values: np.ndarray, level: float, side: str) -> float:
    """One end of the two-sided t-interval of the mean of ``values``; an infinite value makes that end
    infinite (the mean is only bounded on the other side); one value: the value itself."""
    if not np.all(np.isfinite(values)):
        return float(-np.inf if side == "lo" else np.inf)
    if len(values) < 2:
        return float(values.mean())
    half = sps.t.ppf((1.0 + level) / 2, len(values) - 1) * values.std(ddof=1) / np.sqrt(len(values))
    return float(values.mean() - half if side == "lo" else values.mean() + half)


def paired_interval(lo, hi, *, level: float = LEVEL) -> dict:
    """Mean over seeds of per-seed values known to lie in [lo_i, hi_i] (lo = hi when exact), with the
    Student t-interval over seeds: the lower end from the lower bounds' interval, the upper end from the
    upper bounds' (an infinite bound makes its end infinite). Returns {estimate_lo, estimate_hi, ci_lo,
    ci_hi, n, lo, hi} (``lo`` and ``hi``: the per-seed bounds, for :func:`claim_p_values`); with one seed
    the interval is that seed's bounds."""
    lo, hi = np.asarray(lo, float), np.asarray(hi, float)
    if len(lo) == 0:
        nan = float("nan")
        return {"estimate_lo": nan, "estimate_hi": nan, "ci_lo": nan, "ci_hi": nan, "n": 0, "lo": [], "hi": []}
    return {"estimate_lo": float(lo.mean()), "estimate_hi": float(hi.mean()),
            "ci_lo": _t_interval(lo, level, "lo"), "ci_hi": _t_interval(hi, level, "hi"), "n": len(lo),
            "lo": lo.tolist(), "hi": hi.tolist()}


def factor_interval(lo, hi, **kw) -> dict:
    """:func:`paired_interval` of per-seed log factors, with the estimate and interval returned as
    factors (exp of every end); ``lo`` / ``hi`` stay the per-seed log bounds."""
    r = paired_interval(lo, hi, **kw)
    ends = ("estimate_lo", "estimate_hi", "ci_lo", "ci_hi")
    return {k: (float(np.exp(v)) if k in ends else v) for k, v in r.items()}


def one_sided_p(values, threshold: float, alternative: str) -> float:
    """p-value of the one-sample t-test of H0 "mean <= threshold" (``alternative="greater"``) or "mean >=
    threshold" (``"less"``). Values are the per-seed bounds on the side the test needs (lower bounds to
    show a mean is above, upper bounds to show it is below), so a censored seed only weakens the test;
    a bound that is infinite in the tested direction, or fewer than two seeds, gives p = 1. Equal values
    (no spread) give 0 when the mean lies strictly on the alternative's side, else 1."""
    v = np.asarray(values, float)
    sign = 1.0 if alternative == "greater" else -1.0
    if len(v) < 2 or np.any(sign * v == -np.inf):
        return 1.0
    diff, sd = sign * (v.mean() - threshold), v.std(ddof=1)
    if sd == 0 or not np.isfinite(sd):
        return 0.0 if diff > 0 else 1.0
    return float(sps.t.sf(diff / (sd / np.sqrt(len(v))), len(v) - 1))


def claim_p_values(interval: dict, kind: str, value: float) -> tuple[float, float]:
    """(p_support, p_against): one-sided p-values of the tests that the data support a claim and that
    they refute it, from the per-seed bounds of ``interval`` (:func:`factor_interval` for ``factor``,
    :func:`paired_interval` of differences otherwise).

    factor (claimed factor ``value`` > 1): support = the factor is above 1 (a gain), against = the factor
    is below the claimed one. above: support = the difference is above 0, against = below 0. match
    (margin ``value``): support = both one-sided tests of equivalence (TOST: max of the two p), against =
    the difference lies outside the margin on either side (twice the smaller p, Bonferroni)."""
    lo, hi = interval["lo"], interval["hi"]
    if kind == "factor":
        return one_sided_p(lo, 0.0, "greater"), one_sided_p(hi, float(np.log(value)), "less")
    if kind == "above":
        return one_sided_p(lo, 0.0, "greater"), one_sided_p(hi, 0.0, "less")
    if kind == "match":
        support = max(one_sided_p(lo, -value, "greater"), one_sided_p(hi, value, "less"))
        against = min(1.0, 2 * min(one_sided_p(lo, value, "greater"), one_sided_p(hi, -value, "less")))
        return support, against
    raise ValueError(f"claim kind {kind!r}: expected factor, above or match")


def holm(p_values) -> np.ndarray:
    """Holm's step-down adjustment: adjusted p_(i) = max over j <= i of min(1, (m - j + 1) p_(j)) in
    increasing order of p. Rejecting every hypothesis with adjusted p < alpha keeps the familywise
    error rate at most alpha, whatever the dependence between the tests."""
    p = np.asarray(p_values, float)
    order = np.argsort(p, kind="stable")
    m = len(p)
    adjusted = np.minimum(1.0, np.maximum.accumulate((m - np.arange(m)) * p[order]))
    out = np.empty(m)
    out[order] = adjusted
    return out


def verdict(interval: dict, kind: str, value: float, p_support: float, p_against: float,
            premise_met: bool = True, alpha: float = ALPHA) -> str:
    """A claim's verdict from its (Holm-adjusted) p-values (:func:`claim_p_values`, :func:`holm`).

    *not reproduced in this regime*: the refuting test rejects (a factor clearly below the claimed one,
    an accuracy clearly on the other side, a difference clearly outside the margin). *reproduced*: the
    supporting test rejects and, for a factor, the 95% interval reaches the claimed factor. Otherwise
    *inconclusive*. When the method's premise was not met in this run (``premise_met`` False) a verdict
    other than reproduced becomes *premise not met*: the claim was not tested where it applies. Fewer
    than two seeds: inconclusive."""
    if kind not in ("factor", "above", "match"):
        raise ValueError(f"claim kind {kind!r}: expected factor, above or match")
    result = "inconclusive"
    if interval["n"] >= 2:
        if p_against < alpha:
            result = "not reproduced in this regime"
        elif p_support < alpha and (kind != "factor" or interval["ci_hi"] >= value):
            result = "reproduced"
    return result if premise_met or result == "reproduced" else "premise not met"


def first_reach(x, y, target: float) -> tuple[float, bool]:
    """(x at the first point after the first one with y >= target, True), or (the last x, False) when
    no such point exists (censored: the run needs more than it spent). Index 0 is the starting point
    (step 0), which never counts as reaching."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    hit = np.flatnonzero(y[1:] >= target)
    return (float(x[1 + hit[0]]), True) if len(hit) else (float(x[-1]), False)


def mean_over(x, y, horizon: float) -> float:
    """Mean of the piecewise-linear curve y(x) over [x[0], horizon] (the area under it divided by the
    width); ``x`` increasing, ``horizon`` within [x[0], x[-1]]."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    if horizon <= x[0]:
        return float(y[0])
    keep = x < horizon
    xs = np.append(x[keep], horizon)
    ys = np.append(y[keep], np.interp(horizon, x, y))
    return float(np.sum((xs[1:] - xs[:-1]) * (ys[1:] + ys[:-1]) / 2) / (horizon - x[0]))
