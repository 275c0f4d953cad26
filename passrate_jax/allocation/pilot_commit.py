"""Pilot-Commit (DESIGN.md 2.3): the pilot band rule. The buffer is a :class:`GroupQueue` ordered by
:func:`pilot_priority` (max pilot variance, then recency) and aged out after ``buffer_max_age`` steps."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from passrate_jax.allocation.config import PilotCommitConfig

KEEP, SKIP, EVICT = 0, 1, 2


def pilot_size(cfg: PilotCommitConfig, group_size: int) -> int:
    """n_p = round(pilot_fraction * N), kept within [1, N - 1] so a commit always adds rollouts."""
    return int(min(max(round(cfg.pilot_fraction * group_size), 1), group_size - 1))


@functools.partial(jax.jit, static_argnames=("cfg",))
def pilot_classify(n, s, cfg: PilotCommitConfig):
    """KEEP if p_low <= s/n <= 1 - p_high, else SKIP (this step); EVICT (from later epochs) if every
    pilot rollout succeeded. int32 elementwise over pilots."""
    p_hat = s / jnp.maximum(n, 1)
    keep = (p_hat >= cfg.p_low) & (p_hat <= 1 - cfg.p_high)
    return jnp.where(keep, KEEP, jnp.where((s == n) & (n > 0), EVICT, SKIP)).astype(jnp.int32)
