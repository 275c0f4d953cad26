"""Group-relative advantage estimators: GRPO, Dr.GRPO and RLOO.

Every estimator maps per-rollout scalar rewards ``rewards_b`` [B] and integer group ids
``group_ids_b`` [B] to one advantage per rollout [B]. Rollouts that share a group id form a
group; a Prefix Sampling re-rollout group simply gets a group id of its own, even though it
shares the prompt of the group it was replayed from.

Conventions (all estimators):
  * group ids are int32 in ``[0, num_groups)``; ``num_groups`` defaults to B, which always
    suffices when ids are dense indices (e.g. ``arange(G).repeat(N)``);
  * ``valid_b`` (optional bool [B]) marks real rows; padding rows get advantage 0 and do not
    enter any group statistic;
  * a saturated group (all valid rewards equal, including a group of one) gets advantage
    *exactly* 0.0: it is zeroed explicitly rather than trusting ``r - mean`` to round to 0.

The functions are pure and jit/vmap compatible; the estimator is a static choice.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

Estimator = Literal["grpo", "dr_grpo", "rloo"]


def _group_stats(rewards_b, group_ids_b, valid_b, num_groups):
    """Per-row group count, sum, sum of squares, and a saturated flag ([B] each)."""
    ones = valid_b.astype(jnp.float32)
    r = jnp.where(valid_b, rewards_b, 0.0)
    count_g = jax.ops.segment_sum(ones, group_ids_b, num_segments=num_groups)
    sum_g = jax.ops.segment_sum(r, group_ids_b, num_segments=num_groups)
    # Saturation is decided by max == min (exact), not by a rounded variance.
    max_g = jax.ops.segment_max(jnp.where(valid_b, rewards_b, -jnp.inf), group_ids_b,
                                num_segments=num_groups)
    min_g = jax.ops.segment_min(jnp.where(valid_b, rewards_b, jnp.inf), group_ids_b,
                                num_segments=num_groups)
    count, total = count_g[group_ids_b], sum_g[group_ids_b]
    saturated = (max_g[group_ids_b] == min_g[group_ids_b]) | (count < 2)
    return count, total, saturated


def group_advantages(rewards_b: jax.Array, group_ids_b: jax.Array, estimator: Estimator = "grpo", *,
                     valid_b: jax.Array | None = None, num_groups: int | None = None,
                     eps: float = 1e-6) -> jax.Array:
    """Advantages [B] float32 from rewards [B] within groups.

    Args:
      rewards_b: float rewards per rollout (any units; binary for verifiable rewards).
      group_ids_b: int group index per rollout, in ``[0, num_groups)``.
      estimator: ``"grpo"``: ``(r - mean_g) / (std_g + eps)`` with the unbiased (ddof=1) group
        standard deviation, as in the GRPO reference implementations; ``"dr_grpo"``:
        ``r - mean_g`` (no std scaling, Liu et al. 2025); ``"rloo"``: ``r_i - mean_{j != i} r_j``.
      valid_b: optional bool mask of real rows (padding rows: advantage 0, excluded from stats).
      num_groups: static number of segments; default B.
      eps: added to the standard deviation (reward units) for ``"grpo"``.
    """
    rewards_b = jnp.asarray(rewards_b, jnp.float32)
    group_ids_b = jnp.asarray(group_ids_b, jnp.int32)
    if valid_b is None:
        valid_b = jnp.ones(rewards_b.shape, bool)
    valid_b = jnp.asarray(valid_b, bool)
    num_groups = rewards_b.shape[0] if num_groups is None else num_groups
    count, total, saturated = _group_stats(rewards_b, group_ids_b, valid_b, num_groups)
    safe_count = jnp.maximum(count, 2.0)  # saturated/singleton rows are zeroed below anyway
    mean = total / safe_count
    centred = rewards_b - mean
    if estimator == "grpo":
        sq = jax.ops.segment_sum(jnp.where(valid_b, centred, 0.0) ** 2, group_ids_b,
                                 num_segments=num_groups)[group_ids_b]
        std = jnp.sqrt(sq / (safe_count - 1.0))
        adv = centred / (std + eps)
    elif estimator == "dr_grpo":
        adv = centred
    elif estimator == "rloo":
        adv = rewards_b - (total - rewards_b) / (safe_count - 1.0)
    else:
        raise ValueError(f"unknown advantage estimator {estimator!r}")
    return jnp.where(valid_b & ~saturated, adv, 0.0)
