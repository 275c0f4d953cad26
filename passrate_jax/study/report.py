"""The Markdown report and plot of a ``passrate-jax study`` (the numbers come from ``study_analysis``).

Tables: per method (to-target Kaplan-Meier medians, accuracies, valid groups, rollouts per valid group),
every method against GRPO and against DS with 95% paired t-intervals, each claim of
docs/design.md 2.6 with its Holm-adjusted verdict and premise probe, the premise probes per method and seed, per-seed rollouts to the target (censored runs marked), and the
Prefix Sampling re-rollout pass rates per bucket after a warm-up. The plot: held-out accuracy gain
against rollouts spent and against wall seconds, mean and band over seeds, two panels per method with
GRPO and DS beside it.
"""

from __future__ import annotations

import datetime
import json
import os

import numpy as np

from passrate_jax.study.analysis import CENSORED, PLATEAU_EVALS
from passrate_jax.study.methods import BASELINES, DEFAULT_METHODS, METHODS
from passrate_jax.study.provenance import pairing_lines
from passrate_jax.study.stats import LEVEL

DISCUSSION_MARKER = "<!-- discussion: text below this line is kept when the study rewrites this file -->"
LABELS = {m: label for m, (label, _) in METHODS.items()}


def _num(x: float, digits: int) -> str:
    if x == float("inf"):
        return "∞"
    if x == float("-inf"):
        return "-∞"
    return f"{x:.{digits}f}"


def fmt_interval(iv: dict, digits: int = 2) -> str:
    """``1.23 [0.95, 1.60]``; a censored estimate is a range (``0.00–1.40``); ``n/a`` without seeds."""
    if not iv["n"]:
        return "n/a"
    lo, hi = iv["estimate_lo"], iv["estimate_hi"]
    est = _num(lo, digits) if np.isclose(lo, hi) else f"{_num(lo, digits)}–{_num(hi, digits)}"
    text = f"{est} [{_num(iv['ci_lo'], digits)}, {_num(iv['ci_hi'], digits)}]"
    if iv.get("censored_seeds"):
        text += f" ({iv['censored_seeds']} censored)"
    if iv.get("unpaired_seeds"):
        text += f" (seed(s) {', '.join(map(str, iv['unpaired_seeds']))} unpaired, left out)"
    return text


def _spread(s: dict, digits: int = 0) -> str:
    if not s["n"]:
        return "–"
    return f"{s['mean']:.{digits}f} ± {s['sd']:.{digits}f}" if s["n"] > 1 else f"{s['mean']:.{digits}f}"


def _median(x: dict, digits: int = 0) -> str:
    return f"{x['median']:.{digits}f}" if x["median_reached"] else f"> {x['median']:.{digits}f}"


def _label(m: str) -> str:
    return LABELS.get(m, m)


AXES = {"rollouts": "rollouts spent", "seconds": "wall seconds (steps and their evaluations)"}


def gain_band(curves: list[dict], axis: str, points: int = 60) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Held-out accuracy minus the warm start against ``axis`` (``rollouts`` or ``seconds``, cumulative at
    each evaluation): the mean over seeds and one standard deviation, each seed's curve interpolated
    linearly on a common grid up to the smallest total any seed reached (no seed extrapolated)."""
    grid = np.linspace(0, min(c[axis][-1] for c in curves), points)
    gains = np.array([np.interp(grid, c[axis], c["accuracy"] - c["accuracy"][0]) for c in curves])
    return grid, gains.mean(0), gains.std(0, ddof=1) if len(gains) > 1 else np.zeros_like(grid)


def figure(analysis: dict):
    """Two panels per method, side by side: accuracy gain against rollouts and against wall seconds
    (a method that saves rollouts must save seconds too); GRPO and DS drawn in every panel for reference,
    averaged over the panel's method's seeds, so a method with fewer seeds is compared on its own seeds."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(analysis["per_seed"])
    curves = {m: {s: x["curve"] for s, x in analysis["per_seed"][m].items()} for m in methods}
    all_seeds = sorted(analysis["targets"])
    per_row = 2  # methods a row, each with one panel per axis
    rows = -(-len(methods) // per_row)
    fig, axes = plt.subplots(rows, per_row * len(AXES), figsize=(4 * per_row * len(AXES), 3.1 * rows),
                             sharey=True, squeeze=False)
    refs = {}  # a baseline's band over the seeds of the panel's method (paired), computed once per seed set

    def ref(b, seeds, axis):
        key = (b, seeds, axis)
        if key not in refs:
            refs[key] = gain_band([curves[b][s] for s in seeds], axis)
        return refs[key]

    for i, m in enumerate(methods):
        seeds = tuple(sorted(curves[m]))
        for j, axis in enumerate(AXES):
            ax = axes[i // per_row, (i % per_row) * len(AXES) + j]
            for b in BASELINES:
                if b != m and b in curves and set(seeds) <= set(curves[b]):
                    x, mu, _ = ref(b, seeds, axis)
                    ax.plot(x, mu, color="0.45", ls="--" if b == "ds" else ":", lw=1.2, label=_label(b))
            x, mu, sd = gain_band(list(curves[m].values()), axis)
            ax.plot(x, mu, color="C0", lw=2, label=_label(m))
            ax.fill_between(x, mu - sd, mu + sd, color="C0", alpha=0.25)
            ax.set_title(_label(m) + ("" if list(seeds) == all_seeds else f" (seeds {', '.join(map(str, seeds))})"),
                         fontsize=9)
            ax.set_xlabel(AXES[axis], fontsize=8)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=6, loc="lower right")
    for ax in axes.flat[len(methods) * len(AXES):]:
        ax.axis("off")
    for ax in axes[:, 0]:
        ax.set_ylabel("accuracy - warm start")
    fig.suptitle(f"held-out {analysis['metric']} gain over each seed's warm start against rollouts and wall "
                 f"seconds: mean and ± 1 sd over seeds {', '.join(map(str, all_seeds))} (or the panel's; GRPO "
                 "and DS over the same seeds)", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.4 / fig.get_figheight()))  # 0.4 inch of the top for the title
    return fig


def plot(analysis: dict, path: str) -> str:
    """Save :func:`figure` to ``path``."""
    import matplotlib.pyplot as plt
    fig = figure(analysis)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _setup(plan, analysis, command) -> list[str]:
    seeds = sorted(analysis["targets"])
    flat = {True: "reached", False: "**still moving**", None: "not measured"}
    targets = ", ".join(f"seed {s}: {analysis['targets'][s]:.4f} (warm start {analysis['starts'][s]:.4f}, GRPO "
                        f"plateau {analysis['plateaus'][s]:.4f}, {flat[analysis['grpo_plateau_reached'][s]]}; peak "
                        f"{analysis['peaks'][s]:.4f}; H = {analysis['horizons'][s]:.0f})" for s in seeds)
    compared = ("every allocation method" if set(DEFAULT_METHODS) <= set(plan.methods)
                else "; ".join(_label(m) for m in plan.methods))
    lines = [
        f"# Efficiency study: {compared} on the built-in task", "",
        f"Generated by `{command}` on {datetime.date.today().isoformat()}; machine: {analysis.get('machine', '?')}; "
        f"this invocation took {analysis.get('study_seconds', 0) / 60:.1f} min (finished runs are reused, not "
        f"retrained). Base preset `{plan.base_config or 'built-in defaults'}`, seeds {', '.join(map(str, seeds))}, "
        f"{'--quick settings' if plan.quick else 'full settings'}. Paired design: every method of a seed starts "
        "from that seed's cached warm start, with the same seed for every random stream (prompt draws, sampling, "
        "update), and differs only in its allocation overrides (`passrate_jax/study/methods.py`).", "",
        f"**Accuracy**: held-out `{analysis['metric']}`. **Target** per seed: the warm start's accuracy plus "
        f"{analysis['target_fraction']:.0%} of that seed's GRPO gain to its plateau (mean of its last "
        f"{PLATEAU_EVALS} evaluations after step 0; *reached* when they lie within one standard error of each "
        f"other, else GRPO was still learning and the target is an early one), and GRPO's **peak** (its highest "
        f"evaluation after step 0, the PS paper's yardstick for steps to the baseline's peak): {targets}. "
        "A run reaches the target at its first "
        "evaluation after step 0 at or above it. A run that never reaches it is **censored**, never dropped: "
        "per method the to-target columns are Kaplan-Meier medians over seeds (`> x` when the median is not "
        "reached: the runs needed more than they spent); against a baseline, a seed whose method run missed "
        "the target bounds that seed's factor from above only (the method needed more than its whole run), a "
        "seed whose baseline missed bounds it from below only, and the interval below then runs from the lower "
        "bounds' to the upper bounds' "
        "quantiles.", "",
        f"**Factors** are baseline / method for costs (rollouts, steps, seconds, rollouts per valid group) and "
        "method / baseline for valid groups per step, so above 1 favours the method; each is the geometric mean "
        "over seeds of the factor computed *within* each seed (that seed's method run against that seed's "
        f"baseline run), shown as estimate [{LEVEL:.0%} interval]: a Student t-interval over seeds of the per-seed "
        "log factors (a percentile bootstrap over 5 seeds has 126 distinct resamples and covers a known mean "
        "about 85% of the time at a nominal 95%: `passrate_jax/study/stats.py`). Accuracy rows are differences "
        "method - baseline (points of accuracy), paired the same way. **Mean accuracy** is the area under held-out accuracy against rollouts divided "
        "by H, the fewest rollouts any method of that seed spent. Wall-clock seconds are this machine's, "
        "shared with whatever else ran meanwhile; rollout and step counts do not depend on the machine.", "",
    ]
    if analysis["no_gain_seeds"]:
        lines += [f"**Warning**: GRPO did not improve on the warm start with seed(s) "
                  f"{', '.join(map(str, analysis['no_gain_seeds']))}, so their target is not above the warm start and "
                  "every run reaches it at its first evaluation: the to-target measures say nothing for them.", ""]
    if plan.headline_seeds:
        heads = [m for m in plan.methods if m in plan.headline]
        lines += [f"**Headline seeds**: {', '.join(_label(m) for m in heads)} also ran seed(s) "
                  f"{', '.join(map(str, plan.headline_seeds))} (`--headline-seeds`): a comparison between two of "
                  f"them pairs {len(plan.seeds) + len(plan.headline_seeds)} seeds, any other "
                  f"{len(plan.seeds)}.", ""]
    lines += pairing_lines(analysis.get("fingerprints", {}), _label)
    if analysis.get("not_trained"):
        missing: dict[str, list[int]] = {}
        for m, s in analysis["not_trained"]:
            missing.setdefault(m, []).append(s)
        lines += ["**Runs left out** (written with `--report-only`; these had not finished): "
                  + "; ".join(f"{_label(m)} seed(s) {', '.join(map(str, s))}" for m, s in missing.items())
                  + ". Each comparison pairs only the seeds both of its methods have.", ""]
    return lines


def _method_table(plan, analysis) -> list[str]:
    ms = analysis["methods"]
    lines = ["## Per method", "",
             "| method | reached | rollouts to target (KM median) | steps to target (KM median) | seconds to "
             "target (KM median) | steps to GRPO's peak (KM median) | final accuracy | mean accuracy over H | "
             "valid groups / step | rollouts / valid group | useful-rollout fraction | rollouts total | wall s |",
             "| --- |" + " --- |" * 12]
    for m in [m for m in plan.methods if m in ms]:
        s = ms[m]
        lines.append(
            f"| {_label(m)} | {s['rollouts_to_target']['reached']}/{len(s['seeds'])} | "
            f"{_median(s['rollouts_to_target'])} | {_median(s['steps_to_target'])} | "
            f"{_median(s['seconds_to_target'])} | {_median(s['steps_to_peak'])} | "
            f"{_spread(s['final_accuracy'], 3)} | {_spread(s['mean_accuracy'], 3)} | "
            f"{_spread(s['valid_groups_per_step'], 1)} | {_spread(s['rollouts_per_valid_group'], 1)} | "
            f"{_spread(s['useful_fraction'], 3)} | {_spread(s['rollouts_total'])} | {_spread(s['wall_seconds'])} |")
    return lines + [""]


def _comparison_tables(plan, analysis) -> list[str]:
    lines = []
    for b in BASELINES:
        rows = [m for m in plan.methods if (m, b) in analysis["comparisons"]]
        if not rows:
            continue
        lines += [f"## Against {_label(b)} (paired over seeds)", "",
                  "| method | rollouts to target × | steps to target × | seconds to target × | rollouts to GRPO's "
                  "peak × | steps to GRPO's peak × | seconds to GRPO's peak × | rollouts / valid group × | valid "
                  "groups / step × | final accuracy − | mean accuracy over H − |",
                  "| --- |" + " --- |" * 10]
        for m in rows:
            c = analysis["comparisons"][(m, b)]
            cells = [fmt_interval(c[k], 2) for k in (*CENSORED, "rollouts_per_valid_group", "valid_groups_per_step")]
            cells += [fmt_interval(c[k], 3) for k in ("final_accuracy", "mean_accuracy")]
            lines.append(f"| {_label(m)} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def _p(x: float) -> str:
    return "<0.001" if x < 1e-3 else f"{x:.3f}"


def _claims_table(analysis) -> list[str]:
    lines = ["## The source papers' claims (docs/design.md 2.6) against this measurement", "",
             "Each claim gives two one-sided t-tests over seeds: *support* (a factor above 1, an accuracy "
             "difference on the claimed side, a difference within the ±0.02 margin by two one-sided tests) and "
             "*against* (a factor below the claimed one, a difference on the other side or outside the margin). "
             f"**Multiplicity**: all the table's p-values are adjusted together by Holm's step-down method, so "
             f"the chance that any verdict below rejects wrongly is at most {1 - LEVEL:.0%}. Verdicts: "
             "*not reproduced in this regime* when the adjusted *against* p is below "
             f"{1 - LEVEL:.2f}; *reproduced* when the adjusted *support* p is and, for a factor, the interval "
             "reaches the claimed factor; else *inconclusive*; *premise not met* (with the probe's number) when "
             "the method's premise probe failed in these runs and the claim was not reproduced: the claim was "
             "not tested where it applies. The papers measured their claims on much larger models (the scale "
             "column); a verdict here is about this regime only. To-target claims leave out seeds where GRPO "
             "gained nothing; with fewer than two seeds a verdict is inconclusive.", "",
             "| claim | source (scale) | the paper's figure (quoted) | measured here | premise probe | "
             "p support / against (Holm) | verdict |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for row in analysis["claims"]:
        c, iv = row["claim"], row["interval"]
        digits = 2 if iv["kind"] == "factor" else 3
        probe = row["premise"]
        mark = "" if probe["met"] is None else " (met)" if probe["met"] else " (**not met**)"
        support, against = row["p_adjusted"]
        lines.append(f"| {_cell(c.label)} | {_cell(c.source)} ({_cell(c.scale)}) | {_cell(c.quote)} | "
                     f"{fmt_interval(iv, digits)} | {_cell(probe['text'])}{mark} | {_p(support)} / {_p(against)} | "
                     f"**{row['verdict']}** |")
    return lines + [""]


def _cell(text: str) -> str:
    """``text`` as one Markdown table cell: a quote's ``|`` (as in ``|SARA - DPS|``) escaped, which else
    ends the cell and shifts the row's later columns."""
    return text.replace("|", "\\|")


def _f(x: float, fmt: str) -> str:
    return "–" if x != x else format(x, fmt)


def _probe_table(plan, analysis) -> list[str]:
    """The premise probes of every run (probes.py), per method and seed."""
    seeds = sorted(analysis["targets"])
    grpo = {s: x["probes"]["rollouts_per_step"] for s, x in analysis["per_seed"].get("grpo", {}).items()}
    lines = ["## Premise probes, per method and seed", "",
             "PS: share of complete re-rollout groups that are mixed (after the warm-up), of how many groups. "
             "Selection: visits per train prompt, share of openings that revisit a prompt. Budget: rollouts per "
             "step against GRPO's of the same seed; Pilot-Commit also the share of pilots kept and the prompts "
             "evicted by the end. Per bucket PS histograms are in the JSON summary.", "",
             "| method | seed | PS re-rollout groups mixed | visits / train prompt | revisits | rollouts / step vs "
             "GRPO | pilots kept | evicted |", "| --- |" + " --- |" * 7]
    for m in [m for m in plan.methods if m in analysis["per_seed"]]:
        for s in seeds:
            x = analysis["per_seed"][m].get(s)
            if x is None:
                continue
            p = x["probes"]
            ps = f"{p['ps_mixed']:.0%} of {p['ps_groups']}" if p["ps_groups"] else "–"
            ratio = p["rollouts_per_step"] / grpo[s] if grpo.get(s) else float("nan")
            pc = m.startswith("pilot_commit")
            lines.append(f"| {_label(m)} | {s} | {ps} | {_f(p['visits_per_prompt'], '.2f')} | "
                         f"{_f(p['revisit_fraction'], '.0%')} | {_f(ratio, '.2f')} | "
                         f"{_f(p['pilots_kept'], '.0%') if pc else '–'} | {_f(p['evicted'], '.0f') if pc else '–'} |")
    return lines + [""]


def _per_seed_table(plan, analysis) -> list[str]:
    seeds = sorted(analysis["targets"])
    lines = ["## Rollouts to the target, per seed", "",
             "`> x`: the run never reached its seed's target; it spent x rollouts in all (censored).", "",
             "| method | " + " | ".join(f"seed {s}" for s in seeds) + " |", "| --- |" + " --- |" * len(seeds)]
    for m in [m for m in plan.methods if m in analysis["per_seed"]]:
        cells = []
        for s in seeds:
            x = analysis["per_seed"][m].get(s)
            v, observed = x["rollouts_to_target"] if x else (float("nan"), True)
            cells.append("–" if x is None else f"{v:.0f}" if observed else f"> {v:.0f}")
        lines.append(f"| {_label(m)} | " + " | ".join(cells) + " |")
    return lines + [""]


def _pooled_mixed(analysis, m: str, b: str) -> str:
    """Share of bucket b's complete re-rollout groups that were mixed, pooled over the method's seeds."""
    hists = [np.asarray(x["probes"]["ps_buckets"][b]["hist"]) for x in analysis["per_seed"][m].values()
             if b in x["probes"]["ps_buckets"]]
    h = np.sum(hists, axis=0) if hists else np.zeros(0)
    return f"{h[1:-1].sum() / h.sum():.0%} of {int(h.sum())}" if h.sum() else "–"


def _ps_table(plan, analysis) -> list[str]:
    ms = analysis["methods"]
    ps = [m for m in plan.methods if m in ms and ms[m]["ps_pass_rate"]]
    if not ps:
        return []
    buckets = sorted({b for m in ps for b in ms[m]["ps_pass_rate"]}, key=int)
    lines = ["## Prefix Sampling re-rollout pass rate per bucket", "",
             f"Bucket = the source group's success count out of N; the controller drives each toward 0.5. Mean over "
             f"the steps after a warm-up of {analysis['ps_warmup']} steps, then mean ± sd over seeds; below it, the "
             "share of the bucket's complete re-rollout groups that were mixed (pooled over seeds). A pass rate "
             "near 0.5 with few mixed groups means the prefix decides the outcome rather than shifting it.", "",
             "| method | " + " | ".join(f"bucket {b}" for b in buckets) + " |", "| --- |" + " --- |" * len(buckets)]
    for m in ps:
        cells = [f"{_spread(ms[m]['ps_pass_rate'].get(b, {'n': 0}), 3)}; mixed {_pooled_mixed(analysis, m, b)}"
                 for b in buckets]
        lines.append(f"| {_label(m)} | " + " | ".join(cells) + " |")
    return lines + [""]


def summary_json(analysis: dict) -> dict:
    """The analysis without the raw curves, JSON-ready (written next to the report)."""
    def clean(x):
        if isinstance(x, dict):
            return {str(k): clean(v) for k, v in x.items() if k != "curve"}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        if isinstance(x, (np.floating, float)):
            return float(x) if np.isfinite(x) else str(float(x))
        return x
    out = {k: v for k, v in analysis.items() if k not in ("comparisons", "claims")}
    out["comparisons"] = {f"{m} vs {b}": v for (m, b), v in analysis["comparisons"].items()}
    out["claims"] = [{"label": r["claim"].label, "quote": r["claim"].quote, "scale": r["claim"].scale,
                      "verdict": r["verdict"], "interval": r["interval"], "p": r["p"], "p_holm": r["p_adjusted"],
                      "premise": r["premise"]} for r in analysis["claims"]]
    return clean(out)


def write_report(plan, analysis: dict, path: str, *, command: str) -> list[str]:
    """Write the Markdown report, its plot and a JSON summary next to it; keeps any text after
    DISCUSSION_MARKER. Returns the paths written."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    stem = os.path.splitext(path)[0]
    png, js = plot(analysis, stem + ".png"), stem + ".json"
    with open(js, "w") as f:
        json.dump(summary_json(analysis), f, indent=1)
    kept = ""
    if os.path.exists(path):
        old = open(path).read()
        if DISCUSSION_MARKER in old:
            kept = old.split(DISCUSSION_MARKER, 1)[1]
    lines = [*_setup(plan, analysis, command), *_method_table(plan, analysis),
             f"![held-out accuracy against rollouts and against wall seconds, bands over seeds]({os.path.basename(png)})", "",
             *_claims_table(analysis), *_probe_table(plan, analysis), *_comparison_tables(plan, analysis),
             *_per_seed_table(plan, analysis), *_ps_table(plan, analysis), DISCUSSION_MARKER]
    with open(path, "w") as f:
        f.write("\n".join(lines) + (kept if kept else "\n"))
    return [path, png, js]

