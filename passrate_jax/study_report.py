"""Analysis and report of a ``passrate-jax study``: rollouts and steps to a target held-out accuracy,
final accuracy, valid groups, useful-rollout fraction and Prefix Sampling re-rollout pass rates per
method (mean and spread over seeds), the source papers' claims against what was measured, and plots.

The target is set per seed from the GRPO (uniform) baseline's plateau (the mean of its last three
held-out evaluations with that seed; seeds differ in their warm start, so one target for all would
compare a seed's runs against another seed's baseline): the warm start's accuracy plus
``target_fraction`` (default 0.8) of GRPO's gain to that plateau. At 1.0 the baseline would define the
target with its own last evaluations, and a method matching GRPO's final accuracy within evaluation
noise would miss it about half the time. A run reaches its seed's target at its first evaluation after
step 0 at or above it.
"""

from __future__ import annotations

import datetime
import os

import numpy as np

from passrate_jax.metrics import read_jsonl

PLATEAU_EVALS = 3
TARGET_FRACTION = 0.8
DISCUSSION_MARKER = "<!-- discussion: text below this line is kept when the study rewrites this file -->"

# (label, method, baseline, measure, claimed factor range "baseline / method"), from ../shared/DESIGN.md.
CLAIMS = (
    ("PS: fewer steps than GRPO", "ps_adaptive", "grpo", "steps", (1.5, 1.9)),
    ("Pilot-Commit: fewer rollouts than GRPO", "pilot_commit", "grpo", "rollouts", (1.5, 1.9)),
    ("Pilot-Commit: fewer rollouts than DAPO", "pilot_commit", "dapo_ds", "rollouts", (2.3, 4.0)),
    ("SARA: 22% fewer rollouts than DAPO", "sara", "dapo_ds", "rollouts", (1 / 0.78, 1 / 0.78)),
    ("SARA + DPS: 67% fewer rollouts than DAPO", "sara_dps", "dapo_ds", "rollouts", (1 / 0.33, 1 / 0.33)),
)


def _eval_curve(records: list[dict]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(step, rollouts_total, training seconds, accuracy) at every evaluation, step 0 included."""
    rows = [(r["step"], r.get("rollouts_total", 0), r.get("time/total_s", 0.0), r["eval_accuracy"])
            for r in records if isinstance(r.get("eval_accuracy"), (int, float))]
    return tuple(np.asarray(c, float) for c in zip(*rows)) if rows else (np.zeros(0),) * 4


def load_runs(plan) -> dict[str, dict[int, list[dict]]]:
    """Metrics records of every finished (method, seed) run of ``plan``."""
    runs: dict[str, dict[int, list[dict]]] = {}
    for m in plan.methods:
        for s in plan.seeds:
            path = os.path.join(plan.run_dir(m, s), "metrics.jsonl")
            if os.path.exists(path):
                runs.setdefault(m, {})[s] = read_jsonl(path)
    return runs


def _first_reach(records, target: float) -> dict | None:
    step, rollouts, seconds, acc = _eval_curve(records)
    hit = np.flatnonzero((acc >= target) & (step > 0))
    if not len(hit):
        return None
    i = hit[0]
    return {"steps": float(step[i]), "rollouts": float(rollouts[i]), "seconds": float(seconds[i])}


def _stats(values) -> dict:
    v = np.asarray([x for x in values if x is not None and np.isfinite(x)], float)
    if not len(v):
        return {"mean": float("nan"), "sd": float("nan"), "n": 0}
    return {"mean": float(v.mean()), "sd": float(v.std(ddof=1)) if len(v) > 1 else 0.0, "n": int(len(v))}


def _mean_of(records, key) -> float:
    v = [r[key] for r in records if isinstance(r.get(key), (int, float))]
    return float(np.mean(v)) if v else float("nan")


def analyse(plan, target_fraction: float = TARGET_FRACTION) -> dict:
    """Per-method statistics over seeds and the per-seed targets (see the module docstring)."""
    runs = load_runs(plan)
    base = runs.get("grpo", {})
    if not base:
        raise RuntimeError("no finished GRPO run: the target accuracy cannot be set")
    plateaus = {s: float(_eval_curve(r)[3][-PLATEAU_EVALS:].mean()) for s, r in base.items()}
    starts = {s: float(_eval_curve(r)[3][0]) for s, r in base.items()}
    targets = {s: starts[s] + target_fraction * (plateaus[s] - starts[s]) for s in base}
    methods = {}
    for m, by_seed in runs.items():
        reach = {s: _first_reach(r, targets[s]) for s, r in by_seed.items() if s in targets}
        hit = [x for x in reach.values() if x is not None]
        buckets = sorted({k.split("/")[-1] for r in by_seed.values() for rec in r for k in rec
                          if k.startswith("ps/pass_rate/")}, key=int)
        methods[m] = {
            "seeds": sorted(by_seed), "reached": len(hit),
            "rollouts_to_target": _stats([x["rollouts"] for x in hit]),
            "steps_to_target": _stats([x["steps"] for x in hit]),
            "seconds_to_target": _stats([x["seconds"] for x in hit]),
            "final_accuracy": _stats([_eval_curve(r)[3][-1] for r in by_seed.values()]),
            "gain": _stats([_eval_curve(r)[3][-1] - _eval_curve(r)[3][0] for r in by_seed.values()]),
            "valid_groups_per_step": _stats([_mean_of(r[1:], "valid_groups") for r in by_seed.values()]),
            "useful_fraction": _stats([r[-1].get("useful_rollout_fraction") for r in by_seed.values()]),
            "rollouts_total": _stats([r[-1].get("rollouts_total") for r in by_seed.values()]),
            "rollouts_per_valid_group": _stats([r[-1]["rollouts_total"] / max(sum(x.get("valid_groups", 0)
                                                for x in r), 1) for r in by_seed.values()]),
            "wall_seconds": _stats([r[-1].get("time/total_s") for r in by_seed.values()]),
            "ps_pass_rate": {b: _stats([_mean_of(r, f"ps/pass_rate/{b}") for r in by_seed.values()])
                             for b in buckets},
        }
    run_seconds = sum(r[-1].get("time/total_s", 0.0) for rs in runs.values() for r in rs.values())
    return {"targets": targets, "starts": starts, "plateaus": plateaus, "target_fraction": target_fraction,
            "methods": methods, "runs": runs, "run_seconds": run_seconds}


def _ratio(analysis, method, baseline, measure) -> float:
    ms = analysis["methods"]
    if method not in ms or baseline not in ms:
        return float("nan")
    key = {"steps": "steps_to_target", "rollouts": "rollouts_to_target",
           "per_valid": "rollouts_per_valid_group"}[measure]
    a, b = ms[method][key]["mean"], ms[baseline][key]["mean"]
    return b / a if a > 0 else float("nan")


def _fmt(s: dict, digits: int = 0, scale: float = 1.0) -> str:
    if not s["n"]:
        return "–"
    mean, sd = s["mean"] * scale, s["sd"] * scale
    return f"{mean:.{digits}f} ± {sd:.{digits}f}" if s["n"] > 1 else f"{mean:.{digits}f}"


def plot(analysis, labels: dict[str, str], path: str) -> str:
    """Held-out accuracy against rollouts spent (left) and against steps (right), mean over seeds."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    cmap = plt.get_cmap("tab20")
    for i, (m, by_seed) in enumerate(analysis["runs"].items()):
        curves = [_eval_curve(r) for r in by_seed.values()]
        n = min(len(c[0]) for c in curves)
        step = np.mean([c[0][:n] for c in curves], 0)
        rollouts = np.mean([c[1][:n] for c in curves], 0)
        acc = np.mean([c[3][:n] for c in curves], 0)
        style = dict(color=cmap(i % 20), lw=2.2 if m in ("grpo", "dapo_ds") else 1.4,
                     ls="--" if m in ("grpo", "dapo_ds") else "-", marker=".", label=labels.get(m, m))
        axes[0].plot(rollouts, acc, **style)
        axes[1].plot(step, acc, **style)
    for ax, xlabel in zip(axes, ("rollouts spent", "training step")):
        ax.axhline(np.mean(list(analysis["targets"].values())), color="k", lw=0.8, ls=":",
                   label="mean target (from GRPO's plateau)")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("held-out accuracy (greedy)")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7, ncol=2, loc="lower right")
    fig.suptitle(f"held-out accuracy, mean over seeds {analysis_seeds(analysis)}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def analysis_seeds(analysis) -> str:
    seeds = sorted({s for by_seed in analysis["runs"].values() for s in by_seed})
    return ", ".join(map(str, seeds))


def write_report(plan, analysis, path: str, *, command: str) -> list[str]:
    """Write the Markdown report (and its plot next to it); keeps any text after DISCUSSION_MARKER."""
    from passrate_jax.study import METHODS

    labels = {m: label for m, (label, _) in METHODS.items()}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    png = os.path.splitext(path)[0] + ".png"
    plot(analysis, labels, png)
    kept = ""
    if os.path.exists(path):
        old = open(path).read()
        if DISCUSSION_MARKER in old:
            kept = old.split(DISCUSSION_MARKER, 1)[1]
    ms, grpo, dapo = analysis["methods"], "grpo", "dapo_ds"
    lines = [
        "# Efficiency study: every allocation method on the built-in task", "",
        f"Generated by `{command}` on {datetime.date.today().isoformat()}; machine: {analysis['machine']}; "
        f"the runs' training loops took {analysis['run_seconds'] / 60:.0f} min in all (warm starts, start-up "
        f"and compilation not counted; this invocation took {analysis['study_seconds'] / 60:.1f} min, finished "
        "runs being reused). Base preset `" + (plan.base_config or "built-in defaults") + "`, seeds "
        f"{analysis_seeds(analysis)}, {'--quick settings' if plan.quick else 'full settings'}; every method "
        "starts from the same cached warm start of each seed and differs only in its allocation overrides "
        "(`passrate_jax/study.py`).", "",
        f"**Target accuracy** per seed: the warm start's accuracy plus {analysis['target_fraction']:.0%} of the "
        "GRPO baseline's gain to its plateau with that seed (the mean of its last "
        f"{PLATEAU_EVALS} held-out evaluations): " + ", ".join(
            f"seed {s}: {analysis['targets'][s]:.4f} (warm start {analysis['starts'][s]:.4f}, GRPO plateau "
            f"{analysis['plateaus'][s]:.4f})" for s in sorted(analysis["targets"]))
        + ". A run reaches its seed's target at its first evaluation "
        "after step 0 at or above it. Columns are mean ± sd over the seeds "
        "that reached it (`reached`); ratios are GRPO's (or DAPO's) mean divided by the method's: above 1 "
        "means fewer rollouts than the baseline.", "",
        "| method | reached | rollouts to target | × vs GRPO | × vs DAPO | steps to target | final accuracy | "
        "gain over warm start | valid groups / step | useful-rollout fraction | rollouts / valid group | "
        "rollouts total | wall s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for m in plan.methods:
        if m not in ms:
            continue
        s = ms[m]
        lines.append(
            f"| {labels[m]} | {s['reached']}/{len(s['seeds'])} | {_fmt(s['rollouts_to_target'])} | "
            f"{_ratio(analysis, m, grpo, 'rollouts'):.2f} | {_ratio(analysis, m, dapo, 'rollouts'):.2f} | "
            f"{_fmt(s['steps_to_target'], 1)} | {_fmt(s['final_accuracy'], 3)} | {_fmt(s['gain'], 3)} | "
            f"{_fmt(s['valid_groups_per_step'], 1)} | {_fmt(s['useful_fraction'], 3)} | "
            f"{_fmt(s['rollouts_per_valid_group'], 1)} | {_fmt(s['rollouts_total'])} | {_fmt(s['wall_seconds'])} |")
    lines += ["", f"![held-out accuracy against rollouts and steps]({os.path.basename(png)})", ""]
    ps = [m for m in plan.methods if m in ms and ms[m]["ps_pass_rate"]]
    if ps:
        buckets = sorted({b for m in ps for b in ms[m]["ps_pass_rate"]}, key=int)
        lines += ["## Prefix Sampling re-rollout pass rate per bucket",
                  "", "Bucket = the source group's success count out of N; the controller drives each toward 0.5 "
                  "(mean over steps, then mean ± sd over seeds).", "",
                  "| method | " + " | ".join(f"bucket {b}" for b in buckets) + " |",
                  "| --- |" + " --- |" * len(buckets)]
        for m in ps:
            cells = [_fmt(ms[m]["ps_pass_rate"].get(b, {"n": 0}), 3) for b in buckets]
            lines.append(f"| {labels[m]} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["## The source papers' claims against this measurement", "",
              "Factors are baseline / method (above 1: the method needs less). The last column compares the "
              "rollouts spent per valid (mixed-reward) group over whole runs, which does not depend on a target.",
              "", "| claim | claimed factor | measured factor (to target) | rollouts per valid group |",
              "| --- | --- | --- | --- |"]
    for label, m, b, measure, (lo, hi) in CLAIMS:
        claimed = f"{lo:.2f}" if lo == hi else f"{lo:.1f}–{hi:.1f}"
        lines.append(f"| {label} | {claimed} | {_ratio(analysis, m, b, measure):.2f} | "
                     f"{_ratio(analysis, m, b, 'per_valid'):.2f} |")
    best = [m for m in plan.methods if m in ms and ms[m]["reached"] and m not in (grpo, dapo)]  # compositions
    if best:
        top = max(best, key=lambda m: (ms[m]["reached"], -ms[m]["rollouts_to_target"]["mean"]))
        lines.append(f"| goal: the best composition (most seeds reaching the target, then fewest rollouts: "
                     f"{labels[top]}) at ≤ 0.5× GRPO's rollouts and ≤ 0.25× DAPO's | "
                     f"≥ 2.0 and ≥ 4.0 | {_ratio(analysis, top, grpo, 'rollouts'):.2f} and "
                     f"{_ratio(analysis, top, dapo, 'rollouts'):.2f} | {_ratio(analysis, top, grpo, 'per_valid'):.2f} "
                     f"and {_ratio(analysis, top, dapo, 'per_valid'):.2f} |")
    lines += ["", DISCUSSION_MARKER]
    with open(path, "w") as f:
        f.write("\n".join(lines) + (kept if kept else "\n"))
    return [path, png]
