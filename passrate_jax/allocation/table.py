"""The step's groups as one fixed-capacity array table, and the pure row operations every policy uses.

A step's rewards live here and nowhere else: the host writes a round's outcomes into ``rewards``,
the policies decide from it, and the groups to train are read from it at the end. Capacity G and
group size N are static (array shapes), so one jitted round function serves every round of every
step, and the simulator runs the same functions under ``lax.scan``.

The rows hold only the *live* groups (trained, or still being probed or completed), packed at the
front in the order they were opened. A group that ends otherwise (abandoned, dropped, buffered as a
pilot, rejected) is closed: what the end of the step needs from it (its rollouts and successes, for
the selection models) moves to per-prompt arrays and its row is reused. So G is the most groups live
at once (about 2B), not the most a step opens (up to the whole dataset in SARA's fill mode), and every
round's work scales with B.
"""

from __future__ import annotations

import dataclasses
import operator

import jax
import jax.numpy as jnp
from flax import struct

from passrate_jax.allocation.config import AllocationConfig
from passrate_jax.allocation.group_queue import GroupQueue, queue_take
from passrate_jax.allocation.selection import SelectionState, prior_by_id, select_by_id, thompson_draws

# Row status. ACTIVE: being probed (SARA) or piloted; CONFIRMED: will be completed to N; TRAINED,
# DROPPED (complete but saturated or surplus), ABANDONED (given up partial), BUFFERED (a kept pilot
# waiting in the Pilot-Commit buffer), REJECTED (its outcomes were not an observation). The last four
# are closing states: such a row is closed (recorded per prompt, row freed) by :func:`close_rows`.
FREE, ACTIVE, CONFIRMED, TRAINED, DROPPED, ABANDONED, BUFFERED, REJECTED = range(8)
CLOSING = (DROPPED, ABANDONED, BUFFERED, REJECTED)


@struct.dataclass
class GroupRows:
    """The step's G rows of groups of up to N rollouts, one entry per row (shape [G] unless noted).

    prompt, key (group key, unique across steps), status, n (rollouts held), rewards int8 [G, N] (first n
    meaningful), chunk (rollouts the current round requests), probes (SARA probe rounds done), prior_a /
    prior_b (SARA's Beta prior), bucket (PS bucket of a re-rollout group, -1 for a fresh group), src_key /
    src_index / cut / src_success (the replayed prefix), pilot (a Pilot-Commit pilot awaiting its verdict),
    carried (came from the ideal-DS surplus: observed at its own step), rank (training order, -1 when not
    trained), inflight (event mode: rollouts requested and not yet observed; 0 in round mode), wave (the
    round of the row's latest request: 1 + the round of the event that issued it).
    """
    prompt: jax.Array
    key: jax.Array
    status: jax.Array
    n: jax.Array
    rewards: jax.Array
    chunk: jax.Array
    probes: jax.Array
    prior_a: jax.Array
    prior_b: jax.Array
    bucket: jax.Array
    src_key: jax.Array
    src_index: jax.Array
    cut: jax.Array
    src_success: jax.Array
    pilot: jax.Array
    carried: jax.Array
    rank: jax.Array
    inflight: jax.Array
    wave: jax.Array


@struct.dataclass
class PromptArrays:
    """The step's P-sized arrays, one entry per prompt, and the step order's cursor.

    used / evicted: bool [P]. thompson: float32 [P], the step's MoPPS Thompson draws (zeros under another
    selection method). order: int32 [P], the prompts available at the start of the step first, in random
    order; cursor: how many of them selection method none has opened; num_available: how many there are.
    Closed groups, per prompt (a prompt has at most one row a step, closed once except a pilot buffered
    and committed in the same step): closed (its closing status, FREE if none), closed_n / closed_s
    (rollouts, successes), closed_seen (an observation for the selection models: a fresh group of this
    step that was observed).
    """
    used: jax.Array
    evicted: jax.Array
    thompson: jax.Array
    order: jax.Array
    cursor: jax.Array
    num_available: jax.Array
    closed: jax.Array
    closed_n: jax.Array
    closed_s: jax.Array
    closed_seen: jax.Array


@struct.dataclass
class Counters:
    """The step's scalars and per-bucket sums.

    count (live rows, packed at the front), opened (new group keys drawn this step: the next new
    group's key is key_base + opened; a group taken from a queue keeps its key and draws none), trained, spent (rollouts requested), rounds, done, overflow (groups that found no
    free row: 0 unless a capacity is wrong; the host raises on it), replay_left (same-step Prefix Sampling:
    re-rollout groups the step may still open, their slots and rollouts held back from the policy; 0
    otherwise), event_wave (the round of the latest observation: the largest wave it observed; the next
    requests are of round event_wave + 1, so in round mode it equals rounds). replay_successes /
    replay_rollouts: float32 [K], this step's re-rollout outcomes per PS bucket.
    """
    count: jax.Array
    opened: jax.Array
    overflow: jax.Array
    key_base: jax.Array
    trained: jax.Array
    spent: jax.Array
    rounds: jax.Array
    done: jax.Array
    replay_left: jax.Array
    event_wave: jax.Array
    replay_successes: jax.Array
    replay_rollouts: jax.Array


@struct.dataclass
class StepTable:
    """One step's groups: G rows (:class:`GroupRows`), P prompts (:class:`PromptArrays`), the counters
    (:class:`Counters`, K Prefix Sampling buckets) and the step's PRNG key ``rng``.

    The parts are split by shape, so that what happens to every field of a kind is one ``jax.tree.map``
    over its part (packing the rows, selecting a round's plan). Every field of a part also reads as an
    attribute of the table (``t.status`` is ``t.rows.status``), and :meth:`replace` takes field names
    (``t.replace(status=..., trained=...)`` replaces them in their parts) as well as whole parts.
    """
    rows: GroupRows
    prompts: PromptArrays
    counters: Counters
    rng: jax.Array

    @property
    def capacity(self) -> int:
        return self.rows.status.shape[0]


_PART_OF = {f.name: part for part, kind in (("rows", GroupRows), ("prompts", PromptArrays), ("counters", Counters))
            for f in dataclasses.fields(kind)}


def _replace(t: StepTable, **updates) -> StepTable:
    """``t`` with fields replaced: a part's field name replaces it within its part, any other name
    (``rows``, ``prompts``, ``counters``, ``rng``) a whole part."""
    whole = {name: value for name, value in updates.items() if name not in _PART_OF}
    for part in ("rows", "prompts", "counters"):
        fields = {name: value for name, value in updates.items() if _PART_OF.get(name) == part}
        if fields:
            whole[part] = whole.get(part, getattr(t, part)).replace(**fields)
    return dataclasses.replace(t, **whole)


# flax's struct.dataclass installs its own ``replace``; the table's routes field names to their parts.
StepTable.replace = _replace
for _name, _part in _PART_OF.items():
    setattr(StepTable, _name, property(operator.attrgetter(f"{_part}.{_name}")))


def rows_init(capacity: int, group_size: int) -> GroupRows:
    """``capacity`` free rows."""
    zi = jnp.zeros((capacity,), jnp.int32)
    zf = jnp.zeros((capacity,), jnp.float32)
    zb = jnp.zeros((capacity,), bool)
    return GroupRows(prompt=zi, key=zi, status=zi, n=zi, rewards=jnp.zeros((capacity, group_size), jnp.int8),
                     chunk=zi, probes=zi, prior_a=zf + 1, prior_b=zf + 1, bucket=zi - 1, src_key=zi, src_index=zi,
                     cut=zf, src_success=zb, pilot=zb, carried=zb, rank=zi - 1, inflight=zi, wave=zi)


def table_init(capacity: int, group_size: int, num_buckets: int, key_base, evicted, rng) -> StepTable:
    """An empty table for one step."""
    z = jnp.zeros((), jnp.int32)
    per_prompt = lambda dtype: jnp.zeros(evicted.shape, dtype)  # noqa: E731
    prompts = PromptArrays(used=jnp.zeros_like(evicted), evicted=evicted, thompson=per_prompt(jnp.float32),
                           order=per_prompt(jnp.int32), cursor=z, num_available=z, closed=per_prompt(jnp.int32),
                           closed_n=per_prompt(jnp.int32), closed_s=per_prompt(jnp.int32),
                           closed_seen=jnp.zeros_like(evicted))
    counters = Counters(count=z, opened=z, overflow=z, key_base=jnp.asarray(key_base, jnp.int32), trained=z, spent=z,
                        rounds=z, done=jnp.zeros((), bool), replay_left=z, event_wave=z,
                        replay_successes=jnp.zeros((num_buckets,), jnp.float32),
                        replay_rollouts=jnp.zeros((num_buckets,), jnp.float32))
    return StepTable(rows=rows_init(capacity, group_size), prompts=prompts, counters=counters, rng=rng)


def draw_thompson(t: StepTable, selection: SelectionState, method) -> StepTable:
    """The step's MoPPS Thompson draws, once, for every round's :func:`open_fresh`."""
    t, use = split_rng(t)
    return t.replace(thompson=thompson_draws(selection, use, method))


def shuffle_available(t: StepTable, held) -> StepTable:
    """The prompts available to :func:`open_fresh` in a random order, drawn once a step (call it after
    the step's carried and replayed groups are opened). Within the step a prompt stops being available
    only when a round opens it, so selection method none takes the next ones in this order: sampling
    without replacement, as a fresh draw every round would be, without a pass over the dataset. ``held``:
    bool [P], prompts the policy's queues hold (``Policy.held_prompts``)."""
    avail = _available(t, held)
    num = avail.shape[0]
    candidate = random_permutation(jax.random.fold_in(t.rng, 1), num)
    ok = (candidate < num) & avail[jnp.minimum(candidate, num - 1)]
    order = jnp.zeros((num,), jnp.int32).at[jnp.where(ok, jnp.cumsum(ok) - 1, num)].set(candidate, mode="drop")
    return t.replace(order=order, cursor=jnp.zeros((), jnp.int32), num_available=jnp.sum(ok).astype(jnp.int32))


def random_permutation(key, num: int, rounds: int = 4):
    """A keyed pseudo-random permutation of 0 .. D - 1 (D the power of 4 >= ``num``), int32 [D]: a
    ``rounds``-round Feistel network over the index bits, computed elementwise. Used instead of
    ``jax.random.permutation`` where a sort per call is the cost that matters (XLA's CPU sort of 512
    keys in each of 500 vmapped lanes took longer than a whole SARA round); values >= ``num`` are for
    the caller to skip."""
    half = max(1, (max(num - 1, 1).bit_length() + 1) // 2)
    mask = jnp.uint32((1 << half) - 1)
    keys = jax.random.bits(key, (rounds,), jnp.uint32)
    x = jnp.arange(1 << (2 * half), dtype=jnp.uint32)
    left, right = x >> half, x & mask
    for r in range(rounds):
        left, right = right, left ^ (_mix32(right ^ keys[r]) & mask)
    return ((left << half) | right).astype(jnp.int32)


def _mix32(x):
    """A 32-bit integer hash (the "lowbias32" xor-shift-multiply finaliser)."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def successes(t: StepTable):
    """Successes held by each row, int32 [G]."""
    held = jnp.arange(t.rewards.shape[1])[None, :] < t.n[:, None]
    return jnp.sum(jnp.where(held, t.rewards, 0), axis=1).astype(jnp.int32)


def observed(t: StepTable):
    """Rows that are an observation of their prompt for the selection models, bool [G]: a fresh group
    of this step (not a replay, not ideal DS's carried surplus) with rollouts, neither rejected nor a
    pilot waiting in the buffer (observed when committed or when it expires)."""
    return ((t.bucket < 0) & ~t.carried & (t.n > 0) & (t.status != FREE) & (t.status != REJECTED)
            & (t.status != BUFFERED))


def pending(t: StepTable):
    """Rows still being probed or completed, bool [G]."""
    return (t.status == ACTIVE) | (t.status == CONFIRMED)


def split_rng(t: StepTable):
    """(table with a fresh rng, a key to use once)."""
    rng, use = jax.random.split(t.rng)
    return t.replace(rng=rng), use


def afford(free, cost):
    """How many items of ``cost`` rollouts fit in ``free`` rollouts (0 if none)."""
    return jnp.maximum(free // cost, 0).astype(jnp.int32)


def open_rows(t: StepTable, ok, prompt, status, chunk, **fields) -> StepTable:
    """Append the K candidate rows with ``ok`` True (bool [K]) after the used rows, in order.

    ``prompt``, ``chunk`` and any of the row fields in ``fields`` are [K] arrays or scalars; ``key``
    defaults to a new key (key_base + the number of new keys drawn this step before it). A group given its
    key (taken from a queue: a commit, a carried surplus group) draws none, so a fresh group's key does
    not depend on how many such groups were taken before it (the slot engine predicts it,
    machine.lookahead). Rows past capacity are dropped and counted in ``overflow`` (capacities are sized
    so that this never happens). Marks the prompts used for this step.
    """
    g = t.capacity
    rank = jnp.cumsum(ok) - 1
    pos = t.count + rank
    idx = jnp.where(ok & (pos < g), pos, g)
    k = ok.shape[0]
    new_keys = "key" not in fields
    fields = {"prompt": prompt, "status": status, "chunk": chunk,
              "key": fields.pop("key", t.key_base + t.opened + rank), **fields}
    updates = {}
    for name, value in fields.items():
        column = getattr(t, name)
        value = jnp.broadcast_to(jnp.asarray(value).astype(column.dtype), (k,) + column.shape[1:])
        updates[name] = column.at[idx].set(value, mode="drop")
    opened = jnp.sum(ok & (pos < g)).astype(jnp.int32)
    used = t.used.at[jnp.where(ok, prompt, t.used.shape[0])].set(True, mode="drop")
    return t.replace(**updates, count=t.count + opened, opened=t.opened + (opened if new_keys else 0), used=used,
                     overflow=t.overflow + jnp.sum(ok).astype(jnp.int32) - opened)


def close_rows(t: StepTable) -> StepTable:
    """Close the rows in a closing state: record each one's rollouts and successes under its prompt,
    then pack the live rows at the front (keeping their order) and free the rest."""
    closing = jnp.isin(t.status, jnp.asarray(CLOSING))
    at = jnp.where(closing, t.prompt, t.closed.shape[0])
    record = {"closed": t.status, "closed_n": t.n, "closed_s": successes(t), "closed_seen": closing & observed(t)}
    t = t.replace(**{name: getattr(t, name).at[at].set(value, mode="drop") for name, value in record.items()})
    return _pack(t, (t.status != FREE) & ~closing)


def _pack(t: StepTable, keep) -> StepTable:
    """Rows with ``keep`` moved to the front in order; the other rows reset to empty."""
    g = t.capacity
    src = jnp.full((g,), g, jnp.int32).at[jnp.where(keep, jnp.cumsum(keep) - 1, g)].set(
        jnp.arange(g, dtype=jnp.int32), mode="drop")
    filled = src < g

    def gather(column, blank):
        mask = filled.reshape((g,) + (1,) * (column.ndim - 1))
        return jnp.where(mask, column[jnp.minimum(src, g - 1)], blank)
    rows = jax.tree.map(gather, t.rows, rows_init(g, t.rewards.shape[1]))
    return t.replace(rows=rows, count=jnp.sum(keep).astype(jnp.int32))


def open_fresh(t: StepTable, selection: SelectionState, held, cfg: AllocationConfig, method,
               k, k_max: int, status, chunk, **fields) -> StepTable:
    """Open up to ``k`` (traced, <= static ``k_max``) groups on prompts the selection method ``method``
    (an index into ``selection.METHODS``, may be traced) chooses among those not used this step, not
    evicted and not ``held`` (bool [P]: waiting in the policy's queues, e.g. the pilot buffer): the next
    ones of the step's random order (:func:`shuffle_available`) under method none, else by
    :func:`~.selection.select_by_id`."""
    def in_order():
        at = t.cursor + jnp.arange(k_max)
        return t.order[jnp.minimum(at, t.order.shape[0] - 1)], (jnp.arange(k_max) < k) & (at < t.num_available), t.rng

    def by_score():
        rng, use = jax.random.split(t.rng)
        ids, ok = select_by_id(selection, use, _available(t, held), k, k_max, cfg.selection, method, t.thompson)
        return ids, ok, rng
    if isinstance(method, int):
        ids, ok, rng = in_order() if method == 0 else by_score()
    else:
        ids, ok, rng = jax.lax.cond(method == 0, in_order, by_score)
    pa, pb = prior_by_id(selection, ids, method, cfg.sara.prior_a, cfg.sara.prior_b)
    t = t.replace(rng=rng, cursor=t.cursor + jnp.sum(ok).astype(jnp.int32))
    return open_rows(t, ok, ids, status, chunk, prior_a=pa, prior_b=pb, **fields)


def _available(t: StepTable, held):
    """Prompts not used this step, not evicted, not ``held`` in a policy's queue: bool [P]."""
    return ~t.evicted & ~t.used & ~held


def take_rows(t: StepTable, q: GroupQueue, k, priority, status, chunk_of, **fields):
    """Move the ``k`` highest-``priority`` groups of queue ``q`` into the table with their rollouts and
    keys; ``chunk_of(n)`` gives each one's request size. ``fields``: more row fields (or overrides),
    each a scalar, None, or a [C] array over the queue's slots. Returns (table, queue, slots, ok)."""
    slots, ok, q_new = queue_take(q, k, priority)
    n = q.n[slots]
    per_row = {"key": q.group_key, "n": q.n, "rewards": q.rewards, **fields}
    # A None field keeps the table's default (key None: the rows get new keys).
    per_row = {name: (v[slots] if jnp.ndim(v) >= 1 else v) for name, v in per_row.items() if v is not None}
    t = open_rows(t, ok, q.prompt_id[slots], status, chunk_of(n), **per_row)
    return t, q_new, slots, ok
