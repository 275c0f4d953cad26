"""Host-side rollout bookkeeping for the training loop: the trajectory store, Prefix Sampling cuts,
sampler contexts for allocator requests, and the padded update batch of the trained groups.

Everything here is plain Python / numpy on the host; the arrays it builds go to the jitted sampler
and update. The store is JSON-serialisable so a checkpoint keeps the trajectories that later steps
may replay (the allocator names them in ``StepResult.retained_keys``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from passrate_jax.allocation import Request, TrainGroup
from passrate_jax.sampling.sampler import Context, bucket


def cut_prefix(response: Sequence[int], ratio: float, newline_id: int | None = None) -> list[int]:
    """The first ``ratio`` of a response's tokens, at least 1 and at most ``len - 1`` (a prefix never
    holds the whole answer or its end token). When a line break lies within the last 10% of the cut,
    the cut snaps back to just after it, so the replayed prefix ends on a whole step (DESIGN 2.4)."""
    n = len(response)
    if n < 2:
        return []
    cut = min(max(int(math.floor(ratio * n)), 1), n - 1)
    if newline_id is not None:
        window = max(1, math.ceil(0.1 * cut))
        for j in range(cut - 1, max(cut - 1 - window, -1), -1):
            if response[j] == newline_id:
                cut = j + 1
                break
    return list(response[:cut])


@dataclasses.dataclass
class GroupRecord:
    """One group's rollouts: the prompt index, the replayed prefix (empty for a fresh group) and each
    rollout's generated ids and reward, by rollout index within the group."""
    prompt: int
    prefix: list[int]
    completions: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    rewards: dict[int, float] = dataclasses.field(default_factory=dict)  # as scored, before the success threshold


class RolloutStore:
    """Trajectories by group key. ``prompt_ids(i)`` gives prompt i's token ids (with BOS)."""

    def __init__(self, prompt_ids, newline_id: int | None):
        self.prompt_ids = prompt_ids
        self.newline_id = newline_id
        self.groups: dict[int, GroupRecord] = {}

    def contexts(self, requests: Sequence[Request], max_new_tokens: int) -> list[Context]:
        """Sampler contexts for one round of requests. A group's randomness is keyed by its group key
        and rollout index, so a row samples the same tokens whatever batch it lands in."""
        out = []
        for r in requests:
            g = self.groups.get(r.group_key)
            if g is None:
                prefix = []
                if r.prefix is not None:
                    src = self.groups[r.prefix.source_group].completions[r.prefix.source_rollout]
                    prefix = cut_prefix(src, r.prefix.cut_ratio, self.newline_id)
                g = self.groups[r.group_key] = GroupRecord(prompt=r.prompt_id, prefix=prefix)
            out.append(Context(prompt_ids=self.prompt_ids(g.prompt), prefix_ids=g.prefix,
                               num_samples=r.num_rollouts, context_id=r.group_key,
                               first_sample_index=r.first_index,
                               max_new_tokens=max(1, max_new_tokens - len(g.prefix))))
        return out

    def record(self, request: Request, completions: Sequence[list[int]], rewards: Sequence[float]) -> None:
        g = self.groups[request.group_key]
        for j, (ids, reward) in enumerate(zip(completions, rewards)):
            g.completions[request.first_index + j] = list(ids)
            g.rewards[request.first_index + j] = float(reward)

    def response(self, group_key: int, index: int) -> list[int]:
        """Prefix + completion ids of one rollout: the whole response the verifier scores."""
        g = self.groups[group_key]
        return g.prefix + g.completions[index]

    def retain(self, keys) -> None:
        """Free every group not in ``keys``."""
        self.groups = {k: g for k, g in self.groups.items() if k in keys}

    def to_json(self) -> dict:
        return {str(k): {"prompt": g.prompt, "prefix": g.prefix,
                         "completions": {str(i): c for i, c in g.completions.items()},
                         "rewards": {str(i): r for i, r in g.rewards.items()}} for k, g in self.groups.items()}

    def load_json(self, data: dict) -> None:
        self.groups = {int(k): GroupRecord(prompt=v["prompt"], prefix=list(v["prefix"]),
                                           completions={int(i): list(c) for i, c in v["completions"].items()},
                                           rewards={int(i): float(r) for i, r in v["rewards"].items()})
                       for k, v in data.items()}


def batch_arrays(store: RolloutStore, groups: Sequence[TrainGroup], *, rows: int, width_buckets: Sequence[int],
                 pad_id: int) -> dict[str, np.ndarray]:
    """Rows of every trained group's rollouts, right-padded to ``rows`` x a width bucket.

    Returns numpy arrays: tokens, attention_mask, loss_mask (generated tokens only: prompt and
    replayed prefix are context), rewards [rows], group_ids [rows] (padding rows get their own id
    and an all-zero mask, so they change no group statistic).
    """
    seqs, masks, rewards, gids = [], [], [], []
    for gi, tg in enumerate(groups):
        g = store.groups[tg.group_key]
        context = list(store.prompt_ids(g.prompt)) + g.prefix
        for i in range(len(tg.rewards)):
            comp = g.completions[i]
            seqs.append(context + comp)
            masks.append([0] * len(context) + [1] * len(comp))
            rewards.append(g.rewards[i])  # the scored reward, not the allocator's success bit
            gids.append(gi)
    return pack_rows(seqs, masks, rewards, gids, num_groups=len(groups), rows=rows, width_buckets=width_buckets,
                     pad_id=pad_id)


def pack_rows(seqs, masks, rewards, group_ids, *, num_groups: int, rows: int, width_buckets: Sequence[int],
              pad_id: int) -> dict[str, np.ndarray]:
    """Token sequences with their loss masks, rewards and group ids as the padded arrays of
    :func:`batch_arrays` (shared with the multi-turn environments' batch builder)."""
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
