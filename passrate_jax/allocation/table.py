"""The step's groups as one fixed-capacity array table, and the pure row operations every policy uses.

A step's rewards live here and nowhere else: the host writes a round's outcomes into ``rewards``,
the policies decide from it, and the groups to train are read from it at the end. Capacity G and
group size N are static (array shapes), so one jitted round function serves every round of every
step, and the simulator runs the same functions under ``lax.scan``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from passrate_jax.allocation.config import AllocationConfig
from passrate_jax.allocation.group_queue import GroupQueue, queue_take
from passrate_jax.allocation.selection import SelectionState, prior_by_id, select_by_id

# Row status. ACTIVE: being probed (SARA) or piloted; CONFIRMED: will be completed to N; TRAINED,
# DROPPED (complete but saturated or surplus), ABANDONED (given up partial), BUFFERED (a kept pilot
# waiting in the Pilot-Commit buffer), REJECTED (its outcomes were not an observation).
FREE, ACTIVE, CONFIRMED, TRAINED, DROPPED, ABANDONED, BUFFERED, REJECTED = range(8)


@struct.dataclass
class StepTable:
    """G rows of groups of up to N rollouts, P prompts, K Prefix Sampling buckets.

    Per row (shape [G] unless noted): prompt, key (group key, unique across steps), status, n (rollouts
    held), rewards int8 [G, N] (first n meaningful), chunk (rollouts the current round requests),
    probes (SARA probe rounds done), prior_a / prior_b (SARA's Beta prior), bucket (PS bucket of a
    re-rollout group, -1 for a fresh group), src_key / src_index / cut / src_success (the replayed
    prefix), pilot (a Pilot-Commit pilot awaiting its verdict), carried (came from the ideal-DS surplus:
    observed at its own step), rank (training order, -1 when not trained).
    Scalars: count (rows used), key_base (key of row 0), trained, spent (rollouts requested), rounds,
    done. used / evicted: bool [P]. rng: PRNG key. replay_successes / replay_rollouts: float32 [K].
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
    count: jax.Array
    key_base: jax.Array
    trained: jax.Array
    spent: jax.Array
    rounds: jax.Array
    done: jax.Array
    used: jax.Array
    evicted: jax.Array
    rng: jax.Array
    replay_successes: jax.Array
    replay_rollouts: jax.Array

    @property
    def capacity(self) -> int:
        return self.status.shape[0]


def table_init(capacity: int, group_size: int, num_buckets: int, key_base, evicted, rng) -> StepTable:
    """An empty table for one step."""
    zi = jnp.zeros((capacity,), jnp.int32)
    zf = jnp.zeros((capacity,), jnp.float32)
    zb = jnp.zeros((capacity,), bool)
    z = jnp.zeros((), jnp.int32)
    return StepTable(prompt=zi, key=zi, status=zi, n=zi, rewards=jnp.zeros((capacity, group_size), jnp.int8),
                     chunk=zi, probes=zi, prior_a=zf + 1, prior_b=zf + 1, bucket=zi - 1, src_key=zi,
                     src_index=zi, cut=zf, src_success=zb, pilot=zb, carried=zb, rank=zi - 1, count=z,
                     key_base=jnp.asarray(key_base, jnp.int32), trained=z, spent=z, rounds=z,
                     done=jnp.zeros((), bool), used=jnp.zeros_like(evicted), evicted=evicted, rng=rng,
                     replay_successes=jnp.zeros((num_buckets,), jnp.float32),
                     replay_rollouts=jnp.zeros((num_buckets,), jnp.float32))


def successes(t: StepTable):
    """Successes held by each row, int32 [G]."""
    held = jnp.arange(t.rewards.shape[1])[None, :] < t.n[:, None]
    return jnp.sum(jnp.where(held, t.rewards, 0), axis=1).astype(jnp.int32)


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
    defaults to a new key (key_base + row). Rows past capacity are dropped (capacities are sized so
    that this never happens). Marks the prompts used for this step.
    """
    g = t.capacity
    pos = t.count + jnp.cumsum(ok) - 1
    idx = jnp.where(ok & (pos < g), pos, g)
    k = ok.shape[0]
    fields = {"prompt": prompt, "status": status, "chunk": chunk, "key": fields.pop("key", t.key_base + idx),
              **fields}
    updates = {}
    for name, value in fields.items():
        column = getattr(t, name)
        value = jnp.broadcast_to(jnp.asarray(value).astype(column.dtype), (k,) + column.shape[1:])
        updates[name] = column.at[idx].set(value, mode="drop")
    opened = jnp.sum(ok & (pos < g)).astype(jnp.int32)
    used = t.used.at[jnp.where(ok, prompt, t.used.shape[0])].set(True, mode="drop")
    return t.replace(**updates, count=t.count + opened, used=used)


def open_fresh(t: StepTable, selection: SelectionState, pilot_buffer: GroupQueue, cfg: AllocationConfig, method,
               k, k_max: int, status, chunk, **fields) -> StepTable:
    """Open up to ``k`` (traced, <= static ``k_max``) groups on prompts the selection method ``method``
    (an index into ``selection.METHODS``, may be traced) chooses among those not used this step, not
    evicted and not waiting in the pilot buffer."""
    buffered = pilot_buffer.prompt_id
    avail = ~t.evicted & ~t.used
    avail = avail.at[jnp.where(pilot_buffer.valid, buffered, avail.shape[0])].set(False, mode="drop")
    t, use = split_rng(t)
    ids, ok = select_by_id(selection, use, avail, k, k_max, cfg.selection, method)
    pa, pb = prior_by_id(selection, ids, method, cfg.sara.prior_a, cfg.sara.prior_b)
    return open_rows(t, ok, ids, status, chunk, prior_a=pa, prior_b=pb, **fields)


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
