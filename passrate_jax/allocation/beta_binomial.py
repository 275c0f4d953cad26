"""Beta-binomial validity predictor of SARA (DESIGN.md 2.2), a pure elementwise function.

A group of ``group_size`` (N) binary rollouts is *valid* when it holds at least one success and one
failure. After n rollouts with s successes, the prompt's success rate has posterior
Beta(a + s, b + n - s); the probability that the completed group is valid is

    1                                                    if 0 < s < n (already mixed)
    1 - [s = 0] P(m more failures) - [s = n] P(m more successes)    otherwise, m = N - n,

where P(m more failures) = prod_{j<m} (beta + j) / (alpha + beta + j) = B(beta + m, alpha) / B(beta, alpha).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.scipy.special import betaln, gammaln


@jax.jit
def log_run_probability(m, alpha, beta):
    """log P(the next ``m`` Bernoulli draws all fail) under a Beta(alpha, beta) success rate.

    Equals sum_{j<m} log((beta + j) / (alpha + beta + j)). Computed as a difference of log-Beta
    functions in float32, whose error stays ~1e-6 relative up to m = 512, where a difference of raw
    ``lgamma`` values (each ~2.6e3 at 512) would lose about 4e-4; in float64 as lgamma differences.
    """
    m = jnp.asarray(m)
    alpha, beta = jnp.asarray(alpha), jnp.asarray(beta)
    dtype = jnp.result_type(alpha, beta, jnp.float32)
    m, alpha, beta = m.astype(dtype), alpha.astype(dtype), beta.astype(dtype)
    if dtype == jnp.float64:
        # In float64 plain lgamma differences are exact to ~1e-13, while jax's betaln carries
        # float32-grade corrections (~1e-7 relative).
        return gammaln(beta + m) - gammaln(beta) + gammaln(alpha + beta) - gammaln(alpha + beta + m)
    return betaln(beta + m, alpha) - betaln(beta, alpha)


def _run_probability_short(m, alpha, beta, max_run: int):
    """exp(:func:`log_run_probability`) for runs of at most ``max_run`` (static): the product itself,
    prod_{j < min(m, max_run)} (beta + j) / (alpha + beta + j), unrolled over j. Exact to float
    rounding and, for a small ``max_run`` such as a group size, far cheaper than log-Beta functions
    (no transcendental functions and no reduction over a trailing axis: SARA evaluates it for every
    row of every round)."""
    p = jnp.ones_like(alpha)
    for j in range(max_run):
        p = jnp.where(j < m, p * ((beta + j) / (alpha + beta + j)), p)
    return p


@functools.partial(jax.jit, static_argnames=("max_run",))
def validity_probability(n, s, group_size, prior_a=1.0, prior_b=1.0, max_run: int | None = None):
    """Probability that a group completed to ``group_size`` rollouts is valid (mixed), elementwise.

    Args:
      n: rollouts observed so far (0 <= n <= group_size), int array.
      s: successes among them (0 <= s <= n), int array.
      group_size: N, the full group size (int or int array, broadcastable).
      prior_a, prior_b: Beta prior of the prompt's success rate (float or array, > 0).
      max_run: optional static bound on N - n (e.g. the group size); when given, the run probabilities
        are the products themselves (cheap for small N) instead of log-Beta differences.

    Returns:
      Probability in [0, 1], float32 (float64 when the priors are float64), broadcast shape of the
      arguments. Pure, elementwise and jitted (one compile per shape and dtype); ``jax.vmap`` and
      an enclosing ``jax.jit`` apply directly.
    """
    n, s, group_size = jnp.asarray(n), jnp.asarray(s), jnp.asarray(group_size)
    a, b = jnp.asarray(prior_a), jnp.asarray(prior_b)
    dtype = jnp.result_type(a, b, jnp.float32)
    alpha = a.astype(dtype) + s.astype(dtype)
    beta = b.astype(dtype) + (n - s).astype(dtype)
    m = jnp.maximum(group_size - n, 0)
    if max_run is None:
        p_all_fail = jnp.exp(log_run_probability(m, alpha, beta))
        p_all_succeed = jnp.exp(log_run_probability(m, beta, alpha))
    else:
        alpha, beta, m = jnp.broadcast_arrays(alpha, beta, m)
        p_all_fail = _run_probability_short(m, alpha, beta, max_run)
        p_all_succeed = _run_probability_short(m, beta, alpha, max_run)
    # n = 0 makes both indicators true: the group is invalid if all N fail or all N succeed.
    p = 1.0 - jnp.where(s == 0, p_all_fail, 0.0) - jnp.where(s == n, p_all_succeed, 0.0)
    mixed = (s > 0) & (s < n)
    return jnp.clip(jnp.where(mixed, 1.0, p), 0.0, 1.0).astype(dtype)
