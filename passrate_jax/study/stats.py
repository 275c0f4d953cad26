"""The statistics of ``passrate-jax study``, as pure numpy functions of per-seed numbers (tested on
synthetic runs with known answers in tests/test_study.py).

Time to a target is a censored observation: a run that never reaches the target tells us only that it
needs *more than* what it spent (its value at its last evaluation, ``observed = False``). Nothing is
dropped:

- per method, :func:`km_median` is the Kaplan-Meier median over seeds (when fewer than half of the
  seeds' survival mass reaches the target it is "more than" the largest time, not a number);
- against a baseline, every seed gives an interval for its log factor (:func:`log_factor_bounds`): a
  point when both runs reached the target, a one-sided bound when one was censored (a miss counted as
  "more than the run"), unbounded when both were; :func:`paired_bootstrap` resamples *seeds* (the
  method's and the baseline's run of a seed stay together) and returns the interval of the mean log
  factor, the lower end from the lower bounds and the upper end from the upper bounds.

Factors are geometric means over seeds of per-seed factors (the mean of logs), so a seed with a 2x
gain and a seed with a 0.5x loss average to 1x, whatever the scale of each seed's numbers.
"""

from __future__ import annotations

import numpy as np

LEVEL = 0.95
BOOTSTRAP_SAMPLES = 10_000


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


def paired_bootstrap(lo, hi, *, level: float = LEVEL, samples: int = BOOTSTRAP_SAMPLES,
                     seed: int = 0) -> dict:
    """Mean over seeds of per-seed values known to lie in [lo_i, hi_i] (lo = hi when exact), with a
    percentile bootstrap interval over seeds: each resample draws seeds with replacement, the same
    draw for lo and hi; the interval runs from the (1 - level)/2 quantile of the resampled mean of lo
    to the (1 + level)/2 quantile of the resampled mean of hi (no interpolation across an infinite
    value). Returns {estimate_lo, estimate_hi, ci_lo, ci_hi, n}; with one seed the interval is only
    that seed's bounds (there is nothing to resample)."""
    lo, hi = np.asarray(lo, float), np.asarray(hi, float)
    n = len(lo)
    if n == 0:
        nan = float("nan")
        return {"estimate_lo": nan, "estimate_hi": nan, "ci_lo": nan, "ci_hi": nan, "n": 0}
    idx = np.random.default_rng(seed).integers(0, n, size=(samples, n))
    low_means, high_means = lo[idx].mean(1), hi[idx].mean(1)
    tail = (1.0 - level) / 2
    return {"estimate_lo": float(lo.mean()), "estimate_hi": float(hi.mean()),
            "ci_lo": float(np.quantile(low_means, tail, method="lower")),
            "ci_hi": float(np.quantile(high_means, 1.0 - tail, method="higher")), "n": n}


def factor_interval(lo, hi, **kw) -> dict:
    """:func:`paired_bootstrap` of per-seed log factors, returned as factors (exp of every end)."""
    r = paired_bootstrap(lo, hi, **kw)
    return {k: (float(np.exp(v)) if k != "n" else v) for k, v in r.items()}


def verdict(interval: dict, kind: str, value: float) -> str:
    """A claim's verdict from a paired interval (``factor_interval`` for ``factor``, ``paired_bootstrap``
    of differences for ``above`` / ``match``).

    factor (claimed factor ``value`` > 1): reproduced when the interval excludes 1 (no gain) and reaches
    the claimed factor; contradicted when it lies wholly below the claimed factor; inconclusive when it
    covers both 1 and the claimed factor. above: reproduced when the interval is above 0, contradicted
    when below 0. match: reproduced when the interval lies within +-value, contradicted when it lies
    wholly outside it. Fewer than two seeds: inconclusive."""
    lo, hi, n = interval["ci_lo"], interval["ci_hi"], interval["n"]
    if n < 2 or not (lo == lo and hi == hi):
        return "inconclusive"
    if kind == "factor":
        if hi < value:
            return "contradicted"
        return "reproduced" if lo > 1.0 else "inconclusive"
    if kind == "above":
        return "reproduced" if lo > 0 else "contradicted" if hi < 0 else "inconclusive"
    if kind == "match":
        if -value <= lo and hi <= value:
            return "reproduced"
        return "contradicted" if lo > value or hi < -value else "inconclusive"
    raise ValueError(f"claim kind {kind!r}: expected factor, above or match")


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
