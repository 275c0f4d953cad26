"""The step's one table of rollouts: where a rollout's reward and score live.

Every other record of a rollout refers to its row: the trajectory store (:mod:`.store`) keeps a
``(table, row)`` reference beside each trajectory and reads the score the update trains on from it; the
allocator's :class:`~passrate_jax.allocation.Result` is a message built from the rows as a round is
added, not a second store.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from passrate_jax.allocation import Request, Result


class RolloutTable:
    """Every rollout of one step, one row each in generation order.

    Columns (numpy, by ``table[name]``): ``group_key``, ``index`` (the rollout's index in its group),
    ``observed``, ``reward`` (0/1: the success the allocator sees), ``truncated``, ``verifier_error``
    (the verifier raised on this answer: reward 0), and the backend's own (text answers and environments:
    ``score``, the reward as scored, e.g. a reward plugin's float, which the update trains on; environments
    also ``turns``, ``action_errors``). The rows of an unobserved request (nothing was generated) have
    ``observed`` False and 0 in every other column.
    """

    def __init__(self):
        self._columns: dict[str, list[np.ndarray]] = {}
        self._joined: dict[str, np.ndarray] = {}  # columns concatenated since the last append
        self._rows = 0

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._joined:
            parts = self._columns.get(name, [])
            self._joined[name] = np.concatenate(parts) if parts else np.zeros(0, int)
        return self._joined[name]

    def __contains__(self, name: str) -> bool:
        return name in self._columns

    def __len__(self) -> int:
        return self._rows

    def append(self, columns: dict[str, np.ndarray]) -> np.ndarray:
        """Append rows (every column the same length); returns their row numbers."""
        first, n = self._rows, len(columns["group_key"])
        for k, v in columns.items():
            self._columns.setdefault(k, []).append(np.asarray(v))
        self._joined.clear()
        self._rows += n
        return np.arange(first, first + n)

    def add(self, requests: Sequence[Request], observed: Sequence[bool],
            scores: dict[str, np.ndarray]) -> tuple[list[Result], list[np.ndarray]]:
        """Append one round: ``scores`` holds the observed requests' rollouts, request by request. Returns
        the round's results for the allocator and, per observed request, the row numbers of its rollouts
        (what the trajectory store refers to)."""
        results, rows, pos = [], [], 0
        for req, seen in zip(requests, observed):
            n = req.num_rollouts
            cols = {k: v[pos:pos + n] if seen else np.zeros(n, v.dtype) for k, v in scores.items()}
            pos += n if seen else 0
            cols.update(group_key=np.full(n, req.group_key), index=req.first_index + np.arange(n),
                        observed=np.full(n, bool(seen)))
            added = self.append(cols)
            if seen:
                rows.append(added)
            results.append(Result(req.group_key, tuple(int(x) for x in cols["reward"]), observed=bool(seen)))
        return results, rows

    def unobserved_groups(self) -> set[int]:
        return {int(k) for k in self["group_key"][~self["observed"].astype(bool)]}
