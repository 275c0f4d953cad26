"""Prefix Sampling's part of the round machine (:mod:`.machine`): opening re-rollout groups from the
replay queue and pushing replay sources into it, and the two switches of docs/design.md 5.6 as objects
whose methods are the machine's hooks, chosen once from the config (:data:`TIMINGS`, :data:`PLACEMENTS`),
so that no round compares a string.

Timing. :class:`NextStep`: a step's trained skewed fresh groups are pushed when it ends (``end``, from
``finish_step``) and replayed in the first round of the next step (``begin``, from ``begin_step``).
:class:`SameStep`: ``begin`` grants the step ``replay_left`` = replay_slots re-rollout groups; each
round's completed skewed fresh groups are pushed as they come in (``observed``, from ``observe_round``),
and the next round opens replays of them (``open_round``, from ``plan_round``) while any are left.

Placement. :class:`InPlace`: re-rollout groups count toward the step's B; :class:`OnTop`: they come on
top of it. Its hooks say which rows count toward B and how many of B are held back for replays.

Pure functions of (setup, knobs, allocator state, step table), jitted with the machine; the objects are
stateless and hashable (static parts of the :class:`~.composition.Setup`).
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import jax
import jax.numpy as jnp

from passrate_jax.allocation.group_queue import queue_push
from passrate_jax.allocation.composition import Knobs, Setup
from passrate_jax.allocation.policies import budget_left, slots
from passrate_jax.allocation.prefix_control import plan_replays
from passrate_jax.allocation.table import (CONFIRMED, DROPPED, TRAINED, StepTable, afford, pending, split_rng,
                                           successes, take_rows)


def open_replays(setup: Setup, knobs: Knobs, state, t: StepTable, k, use=None):
    """Open up to ``k`` re-rollout groups from the replay queue, in random order (drawn with key ``use``;
    default: split from the table's), each requesting N rollouts from its source's prefix cut at its
    bucket's ratio. Returns (state, table, opened int32)."""
    # The rollouts held back for same-step replays are these replays' to spend.
    free = budget_left(knobs, t) + t.replay_left * setup.N
    k = jnp.minimum(k, afford(free, setup.N))
    q = state.replay_queue
    if use is None:
        t, use = split_rng(t)
    prio = jax.random.uniform(use, (q.capacity,))
    ratio = state.prefix_control.ratio
    bucket, src = q.tag, q.aux
    success = jnp.take_along_axis(q.rewards, src[:, None], axis=1)[:, 0] == 1
    zero = jnp.zeros_like(q.n)
    t, q, _, ok = take_rows(t, q, k, prio, CONFIRMED, lambda n: jnp.full_like(n, setup.N), key=None, n=zero,
                            rewards=jnp.zeros_like(q.rewards), bucket=bucket, src_key=q.group_key, src_index=src,
                            cut=ratio[bucket], src_success=success)
    return state.replace(replay_queue=q), t, jnp.sum(ok).astype(jnp.int32)


def push_sources(setup: Setup, knobs: Knobs, state, t: StepTable, rows, use=None):
    """Push the rows with ``rows`` True (full fresh groups) of a replay-eligible bucket into the replay
    queue, each with a random minority-outcome rollout as its source, drawn with key ``use`` (default:
    split from the table's). Returns (state, table)."""
    if use is None:
        t, use = split_rng(t)
    eligible, bucket, src = plan_replays(use, t.rewards.astype(jnp.int32), setup.ps)
    q = queue_push(state.replay_queue, t.prompt, t.key, t.n, successes(t), t.rewards, bucket, src, state.step,
                   knobs.ps_on & rows & eligible)
    return state.replace(replay_queue=q), t


def source_rows(setup: Setup, t: StepTable, rows, dropped: bool = False):
    """Of ``rows``, the trained full fresh groups (and with ``dropped`` those dropped, e.g. a valid
    group beyond the room left for fresh groups): a replay's possible sources."""
    kept = (t.status == TRAINED) | ((t.status == DROPPED) & dropped)
    return rows & kept & (t.bucket < 0) & (t.n == setup.N)


def open_same_step(setup: Setup, knobs: Knobs, state, t: StepTable, go):
    """A same-step round's re-rollout groups: up to ``replay_left`` from the sources waiting in the
    queue (none unless ``go``). Once the fresh groups have filled their part of the step (no slot left
    to the policy), none of them is in progress and no source waits, no replay can come any more: the
    slots still held go back to the policy. The keys leave the table's random stream alone, so that the
    rounds' prompt choices are the same whatever the timing."""
    use = jax.random.fold_in(jax.random.fold_in(t.rng, 3), t.rounds)
    state, t, opened = open_replays(setup, knobs, state, t, jnp.where(go, t.replay_left, 0), use)
    t = t.replace(replay_left=t.replay_left - opened)
    idle = (slots(setup, t) <= 0) & ~jnp.any(pending(t) & (t.bucket < 0)) & ~jnp.any(state.replay_queue.valid)
    return state, t.replace(replay_left=jnp.where(go & idle, 0, t.replay_left))


class Timing(Protocol):
    """When Prefix Sampling's re-rollout groups are queued and issued (:class:`~.replay.NextStep`,
    :class:`~.replay.SameStep`): hooks of ``begin_step``, ``plan_round``, ``observe_round`` and
    ``finish_step``. ``extra_rounds``: rounds a step needs beyond the policy's; ``in_step``: replays are
    opened and requested among the step's own rounds."""
    extra_rounds: int
    in_step: bool

    def begin(self, setup: Setup, knobs: Knobs, state, t: StepTable) -> tuple: ...
    def open_round(self, setup: Setup, knobs: Knobs, state, t: StepTable, go) -> tuple: ...
    def observed(self, setup: Setup, knobs: Knobs, state, t: StepTable, completed) -> tuple: ...
    def end(self, setup: Setup, knobs: Knobs, state, t: StepTable) -> tuple: ...


class Placement(Protocol):
    """How re-rollout groups are placed against the step's B (:class:`~.replay.InPlace`,
    :class:`~.replay.OnTop`)."""

    def toward_b(self, t: StepTable): ...
    def trained_toward_b(self, t: StepTable): ...
    def held(self, t: StepTable): ...



@dataclasses.dataclass(frozen=True)
class InPlace:
    """Re-rollout groups take the place of fresh ones: every group counts toward the step's B, and the
    ``replay_left`` slots granted to same-step replays are held back from the policy."""

    def toward_b(self, t: StepTable):
        """Rows whose groups count toward B, bool [G]."""
        return jnp.ones_like(t.bucket, bool)

    def trained_toward_b(self, t: StepTable):
        """Trained groups that count toward B, int32."""
        return t.trained

    def held(self, t: StepTable):
        """Groups of B held back from the policy for re-rollout groups not yet opened."""
        return t.replay_left


@dataclasses.dataclass(frozen=True)
class OnTop:
    """Re-rollout groups come on top of B: the policy fills B with fresh groups as without PS."""

    def toward_b(self, t: StepTable):
        return t.bucket < 0

    def trained_toward_b(self, t: StepTable):
        return jnp.sum((t.status == TRAINED) & self.toward_b(t)).astype(jnp.int32)

    def held(self, t: StepTable):
        return 0


@dataclasses.dataclass(frozen=True)
class NextStep:
    """A step's trained skewed groups are replayed in the first round of the next step."""
    extra_rounds = 0  # rounds a step needs beyond the policy's
    in_step = False  # re-rollout groups are opened and requested among the step's rounds

    def begin(self, setup: Setup, knobs: Knobs, state, t: StepTable):
        """Open the replays of last step's sources (requested in the first round), once a step."""
        k = jnp.where(knobs.ps_on & (setup.placement.trained_toward_b(t) < setup.B), setup.replay_slots, 0)
        state, t, _ = open_replays(setup, knobs, state, t, k)
        return state, t

    def open_round(self, setup: Setup, knobs: Knobs, state, t: StepTable, go):
        """(state, table, rows requested whatever the policy says): none, the replays were opened by begin."""
        return state, t, False

    def observed(self, setup: Setup, knobs: Knobs, state, t: StepTable, completed):
        """After a round's outcomes: sources wait for the end of the step."""
        return state, t

    def end(self, setup: Setup, knobs: Knobs, state, t: StepTable):
        """At the end of the step (``state.replay_queue`` already expired): queue the step's sources."""
        return push_sources(setup, knobs, state, t, source_rows(setup, t, jnp.ones_like(t.bucket, bool)))


@dataclasses.dataclass(frozen=True)
class SameStep:
    """A skewed group is replayed in a later round of its own step (one extra round a step for it)."""
    extra_rounds = 1
    in_step = True

    def begin(self, setup: Setup, knobs: Knobs, state, t: StepTable):
        """Grant the step its re-rollout groups (opened by :meth:`open_round` as sources come in)."""
        t = t.replace(replay_left=jnp.where(knobs.ps_on, setup.replay_slots, 0).astype(jnp.int32))
        t, _ = split_rng(t)  # as opening does: the step's prompt order is the same whatever the timing
        return state, t

    def open_round(self, setup: Setup, knobs: Knobs, state, t: StepTable, go):
        state, t = open_same_step(setup, knobs, state, t, go)
        return state, t, go & (t.bucket >= 0)  # requested even when B groups count already

    def observed(self, setup: Setup, knobs: Knobs, state, t: StepTable, completed):
        # A skewed group dropped for want of room (DS's surplus) is a source too: its replay can take
        # a held slot that would otherwise cost another generation batch. Its key leaves the table's
        # stream alone, so that the rounds' prompt choices are the same whatever the timing.
        use = jax.random.fold_in(jax.random.fold_in(t.rng, 2), t.rounds)
        return push_sources(setup, knobs, state, t, source_rows(setup, t, completed, dropped=True), use)

    def end(self, setup: Setup, knobs: Knobs, state, t: StepTable):
        """A source is replayed in its own step or never: the queue is emptied."""
        q = state.replay_queue
        return state.replace(replay_queue=q.replace(valid=jnp.zeros_like(q.valid))), t


TIMINGS = {"next_step": NextStep(), "same_step": SameStep()}
PLACEMENTS = {"in_place": InPlace(), "on_top": OnTop()}
