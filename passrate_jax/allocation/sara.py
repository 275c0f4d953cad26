"""SARA's per-round decision (DESIGN.md 2.2): confirm, abandon or continue each active prompt.

Pure and elementwise over the active prompts, so one jitted call decides a whole round:

    action, p_valid, chunk = sara_decide(n, s, probes_done, prior_a, prior_b, cfg, group_size)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from passrate_jax.allocation.beta_binomial import validity_probability
from passrate_jax.allocation.config import SaraConfig

CONTINUE, CONFIRM, ABANDON = 0, 1, 2


@functools.partial(jax.jit, static_argnames=("cfg", "group_size"))
def sara_decide(n, s, probes_done, prior_a, prior_b, cfg: SaraConfig, group_size: int):
    """Dual-threshold (SPRT-style) rule for each active prompt.

    Args:
      n, s: rollouts observed and successes, int arrays [K].
      probes_done: probe rounds this prompt has had (1 after its first probe), int array [K].
      prior_a, prior_b: Beta prior of each prompt's success rate, float arrays [K].
      cfg: thresholds and round schedule (static). group_size: N (static).

    Returns:
      (action int32 [K] in {CONTINUE, CONFIRM, ABANDON}, p_valid float32 [K], chunk int32 [K]) where
      chunk is the number of rollouts the next round requests for the prompt: N - n when confirmed,
      the schedule's next probe size when continuing (N - n once the schedule is exhausted, so an
      undecided prompt ends as a full group), 0 when abandoned.
    """
    p_valid = validity_probability(n, s, group_size, prior_a, prior_b)
    action = jnp.where(p_valid >= cfg.tau_confirm, CONFIRM,
                       jnp.where(p_valid <= cfg.tau_abandon, ABANDON, CONTINUE)).astype(jnp.int32)
    remaining = jnp.maximum(group_size - n, 0)
    schedule = jnp.asarray(cfg.round_schedule, jnp.int32)
    idx = jnp.clip(probes_done, 0, len(cfg.round_schedule) - 1)
    probe = jnp.where(probes_done < len(cfg.round_schedule), schedule[idx], remaining)
    chunk = jnp.where(action == CONFIRM, remaining,
                      jnp.where(action == ABANDON, 0, jnp.minimum(probe, remaining)))
    return action, p_valid, chunk.astype(jnp.int32)
