"""The four "why a 50% pass rate" measures of DESIGN.md section 1, as pure elementwise functions of the
success rate p of a prompt and the group size N. Each is maximal at p = 0.5."""

from __future__ import annotations

import jax.numpy as jnp
from jax.scipy.special import xlogy


def reward_entropy(p):
    """Entropy of one Bernoulli(p) reward in bits: -p log2 p - (1-p) log2 (1-p); 0 at p in {0, 1}."""
    p = jnp.asarray(p, dtype=jnp.result_type(p, jnp.float32))
    return -(xlogy(p, p) + xlogy(1 - p, 1 - p)) / jnp.log(2.0).astype(p.dtype)


def filter_survival(p, group_size):
    """Probability that a group of N Bernoulli(p) rewards is mixed: 1 - p^N - (1-p)^N."""
    p = jnp.asarray(p, dtype=jnp.result_type(p, jnp.float32))
    return 1 - p**group_size - (1 - p) ** group_size


def rloo_advantage_energy(p, group_size):
    """E[sum_i A_i^2] with leave-one-out advantages A_i = r_i - mean_{j != i} r_j: N^2 p(1-p) / (N-1)."""
    p = jnp.asarray(p, dtype=jnp.result_type(p, jnp.float32))
    return group_size**2 * p * (1 - p) / (group_size - 1)


def success_failure_pairs(p, group_size):
    """Expected number of (success, failure) pairs in a group, E[S (N - S)] = N (N-1) p (1-p)."""
    p = jnp.asarray(p, dtype=jnp.result_type(p, jnp.float32))
    return group_size * (group_size - 1) * p * (1 - p)
