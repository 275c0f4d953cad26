"""Analysis of a ``passrate-jax study``: per (method, seed) measures read from the runs' metrics, per
method summaries over seeds, paired comparisons against GRPO and DS, and the claims' verdicts.

**Target.** Set per seed from that seed's GRPO (uniform) run: the warm start's held-out accuracy plus
``target_fraction`` (default 0.8) of GRPO's gain to its plateau (the mean of its last
``PLATEAU_EVALS`` evaluations after step 0). Seeds differ in their warm start, so each seed's runs are measured
against their own baseline. A run reaches the target at its first evaluation after step 0 at or above
it; a run that never does is censored at its last evaluation (see ``study_stats``).

**Accuracy.** The held-out *sampled* accuracy (``eval_sampled_accuracy``: several answers per prompt,
less noisy than one greedy answer) when every run of the study records it, else greedy
(``eval_accuracy``); the analysis says which it used.

**Area under accuracy against rollouts.** Per seed, the mean held-out accuracy over the first H
rollouts, H = the smallest number of rollouts any method of that seed spent in its run (so every
method's curve covers it; the curve is linear between evaluations).
"""

from __future__ import annotations

import os

import numpy as np

from passrate_jax.run.metrics import read_jsonl
from passrate_jax.study.methods import BASELINES, CLAIMS
from passrate_jax.study.probes import premise, seed_probes
from passrate_jax.study.provenance import unpaired_seeds
from passrate_jax.study.stats import (claim_p_values, factor_interval, first_reach, holm, km_median, log_factor_bounds,
                                      mean_over, paired_interval, verdict)

PLATEAU_EVALS = 3
TARGET_FRACTION = 0.8
PS_WARMUP_STEPS = 10  # the PS controllers' EMA (decay 0.9) needs about ten updates to forget its start
METRICS = ("eval_sampled_accuracy", "eval_accuracy")

# measure -> how it is compared: a cost to the target (censored), a cost or a benefit (factor), or a
# difference in accuracy (method - baseline).
# "peak": the first evaluation at or above the highest evaluation of the seed's GRPO run after step 0 (the
# PS paper's "steps to the baseline's peak"; GRPO itself reaches it at its peak).
CENSORED = ("rollouts_to_target", "steps_to_target", "seconds_to_target", "rollouts_to_peak", "steps_to_peak",
            "seconds_to_peak")
COSTS = ("rollouts_per_valid_group",)
BENEFITS = ("valid_groups_per_step",)
DIFFERENCES = ("final_accuracy", "mean_accuracy")
COMPARED = (*CENSORED, *COSTS, *BENEFITS, *DIFFERENCES)


def load_runs(plan, leave_out=()) -> dict[str, dict[int, list[dict]]]:
    """Metrics records of every (method, seed) run of ``plan`` that has any, but those in ``leave_out``."""
    runs: dict[str, dict[int, list[dict]]] = {}
    for m, s in plan.jobs():
        path = os.path.join(plan.run_dir(m, s), "metrics.jsonl")
        if (m, s) not in leave_out and os.path.exists(path):
            runs.setdefault(m, {})[s] = read_jsonl(path)
    return runs


def eval_curve(records: list[dict], metric: str) -> dict[str, np.ndarray]:
    """step, rollouts (cumulative), seconds and accuracy at every evaluation, step 0 (the warm start)
    included. Seconds are the sum of the steps' own wall clock (rollouts, update, evaluation) so far,
    which a resumed run keeps (its ``time/total_s`` restarts at the resume)."""
    rows, seconds = [], 0.0
    for r in records:
        seconds += r.get("time/step_s", 0.0) if r.get("step", 0) >= 1 else 0.0
        if isinstance(r.get(metric), (int, float)):
            rows.append((r["step"], r.get("rollouts_total", 0), seconds, r[metric]))
    cols = [np.asarray(c, float) for c in zip(*rows)] if rows else [np.zeros(0)] * 4
    return dict(zip(("step", "rollouts", "seconds", "accuracy"), cols))


def choose_metric(runs) -> str:
    """Sampled accuracy when every run evaluates it, else greedy."""
    for metric in METRICS:
        if all(len(eval_curve(r, metric)["step"]) >= 2 for by_seed in runs.values() for r in by_seed.values()):
            return metric
    raise RuntimeError("some run has fewer than two held-out evaluations: nothing to measure")


def plateau_reached(records: list[dict], metric: str) -> bool | None:
    """Whether a run's last ``PLATEAU_EVALS`` evaluations after step 0 lie within one standard error of
    each other (the largest of their ``<metric>_se``): a real plateau, so "steps to the baseline's peak"
    measures something. None when the run has too few evaluations or logs no standard error."""
    evals = [r for r in records if r.get("step", 0) >= 1 and isinstance(r.get(metric), (int, float))]
    last = evals[-PLATEAU_EVALS:]
    if len(last) < PLATEAU_EVALS or not all(isinstance(r.get(f"{metric}_se"), (int, float)) for r in last):
        return None
    values = [r[metric] for r in last]
    return bool(max(values) - min(values) <= max(r[f"{metric}_se"] for r in last))


def _mean(values) -> float:
    v = [x for x in values if isinstance(x, (int, float)) and x == x]
    return float(np.mean(v)) if v else float("nan")


def seed_measures(records: list[dict], metric: str, target: float, ps_warmup: int, peak: float = float("inf")) -> dict:
    """Every per-seed measure of one run (the to-target and to-peak ones as (value, observed))."""
    c = eval_curve(records, metric)
    steps = [r for r in records if r.get("step", 0) >= 1]
    valid_total = sum(r.get("valid_groups", 0) for r in steps)
    last = records[-1]
    buckets = sorted({k.rsplit("/", 1)[1] for r in steps for k in r if k.startswith("ps/pass_rate/")}, key=int)
    return {
        "curve": c,
        "rollouts_to_target": first_reach(c["rollouts"], c["accuracy"], target),
        "steps_to_target": first_reach(c["step"], c["accuracy"], target),
        "seconds_to_target": first_reach(c["seconds"], c["accuracy"], target),
        "rollouts_to_peak": first_reach(c["rollouts"], c["accuracy"], peak),
        "steps_to_peak": first_reach(c["step"], c["accuracy"], peak),
        "seconds_to_peak": first_reach(c["seconds"], c["accuracy"], peak),
        "start_accuracy": float(c["accuracy"][0]),
        "final_accuracy": float(c["accuracy"][-1]),
        "valid_groups_per_step": _mean([r.get("valid_groups") for r in steps]),
        "rollouts_per_valid_group": last.get("rollouts_total", 0) / valid_total if valid_total else float("inf"),
        "useful_fraction": float(last.get("useful_rollout_fraction", float("nan"))),
        "rollouts_total": float(last.get("rollouts_total", 0)),
        "wall_seconds": float(sum(r.get("time/step_s", 0.0) for r in steps)),
        "ps_pass_rate": {b: _mean([r.get(f"ps/pass_rate/{b}") for r in steps if r["step"] > ps_warmup])
                         for b in buckets},
        "probes": seed_probes(records, ps_warmup),
    }


def _spread(values) -> dict:
    v = np.asarray([x for x in values if x == x and np.isfinite(x)], float)
    if not len(v):
        return {"mean": float("nan"), "sd": float("nan"), "n": 0}
    return {"mean": float(v.mean()), "sd": float(v.std(ddof=1)) if len(v) > 1 else 0.0, "n": int(len(v))}


def summarise(per_seed: dict[int, dict]) -> dict:
    """One method over its seeds: Kaplan-Meier medians of the to-target measures, mean and sd of the rest."""
    out = {"seeds": sorted(per_seed)}
    for name in CENSORED:
        values = [per_seed[s][name] for s in out["seeds"]]
        median, reached = km_median([v for v, _ in values], [o for _, o in values])
        out[name] = {"median": median, "median_reached": reached, "reached": sum(o for _, o in values),
                     "per_seed": values}
    for name in ("final_accuracy", "mean_accuracy", "valid_groups_per_step", "rollouts_per_valid_group",
                 "useful_fraction", "rollouts_total", "wall_seconds"):
        out[name] = _spread([per_seed[s][name] for s in out["seeds"]])
    buckets = sorted({b for m in per_seed.values() for b in m["ps_pass_rate"]}, key=int)
    out["ps_pass_rate"] = {b: _spread([per_seed[s]["ps_pass_rate"].get(b, float("nan")) for s in out["seeds"]])
                           for b in buckets}
    return out


def compare(method: dict[int, dict], base: dict[int, dict], measure: str, no_gain=(), unpaired=()) -> dict:
    """The paired comparison of ``method`` with ``base`` on their common seeds: a factor interval (above
    1 favours the method) or, for accuracies, the interval of the difference method - base. To-target
    measures leave out the ``no_gain`` seeds (GRPO gained nothing there, so the target is no target);
    every measure leaves out the ``unpaired`` seeds (the two runs were computed differently:
    ``provenance.unpaired_seeds``)."""
    seeds = sorted(set(method) & set(base) - set(unpaired) - (set(no_gain) if measure in CENSORED else set()))
    if measure in CENSORED:
        b, m = [base[s][measure] for s in seeds], [method[s][measure] for s in seeds]
        lo, hi = log_factor_bounds([v for v, _ in b], [o for _, o in b], [v for v, _ in m], [o for _, o in m])
        r = factor_interval(lo, hi)
        r["censored_seeds"] = int(sum(not (bo and mo) for (_, bo), (_, mo) in zip(b, m)))
    elif measure in COSTS or measure in BENEFITS:
        sign = 1.0 if measure in COSTS else -1.0
        lo = sign * np.log([base[s][measure] / method[s][measure] for s in seeds])
        r = factor_interval(lo, lo)
        r["censored_seeds"] = 0
    else:
        d = [method[s][measure] - base[s][measure] for s in seeds]
        r = paired_interval(d, d)
        r["censored_seeds"] = 0
    return {**r, "kind": "difference" if measure in DIFFERENCES else "factor", "seeds": seeds,
            "unpaired_seeds": sorted(unpaired)}


def analyse(runs: dict[str, dict[int, list[dict]]], *, target_fraction: float = TARGET_FRACTION,
            metric: str | None = None, ps_warmup: int | None = None, prints=None) -> dict:
    """Everything the report shows, from ``runs`` (method -> seed -> metrics records); see the module
    docstring for the definitions. Needs GRPO runs (they set the targets). ``prints`` (method -> seed ->
    numerics fingerprints, ``provenance.load_fingerprints``; none: every run counts as paired): seeds
    whose two runs disagree are left out of their comparison."""
    base = runs.get("grpo", {})
    if not base:
        raise RuntimeError("no GRPO run: the target accuracy cannot be set")
    metric = metric or choose_metric(runs)
    if ps_warmup is None:
        last_step = max(r[-1].get("step", 0) for by_seed in runs.values() for r in by_seed.values())
        ps_warmup = min(PS_WARMUP_STEPS, last_step // 4)
    grpo = {s: eval_curve(r, metric)["accuracy"] for s, r in base.items()}
    starts = {s: float(a[0]) for s, a in grpo.items()}
    # The plateau never counts the warm start's own evaluation (a short run may have only 3 evaluations).
    plateaus = {s: float(a[1:][-PLATEAU_EVALS:].mean()) if len(a) > 1 else float(a[0]) for s, a in grpo.items()}
    targets = {s: starts[s] + target_fraction * (plateaus[s] - starts[s]) for s in base}
    peaks = {s: float(a[1:].max()) if len(a) > 1 else float(a[0]) for s, a in grpo.items()}
    per_seed = {m: {s: seed_measures(r, metric, targets[s], ps_warmup, peaks[s]) for s, r in by_seed.items()
                    if s in targets}
                for m, by_seed in runs.items()}
    horizons = {s: min(ms[s]["curve"]["rollouts"][-1] for ms in per_seed.values() if s in ms) for s in targets}
    for ms in per_seed.values():
        for s, x in ms.items():
            x["mean_accuracy"] = mean_over(x["curve"]["rollouts"], x["curve"]["accuracy"], horizons[s])
    # A seed whose GRPO run did not improve on its warm start has a target at or below the start: every
    # run "reaches" it at its first evaluation, and time to target measures nothing there.
    no_gain = sorted(s for s in targets if plateaus[s] <= starts[s])
    prints = prints or {}
    pairs = [(m, b) for m in per_seed for b in BASELINES if b in per_seed and b != m]
    comparisons = {}
    for m, b in pairs:
        unpaired = unpaired_seeds(prints, m, b)
        comparisons[m, b] = {measure: compare(per_seed[m], per_seed[b], measure, no_gain, unpaired)
                             for measure in COMPARED}
    return {"metric": metric, "targets": targets, "peaks": peaks, "no_gain_seeds": no_gain, "starts": starts,
            "grpo_plateau_reached": {s: plateau_reached(r, metric) for s, r in base.items()},
            "plateaus": plateaus,
            "target_fraction": target_fraction, "ps_warmup": ps_warmup, "horizons": horizons,
            "per_seed": per_seed, "methods": {m: summarise(x) for m, x in per_seed.items()},
            "comparisons": comparisons, "claims": judge_claims(per_seed, no_gain, prints),
            "fingerprints": {m: {s: sorted(f) for s, f in by_seed.items()} for m, by_seed in prints.items()}}


def judge_claims(per_seed: dict[str, dict[int, dict]], no_gain, prints) -> list[dict]:
    """Every claim whose method and baseline ran: its paired interval, its two one-sided p-values, Holm-
    adjusted over all the claims' tests together (``stats`` module docstring), its premise probe, and
    its verdict."""
    rows = []
    for c in CLAIMS:
        if c.method in per_seed and c.baseline in per_seed:
            iv = compare(per_seed[c.method], per_seed[c.baseline], c.measure, no_gain,
                         unpaired_seeds(prints, c.method, c.baseline))
            probes = {s: x["probes"] for s, x in per_seed.get(c.premise_run, {}).items()}
            grpo = {s: x["probes"] for s, x in per_seed.get("grpo", {}).items()}
            rows.append({"claim": c, "interval": iv, "p": claim_p_values(iv, c.kind, c.value),
                         "premise": premise(c.premise if probes else None, probes, grpo)})
    adjusted = holm([p for r in rows for p in r["p"]]).reshape(-1, 2) if rows else []
    for r, (support, against) in zip(rows, adjusted):
        c = r["claim"]
        r["p_adjusted"] = (float(support), float(against))
        r["verdict"] = verdict(r["interval"], c.kind, c.value, support, against, r["premise"]["met"] is not False)
    return rows
