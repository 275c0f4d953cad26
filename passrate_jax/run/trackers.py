"""Experiment trackers fed by the metrics writer: every ``metrics.jsonl`` record also goes to Weights & Biases.

    logging:
      wandb: true              # pip install passrate-jax[wandb]
      wandb_project: my-rlvr
      wandb_mode: offline      # online | offline (no network; `wandb sync` later) | disabled

A tracker has ``log(record)`` (one step's record, as written to metrics.jsonl) and ``close()``. The
W&B run lives under ``run_dir/wandb`` and its id is kept in ``run_dir/wandb_id``, so a resumed run keeps
logging to the same W&B run. At close the run's plots (``passrate-jax plot``) are logged as images.
"""

from __future__ import annotations

import logging
import os
import secrets
from typing import Any

from etils import epath

from passrate_jax.configlib import ConfigError
from passrate_jax.run.plot import plot_run
from passrate_jax.run.runfiles import is_remote

log = logging.getLogger(__name__)
INSTALL_HINT = "pip install 'passrate-jax[wandb]'"


def check_wandb_installed() -> None:
    """ConfigError (before any compute) when ``logging.wandb`` is on and wandb cannot be imported."""
    try:
        import wandb  # noqa: F401
    except ImportError as e:
        raise ConfigError(f"logging.wandb = true: wandb is not installed ({e}); {INSTALL_HINT}, or set "
                          "logging.wandb=false") from None


def scalars(record: dict, prefix: str = "") -> dict[str, float]:
    """The numbers of a metrics record, nested dicts and lists flattened to ``a/b`` and ``a/0`` keys; the
    ``step`` key, nulls (non-finite values) and strings are left out."""
    out: dict[str, float] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(scalars(value, name + "/"))
        elif isinstance(value, (list, tuple)):
            out.update(scalars({str(i): v for i, v in enumerate(value)}, name + "/"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and name != "step":
            out[name] = value
        elif isinstance(value, bool):
            out[name] = int(value)
    return out


class WandbTracker:
    """One W&B run per run directory (see the module docstring)."""

    def __init__(self, run_dir: str, *, project: str, name: str = "", tags: tuple[str, ...] = (),
                 mode: str = "online", config: dict[str, Any] | None = None) -> None:
        check_wandb_installed()
        import wandb

        self.run_dir = os.fspath(run_dir)
        id_file = epath.Path(self.run_dir) / "wandb_id"
        run_id = id_file.read_text().strip() if id_file.exists() else secrets.token_hex(6)
        id_file.write_text(run_id)
        # W&B writes its files locally: into the run directory, or for a gs:// run where WANDB_DIR says.
        self._run = wandb.init(project=project, name=name or os.path.basename(self.run_dir.rstrip("/")),
                               tags=list(tags), mode=mode, dir=None if is_remote(self.run_dir) else self.run_dir,
                               id=run_id, resume="allow", config=config or {})

    def log(self, record: dict) -> None:
        self._run.log(scalars(record), step=int(record["step"]))

    def log_samples(self, rows: list[dict]) -> None:
        """A step's (prompt, completion, reward) samples as a W&B table (``samples``)."""
        import wandb

        columns = ["step", "prompt", "completion", "reward"]
        table = wandb.Table(columns=columns, data=[[r[c] for c in columns] for r in rows])
        self._run.log({"samples": table}, step=int(rows[0]["step"]))

    def close(self) -> None:
        import wandb

        try:
            self._run.log({f"plots/{os.path.splitext(os.path.basename(p))[0]}": wandb.Image(p)
                           for p in plot_run(self.run_dir)})
        except Exception as e:  # noqa: BLE001 - a figure that fails to draw must not lose the run's metrics
            log.warning("wandb: plots not logged: %s", e)
        self._run.finish()
        # finish() can return before W&B's writer process has flushed an offline run's .wandb file (read back
        # right after, it sometimes held no history); teardown waits for that process to exit. A later
        # wandb.init starts a new one.
        wandb.teardown()


def make_trackers(logging_cfg, run_dir: str, config: dict[str, Any] | None = None) -> list:
    """The trackers ``logging_cfg`` (a :class:`passrate_jax.run.config.LoggingConfig`) turns on, for ``run_dir``."""
    if not logging_cfg.wandb:
        return []
    return [WandbTracker(run_dir, project=logging_cfg.wandb_project, name=logging_cfg.wandb_name,
                         tags=logging_cfg.wandb_tags, mode=logging_cfg.wandb_mode, config=config)]
