"""Prompt sources: one resumable, seeded stream of prompt records over built-in tasks, files and TFDS.

    source = make_source(cfg.data)                  # DataConfig -> PromptSource (passrate_jax/data/configured.py)
    batch = source.take(64)                         # list[PromptRecord], crossing epochs as needed
    ckpt["data"] = source.state()                   # small JSON-serialisable dict
    ...
    source.restore(ckpt["data"])                    # the next take() continues exactly where it left off
    evals = source.heldout(256)                     # first K records of the held-out split, fixed order

A :class:`PromptSource` is a row getter plus a position. Finite sources (files, TFDS, a fixed pool of
built-in problems) visit their rows once per epoch, in a permutation drawn from (seed, epoch) when
shuffling, so the order of any epoch is a pure function of the seed and restoring a position needs no
saved permutation. The built-in tasks' default train split is an endless stream: record i is problem i
of the task's train split, already random, so it has one endless epoch.

Bad rows (malformed JSON, a missing or empty field) raise :class:`BadDataError` naming the file, the
1-based line or row and the field; with ``skip_bad_rows`` they are skipped and counted instead
(``source.metrics()["data/skipped_rows"]``).
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import logging
import os
import random
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from passrate_jax.configlib import UserError, UserFileError
from passrate_jax.data.formatting import extract_answer
from passrate_jax.data.tasks import Problem, Task, reference_solution, task_with_levels

log = logging.getLogger(__name__)
_ID_MASK = (1 << 63) - 1
# Bad-row messages kept in full for logs; beyond that they are only counted.
_KEPT_MESSAGES = 20


@dataclasses.dataclass(frozen=True)
class PromptRecord:
    """One prompt: a stable id (non-negative int < 2**63; the key of per-prompt allocation state), the
    raw prompt text (before templates), the reference answer, and JSON-serialisable metadata
    (``solution``: a worked solution when known; ``row``: the 1-based line or row it came from)."""
    prompt_id: int
    prompt: str
    answer: str
    metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)


def stable_id(text: str) -> int:
    """A 63-bit id of ``text``, the same in every process and Python version (unlike ``hash``)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big") & _ID_MASK


class BadDataError(UserError, ValueError):
    """A row of a prompt file cannot be used. ``where`` is the file (or dataset split), ``line`` the
    1-based line (JSONL) or row (Parquet, TFDS), ``field`` the field at fault, when there is one."""

    def __init__(self, where: str, line: int | None, field: str | None, problem: str) -> None:
        self.where, self.line, self.field, self.problem = where, line, field, problem
        place = where if line is None else f"{where}:{line}"
        super().__init__(f"{place}: " + (f"field {field!r}: " if field else "") + problem)


class BadRows:
    """Raises bad-row errors, or with ``skip`` counts and logs them: the skip policy shared by sources."""

    def __init__(self, skip: bool = False) -> None:
        self.skip = skip
        self.count = 0
        self.messages: list[str] = []
        self._seen: set[tuple[str, int | None]] = set()

    def handle(self, error: BadDataError) -> None:
        if not self.skip:
            raise error
        key = (error.where, error.line)
        if key in self._seen:  # a lazily read row met again in a later epoch is one bad row, not two
            return
        self._seen.add(key)
        self.count += 1
        if len(self.messages) < _KEPT_MESSAGES:
            self.messages.append(str(error))
            log.warning("skipping bad row: %s", error)


# The config key that names each field of :class:`Fields`, for messages that say what to set.
_FIELD_KEYS = {"prompt": "data.prompt_field", "answer": "data.answer_field", "id": "data.id_field"}
# Usual names of a dataset's prompt and answer fields, tried first when suggesting which to set.
_USUAL_NAMES = {"prompt": ("question", "problem", "prompt", "input", "query", "instruction"),
                "answer": ("answer", "solution", "output", "target", "response", "label")}


def missing_field(row: Mapping[str, Any], fields: "Fields", role: str) -> str:
    """The problem text of a row without its ``role`` field: the row's fields and the key to set, with
    the row's most likely field as the example (``data.prompt_field=question``)."""
    names = [str(k) for k in row]
    others = {getattr(fields, r) for r in _FIELD_KEYS if r != role}
    candidates = [n for n in names if n not in others]
    guess = next((n for n in _USUAL_NAMES.get(role, ()) if n in candidates), None)
    guess = guess or next(iter(difflib.get_close_matches(getattr(fields, role), candidates, n=1, cutoff=0.5)),
                          None) or (candidates[0] if candidates else None)
    fix = f"; set {_FIELD_KEYS[role]}={guess}" if guess else ""
    return f"missing; the row has fields {names}{fix}"


@dataclasses.dataclass(frozen=True)
class Fields:
    """Which fields of a row hold the prompt, the answer and (optionally) the id; ``reference_extract``
    pulls the reference out of a worked answer (``gsm8k``: after ``####``; ``boxed``: the last box)."""
    prompt: str = "prompt"
    answer: str = "answer"
    id: str = ""
    reference_extract: str = "none"


def _plain(value: Any) -> Any:
    """A TFDS/Arrow value as plain JSON-able Python: bytes -> str, numpy scalars/arrays -> int/float/list."""
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    if isinstance(value, np.ndarray):
        return [_plain(v) for v in value.tolist()]
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def row_to_record(row: Mapping[str, Any], fields: Fields, where: str, line: int) -> PromptRecord:
    """A validated :class:`PromptRecord` from one row; :class:`BadDataError` on a missing, empty or
    mistyped field. Fields other than prompt/answer/id with JSON-scalar or list values go to metadata."""
    if not isinstance(row, Mapping):
        raise BadDataError(where, line, None, f"expected a JSON object, got {type(row).__name__}")
    prompt = _plain(row.get(fields.prompt))
    if fields.prompt not in row or prompt is None:
        raise BadDataError(where, line, fields.prompt, missing_field(row, fields, "prompt"))
    if not isinstance(prompt, str) or not prompt.strip():
        raise BadDataError(where, line, fields.prompt, f"must be a non-empty string, got {prompt!r:.60}")
    raw = _plain(row.get(fields.answer))
    if fields.answer not in row or raw is None:
        raise BadDataError(where, line, fields.answer, missing_field(row, fields, "answer"))
    if isinstance(raw, bool) or not isinstance(raw, (str, int, float)) or not str(raw).strip():
        raise BadDataError(where, line, fields.answer, f"must be a non-empty string or number, got {raw!r:.60}")
    answer = extract_answer(str(raw), fields.reference_extract)
    if answer is None:
        plain = isinstance(raw, (int, float)) or len(str(raw).split()) == 1  # a bare number or word
        fix = "; a plain answer needs no extraction: set data.reference_extract=none" if plain else ""
        raise BadDataError(where, line, fields.answer, f"no {fields.reference_extract} answer in {str(raw)!r:.80} "
                           f"(data.reference_extract = {fields.reference_extract!r}){fix}")
    if fields.id:
        value = _plain(row.get(fields.id))
        if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= _ID_MASK:
            prompt_id = value
        elif isinstance(value, str) and value:
            prompt_id = stable_id(value)
        else:
            raise BadDataError(where, line, fields.id, f"must be an int in [0, 2**63) or a non-empty string, "
                                                       f"got {value!r:.60}")
    else:
        prompt_id = stable_id(prompt)
    metadata = {k: _plain(v) for k, v in row.items() if k not in (fields.prompt, fields.answer, fields.id)}
    metadata = {k: v for k, v in metadata.items() if v is None or isinstance(v, (str, int, float, bool, list))}
    if fields.reference_extract != "none":
        metadata["solution"] = str(raw)
    metadata["row"] = line
    return PromptRecord(prompt_id, prompt, answer, metadata)


def read_jsonl(path: str | os.PathLike, fields: Fields = Fields(), bad: BadRows | None = None) -> list[PromptRecord]:
    """Every valid record of a JSON-lines file (blank lines ignored), in file order."""
    bad = bad if bad is not None else BadRows()
    records, where = [], str(path)
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise BadDataError(where, line_no, None, f"malformed JSON ({e.msg} at column {e.colno})") from None
                records.append(row_to_record(row, fields, where, line_no))
            except BadDataError as e:
                bad.handle(e)
    return records


def read_parquet(path: str | os.PathLike, fields: Fields = Fields(), bad: BadRows | None = None) -> list[PromptRecord]:
    """Every valid record of a Parquet file, rows numbered from 1. A missing column fails even when
    skipping bad rows: it would skip every row."""
    import pyarrow.parquet as pq

    bad = bad if bad is not None else BadRows()
    table, where = pq.read_table(path), str(path)
    for name in (fields.prompt, fields.answer, fields.id):
        if name and name not in table.column_names:
            raise BadDataError(where, None, name, f"no such column; the file has {table.column_names}")
    records = []
    for row_no, row in enumerate(table.to_pylist(), start=1):
        try:
            records.append(row_to_record(row, fields, where, row_no))
        except BadDataError as e:
            bad.handle(e)
    return records


def builtin_record(problem: Problem) -> PromptRecord:
    """The record of a built-in task problem; its metadata holds what the task's verifier needs."""
    metadata = dict(problem.metadata, numbers=list(problem.numbers), target=problem.target,
                    solution=reference_solution(problem))
    return PromptRecord(problem.prompt_id, problem.prompt, problem.answer, metadata)


def builtin_problem(record: PromptRecord) -> Problem:
    """The built-in :class:`Problem` behind ``record`` (from the built-in source or its TFDS build), as
    far as verification needs it (countdown's generating operations are not kept)."""
    m = record.metadata
    return Problem(task=m["task"], prompt_id=record.prompt_id, prompt=record.prompt, answer=record.answer,
                   level=int(m["level"]), numbers=tuple(int(x) for x in m["numbers"]), target=int(m["target"]),
                   op=m.get("op", ""), carries=int(m.get("carries", 0)))


class PromptSource:
    """A resumable stream of :class:`PromptRecord` (see the module docstring).

    ``get(i)`` returns row ``i`` (in storage order) or None for a bad row that was skipped; ``size`` is
    the row count, None for an endless stream; ``heldout_get(k)`` returns the first ``k`` held-out
    records. The position is ``state()``: ``{"epoch", "index"}`` (``index`` counts rows of the
    current epoch already taken) plus the seed, size and shuffle flag it is only valid for.
    """

    def __init__(self, name: str, get: Callable[[int], PromptRecord | None], size: int | None,
                 heldout_get: Callable[[int], list[PromptRecord]], *, seed: int = 0, shuffle: bool = True,
                 bad: BadRows | None = None, default_heldout: int = 256) -> None:
        if size is not None and size <= 0:
            raise ValueError(f"{name}: no usable rows")
        self.name, self.size, self.seed, self.shuffle = name, size, seed, bool(shuffle and size is not None)
        self._get, self._heldout_get = get, heldout_get
        self.bad = bad if bad is not None else BadRows()
        self.default_heldout = default_heldout
        self.epoch, self.index = 0, 0
        self._order: tuple[int, np.ndarray] | None = None

    def _row(self, epoch: int, index: int) -> int:
        if not self.shuffle:
            return index
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, np.random.default_rng([self.seed, epoch]).permutation(self.size))
        return int(self._order[1][index])

    def take(self, n: int) -> list[PromptRecord]:
        """The next ``n`` records, starting a new epoch (a new permutation) whenever one is exhausted."""
        out: list[PromptRecord] = []
        skipped_in_a_row = 0
        while len(out) < n:
            if self.size is not None and self.index >= self.size:
                self.epoch, self.index = self.epoch + 1, 0
            record = self._get(self._row(self.epoch, self.index))
            self.index += 1
            if record is None:
                skipped_in_a_row += 1
                if self.size is not None and skipped_in_a_row >= self.size:
                    raise ValueError(f"{self.name}: every row is bad ({self.bad.count} skipped)")
                continue
            skipped_in_a_row = 0
            out.append(record)
        return out

    def __iter__(self):
        return self

    def __next__(self) -> PromptRecord:
        return self.take(1)[0]

    def state(self) -> dict[str, Any]:
        """The position, JSON-serialisable; :meth:`restore` it to continue with the same records."""
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed, "size": self.size,
                "shuffle": self.shuffle}

    def restore(self, state: Mapping[str, Any]) -> None:
        """Continue from a :meth:`state`; ValueError when it was saved for a different seed, row count
        or shuffle setting (its positions would name other rows)."""
        for key in ("seed", "size", "shuffle"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(f"{self.name}: saved data position has {key} = {state[key]!r}, this source has "
                                 f"{getattr(self, key)!r}; it was saved for different data")
        epoch, index = int(state["epoch"]), int(state["index"])
        if epoch < 0 or index < 0 or (self.size is not None and index > self.size):
            raise ValueError(f"{self.name}: saved data position (epoch {epoch}, index {index}) is out of range")
        self.epoch, self.index = epoch, index

    def heldout(self, k: int | None = None) -> list[PromptRecord]:
        """The first ``k`` (default ``default_heldout``) held-out records, always the same; [] when the
        source has no held-out split."""
        return self._heldout_get(self.default_heldout if k is None else k)

    def metrics(self) -> dict[str, int]:
        return {"data/epoch": self.epoch, "data/skipped_rows": self.bad.count}


def check_level_weights(task: Task, weights: tuple[float, ...], name: str = "level_weights") -> None:
    """ValueError naming ``name`` unless ``weights`` is empty or one weight per level of ``task``."""
    if weights and len(weights) != len(task.difficulty_levels):
        raise ValueError(f"{name} = {list(weights)}: need one per level {task.difficulty_levels}")


def weighted_level(task: Task, seed: int, index: int, weights: tuple[float, ...], stream: str = "level") -> int | None:
    """The level of train problem ``index`` drawn with relative ``weights`` (one per level of ``task``;
    empty: None, the task draws it uniformly). Each index has its own random ``stream``, so the problem
    at an index stays a pure function of (seed, index)."""
    if not weights:
        return None
    rng = random.Random(f"{task.name}|{seed}|{stream}|{index}")
    return rng.choices(task.difficulty_levels, weights=weights)[0]


def builtin_source(task: str, *, seed: int = 0, level: int | None = None, train_size: int = 0,
                   shuffle: bool = True, default_heldout: int = 256, max_level: int = 0,
                   min_level: int = 1, level_weights: tuple[float, ...] = ()) -> PromptSource:
    """The built-in procedural ``task``: an endless train stream, or with ``train_size`` > 0 a fixed
    pool of its first ``train_size`` train problems visited in epochs (so prompts recur, which
    predictive selection needs). Held-out: the first K problems of the task's held-out split.
    ``level_weights``: relative weights of levels min_level..max_level in the train draws (empty:
    uniform); the held-out prompts stay uniform over the levels."""
    t = task_with_levels(task, max_level, min_level)
    check_level_weights(t, level_weights)

    def get(i: int) -> PromptRecord:
        drawn = level if level is not None else weighted_level(t, seed, i, level_weights)
        return builtin_record(t.sample(seed, "train", i, drawn))

    def heldout(k: int) -> list[PromptRecord]:
        return [builtin_record(t.sample(seed, "heldout", i, level)) for i in range(k)]

    return PromptSource(f"builtin:{task}", get, train_size or None, heldout, seed=seed, shuffle=shuffle,
                        default_heldout=default_heldout)


def file_source(path: str, eval_path: str = "", *, file_format: str | None = None, fields: Fields = Fields(),
                seed: int = 0, shuffle: bool = True, skip_bad_rows: bool = False,
                default_heldout: int = 256) -> PromptSource:
    """A JSONL or Parquet file (``file_format`` "jsonl" or "parquet"; None: from the suffix), read and
    validated up front; held-out records come from ``eval_path`` (same format and fields), none when
    it is empty."""
    bad = BadRows(skip_bad_rows)
    file_format = file_format or ("parquet" if path.endswith(".parquet") else "jsonl")
    if file_format not in ("jsonl", "parquet"):
        raise ValueError(f"file_format = {file_format!r}: must be 'jsonl' or 'parquet'")
    read = read_parquet if file_format == "parquet" else read_jsonl
    train = _read(read, path, fields, bad, "data.path")
    if not train:
        raise BadDataError(path, None, None, f"no usable rows ({bad.count} bad rows skipped): data.path needs at "
                                             f"least one row with a {fields.prompt!r} and an {fields.answer!r} field")
    # Held-out rows are read on first use only, then kept: evaluation asks for them every few steps.
    cache: list[list[PromptRecord]] = []

    def heldout(k: int) -> list[PromptRecord]:
        if not eval_path:
            return []
        if not cache:
            cache.append(_read(read, eval_path, fields, bad, "data.eval_path"))
        return cache[0][:k]

    return PromptSource(f"file:{path}", train.__getitem__, len(train), heldout, seed=seed, shuffle=shuffle,
                        bad=bad, default_heldout=default_heldout)


def _read(read, path: str, fields: Fields, bad: BadRows, key: str) -> list[PromptRecord]:
    if not os.path.isfile(path):
        raise UserFileError(f"{key} = {path!r}: no such file (relative paths are from the working directory "
                            f"{os.getcwd()!r})")
    return read(path, fields, bad)
