"""Advantage estimators against independent NumPy references (loops over groups)."""

import jax
import numpy as np
import pytest

from passrate_jax.rl import advantages

# One compile per (estimator, shape) instead of one eager dispatch per op keeps this file fast.
group_advantages = jax.jit(advantages.group_advantages, static_argnames=("estimator", "num_groups"))


def _reference(rewards, group_ids, valid, estimator, eps=1e-6):
    """Straightforward per-group loop; float64."""
    out = np.zeros(len(rewards))
    for g in np.unique(group_ids):
        rows = np.flatnonzero((group_ids == g) & valid)
        r = rewards[rows].astype(np.float64)
        n = len(r)
        if n < 2 or np.all(r == r[0]):
            continue
        if estimator == "grpo":
            out[rows] = (r - r.mean()) / (r.std(ddof=1) + eps)
        elif estimator == "dr_grpo":
            out[rows] = r - r.mean()
        else:  # rloo: each rollout against the mean of the others
            out[rows] = [r[i] - np.delete(r, i).mean() for i in range(n)]
    return out


def _random_case(seed, binary, b=32):
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 7, size=b)  # includes singleton groups
    group_ids = np.repeat(np.arange(b), sizes)[:b]
    rng.shuffle(group_ids)  # groups need not be contiguous
    rewards = rng.integers(0, 2, b).astype(np.float32) if binary else rng.normal(size=b).astype(np.float32)
    valid = rng.random(b) > 0.15
    return rewards, group_ids, valid


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
def test_matches_numpy_reference(estimator):
    for seed in range(6):
        rewards, group_ids, valid = _random_case(seed, binary=seed % 2 == 0)
        got = np.asarray(group_advantages(rewards, group_ids, estimator, valid_b=valid))
        want = _reference(rewards, group_ids, valid, estimator)
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6, err_msg=f"seed {seed}")


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
def test_saturated_groups_are_exactly_zero(estimator):
    # 0.1 is not exactly representable; a mean computed as sum / n need not round back to it.
    rewards = np.array([0.1] * 3 + [1.0] * 4 + [0.0] * 4 + [0.3, 0.7], np.float32)
    group_ids = np.array([0] * 3 + [1] * 4 + [2] * 4 + [3, 3])
    adv = np.asarray(group_advantages(rewards, group_ids, estimator))
    assert np.all(adv[:11] == 0.0)
    assert np.all(adv[11:] != 0.0)


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
def test_rerollout_group_is_its_own_group(estimator):
    # A PS re-rollout group (ids 1) from the same prompt as group 0 is normalised on its own.
    orig = np.array([1, 0, 0, 0], np.float32)
    rerollout = np.array([1, 1, 0, 1], np.float32)
    both = np.asarray(group_advantages(np.concatenate([orig, rerollout]), np.repeat([0, 1], 4), estimator))
    np.testing.assert_array_equal(both[:4], np.asarray(group_advantages(orig, np.zeros(4, int), estimator)))
    np.testing.assert_array_equal(both[4:], np.asarray(group_advantages(rerollout, np.zeros(4, int), estimator)))


def test_padding_rows_do_not_enter_statistics():
    rewards = np.array([1, 0, 1, 0, 57.0], np.float32)  # row 4 is padding with a garbage reward
    valid = np.array([1, 1, 1, 1, 0], bool)
    adv = np.asarray(group_advantages(rewards, np.zeros(5, int), "grpo", valid_b=valid))
    assert adv[4] == 0.0
    np.testing.assert_allclose(adv[:4], np.asarray(group_advantages(rewards[:4], np.zeros(4, int), "grpo")))


def test_rloo_is_scaled_dr_grpo():
    # RLOO = N / (N - 1) * (r - mean): a cross-check between two estimators.
    rng = np.random.default_rng(5)
    rewards = rng.normal(size=16).astype(np.float32)
    ids = np.repeat(np.arange(2), 8)
    np.testing.assert_allclose(np.asarray(group_advantages(rewards, ids, "rloo")),
                               8 / 7 * np.asarray(group_advantages(rewards, ids, "dr_grpo")), rtol=1e-5, atol=1e-6)
