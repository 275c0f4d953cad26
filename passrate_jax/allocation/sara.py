"""SARA's per-round decision (DESIGN.md 2.2): confirm, abandon or continue each active prompt.

Pure and elementwise over the active prompts, so one jitted call decides a whole round:

    action, p_valid, chunk = sara_decide(n, s, probes_done, prior_a, prior_b, cfg, group_size)

:func:`sara_rule` is the same rule with traced thresholds, for sweeps under ``jax.vmap``.
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
    """Dual-threshold (SPRT-style) rule for each active prompt, with ``cfg``'s thresholds and schedule.

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
    return sara_rule(n, s, probes_done, prior_a, prior_b, cfg.tau_confirm, cfg.tau_abandon,
                     jnp.asarray(cfg.round_schedule, jnp.int32), group_size)


def sara_rule(n, s, probes_done, prior_a, prior_b, tau_confirm, tau_abandon, schedule, group_size: int):
    """:func:`sara_decide` with traced thresholds (float scalars) and ``schedule`` (int32 [L], L static),
    so a sweep can ``jax.vmap`` over them. Not jitted: call it inside a jitted function."""
    p_valid = validity_probability(n, s, group_size, prior_a, prior_b, max_run=group_size)
    action = jnp.where(p_valid >= tau_confirm, CONFIRM,
                       jnp.where(p_valid <= tau_abandon, ABANDON, CONTINUE)).astype(jnp.int32)
    remaining = jnp.maximum(group_size - n, 0)
    length = schedule.shape[0]
    idx = jnp.clip(probes_done, 0, length - 1)
    probe = jnp.where(probes_done < length, schedule[idx], remaining)
    chunk = jnp.where(action == CONFIRM, remaining,
                      jnp.where(action == ABANDON, 0, jnp.minimum(probe, remaining)))
    return action, p_valid, chunk.astype(jnp.int32)
