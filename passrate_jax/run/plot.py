"""``passrate-jax plot --run-dir DIR``: PNG figures of a run's ``metrics.jsonl``.

Reads only the metrics file, so it works on a finished run, a running one, or a copy of the file.
Figures: accuracy (training and held-out) against rollouts spent, valid-group fraction and rollouts
per step, Prefix Sampling ratios and EMAs per bucket, and the pass-rate histogram of trained groups.
"""

from __future__ import annotations

import os

import numpy as np

from passrate_jax.configlib import UserError, UserFileError
from passrate_jax.run.runfiles import read_jsonl


def _series(records, key):
    xs, ys = [], []
    for r in records:
        value = r.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            xs.append(r.get("rollouts_total", r["step"]))
            ys.append(value)
    return np.asarray(xs), np.asarray(ys)


def _by_step(records, key):
    steps = [r["step"] for r in records if isinstance(r.get(key), (int, float))]
    return np.asarray(steps), np.asarray([r[key] for r in records if isinstance(r.get(key), (int, float))])


def plot_run(run_dir: str | os.PathLike, out_dir: str | os.PathLike | None = None) -> list[str]:
    """Write the run's figures as PNGs (default: ``run_dir/plots``); returns their paths."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = os.path.join(os.fspath(run_dir), "metrics.jsonl")
    if not os.path.exists(path):
        what = "no such directory" if not os.path.isdir(run_dir) else f"{path} does not exist"
        raise UserFileError(f"--run-dir {os.fspath(run_dir)!r}: {what}, so it is not a run directory; give the "
                            "directory of a run (passrate-jax train --run-dir DIR writes metrics.jsonl there)")
    records = read_jsonl(path)
    if not records:
        raise UserError(f"--run-dir {os.fspath(run_dir)!r}: {path} holds no records yet; plot it after the first step")
    out_dir = os.fspath(out_dir or os.path.join(os.fspath(run_dir), "plots"))
    os.makedirs(out_dir, exist_ok=True)
    written = []
    for name, draw in (("accuracy_vs_rollouts.png", _accuracy_figure), ("groups_and_rollouts.png", _groups_figure),
                       ("prefix_sampling.png", _prefix_figure), ("pass_rate_histogram.png", _histogram_figure)):
        fig = draw(plt, records)
        if fig is None:  # the run has none of the figure's metrics (e.g. no Prefix Sampling)
            continue
        fig.tight_layout()
        target = os.path.join(out_dir, name)
        fig.savefig(target, dpi=110, bbox_inches="tight")
        plt.close(fig)
        written.append(target)
    return written


def _accuracy_figure(plt, records: list[dict]):
    fig, ax = plt.subplots(figsize=(6, 4))
    x, y = _series(records, "train_accuracy")
    if len(x):
        # The per-step reward swings with the step's prompts: the raw series faint, a 10-step mean on top.
        line, = ax.plot(x, y, alpha=0.3, lw=1)
        window = min(10, len(y))
        ax.plot(x[window - 1:], np.convolve(y, np.ones(window) / window, mode="valid"), color=line.get_color(),
                label=f"training (rollout reward, {window}-step mean)")
    for key, label in (("eval_accuracy", "held-out, greedy"), ("eval_sampled_accuracy", "held-out, sampled")):
        x, y = _series(records, key)
        if not len(x):
            continue
        line, = ax.plot(x, y, marker="o", label=label)
        xs, se = _series(records, f"{key}_se")
        if np.array_equal(xs, x):  # a band of +- one standard error over prompts, where every point has one
            ax.fill_between(x, y - se, y + se, color=line.get_color(), alpha=0.2, lw=0,
                            label=f"{label}, +- 1 standard error")
    ax.set_xlabel("rollouts spent")
    ax.set_ylabel("accuracy")
    # Below the axes: inside, the legend covered the greedy curve, which sits near the top.
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, fontsize=8, frameon=False)
    ax.set_title("accuracy against rollouts spent")
    return fig


def _groups_figure(plt, records: list[dict]):
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    x, y = _by_step(records, "valid_group_fraction")
    ax1.plot(x, y)
    ax1.set_ylim(0, 1.05)
    ax1.set_xlabel("step")
    ax1.set_title("valid-group fraction")
    x, y = _by_step(records, "rollouts_step")
    ax2.plot(x, y)
    ax2.set_xlabel("step")
    ax2.set_title("rollouts per step")
    return fig


def _prefix_figure(plt, records: list[dict]):
    buckets = sorted({k.split("/")[-1] for r in records for k in r if k.startswith("ps/ratio/")}, key=int)
    if not buckets:
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for b in buckets:
        x, y = _by_step(records, f"ps/ratio/{b}")
        ax1.plot(x, y, label=f"s={b}")
        x, y = _by_step(records, f"ps/ema/{b}")
        ax2.plot(x, y, label=f"s={b}")
    ax1.set_title("prefix ratio per bucket")
    ax2.axhline(0.5, color="gray", linestyle="--", linewidth=1)
    ax2.set_title("re-rollout pass-rate EMA per bucket")
    for ax in (ax1, ax2):
        ax.set_xlabel("step")
        ax.set_ylim(0, 1)
        ax.legend()
    return fig


def _histogram_figure(plt, records: list[dict]):
    hists = [r["pass_rate_hist"] for r in records if isinstance(r.get("pass_rate_hist"), list)]
    if not hists:
        return None
    total = np.sum(np.asarray(hists, dtype=float), axis=0)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar(np.arange(len(total)), total / max(total.sum(), 1))
    ax.set_xlabel("successes in the group")
    ax.set_ylabel("fraction of trained groups")
    ax.set_title("pass-rate histogram of trained groups")
    return fig


def add_subparser(subparsers) -> None:
    p = subparsers.add_parser("plot", help="write PNG figures of a run's metrics")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--out-dir", default=None, help="default: RUN_DIR/plots")
    p.set_defaults(func=run)


def run(args) -> int:
    for path in plot_run(args.run_dir, args.out_dir):
        print(path)
    return 0
