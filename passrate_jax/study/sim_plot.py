"""The simulator's summary figure (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

import numpy as np


def plot_report(report: dict, path: str) -> None:
    """Write a 3x2 PNG: rollouts per valid group, useful-rollout fraction, pass-rate histograms of
    trained groups, each PS bucket's re-rollout pass rate over time, and per rollout mode (round mode,
    the slot engine) decode slot-steps per trained rollout and slot utilization."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = report["methods"]
    names = list(methods)
    n = report["config"]["group_size"]
    fig, ax = plt.subplots(3, 2, figsize=(14, 13))
    rpv = [methods[m]["rollouts_per_valid_group"] or np.nan for m in names]
    ax[0, 0].barh(names, rpv, color="tab:blue")
    ax[0, 0].axvline(n, color="k", ls="--", lw=1, label=f"limit N = {n}")
    if "ds" in methods:
        ax[0, 0].axvline(methods["ds"]["rollouts_per_valid_group"] * 0.5, color="tab:red", ls=":", label="0.5x DS")
    ax[0, 0].set_xlabel("rollouts per valid group (lower is better)")
    ax[0, 0].invert_yaxis()
    ax[0, 0].legend()
    ax[0, 1].barh(names, [methods[m]["useful_rollout_fraction"] or 0 for m in names], color="tab:green")
    ax[0, 1].axvline(0.8, color="tab:red", ls=":", label="0.8")
    ax[0, 1].set_xlim(0, 1)
    ax[0, 1].set_xlabel("useful-rollout fraction (rollouts in trained valid groups / all)")
    ax[0, 1].invert_yaxis()
    ax[0, 1].legend()
    shown = [m for m in ("uniform", "ds", "sara+dps", "uniform+ps", "sara+dps+ps") if m in methods] or names[:4]
    width = 0.8 / len(shown)
    for i, m in enumerate(shown):
        ax[1, 0].bar(np.arange(n + 1) + i * width, methods[m]["pass_rate_histogram"], width, label=m)
    ax[1, 0].set_xlabel("successes s in a trained full group")
    ax[1, 0].set_ylabel("fraction of trained groups")
    ax[1, 0].legend()
    ps_name = next((m for m in ("sara+dps+ps", "uniform+ps") if m in methods),
                   next((m for m in names if "ps" in methods[m]), None))
    if ps_name is not None:
        ps = methods[ps_name]["ps"]
        rate = np.array([[np.nan if x is None else x for x in row] for row in ps["pass_rate_per_step"]], float)
        for b, s in enumerate(ps["bucket_successes"]):
            series = rate[:, b]
            ok = ~np.isnan(series)
            # A 20-step moving average over the steps that had re-rollouts of this bucket.
            steps = np.nonzero(ok)[0]
            smooth = np.convolve(series[ok], np.ones(20) / 20, mode="valid") if ok.sum() >= 20 else series[ok]
            ax[1, 1].plot(steps[len(steps) - len(smooth):], smooth, label=f"bucket s={s}/{n}")
        ax[1, 1].axhspan(0.45, 0.55, color="grey", alpha=0.2, label="0.5 +- 0.05")
        ax[1, 1].axvline(report["config"]["sim"]["warmup"], color="k", ls=":", lw=1)
        ax[1, 1].set_ylim(0, 1)
        ax[1, 1].set_xlabel("step")
        ax[1, 1].set_ylabel("re-rollout pass rate (20-step moving average)")
        ax[1, 1].set_title(ps_name)
        ax[1, 1].legend()
    _plot_modes(report, ax[2])
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_modes(report: dict, ax) -> None:
    """Bars per method and rollout mode: slot-steps per trained rollout, and slot utilization."""
    methods = report["methods"]
    names = list(methods)
    modes = list(methods[names[0]].get("modes", {}))
    width = 0.8 / max(len(modes), 1)
    y = np.arange(len(names))
    for i, mode in enumerate(modes):
        for a, key in zip(ax, ("slot_steps_per_trained_rollout", "slot_utilization")):
            a.barh(y + i * width, [methods[m]["modes"][mode][key] or np.nan for m in names], width, label=mode)
    cfg = report["config"]
    ax[0].set_xlabel(f"decode slot-steps per trained rollout (lower is better; {cfg.get('slots')} slots, "
                     f"chunks of {cfg.get('chunk_tokens')})")
    ax[1].set_xlabel("decode slot utilization (live rows / rows)")
    ax[1].set_xlim(0, 1)
    for a in ax:
        a.set_yticks(y + width * (len(modes) - 1) / 2, names)
        a.invert_yaxis()
        a.legend()
