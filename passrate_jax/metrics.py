"""Metrics sinks: one JSON object per step in ``metrics.jsonl`` and TensorBoard event files.

Values are converted to plain Python numbers on the host; non-finite floats are written as JSON
``null`` (JSON has no NaN) and skipped in TensorBoard.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import numpy as np


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


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """All records of a metrics file, in order."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


class MetricsWriter:
    """Appends step records to ``run_dir/metrics.jsonl`` and, optionally, TensorBoard events under
    ``run_dir/tensorboard``. Appending lets a resumed run continue the same file; ``truncate_after``
    drops records past the checkpoint a run resumes from, so no step appears twice."""

    def __init__(self, run_dir: str | os.PathLike, tensorboard: bool = True, truncate_after: int | None = None,
                 enabled: bool = True):
        self.enabled = enabled  # False on every host but the first of a multi-process run: one writer
        self._tb = None
        if not enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        self.path = os.path.join(os.fspath(run_dir), "metrics.jsonl")
        if truncate_after is not None and os.path.exists(self.path):
            kept = [r for r in read_jsonl(self.path) if r.get("step", 0) <= truncate_after]
            with open(self.path, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in kept)
        self._file = open(self.path, "a")
        if tensorboard:
            from tensorboardX import SummaryWriter
            self._tb = SummaryWriter(os.path.join(os.fspath(run_dir), "tensorboard"))

    def write(self, record: dict) -> None:
        """Write one step's record; it must hold ``step``."""
        if not self.enabled:
            return
        record = to_python(record)
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            step = int(record["step"])
            for key, value in flatten(record):
                if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tb.add_scalar(key, value, step)

    def close(self) -> None:
        if not self.enabled:
            return
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def flatten(record: dict, prefix: str = "", sep: str = "/"):
    """Yield (joined key, value) for every leaf of a nested dict, keys joined with ``sep``."""
    for key, value in record.items():
        if isinstance(value, dict):
            yield from flatten(value, f"{prefix}{key}{sep}", sep)
        else:
            yield prefix + key, value
