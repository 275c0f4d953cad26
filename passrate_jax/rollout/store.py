"""One trajectory store for every kind of rollout: text answers and environment episodes.

A group is a prompt, a replayed prefix (empty for a fresh group) and, by rollout index, each rollout's
trajectory. The two kinds differ only in what an item of a trajectory is (a token id; an environment
:class:`~passrate_jax.envs.replay.Turn`) and how a trajectory becomes token ids and a loss mask: a
:class:`TrajectoryKind` says that; batching, retaining, saving and loading are written once here.

The store keeps no reward: each trajectory refers to its row of the step's
:class:`~passrate_jax.rollout.table.RolloutTable`, which holds the score the update trains on. A trained
group may hold rollouts of earlier steps (Pilot-Commit's pilots), so a retained group keeps its step's
table alive through those references; a checkpoint writes the scores out and a restored store refers to
one table rebuilt from them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from passrate_jax.allocation import Request, TrainGroup
from passrate_jax.rollout.table import RolloutTable
from passrate_jax.sampling.sampler import bucket

# Padded widths (prompt + response tokens) of the update batch: a run compiles one update per width used.
WIDTH_BUCKETS = (64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192)


class TrajectoryKind(Protocol):
    """What one kind's trajectories are. ``sequence``: a rollout's token ids after the prompt ids given,
    and its loss mask (1 exactly on the tokens the policy generated); ``response``: the ids the rollout
    wrote after its prompt, replayed prefix included (what the person watching reads); ``generated``: how
    many tokens the policy generated; ``item_to_json`` / ``item_from_json``: one item of a prefix or a
    trajectory, for checkpoints."""

    def sequence(self, prompt: list[int], prefix: list, trajectory: list) -> tuple[list[int], list[int]]: ...

    def response(self, prefix: list, trajectory: list) -> list[int]: ...

    def generated(self, trajectory: list) -> int: ...

    def item_to_json(self, item): ...

    def item_from_json(self, data): ...


@dataclasses.dataclass(eq=False)
class Group:
    """One group's trajectories: the prompt index, the replayed prefix, whether its start could not be
    rebuilt (``rejected``: an environment replay that failed its determinism check; nothing generated),
    each rollout's trajectory by rollout index and the table row holding its score. Two groups are equal
    when they hold the same trajectories and scores, whichever tables the scores live in."""
    prompt: int
    prefix: list
    rejected: bool = False
    trajectories: dict[int, list] = dataclasses.field(default_factory=dict)
    rows: dict[int, tuple[RolloutTable, int]] = dataclasses.field(default_factory=dict)

    def score(self, index: int, success: int) -> float:
        """The score rollout ``index`` is trained on: its table row's ``score`` (the allocator's success
        bit where it has no row, e.g. restored from a checkpoint written before scores were kept)."""
        if index not in self.rows:
            return float(success)
        table, row = self.rows[index]
        return float(table["score"][row])

    def scores(self) -> dict[int, float]:
        return {i: self.score(i, 0) for i in self.rows}

    def __eq__(self, other) -> bool:
        return isinstance(other, Group) and (self.prompt, self.prefix, self.rejected, self.trajectories,
                                             self.scores()) == (other.prompt, other.prefix, other.rejected,
                                                                other.trajectories, other.scores())


class TrajectoryStore:
    """The trajectories of one run's groups (``groups``, by group key), for one :class:`TrajectoryKind`.
    ``prompt_ids(i)``: prompt i's token ids (with BOS); ``pad_id`` and ``width_buckets``: the update
    batch's padding (see :func:`pack_rows`)."""

    def __init__(self, kind: TrajectoryKind, prompt_ids: Callable[[int], Sequence[int]], *, pad_id: int,
                 width_buckets: Sequence[int] = WIDTH_BUCKETS):
        self.kind, self.prompt_ids, self.pad_id, self.width_buckets = kind, prompt_ids, pad_id, tuple(width_buckets)
        self.groups: dict[int, Group] = {}

    def open(self, key: int, prompt: int, prefix: list) -> Group:
        """The group of ``key``, created with ``prompt`` and ``prefix`` if new."""
        if key not in self.groups:
            self.groups[key] = Group(prompt=prompt, prefix=prefix)
        return self.groups[key]

    def add(self, requests: Sequence[Request], trajectories: Sequence[list], table: RolloutTable,
            rows: Sequence[np.ndarray]) -> None:
        """Keep each request's trajectories (in sample order) with the table rows of their scores."""
        for req, trajs, req_rows in zip(requests, trajectories, rows):
            g = self.groups[req.group_key]
            for j, (traj, row) in enumerate(zip(trajs, req_rows)):
                g.trajectories[req.first_index + j] = traj
                g.rows[req.first_index + j] = (table, int(row))

    def batch(self, groups: Sequence[TrainGroup], rows: int) -> dict[str, np.ndarray]:
        """Rows of every trained group's rollouts, right-padded to ``rows`` x a width bucket (see
        :func:`pack_rows`): the loss mask on generated tokens only, rewards as scored. Rejected groups must
        not be among ``groups``."""
        seqs, masks, rewards, gids = [], [], [], []
        for gi, tg in enumerate(groups):
            g = self.groups[tg.group_key]
            if g.rejected:
                raise ValueError(f"group {tg.group_key}: its replay was rejected, it has no trajectories to train on")
            prompt = list(self.prompt_ids(g.prompt))
            for i, success in enumerate(tg.rewards):
                ids, mask = self.kind.sequence(prompt, g.prefix, g.trajectories[i])
                seqs.append(ids)
                masks.append(mask)
                rewards.append(g.score(i, success))
                gids.append(gi)
        return pack_rows(seqs, masks, rewards, gids, num_groups=len(groups), rows=rows,
                         width_buckets=self.width_buckets, pad_id=self.pad_id)

    def response(self, group_key: int, index: int) -> list[int]:
        g = self.groups[group_key]
        return self.kind.response(g.prefix, g.trajectories[index])

    def generated_tokens(self, group_key: int, index: int) -> int:
        return self.kind.generated(self.groups[group_key].trajectories[index])

    def retain(self, keys) -> None:
        """Free every group not in ``keys``."""
        self.groups = {k: g for k, g in self.groups.items() if k in keys}

    def discard(self, keys) -> None:
        """Forget groups the slot engine started ahead of a request that never came (rollout/ahead.py)."""
        for k in keys:
            self.groups.pop(k, None)

    # ------------------------------------------------------------------ checkpoints
    def to_json(self) -> dict:
        enc = self.kind.item_to_json
        return {str(k): {"prompt": g.prompt, "prefix": [enc(x) for x in g.prefix], "rejected": g.rejected,
                         "trajectories": {str(i): [enc(x) for x in t] for i, t in g.trajectories.items()},
                         "scores": {str(i): s for i, s in g.scores().items()}} for k, g in self.groups.items()}

    def load_json(self, data: dict) -> None:
        """Inverse of :meth:`to_json`; the scores go into one table the restored groups refer to. Reads the
        text and environment stores of earlier versions too (``completions`` / ``turns``, ``rewards``)."""
        dec, table = self.kind.item_from_json, RolloutTable()
        self.groups = {}
        for k, v in data.items():
            trajs = v.get("trajectories", v.get("completions", v.get("turns", {})))
            g = self.groups[int(k)] = Group(prompt=int(v["prompt"]), prefix=[dec(x) for x in v["prefix"]],
                                            rejected=bool(v.get("rejected", False)),
                                            trajectories={int(i): [dec(x) for x in t] for i, t in trajs.items()})
            scores = v.get("scores", v.get("rewards", {}))
            if scores:
                index = np.array([int(i) for i in scores], np.int64)
                added = table.append({"group_key": np.full(len(index), int(k)), "index": index,
                                      "score": np.array([float(s) for s in scores.values()], np.float32)})
                g.rows = {int(i): (table, int(r)) for i, r in zip(index, added)}


class TextKind:
    """Text answers: an item is a token id; the trajectory is the generated answer after the prompt and
    the replayed prefix (both context, loss mask 0)."""

    @staticmethod
    def sequence(prompt, prefix, trajectory):
        context = prompt + list(prefix)
        return context + list(trajectory), [0] * len(context) + [1] * len(trajectory)

    @staticmethod
    def response(prefix, trajectory):
        return list(prefix) + list(trajectory)

    @staticmethod
    def generated(trajectory):
        return len(trajectory)

    @staticmethod
    def item_to_json(item):
        return int(item)

    @staticmethod
    def item_from_json(data):
        return int(data)


def pack_rows(seqs, masks, rewards, group_ids, *, num_groups: int, rows: int, width_buckets: Sequence[int],
              pad_id: int) -> dict[str, np.ndarray]:
    """Token sequences with their loss masks, rewards and group ids as right-padded numpy arrays:
    tokens, attention_mask, loss_mask [rows, width bucket], rewards [rows], group_ids [rows] (padding
    rows get their own id and an all-zero mask, so they change no group statistic)."""
    if len(seqs) > rows:
        raise ValueError(f"{len(seqs)} rollouts to train on exceed the batch of {rows} rows")
    width = bucket(max(len(s) for s in seqs), width_buckets)
    out = {"tokens": np.full((rows, width), pad_id, np.int32), "attention_mask": np.zeros((rows, width), np.int32),
           "loss_mask": np.zeros((rows, width), np.int32), "rewards": np.zeros((rows,), np.float32),
           "group_ids": np.arange(rows, dtype=np.int32) + num_groups}
    for i, (s, m) in enumerate(zip(seqs, masks)):
        out["tokens"][i, :len(s)] = s
        out["attention_mask"][i, :len(s)] = 1
        out["loss_mask"][i, :len(s)] = m
    out["rewards"][:len(seqs)] = rewards
    out["group_ids"][:len(seqs)] = group_ids
    return out
