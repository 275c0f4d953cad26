"""What an allocation composition is, for the round machine and its policies: the static :class:`Setup`
(the method's policy, Prefix Sampling's timing and placement, the configs), the :class:`Knobs` a sweep
varies, the :class:`Policy` protocol every method implements (:mod:`.policies`) and the
:class:`Opening` a policy's plan returns."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Protocol

import jax
import jax.numpy as jnp
from flax import struct

from passrate_jax.allocation.config import AllocationConfig, PrefixSamplingConfig
from passrate_jax.allocation.prefix_control import ControllerGains, num_buckets
from passrate_jax.allocation.table import StepTable

if TYPE_CHECKING:  # the setup's Prefix Sampling objects are defined above this module, with their hooks
    from passrate_jax.allocation.replay import Placement, Timing

UNBOUNDED = 1 << 30  # a rollout budget no step reaches (int32-safe)


@struct.dataclass
class Knobs:
    """The tunable numbers a sweep varies, as arrays (so ``jax.vmap`` runs many settings at once).

    tau_confirm, tau_abandon: SARA thresholds, float32 scalars. schedule: SARA probe sizes, int32 [L].
    gains: the Prefix Sampling controller's target, deadzone, step and EMA decay.
    The composition's switches are knobs too, so compositions that share a setup share one compile:
    selection: int32, index into ``selection.METHODS``; ps_on: bool, Prefix Sampling on; budget: int32,
    rollouts a step may request (SARA's fill and fixed-budget modes differ only here); keep_surplus:
    bool, ideal DS; policy: int32, index into :data:`~.family.POLICIES` (read only by a
    :class:`~.family.Family` setup, which runs every method in one compile); max_rounds: int32, rounds
    per step; train_saturated: bool, saturated complete groups are trained (GRPO) rather than dropped.
    """
    tau_confirm: jax.Array
    tau_abandon: jax.Array
    schedule: jax.Array
    gains: ControllerGains
    selection: jax.Array
    ps_on: jax.Array
    budget: jax.Array
    keep_surplus: jax.Array
    policy: jax.Array
    max_rounds: jax.Array
    train_saturated: jax.Array


@dataclasses.dataclass(frozen=True)
class Setup:
    """Static description of a family of compositions: the method's policy, Prefix Sampling's timing and
    placement (objects from :mod:`.replay` whose methods are the machine's hooks: a round reads the two
    switches through them, never as the strings of ``ps``), the configs with the fields that :class:`Knobs`
    carry normalised away (selection method, PS on/off, SARA mode, ideal DS, budget: never read them here),
    the dataset size, and the largest budget a member may have. Built by :func:`~.allocator.make_setup`."""
    cfg: AllocationConfig
    ps: PrefixSamplingConfig
    num_prompts: int
    policy: Policy
    max_budget: int
    timing: Timing
    placement: Placement

    @property
    def B(self) -> int:  # noqa: N802
        return self.cfg.num_prompts

    @property
    def N(self) -> int:  # noqa: N802
        return self.cfg.group_size

    @property
    def replay_slots(self) -> int:
        """Re-rollout groups a step may open when Prefix Sampling is on."""
        return self.ps.replay_slots(self.B)

    @property
    def num_buckets(self) -> int:
        return num_buckets(self.N)

    @property
    def capacity(self) -> int:
        """Table rows: the most groups live at once (trained, pending, and opened by one round)."""
        return self.policy.capacity(self) + self.replay_slots

    @property
    def max_open(self) -> int:
        """The most fresh prompts one round opens (the selection's static output size)."""
        return self.policy.max_open(self)


@struct.dataclass
class Opening:
    """Fresh prompts a round opens: ``k`` (int32, at most the policy's ``max_open``) new rows with this status,
    first request ``chunk`` and ``pilot`` flag. The machine (selection) chooses the prompts for every policy."""
    k: jax.Array
    status: jax.Array
    chunk: jax.Array
    pilot: jax.Array

    @classmethod
    def of(cls, k, status, chunk, pilot=False) -> Opening:
        return cls(jnp.asarray(k, jnp.int32), jnp.int32(status), jnp.asarray(chunk, jnp.int32), jnp.asarray(pilot))


class Policy(Protocol):
    """One allocation method. ``plan`` sets ``chunk`` > 0 on the rows to request this round and says
    how many fresh prompts to open (an :class:`Opening`); ``decide`` updates rows just observed that
    are still unfinished (``fresh``, bool [G]) and rows that just completed (``completed``). Both are
    pure; the machine jits them. ``trains_saturated`` and ``max_rounds`` become knobs.

    A policy owns its state across steps (its queues), ``state.policy``: ``init`` makes it, and the
    machine calls ``begin`` (at the start of a step, before anything is opened), ``held_prompts`` (bool
    [P]: prompts its queues hold, not available to fresh groups) and ``end`` (at the end of the step:
    expiry; returns (state, (prompt_id, n, s, seen)), groups leaving the queues that the selection
    models observe now)."""
    trains_saturated: bool

    def default_budget(self, cfg: AllocationConfig) -> int: ...
    def capacity(self, setup: Setup) -> int: ...
    def max_open(self, setup: Setup) -> int: ...
    def max_rounds(self, cfg: AllocationConfig) -> int: ...
    def plan(self, setup: Setup, knobs: Knobs, state, t: StepTable) -> tuple: ...
    def decide(self, setup: Setup, knobs: Knobs, state, t: StepTable, fresh, completed) -> tuple: ...
    def next_request(self, setup: Setup, knobs: Knobs, n, s, probes): ...
    def init(self, setup: Setup): ...
    def begin(self, setup: Setup, knobs: Knobs, state, t: StepTable) -> tuple: ...
    def held_prompts(self, state, num_prompts: int): ...
    def end(self, setup: Setup, state, now) -> tuple: ...
