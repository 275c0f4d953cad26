"""What the host and the allocator exchange (requests, results, groups to train) and the allocator's
persistent state. Plain data: no allocation logic lives here."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from passrate_jax.allocation.group_queue import GroupQueue
from passrate_jax.allocation.prefix_control import PrefixControlState
from passrate_jax.allocation.selection import SelectionState


@dataclasses.dataclass(frozen=True)
class Prefix:
    """A prefix replay: continue from the first ``cut_ratio`` of trajectory ``source_rollout`` of
    group ``source_group`` (a group of an earlier step, kept by the host; see
    ``StepResult.retained_keys``). ``success``: the source trajectory succeeded (hard bucket, head
    start) or failed (easy bucket, handicap). ``bucket``: the PS bucket id."""
    source_group: int
    source_rollout: int
    cut_ratio: float
    bucket: int
    success: bool


@dataclasses.dataclass(frozen=True)
class Request:
    """Generate ``num_rollouts`` rollouts of prompt ``prompt_id`` for group ``group_key``; they are
    the group's rollouts ``first_index .. first_index + num_rollouts - 1``. ``prefix`` None: fresh
    context; else continue from the replayed prefix (mask the prefix tokens out of the loss)."""
    group_key: int
    prompt_id: int
    num_rollouts: int
    first_index: int
    prefix: Prefix | None = None


@dataclasses.dataclass(frozen=True)
class Result:
    """Binary rewards (0/1) of one request's rollouts, in request order. ``observed`` False: the rollouts
    were generated (they count as spent) but are not an observation of the prompt (an environment
    replay that failed its determinism check): nothing learns from them and the group is not trained."""
    group_key: int
    rewards: tuple[int, ...]
    observed: bool = True


@dataclasses.dataclass(frozen=True)
class TrainGroup:
    """A group to train on: rollouts ``0 .. len(rewards) - 1`` of ``group_key`` (some may come from
    earlier steps: Pilot-Commit's pilot, ideal DS's surplus). ``valid``: rewards are mixed."""
    group_key: int
    prompt_id: int
    rewards: tuple[int, ...]
    prefix: Prefix | None
    valid: bool


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What one step produced.

    groups: the groups to train on, in order. rollouts_spent: rollouts generated this step
    (every request, including abandoned probes, skipped pilots and discarded surplus).
    abandoned: (prompt_id, n, s) of prompts given up after a partial group (SARA abandon,
    Pilot-Commit skip or evict). retained_keys: group keys whose trajectories later steps may
    request (pilot buffer, replay sources, DS surplus); the host may free every other trajectory.
    replay_successes, replay_rollouts: per PS bucket, this step's re-rollout outcomes.
    """
    groups: list[TrainGroup]
    rollouts_spent: int
    rounds: int
    abandoned: list[tuple[int, int, int]]
    retained_keys: frozenset[int]
    replay_successes: np.ndarray
    replay_rollouts: np.ndarray


@struct.dataclass
class AllocatorState:
    """Everything the allocator keeps across steps (P prompts, N group size).

    step: int32 scalar. key: uint32 [2] PRNG key. next_group_key: int32 scalar, next unused group key.
    evicted_until: int32 [P], per prompt the first step it may be drawn again after Pilot-Commit evicted it
    (0: never evicted; int32 max: evicted for the rest of the run). selection: MoPPS/DPS models.
    policy: the method's own state, a pytree its policy makes (``Policy.init``) and alone reads: ideal DS's
    surplus queue, Pilot-Commit's buffer of kept pilots, nothing for uniform and SARA.
    replay_queue: Prefix Sampling's replay sources; prefix_control: its per-bucket ratio and EMA.
    """
    step: jax.Array
    key: jax.Array
    next_group_key: jax.Array
    evicted_until: jax.Array
    selection: SelectionState
    policy: Any
    replay_queue: GroupQueue
    prefix_control: PrefixControlState

    @property
    def evicted_now(self) -> jax.Array:
        """bool [P]: the prompts Pilot-Commit's eviction keeps out of the pool at ``step``."""
        return self.evicted_until > self.step


def state_to_dict(state: AllocatorState) -> dict[str, np.ndarray]:
    """Flatten the state to {"selection/alpha": array, ...} (numpy), e.g. for a checkpoint."""
    leaves = jax.tree_util.tree_leaves_with_path(state)
    return {"/".join(str(getattr(k, "name", k)) for k in path): np.asarray(v) for path, v in leaves}


def state_from_dict(data: dict[str, np.ndarray], like: AllocatorState) -> AllocatorState:
    """Inverse of :func:`state_to_dict`; ``like`` (e.g. ``Allocator.init``) gives the structure.
    Raises KeyError or ValueError on a missing key or a shape mismatch."""
    def load(path, leaf):
        name = "/".join(str(getattr(k, "name", k)) for k in path)
        value = np.asarray(data[name])
        if value.shape != leaf.shape:
            raise ValueError(f"{name}: shape {value.shape} != expected {leaf.shape}")
        return jnp.asarray(value, dtype=leaf.dtype)
    return jax.tree_util.tree_map_with_path(load, like)
