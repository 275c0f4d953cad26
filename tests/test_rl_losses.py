"""Token losses, KL, aggregation and masking against independent NumPy references."""

import dataclasses

import jax
import numpy as np
import pytest

from passrate_jax.rl import losses
from passrate_jax.rl.advantages import group_advantages
from passrate_jax.rl.config import RLConfig

B, T, V = 6, 10, 11
MODES = ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    logp = -rng.exponential(1.0, (B, T)).astype(np.float32)
    old = (logp + rng.normal(0, 0.4, (B, T))).astype(np.float32)  # ratios on both sides of the clips
    ref = (logp + rng.normal(0, 0.5, (B, T))).astype(np.float32)
    adv = rng.normal(size=B).astype(np.float32)
    mask = (rng.random((B, T)) > 0.3).astype(np.int32)
    mask[:, 0] = 0
    mask[2] = 0  # a row with no target tokens (padding row)
    return logp, old, ref, adv, mask


# ---- NumPy references (written from the papers' formulas, not from the implementation) ----

def np_ppo(logp, old, adv, cl, ch, dual=None):
    """Per-token loss = -(PPO objective): objective = min(r A, clip(r) A), dual clip max(., c A) for A < 0."""
    ratio = np.exp(logp.astype(np.float64) - old)
    a = adv[:, None].astype(np.float64)
    obj = np.minimum(ratio * a, np.clip(ratio, 1 - cl, 1 + ch) * a)
    if dual is not None:
        obj = np.where(a < 0, np.maximum(obj, dual * a), obj)
    return -obj, (ratio < 1 - cl) & (a < 0), (ratio > 1 + ch) & (a > 0)


def np_aggregate(values, mask, mode, const=1.0):
    m = mask.astype(bool)
    v = np.where(m, values, 0.0)
    rows = m.any(1)
    if mode == "token_mean":
        return v.sum() / m.sum()
    if mode == "seq_mean_token_mean":
        return np.mean(v.sum(1)[rows] / m.sum(1)[rows])
    return np.mean(v.sum(1)[rows] / const)


def np_kl(logp, ref, estimator):
    log_r = ref.astype(np.float64) - logp  # log(pi_ref / pi) on samples of pi
    return -log_r if estimator == "k1" else np.exp(log_r) - log_r - 1


# ---- tests ----

def test_token_logprobs_and_entropy():
    rng = np.random.default_rng(1)
    logits = rng.normal(0, 3, (B, T, V)).astype(np.float32)
    tokens = rng.integers(0, V, (B, T))
    logp, ent = jax.jit(losses.token_logprobs)(logits, tokens)
    x = logits.astype(np.float64)
    log_softmax = x - np.log(np.exp(x).sum(-1, keepdims=True))
    want_logp = np.zeros((B, T))
    want_ent = np.zeros((B, T))
    for b in range(B):
        for t in range(1, T):  # token t is predicted by the logits at t - 1
            want_logp[b, t] = log_softmax[b, t - 1, tokens[b, t]]
            want_ent[b, t] = -(np.exp(log_softmax[b, t - 1]) * log_softmax[b, t - 1]).sum()
    np.testing.assert_allclose(logp, want_logp, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ent, want_ent, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dual", [None, 3.0])
def test_ppo_token_loss_and_clip_fractions(dual):
    logp, old, _, adv, mask = _inputs()
    # One negative-advantage token with ratio 5, past the dual-clip constant 3: there the dual clip binds
    # (the loss is capped at 3 |A| rather than 5 |A|), so ignoring dual_clip changes this token's loss.
    row = int(np.flatnonzero(adv < 0)[0])
    col = int(np.flatnonzero(mask[row])[0])
    logp[row, col] = old[row, col] + np.log(5.0)
    loss, low, high = losses.ppo_token_loss(logp, old, adv[:, None], mask, clip_low=0.2, clip_high=0.28,
                                            dual_clip=dual)
    want, want_low, want_high = np_ppo(logp, old, adv, 0.2, 0.28, dual)
    m = mask.astype(bool)
    np.testing.assert_allclose(loss, np.where(m, want, 0.0), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(low, want_low & m)
    np.testing.assert_array_equal(high, want_high & m)
    assert low.any() and high.any()  # the inputs exercise both clips
    if dual is not None:  # the dual clip binds on that token: its loss is -c A, below the unclipped -r A
        binds = m & (adv[:, None] < 0) & (np_ppo(logp, old, adv, 0.2, 0.28)[0] > -dual * adv[:, None])
        assert binds[row, col]
        np.testing.assert_allclose(loss[row, col], -dual * adv[row], rtol=1e-5)


@pytest.mark.parametrize("mode", MODES)
def test_aggregation_modes(mode):
    logp, old, _, adv, mask = _inputs(2)
    values = np_ppo(logp, old, adv, 0.2, 0.2)[0].astype(np.float32)
    got = losses.aggregate(values, mask, mode, norm_constant=7.0)
    np.testing.assert_allclose(got, np_aggregate(values, mask, mode, 7.0), rtol=1e-5)


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_kl_estimators(estimator):
    logp, _, ref, _, mask = _inputs(3)
    got = losses.kl_penalty(logp, ref, mask, estimator)
    np.testing.assert_allclose(got, np.where(mask.astype(bool), np_kl(logp, ref, estimator), 0.0),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_grpo_loss_total(mode, estimator):
    cfg = RLConfig(loss_aggregation=mode, loss_norm_constant=5.0, kl_coef=0.3, kl_estimator=estimator,
                   clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    logp, old, ref, adv, mask = _inputs(4)
    loss, stats = losses.grpo_loss(cfg, logp, old, adv, mask, ref_logp_bt=ref)
    tok, low, high = np_ppo(logp, old, adv, 0.2, 0.28, 3.0)
    kl = np_kl(logp, ref, estimator)
    want = np_aggregate(tok, mask, mode, 5.0) + 0.3 * np_aggregate(kl, mask, mode, 5.0)
    np.testing.assert_allclose(loss, want, rtol=1e-5)
    m = mask.astype(bool)
    assert stats["tokens"] == m.sum()
    assert stats["clip_low"] == (low & m).sum() and stats["clip_high"] == (high & m).sum()
    np.testing.assert_allclose(stats["kl"], np.where(m, kl, 0).sum(), rtol=1e-5)


@pytest.mark.parametrize("mode", MODES)
def test_micro_batch_losses_add_up(mode):
    # Gradient accumulation relies on this: with the full batch's totals as denominators, the losses
    # of disjoint row subsets sum to the loss of the whole batch.
    cfg = RLConfig(loss_aggregation=mode, kl_coef=0.1)
    logp, old, ref, adv, mask = _inputs(5)
    full, _ = losses.grpo_loss(cfg, logp, old, adv, mask, ref_logp_bt=ref)
    n_tok, n_seq = mask.sum(), mask.any(1).sum()
    parts = [losses.grpo_loss(cfg, logp[r], old[r], adv[r], mask[r], ref_logp_bt=ref[r], num_tokens=n_tok,
                              num_sequences=n_seq)[0] for r in (slice(0, 2), slice(2, 6))]
    np.testing.assert_allclose(sum(parts), full, rtol=1e-6)


def _grad_wrt_logits(cfg, logits, tokens, old, ref, adv, mask):
    def f(lg):
        logp, ent = losses.token_logprobs(lg, tokens)
        return losses.grpo_loss(cfg, logp, old, adv, mask, ref_logp_bt=ref, entropy_bt=ent)[0]
    return jax.jit(jax.value_and_grad(f))(logits)


@pytest.mark.parametrize("mode", MODES)
def test_masked_tokens_cannot_influence_gradients(mode):
    cfg = RLConfig(loss_aggregation=mode, kl_coef=0.2, kl_estimator="k3", dual_clip=2.5)
    rng = np.random.default_rng(6)
    _, old, ref, adv, mask = _inputs(6)
    logits = rng.normal(size=(B, T, V)).astype(np.float32)
    tokens = rng.integers(0, V, (B, T))
    m = mask.astype(bool)
    # Garbage, NaN and inf in every masked slot, and a NaN advantage for the row with no targets.
    bad_old = np.where(m, old, np.where(rng.random((B, T)) > 0.5, np.inf, np.nan)).astype(np.float32)
    bad_ref = np.where(m, ref, rng.normal(0, 1e4, (B, T))).astype(np.float32)
    bad_adv = adv.copy()
    bad_adv[2] = np.nan
    v1, g1 = _grad_wrt_logits(cfg, logits, tokens, old, ref, adv, mask)
    v2, g2 = _grad_wrt_logits(cfg, logits, tokens, bad_old, bad_ref, bad_adv, mask)
    assert np.isfinite(v1) and v1 == v2
    np.testing.assert_array_equal(np.asarray(g1), np.asarray(g2))  # bit for bit
    # Logits whose prediction targets a masked token get exactly zero gradient.
    target_masked = np.concatenate([~m[:, 1:], np.ones((B, 1), bool)], axis=1)
    assert np.all(np.asarray(g1)[target_masked] == 0.0)


def test_zero_variance_groups_give_zero_gradient():
    cfg = RLConfig(loss_aggregation="seq_mean_token_mean")
    rng = np.random.default_rng(7)
    _, old, _, _, mask = _inputs(7)
    rewards = np.array([1, 1, 1, 0, 0, 0], np.float32)  # two saturated groups of 3
    adv = group_advantages(rewards, np.repeat([0, 1], 3), "grpo")
    logits = rng.normal(size=(B, T, V)).astype(np.float32)
    _, grads = _grad_wrt_logits(cfg, logits, rng.integers(0, V, (B, T)), old, None, adv, mask)
    assert np.all(np.asarray(grads) == 0.0)


def test_config_is_static_hashable():
    # The step closes over the config as a static value; it must be hashable and comparable.
    assert hash(RLConfig()) == hash(dataclasses.replace(RLConfig()))


def test_token_logprobs_gradient_equals_autodiff_of_the_plain_formula():
    """token_logprobs writes its gradient out (no softmax residual, no scatter): it must equal autodiff of
    log_softmax / entropy over the shifted logits, for cotangents on both outputs."""
    rng = np.random.default_rng(7)
    logits = rng.normal(0, 3, (B, T, V)).astype(np.float32)
    tokens = rng.integers(0, V, (B, T))
    w_logp, w_ent = rng.normal(size=(2, B, T)).astype(np.float32)

    def plain(z):
        z = z[:, :-1]
        log_softmax = jax.nn.log_softmax(z, axis=-1)
        logp = jax.numpy.take_along_axis(log_softmax, tokens[:, 1:, None], axis=-1)[..., 0]
        ent = -(jax.numpy.exp(log_softmax) * log_softmax).sum(-1)
        return (logp * w_logp[:, 1:]).sum() + (ent * w_ent[:, 1:]).sum()

    def shipped(z):
        logp, ent = losses.token_logprobs(z, tokens)
        return (logp * w_logp).sum() + (ent * w_ent).sum()

    want_v, want_g = jax.jit(jax.value_and_grad(plain))(logits)
    got_v, got_g = jax.jit(jax.value_and_grad(shipped))(logits)
    np.testing.assert_allclose(got_v, want_v, rtol=1e-5)
    np.testing.assert_allclose(got_g, want_g, rtol=1e-4, atol=1e-6)
    assert np.all(np.asarray(got_g)[:, -1] == 0.0)  # the last column predicts nothing
