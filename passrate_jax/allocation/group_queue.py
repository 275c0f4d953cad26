"""A fixed-capacity queue of groups as a pytree with pure push / take / expire functions.

It carries groups across steps: the Pilot-Commit buffer (kept pilots awaiting their commit), the
Prefix Sampling replay queue (skewed groups awaiting a re-rollout) and ideal DS's surplus. Capacity
and group size are static (array shapes); a checkpoint saves it as arrays.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class GroupQueue:
    """C slots of groups of up to N rollouts.

    prompt_id, group_key: int32 [C]; n, s: int32 [C] rollouts and successes; rewards: int8 [C, N]
    (first n entries meaningful); tag, aux: int32 [C] user fields (PS bucket, replay source index);
    stamp: int32 [C] step the group entered; valid: bool [C] slot in use.
    """
    prompt_id: jax.Array
    group_key: jax.Array
    n: jax.Array
    s: jax.Array
    rewards: jax.Array
    tag: jax.Array
    aux: jax.Array
    stamp: jax.Array
    valid: jax.Array

    @property
    def capacity(self) -> int:
        return self.valid.shape[0]


def queue_init(capacity: int, group_size: int) -> GroupQueue:
    """An empty queue."""
    zi = jnp.zeros((capacity,), jnp.int32)
    return GroupQueue(prompt_id=zi, group_key=zi, n=zi, s=zi, rewards=jnp.zeros((capacity, group_size), jnp.int8),
                      tag=zi, aux=zi, stamp=zi, valid=jnp.zeros((capacity,), bool))


@jax.jit
def queue_push(q: GroupQueue, prompt_id, group_key, n, s, rewards, tag, aux, stamp, mask) -> GroupQueue:
    """Insert the rows with ``mask`` True ([K] arrays, rewards [K, N]) into free slots; when the queue
    is full the oldest entries (lowest stamp) are overwritten. Rows beyond capacity are dropped."""
    cap = q.capacity
    # Slots in fill order: free ones first, then by age (oldest first).
    order = jnp.lexsort((q.stamp, q.valid.astype(jnp.int32)))
    rank = jnp.cumsum(mask) - 1
    slot = jnp.where(mask & (rank < cap), order[jnp.clip(rank, 0, cap - 1)], cap)

    def put(field, values):
        return field.at[slot].set(jnp.asarray(values).astype(field.dtype), mode="drop")

    k = jnp.shape(mask)[0]
    return GroupQueue(prompt_id=put(q.prompt_id, prompt_id), group_key=put(q.group_key, group_key),
                      n=put(q.n, n), s=put(q.s, s), rewards=put(q.rewards, rewards), tag=put(q.tag, tag),
                      aux=put(q.aux, aux), stamp=put(q.stamp, jnp.broadcast_to(stamp, (k,))),
                      valid=put(q.valid, jnp.ones((k,), bool)))


@jax.jit
def queue_take(q: GroupQueue, k, priority):
    """Remove the ``k`` (a traced int, so no recompiles) valid entries with the highest ``priority``.

    Returns (slots int32 [C], ok bool [C], queue): entries in priority order; ok is True for the
    first min(k, #valid) of them. Read them with ``q.field[slots]`` on the queue passed in.
    """
    val, slots = jax.lax.top_k(jnp.where(q.valid, priority, -jnp.inf), q.capacity)
    ok = jnp.isfinite(val) & (jnp.arange(q.capacity) < k)
    return slots, ok, q.replace(valid=q.valid.at[jnp.where(ok, slots, q.capacity)].set(False, mode="drop"))


@jax.jit
def queue_expire(q: GroupQueue, now, max_age):
    """Drop entries older than ``max_age`` steps (now - stamp > max_age). Returns (queue, dropped bool [C])."""
    dropped = q.valid & (now - q.stamp > max_age)
    return q.replace(valid=q.valid & ~dropped), dropped


@jax.jit
def pilot_priority(q: GroupQueue):
    """Pilot-Commit buffer order as a priority [C] (higher first): highest pilot variance p(1-p),
    p = s/n, then most recent stamp first. Ranks from an exact lexicographic sort."""
    p = q.s / jnp.maximum(q.n, 1)
    order = jnp.lexsort((q.stamp, p * (1 - p)))
    return jnp.zeros(q.capacity, jnp.float32).at[order].set(jnp.arange(q.capacity, dtype=jnp.float32))
