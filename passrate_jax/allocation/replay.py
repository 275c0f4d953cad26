"""Prefix Sampling's part of the round machine (:mod:`.machine`): opening re-rollout groups from the
replay queue and pushing replay sources into it, for both timings (DESIGN.md 2.4, docs/design.md 5.6).

next_step: a step's trained skewed fresh groups are pushed when it ends (:func:`push_sources` from
``finish_step``) and replayed in the first round of the next step (:func:`open_replays` from
``begin_step``). same_step: ``begin_step`` grants the step ``replay_left`` = replay_slots re-rollout
groups; each round's completed skewed fresh groups are pushed as they come in (``observe_round``), and
the next round opens replays of them (:func:`open_same_step`) while any are left. Pure functions of
(setup, knobs, allocator state, step table), jitted with the machine.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from passrate_jax.allocation.group_queue import queue_push
from passrate_jax.allocation.policies import Knobs, Setup, budget_left, slots
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
