"""``passrate-jax train``: train (or resume) a run, then say where its files are: the last numbers, any
warnings about the rewards (failures, nothing trained), and the paths of ``metrics.jsonl``,
``samples.jsonl``, the plots (drawn at the end) and the checkpoint."""

from __future__ import annotations

import os

from passrate_jax import distributed
from passrate_jax.configlib import add_config_arguments
from passrate_jax.run.config import Config, load_config
from passrate_jax.run.plot import plot_run
from passrate_jax.run.train import train

SUMMARY_KEYS = ("step", "rollouts_total", "train_accuracy", "reward/mean", "valid_group_fraction",
                "useful_rollout_fraction", "eval_accuracy", "eval_sampled_accuracy")


# What a bare ``train`` (no --config, no override) trains: the README's first run, not the built-in
# defaults, which have no finite prompt pool and no warm start, so they would not train. Overrides without
# --config still apply to the built-in defaults, as the docs' commands and the tests' tiny runs use them.
DEFAULT_PRESET = "default"


def add_subparser(subparsers) -> None:
    p = subparsers.add_parser("train", help="train (or resume) a run")
    add_config_arguments(p, without=f"the packaged preset '{DEFAULT_PRESET}' when no key=value override is given, "
                                    "else the built-in defaults")
    p.add_argument("--run-dir", default=None, help="default: runs/<config name>")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=run)


def run_config(config: str | None, overrides: list[str], log=print) -> tuple[Config, str]:
    """The run's config and its name (the default run directory is runs/<name>): ``config`` (None: the
    built-in defaults) with ``overrides``; with neither, the packaged default preset, said in one ``log`` line."""
    if config is None and not overrides:
        log(f"no --config: training the packaged preset '{DEFAULT_PRESET}' (passrate-jax info --presets lists "
            "the others)")
        config = DEFAULT_PRESET
    name = os.path.splitext(os.path.basename(config))[0] if config else DEFAULT_PRESET
    return load_config(config, overrides), name


def run(args) -> int:
    cfg, name = run_config(args.config, args.overrides)
    run_dir = args.run_dir or os.path.join("runs", name)
    summary = train(cfg, run_dir, progress=not args.no_progress)
    if distributed.is_primary():
        print_summary(summary, cfg)
    return 0


def print_summary(summary: dict, cfg: Config) -> None:
    """The run's last numbers, its warnings (reward failures, nothing trained) and where its files are:
    metrics, the plots (drawn now) and the checkpoint."""
    run_dir, last = summary["run_dir"], summary["last"]
    if last:
        shown = {k: last[k] for k in SUMMARY_KEYS if k in last}
        print(f"run {run_dir}: " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                               for k, v in shown.items()))
    for note in summary["notes"]:
        print(note)
    print(f"metrics:    {os.path.join(run_dir, 'metrics.jsonl')}")
    if cfg.logging.samples_every and os.path.exists(os.path.join(run_dir, "samples.jsonl")):
        print(f"samples:    {os.path.join(run_dir, 'samples.jsonl')}")
    try:
        plots = plot_run(run_dir)
        print(f"plots:      {os.path.dirname(plots[0])}/ ({', '.join(os.path.basename(p) for p in plots)})")
    except Exception as e:  # noqa: BLE001 - a figure that fails to draw must not fail a finished run
        print(f"plots:      not drawn ({type(e).__name__}: {e}); passrate-jax plot --run-dir {run_dir}")
    print(f"checkpoint: {summary['checkpoint']} (step {summary['step']}; passrate-jax export --run-dir {run_dir} "
          "--out DIR makes a Hugging Face model of it)")
