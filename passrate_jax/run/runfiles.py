"""Reading a run directory's files, local or ``gs://``: below both the metrics writer and the readers
of its output (plots, trackers, studies), so none of them imports another to reach these."""

from __future__ import annotations

import json
import os

from etils import epath


def is_remote(path: str | os.PathLike) -> bool:
    """A URL such as ``gs://bucket/run`` (read and written through etils.epath) rather than a local path."""
    return "://" in os.fspath(path)


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """All records of a metrics file (a local path or a ``gs://`` URL), in order."""
    return [json.loads(line) for line in epath.Path(path).read_text().splitlines() if line.strip()]
