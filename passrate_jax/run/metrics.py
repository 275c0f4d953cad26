"""Metrics sinks: one JSON object per step in ``metrics.jsonl``, TensorBoard event files, and trackers
such as Weights & Biases (``passrate_jax/run/trackers.py``), which receive the same records.

Values are converted to plain Python numbers on the host; non-finite floats are written as JSON
``null`` (JSON has no NaN) and skipped in TensorBoard.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import numpy as np
from etils import epath

from passrate_jax.configlib import to_dict
from passrate_jax.run.runfiles import is_remote, read_jsonl  # noqa: F401 - read_jsonl is public here too
from passrate_jax.run.trackers import make_trackers


def to_python(value: Any) -> Any:
    """Arrays and numpy scalars -> Python numbers / lists, recursively; NaN and inf -> None."""
    if isinstance(value, dict):
        return {str(k): to_python(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_python(v) for v in value]
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        arr = np.asarray(value)
        return to_python(arr.tolist()) if arr.ndim else to_python(arr.item())
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _complete_records(text: str) -> list[dict]:
    """The records of a metrics file, without a last line that a killed process left half written
    (its step has no checkpoint, since a step's record is written before its checkpoint)."""
    lines = text.splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines = lines[:-1]
    return [json.loads(line) for line in lines if line.strip()]


def write_text_atomic(path: epath.Path, text: str) -> None:
    """Replace the file at ``path`` with ``text`` so that a kill at any moment leaves the old or the new
    file, never a truncated one (an object store's write is atomic already)."""
    if is_remote(path):
        path.write_text(text)
        return
    tmp = f"{os.fspath(path)}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.fspath(path))


class MetricsWriter:
    """Appends step records to ``run_dir/metrics.jsonl`` and, optionally, TensorBoard events under
    ``run_dir/tensorboard``. Appending lets a resumed run continue the same file; ``truncate_after``
    drops records past the checkpoint a run resumes from, so no step appears twice (-1 for a run
    that starts afresh: records of an attempt killed before its first checkpoint are dropped). A ``gs://`` run
    directory has no append: the file is rewritten whole at every step (a few KB per step)."""

    def __init__(self, run_dir: str | os.PathLike, tensorboard: bool = True, truncate_after: int | None = None,
                 enabled: bool = True, trackers=None):
        self.enabled = enabled  # False on every host but the first of a multi-process run: one writer
        self._tb = None
        if not enabled:
            return
        epath.Path(run_dir).mkdir(parents=True, exist_ok=True)
        self.path = epath.Path(run_dir) / "metrics.jsonl"
        self._remote = is_remote(run_dir)
        self._lines: list[str] = []
        if self.path.exists():
            self._lines = [json.dumps(r) + "\n" for r in _complete_records(self.path.read_text())
                           if truncate_after is None or r.get("step", 0) <= truncate_after]
            if truncate_after is not None:
                write_text_atomic(self.path, "".join(self._lines))
                _truncate_samples(self.path.parent / "samples.jsonl", truncate_after)
        self._file = None if self._remote else open(self.path, "a")
        if tensorboard:
            from tensorboardX import SummaryWriter
            self._tb = SummaryWriter(os.path.join(os.fspath(run_dir), "tensorboard"))
        # A callable run_dir -> trackers, called only on the writing host (so one W&B run per run).
        self._trackers = list(trackers(run_dir)) if trackers is not None else []

    def write(self, record: dict) -> None:
        """Write one step's record; it must hold ``step``."""
        if not self.enabled:
            return
        record = to_python(record)
        line = json.dumps(record) + "\n"
        if self._file is not None:
            self._file.write(line)
            self._file.flush()
        else:
            self._lines.append(line)
            self.path.write_text("".join(self._lines))
        if self._tb is not None:
            step = int(record["step"])
            for key, value in flatten(record):
                if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tb.add_scalar(key, value, step)
        for tracker in self._trackers:
            tracker.log(record)

    def write_samples(self, rows: list[dict]) -> None:
        """A few (step, prompt, completion, reward) rows: appended to ``samples.jsonl``, as one markdown
        table of TensorBoard text and to each tracker that takes samples (W&B: a table)."""
        if not self.enabled or not rows:
            return
        rows = [to_python(r) for r in rows]
        path = self.path.parent / "samples.jsonl"
        text = "".join(json.dumps(r) + "\n" for r in rows)
        if self._remote:
            path.write_text((path.read_text() if path.exists() else "") + text)
        else:
            with open(os.fspath(path), "a") as f:
                f.write(text)
        if self._tb is not None:
            cell = lambda v: str(v).replace("|", "\\|").replace("\n", "<br>")  # noqa: E731 - one markdown cell
            table = "| reward | prompt | completion |\n|---|---|---|\n" + "".join(
                f"| {r['reward']:.3g} | {cell(r['prompt'])} | {cell(r['completion'])} |\n" for r in rows)
            self._tb.add_text("samples", table, int(rows[0]["step"]))
        for tracker in self._trackers:
            if hasattr(tracker, "log_samples"):
                tracker.log_samples(rows)

    @classmethod
    def for_run(cls, cfg, run_dir: str | os.PathLike, *, truncate_after: int | None = None,
                enabled: bool = True) -> MetricsWriter:
        """The writer a run's config asks for (``cfg.logging``: TensorBoard, W&B with the config attached)."""
        return cls(run_dir, tensorboard=cfg.logging.tensorboard, truncate_after=truncate_after, enabled=enabled,
                   trackers=lambda d: make_trackers(cfg.logging, os.fspath(d), to_dict(cfg)))

    def close(self) -> None:
        if not self.enabled:
            return
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
        for tracker in self._trackers:
            tracker.close()


def _truncate_samples(path: epath.Path, after: int) -> None:
    """Drop the sample rows past step ``after`` (the checkpoint a run resumes from), as for metrics."""
    if path.exists():
        rows = [r for r in _complete_records(path.read_text()) if r.get("step", 0) <= after]
        write_text_atomic(path, "".join(json.dumps(r) + "\n" for r in rows))


def flatten(record: dict, prefix: str = "", sep: str = "/"):
    """Yield (joined key, value) for every leaf of a nested dict, keys joined with ``sep``."""
    for key, value in record.items():
        if isinstance(value, dict):
            yield from flatten(value, f"{prefix}{key}{sep}", sep)
        else:
            yield prefix + key, value
