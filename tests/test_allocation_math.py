"""Validity predictor and the four "why 50%" measures against independent references."""

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from passrate_jax.allocation import (filter_survival, reward_entropy, rloo_advantage_energy, success_failure_pairs,
                                     validity_probability)


def enumerate_validity(n, s, N, a, b):
    """P(valid) by summing the Beta-binomial pmf of the m remaining outcomes (pure Python float)."""
    alpha, beta, m = a + s, b + n - s, N - n
    total = 0.0
    for k in range(m + 1):  # k more successes among m
        log_pmf = (math.lgamma(m + 1) - math.lgamma(k + 1) - math.lgamma(m - k + 1)
                   + math.lgamma(alpha + k) + math.lgamma(beta + m - k) - math.lgamma(alpha + beta + m)
                   - math.lgamma(alpha) - math.lgamma(beta) + math.lgamma(alpha + beta))
        if 0 < s + k < N:
            total += math.exp(log_pmf)
    return total


def test_predictor_equals_enumeration_float64():
    with jax.enable_x64(True):
        cases = [(n, s, N, a, b) for N in (2, 4, 8, 16) for n in range(N + 1) for s in range(n + 1)
                 for a, b in ((1.0, 1.0), (0.5, 2.0), (3.0, 0.7))]
        n, s, N, a, b = (np.array(c) for c in zip(*cases))
        got = np.asarray(validity_probability(n, s, N, a.astype(np.float64), b.astype(np.float64)))
        assert got.dtype == np.float64
        want = np.array([enumerate_validity(*c) for c in cases])
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)


def test_predictor_matches_monte_carlo():
    rng = np.random.default_rng(0)
    N, a, b = 8, 1.5, 2.5
    for n, s in [(2, 0), (3, 3), (4, 0), (0, 0)]:
        p = rng.beta(a + s, b + n - s, size=400_000)
        rest = rng.binomial(N - n, p)
        mc = np.mean((s + rest > 0) & (s + rest < N))
        got = float(validity_probability(n, s, N, a, b))
        assert abs(got - mc) < 4 * math.sqrt(mc * (1 - mc) / p.size) + 1e-4


def test_uniform_prior_identity():
    N = 8
    n = jnp.arange(1, N + 1)
    for s in (jnp.zeros_like(n), n):  # n unanimous failures or successes
        np.testing.assert_allclose(validity_probability(n, s, N, 1.0, 1.0), (N - n) / (N + 1), atol=1e-6)
    np.testing.assert_allclose(validity_probability(jnp.arange(1, 5), 0, 8), [0.78, 0.67, 0.56, 0.44], atol=5e-3)
    assert float(validity_probability(3, 1, 8)) == 1.0  # already mixed


@pytest.mark.parametrize("N", [64, 256, 512])
def test_float32_stable_for_large_groups(N):
    n = np.arange(0, N + 1, max(N // 32, 1))
    for a, b in ((1.0, 1.0), (0.3, 5.0), (40.0, 2.0)):
        got = np.asarray(validity_probability(n, np.zeros_like(n), N, np.float32(a), np.float32(b)))
        assert got.dtype == np.float32 and np.all(np.isfinite(got))
        want = np.array([enumerate_validity(int(k), 0, N, a, b) for k in n])
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
    k = n[1:]  # the identity needs n >= 1 observed outcomes
    np.testing.assert_allclose(validity_probability(k, 0, N), (N - k) / (N + 1), rtol=2e-5, atol=1e-6)


def test_one_jitted_call_over_100k_prompts():
    rng = np.random.default_rng(1)
    K, N = 100_000, 8
    n = rng.integers(0, N + 1, K)
    s = rng.integers(0, n + 1)
    a, b = rng.uniform(0.5, 5, K).astype(np.float32), rng.uniform(0.5, 5, K).astype(np.float32)
    out = np.asarray(jax.jit(validity_probability, static_argnums=2)(n, s, N, a, b))
    assert out.shape == (K,)
    idx = rng.choice(K, 50, replace=False)
    want = [enumerate_validity(int(n[i]), int(s[i]), N, float(a[i]), float(b[i])) for i in idx]
    np.testing.assert_allclose(out[idx], want, atol=1e-5)
    np.testing.assert_allclose(jax.vmap(lambda n, s, a, b: validity_probability(n, s, N, a, b))(n, s, a, b), out)


def enumerate_measures(p, N):
    """Exhaustive enumeration over all 2^N reward vectors of the four measures."""
    surv = energy = pairs = 0.0
    for r in itertools.product((0, 1), repeat=N):
        S = sum(r)
        w = p**S * (1 - p) ** (N - S)
        surv += w * (0 < S < N)
        energy += w * sum((r[i] - (S - r[i]) / (N - 1)) ** 2 for i in range(N))
        pairs += w * S * (N - S)
    ent = 0.0 if p in (0.0, 1.0) else -(p * math.log2(p) + (1 - p) * math.log2(1 - p))
    return ent, surv, energy, pairs


def test_measures_equal_enumeration_and_peak_at_half():
    with jax.enable_x64(True):
        for N in (4, 8):
            grid = np.linspace(0, 1, 41)
            got = np.stack([np.asarray(f(grid)) for f in (
                reward_entropy, lambda p: filter_survival(p, N), lambda p: rloo_advantage_energy(p, N),
                lambda p: success_failure_pairs(p, N))], 1)
            want = np.array([enumerate_measures(float(p), N) for p in grid])
            np.testing.assert_allclose(got, want, atol=1e-12)
            assert np.all(np.argmax(got, 0) == 20)  # grid[20] = 0.5
    # DESIGN section 1's table at p = 0.5, N = 8.
    np.testing.assert_allclose([reward_entropy(0.5), filter_survival(0.5, 8), rloo_advantage_energy(0.5, 8),
                                success_failure_pairs(0.5, 8)], [1.0, 0.992, 2.286, 14.0], atol=1e-3)
