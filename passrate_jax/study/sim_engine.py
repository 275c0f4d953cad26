"""The simulator's two rollout modes with a decode-time model: round mode and the slot engine.

Both run the allocator's own machine (:mod:`passrate_jax.allocation.machine`) on simulated outcomes
and answer lengths (:mod:`.lengths`), and count the decode work the device would do, in *slot-steps*
(rows x decode steps; a rollout's first token comes from its prefill, as in the real sampler, so an
answer of L tokens is L - 1 decode steps):

* **Round mode** (:func:`run_step_rounds`): each round is one sampler call over its rollouts, padded
  to a row bucket (``sampling.row_buckets``), decoding until its longest answer ends:
  bucket(rows) x (longest - 1) slot-steps.
* **The slot engine** (:func:`run_step_events`): the host loop of ``passrate_jax/rollout/events.py``
  over the pool of ``passrate_jax/sampling/slot_pool.py``, as pure functions. ``S`` slots; queued
  rollouts start in free slots (lowest slot first, in issue order); a chunk runs up to ``k`` decode
  steps of every live row (fewer when every row ends sooner): steps x S slot-steps; a rollout that ends
  in chunk c is delivered by the next ``advance``: after chunk c + 1 is dispatched (the host scores chunk
  c while the device runs c + 1), or, while rollouts are queued, before, so that its slot takes a queued
  rollout in chunk c + 1. Requests retire in issue order (or, with ``Timing.any_order``, each as soon as
  it is complete: ``Allocator.retires_in_any_order``); the retired requests of one harvest are one event
  for ``observe_event``, after which ``plan_event`` issues new requests. The step ends when the machine is
  done; rollouts still queued or in slots are aborted (counted, their tokens wasted). This is the lagged
  harvest (``sampling.harvest``), an accelerator's run with the machine on the host; a CPU-only run
  harvests at once where a method decides per event, which this model does not follow.

Shapes are static: a list of ``G`` requests in flight (the table's rows: a row has at most one), ``S``
slots, and at most ``max_chunks`` chunks a step (the step stops there and ``limit_hit`` says so).
Under ``vmap`` the chunk loop runs inside the event loop, so a lane waiting for its next event costs
only the pool's [S]-sized bookkeeping, not a machine round.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import struct

from passrate_jax.allocation.machine import (begin_step, finish_step, observe_event, observe_round, plan_event,
                                             plan_round, step_carry, with_step_carry)


@dataclasses.dataclass(frozen=True)
class Timing:
    """Static sizes of the time model: ``slots`` (S), ``chunk`` (k decode steps), ``max_chunks`` a step,
    round mode's ``row_buckets``; ``any_order``: the engine retires each complete request at once rather
    than in issue order (the real loop's choice, ``Allocator.retires_in_any_order``); ``narrow``: a chunk
    dispatched with at most this many slots occupied decodes that many rows, not S
    (``sampling.narrow_slots``; 0 or at least S: never)."""
    slots: int
    chunk: int
    max_chunks: int
    row_buckets: tuple[int, ...]
    any_order: bool = False
    narrow: int = 0


@struct.dataclass
class Flights:
    """Requests issued and not retired, in issue order: request number i lives at position i < count.
    Per request: group key, rollouts, first sample index, rollouts started and delivered, and the
    lengths of its row's N positions (length_qn [Q, N]). Retiring closes the gaps (:func:`retire`), so
    the numbers of the requests after a retired one move down."""
    key_q: jax.Array
    count_q: jax.Array
    first_q: jax.Array
    started_q: jax.Array
    delivered_q: jax.Array
    length_qn: jax.Array
    count: jax.Array


@struct.dataclass
class Pool:
    """The slots: the occupant's request number (-1: free), tokens it has still to decode and has
    generated, and the chunk in which it ended (read once ``left_s`` is 0). Counters, int32 scalars:
    chunks dispatched, slot_steps and live_steps (live rows summed over decode steps), limit_hit,
    stuck (nothing in flight and nothing to observe: the real loop raises), overflow (more requests in
    flight than positions)."""
    seq_s: jax.Array
    left_s: jax.Array
    tokens_s: jax.Array
    done_at_s: jax.Array
    chunks: jax.Array
    slot_steps: jax.Array
    live_steps: jax.Array
    limit_hit: jax.Array
    stuck: jax.Array
    overflow: jax.Array


def _held(f: Flights):
    """bool [Q]: the positions that hold a request."""
    return jnp.arange(f.key_q.shape[0]) < f.count


def _queued(f: Flights):
    """Rollouts not yet started, per position in issue order, int32 [Q]."""
    return jnp.where(_held(f), f.count_q - f.started_q, 0)


def _start(f: Flights, p: Pool):
    """Queued rollouts into free slots: the r-th free slot takes the r-th queued rollout."""
    waiting = _queued(f)
    end = jnp.cumsum(waiting)
    free = p.seq_s < 0
    rank = jnp.cumsum(free) - 1
    take = free & (rank < end[-1])
    q = waiting.shape[0]
    at = jnp.minimum(jnp.searchsorted(end, rank, side="right"), q - 1)
    j = f.first_q[at] + f.started_q[at] + rank - (end[at] - waiting[at])
    length = f.length_qn[at, jnp.clip(j, 0, f.length_qn.shape[1] - 1)]
    p = p.replace(seq_s=jnp.where(take, at, p.seq_s), left_s=jnp.where(take, length - 1, p.left_s),
                  tokens_s=jnp.where(take, 1, p.tokens_s), done_at_s=jnp.where(take, p.chunks, p.done_at_s))
    return f.replace(started_q=f.started_q.at[jnp.where(take, at, q)].add(1, mode="drop")), p


def _deliver(f: Flights, p: Pool, before: jax.Array, when: jax.Array):
    """If ``when``, deliver the rollouts that ended in a chunk before ``before`` (their requests'
    ``delivered_q`` counts go up, their slots are freed)."""
    deliver = when & (p.seq_s >= 0) & (p.left_s == 0) & (p.done_at_s < before)
    q = f.key_q.shape[0]
    f = f.replace(delivered_q=f.delivered_q.at[jnp.where(deliver, p.seq_s, q)].add(1, mode="drop"))
    return f, p.replace(seq_s=jnp.where(deliver, -1, p.seq_s))


def advance(f: Flights, p: Pool, timing: Timing):
    """One ``SlotPool.advance``: deliver the previous chunk's finished rollouts first if rollouts are
    queued, start queued rollouts, dispatch one chunk, then deliver the previous chunk's finished rollouts."""
    f, p = _deliver(f, p, p.chunks, jnp.sum(_queued(f)) > 0)
    f, p = _start(f, p)
    occupied = p.seq_s >= 0
    live = occupied & (p.left_s > 0)
    gain = jnp.where(live, jnp.minimum(p.left_s, timing.chunk), 0)
    c = p.chunks
    dispatched = jnp.any(occupied)
    left = p.left_s - gain
    n = jnp.sum(occupied)
    narrow = timing.narrow if timing.narrow < timing.slots else 0  # as SlotEngine.narrow
    width = jnp.where((n > 0) & (n <= narrow), narrow, timing.slots)
    p = p.replace(left_s=left, tokens_s=p.tokens_s + gain, done_at_s=jnp.where(live & (left == 0), c, p.done_at_s),
                  slot_steps=p.slot_steps + jnp.max(gain, initial=0) * width,
                  live_steps=p.live_steps + jnp.sum(gain), chunks=c + dispatched.astype(jnp.int32))
    return _deliver(f, p, c, jnp.bool_(True))


def retiring(f: Flights, any_order: bool):
    """Per position in issue order, bool [Q]: the requests that retire now. Complete ones (every rollout
    delivered): at the head only (the longest complete run from position 0), or with ``any_order``
    wherever they are."""
    complete = _held(f) & (f.delivered_q == f.count_q)
    return complete if any_order else jnp.cumprod(complete).astype(bool)


def retire(f: Flights, p: Pool, now: jax.Array):
    """Retire the requests ``now`` (from :func:`retiring`) and close the gaps they leave: the requests
    still live keep their issue order and move down, and the slots' request numbers with them. (A ring
    that only dropped requests from its head overflowed under ``Timing.any_order`` with a long tail: a
    long answer at the head held it while the tail ran ``Q`` requests ahead, with far fewer live.)
    Returns (flights, pool)."""
    live = _held(f) & ~now
    src = jnp.argsort(~live, stable=True)  # the live requests' positions first, in issue order
    f = jax.tree.map(lambda a: a[src] if a.ndim else a, f).replace(count=jnp.sum(live).astype(jnp.int32))
    q = live.shape[0]
    renumbered = (jnp.cumsum(live) - 1)[jnp.clip(p.seq_s, 0, q - 1)]
    return f, p.replace(seq_s=jnp.where(p.seq_s >= 0, renumbered, -1).astype(p.seq_s.dtype))


def push(f: Flights, t, chunk, lengths_gn):
    """Append the new requests (rows with ``chunk`` > 0, in row order, as ``StepRun.issue`` lists them).
    Returns (flights, bool: more requests than positions, the step's numbers then unreliable)."""
    q = f.key_q.shape[0]
    new = chunk > 0
    at = jnp.where(new, f.count + jnp.cumsum(new) - 1, q)
    put = lambda a, v: a.at[at].set(v, mode="drop")  # noqa: E731
    count = f.count + jnp.sum(new).astype(jnp.int32)
    return f.replace(key_q=put(f.key_q, t.key), count_q=put(f.count_q, chunk), first_q=put(f.first_q, t.n),
                     started_q=put(f.started_q, 0), delivered_q=put(f.delivered_q, 0),
                     length_qn=put(f.length_qn, lengths_gn), count=jnp.minimum(count, q)), count > q


def _empty(capacity: int, group_size: int, slots: int):
    zq, zs, z = jnp.zeros((capacity,), jnp.int32), jnp.zeros((slots,), jnp.int32), jnp.zeros((), jnp.int32)
    f = Flights(key_q=zq, count_q=zq, first_q=zq, started_q=zq, delivered_q=zq,
                length_qn=jnp.zeros((capacity, group_size), jnp.int32), count=z)
    p = Pool(seq_s=zs - 1, left_s=zs, tokens_s=zs, done_at_s=zs, chunks=z, slot_steps=z, live_steps=z,
             limit_hit=z, stuck=z, overflow=z)
    return f, p


def run_step_events(setup, knobs, state, outcomes, lengths_of, timing: Timing):
    """A whole step on the slot engine. ``outcomes(state, t) -> (rewards int8 [G, N], observed [G])`` as
    for :func:`~passrate_jax.allocation.machine.run_step`; ``lengths_of(t, rewards) -> int32 [G, N]`` the
    tokens of each row's rollouts. Returns (state, table, counters dict of int32 scalars)."""
    state, t = begin_step(setup, knobs, state)
    with_queues = functools.partial(with_step_carry, state)
    ready = lambda f: jnp.any(retiring(f, timing.any_order))  # noqa: E731

    def issue(st, t, f, p):
        st, t, chunk = plan_event(setup, knobs, st, t)
        f, full = push(f, t, chunk, lengths_of(t, outcomes(st, t)[0]))
        return st, t, f, p.replace(overflow=p.overflow | full)

    def chunks_until_event(f, p):
        def cond(c):
            f, p = c
            return ~ready(f) & (p.chunks < timing.max_chunks) & (p.stuck == 0)

        def body(c):
            f, p = advance(*c, timing)
            idle = (jnp.sum(_queued(f)) == 0) & jnp.all(p.seq_s < 0)
            return f, p.replace(stuck=(idle & ~ready(f)).astype(jnp.int32))
        return jax.lax.while_loop(cond, body, (f, p))

    def observe(st, t, f, p):
        now = retiring(f, timing.any_order)
        rows = (t.inflight > 0) & jnp.any((t.key[:, None] == f.key_q[None, :]) & now[None, :], axis=1)
        rewards, observed = outcomes(st, t)
        st, t = observe_event(setup, knobs, st, t, rewards, observed, rows)
        return issue(st, t, *retire(f, p, now))

    def body(carry):
        queues, t, f, p = carry
        f, p = chunks_until_event(f, p)
        st, t, f, p = jax.lax.cond(ready(f), observe, lambda *a: a, with_queues(queues), t, f, p)
        return step_carry(st), t, f, p

    f, p = _empty(t.capacity, setup.N, timing.slots)
    st, t, f, p = issue(state, t, f, p)
    queues, t, f, p = jax.lax.while_loop(
        lambda c: ~c[1].done & (c[3].chunks < timing.max_chunks) & (c[3].stuck == 0), body, (step_carry(st), t, f, p))
    occupied = p.seq_s >= 0
    counters = {"chunks": p.chunks, "slot_steps": p.slot_steps, "live_steps": p.live_steps,
                "aborted": jnp.sum(_queued(f)) + jnp.sum(occupied),
                "wasted": jnp.sum(jnp.where(occupied, p.tokens_s, 0)),
                "limit_hit": (~t.done & (p.stuck == 0)).astype(jnp.int32), "stuck": p.stuck,
                "overflow": p.overflow}
    state, t = finish_step(setup, knobs, with_queues(queues), t)
    return state, t, counters


def row_bucket(rows, buckets: tuple[int, ...]):
    """``sampling.rows.bucket`` in jax: the smallest bucket >= rows, past the largest a multiple of it."""
    b = jnp.asarray(buckets, jnp.int32)
    fits = jnp.min(jnp.where(b >= rows, b, jnp.iinfo(jnp.int32).max))
    over = -(-rows // buckets[-1]) * buckets[-1]
    return jnp.where(rows <= buckets[-1], fits, over)


def run_step_rounds(setup, knobs, state, outcomes, lengths_of, timing: Timing):
    """A whole step in round mode (:func:`~passrate_jax.allocation.machine.run_step`, the same machine
    calls) that also counts each round's sampler call: bucket(rows) x (longest answer - 1) slot-steps,
    sum(L - 1) live. Returns (state, table, counters dict of int32 scalars)."""
    state, t = begin_step(setup, knobs, state)
    with_queues = functools.partial(with_step_carry, state)

    def body(carry):
        queues, t, cost = carry
        st, t = plan_round(setup, knobs, with_queues(queues), t)
        rewards, observed = outcomes(st, t)
        pos = jnp.arange(setup.N)[None, :]
        asked = (pos >= t.n[:, None]) & (pos < (t.n + t.chunk)[:, None])
        steps = jnp.where(asked, lengths_of(t, rewards) - 1, 0)
        rows = jnp.sum(asked).astype(jnp.int32)
        call = jnp.where(rows > 0, row_bucket(rows, timing.row_buckets) * jnp.max(steps), 0)
        cost = cost + jnp.stack([call, jnp.sum(steps), (rows > 0).astype(jnp.int32)])
        st, t = observe_round(setup, knobs, st, t, rewards, observed)
        return step_carry(st), t, cost

    queues, t, cost = jax.lax.while_loop(lambda c: ~c[1].done, body,
                                         (step_carry(state), t,
                                          jnp.zeros((3,), jnp.int32)))
    state, t = finish_step(setup, knobs, with_queues(queues), t)
    zero = jnp.zeros((), jnp.int32)
    return state, t, {"chunks": cost[2], "slot_steps": cost[0], "live_steps": cost[1], "aborted": zero,
                      "wasted": zero, "limit_hit": zero, "stuck": zero, "overflow": zero}
