"""The allocator interface a host loop drives round by round (DESIGN.md 2.5, docs/interfaces.md).

    allocator = Allocator(cfg.allocation, cfg.prefix_sampling, num_prompts=len(dataset))
    state = allocator.init(jax.random.PRNGKey(seed))
    for step in range(steps):
        run = allocator.start_step(state)
        while requests := run.requests():
            run.observe([Result(r.group_key, verify(sample(r))) for r in requests])
        result, state = run.finish()     # result.groups: what to train on; result.rollouts_spent

Every composition {uniform, ds, sara, pilot_commit} x {none, mopps, dps} x {PS off, on} is this one
object: the base method decides which groups are opened, probed, completed and kept; the selection
method decides which prompts are opened; Prefix Sampling adds re-rollout groups. The persistent
state is the :class:`AllocatorState` pytree (round-trips through :func:`state_to_dict`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from passrate_jax.allocation.config import AllocationConfig, PrefixSamplingConfig
from passrate_jax.allocation.group_queue import GroupQueue, queue_init
from passrate_jax.allocation.prefix_control import PrefixControlState, prefix_control_init
from passrate_jax.allocation.selection import SelectionState, selection_init


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
    """Binary rewards (0/1) of one request's rollouts, in request order. ``observed`` False: nothing was
    generated (e.g. an environment replay that failed its determinism check); the rollouts count as
    spent and nothing is learned from them (the rewards are placeholders)."""
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
    evicted: bool [P], prompts Pilot-Commit removed from later epochs. selection: MoPPS/DPS models.
    pilot_buffer, replay_queue, surplus: group queues (Pilot-Commit kept pilots, PS replay sources,
    ideal DS surplus). prefix_control: PS per-bucket ratio and EMA.
    """
    step: jax.Array
    key: jax.Array
    next_group_key: jax.Array
    evicted: jax.Array
    selection: SelectionState
    pilot_buffer: GroupQueue
    replay_queue: GroupQueue
    surplus: GroupQueue
    prefix_control: PrefixControlState


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


class Allocator:
    """Static description of one composition; makes states and step runs. Holds no arrays."""

    def __init__(self, cfg: AllocationConfig, prefix_sampling: PrefixSamplingConfig, num_prompts: int):
        """``num_prompts``: size of the prompt dataset (prompt ids are 0 .. num_prompts - 1)."""
        if num_prompts < 1:
            raise ValueError(f"num_prompts = {num_prompts}: must be >= 1")
        self.cfg = cfg
        self.ps = prefix_sampling
        self.num_prompts = num_prompts

    @property
    def budget(self) -> float:
        """Rollouts a step may spend: ``cfg.budget``, else B * N for uniform and SARA (DESIGN 2.2) and
        unbounded for DS and Pilot-Commit, which their round limits bound."""
        if self.cfg.budget is not None:
            return self.cfg.budget
        if self.cfg.method in ("uniform", "sara"):
            return self.cfg.num_prompts * self.cfg.group_size
        return float("inf")

    def init(self, key) -> AllocatorState:
        """Fresh state: uninformed selection models, empty queues, controllers at ratio_init."""
        cfg, b, n = self.cfg, self.cfg.num_prompts, self.cfg.group_size
        return AllocatorState(
            step=jnp.zeros((), jnp.int32), key=jnp.asarray(key, jnp.uint32),
            next_group_key=jnp.zeros((), jnp.int32),
            evicted=jnp.zeros((self.num_prompts,), bool),
            selection=selection_init(self.num_prompts, cfg.selection),
            pilot_buffer=queue_init(2 * cfg.pilot_commit.pilot_pool_ratio * b, n),
            replay_queue=queue_init(b, n),
            surplus=queue_init(b, n),
            prefix_control=prefix_control_init(n, self.ps))

    def start_step(self, state: AllocatorState):
        """Begin a step; returns a :class:`passrate_jax.allocation.step.StepRun`."""
        from passrate_jax.allocation.step import StepRun
        return StepRun(self, state)
