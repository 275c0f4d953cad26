"""Held-out evaluation: greedy accuracy (per difficulty level) and unbiased pass@k of sampled answers."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from math import comb

import numpy as np

from passrate_jax.sampling.config import SamplingConfig


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples with ``c`` correct (Chen et al. 2021): 1 - C(n-c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k(n={n}, c={c}, k={k}): need 0 <= c <= n and 1 <= k <= n")
    return 1.0 - comb(n - c, k) / comb(n, k)


def evaluate(count_successes: Callable[[int, SamplingConfig, int], np.ndarray], levels: Sequence[int], *,
             sampling: SamplingConfig, temperature: float, seed: int = 0, num_samples: int = 0,
             ks: Sequence[int] = (1,), greedy: bool = True) -> dict:
    """One held-out evaluation for every kind of task. ``count_successes(n, cfg, seed)``: per held-out
    prompt, how many of its ``n`` rollouts (text answers, environment episodes) sampled with ``cfg``
    succeed. Greedy accuracy (one rollout at temperature 0, overall and per level of ``levels``), plus
    pass@k for each k in ``ks`` from ``num_samples`` rollouts per prompt at ``temperature`` when
    ``num_samples > 0``; ``greedy=False`` skips the greedy rollouts (needs ``num_samples > 0``).

    Returns ``{"accuracy": float, "accuracy_by_level": {level: float}, "pass@k": float, ...}``.
    """
    if not greedy and num_samples <= 0:
        raise ValueError(f"evaluate(greedy=False, num_samples={num_samples}): nothing to evaluate")
    correct = count_successes(1, dataclasses.replace(sampling, temperature=0.0), seed) if greedy else None
    successes = None
    if num_samples > 0:
        successes = count_successes(num_samples, dataclasses.replace(sampling, temperature=temperature), seed + 1)
    return summarise(correct, levels, successes, num_samples, ks)


def summarise(correct, levels, successes=None, num_samples: int = 0, ks: Sequence[int] = (1,)) -> dict:
    """The result dict of an evaluation: greedy accuracy overall and per level from per-prompt ``correct``
    (0/1; None: no greedy keys); with per-prompt ``successes`` out of ``num_samples``, the mean accuracy of
    the samples overall and per level (``sampled_accuracy``: pass@1 estimated from all samples) and pass@k
    for each k <= ``num_samples``.
    ``mean@n`` is ``sampled_accuracy`` by its usual name. Every mean over prompts comes with its standard
    error over prompts (``accuracy_se``, ``sampled_accuracy_se``, ``pass@k_se``: sample standard deviation
    / sqrt(prompts); NaN below two prompts). ``per_prompt`` keeps the per-prompt arrays for
    :func:`paired_difference`."""
    levels = np.asarray(levels)
    correct = None if correct is None else np.asarray(correct, float)

    def by_level(values):
        return {int(lv): float(values[levels == lv].mean()) for lv in np.unique(levels)}

    out = {"per_prompt": {"correct": correct, "successes": None if successes is None else np.asarray(successes, int),
                          "num_samples": num_samples}}
    if correct is not None:
        out.update(accuracy=float(correct.mean()) if len(correct) else float("nan"),
                   accuracy_se=standard_error(correct), accuracy_by_level=by_level(correct))
    if successes is not None:
        rate = np.asarray(successes, float) / num_samples
        out["sampled_accuracy"] = float(rate.mean()) if len(rate) else float("nan")
        out["sampled_accuracy_se"] = standard_error(rate)
        out[f"mean@{num_samples}"] = out["sampled_accuracy"]
        out["sampled_accuracy_by_level"] = by_level(rate)
        for k in ks:
            if k <= num_samples:
                estimates = np.asarray([pass_at_k(num_samples, int(c), k) for c in successes])
                out[f"pass@{k}"] = float(estimates.mean())
                out[f"pass@{k}_se"] = standard_error(estimates)
    return out


def standard_error(values) -> float:
    """Standard error of the mean of per-prompt ``values``: sample std (ddof 1) / sqrt(n); NaN for n < 2."""
    values = np.asarray(values, float)
    return float(values.std(ddof=1) / np.sqrt(len(values))) if len(values) > 1 else float("nan")


def mcnemar_exact_p(fixed: int, broken: int) -> float:
    """Two-sided exact McNemar p-value: under "no change", each of the ``fixed + broken`` discordant
    prompts is equally likely to have gone either way (a fair binomial)."""
    n, k = fixed + broken, min(fixed, broken)
    if n == 0:
        return 1.0
    return min(1.0, 2.0 * sum(comb(n, i) for i in range(k + 1)) / 2.0 ** n)


def paired_difference(before: dict, after: dict) -> dict:
    """How ``after`` differs from ``before``, two evaluations of the same prompts (their ``per_prompt``):
    greedy accuracy difference with the prompts fixed / broken and the exact McNemar p-value; with
    samples, the mean difference of per-prompt sampled accuracy and its standard error over prompts."""
    a, b = before["per_prompt"], after["per_prompt"]
    if len(a["correct"]) != len(b["correct"]):
        raise ValueError(f"paired_difference: {len(a['correct'])} vs {len(b['correct'])} prompts")
    fixed = int(np.sum((b["correct"] > 0) & (a["correct"] == 0)))
    broken = int(np.sum((a["correct"] > 0) & (b["correct"] == 0)))
    out = {"accuracy": after["accuracy"] - before["accuracy"], "fixed": fixed, "broken": broken,
           "mcnemar_p": mcnemar_exact_p(fixed, broken)}
    if a["successes"] is not None and b["successes"] is not None:
        d = b["successes"] / b["num_samples"] - a["successes"] / a["num_samples"]
        out["sampled_accuracy"] = float(d.mean())
        out["sampled_accuracy_se"] = standard_error(d)
    return out
