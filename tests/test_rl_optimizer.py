"""Optimizer from config: schedule values, weight-decay mask, non-finite updates rejected and counted."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from passrate_jax.rl.config import OptimizerConfig
from passrate_jax.rl.optimizer import learning_rate_schedule, make_optimizer, skipped_updates


def test_warmup_cosine_schedule():
    cfg = OptimizerConfig(learning_rate=1e-3, warmup_steps=10, decay_steps=90, final_lr_fraction=0.1)
    lr = learning_rate_schedule(cfg)
    cosine = lambda frac: 1e-4 + 0.5 * (1e-3 - 1e-4) * (1 + math.cos(math.pi * frac))
    for step, want in [(0, 0.0), (5, 5e-4), (10, 1e-3), (55, cosine(0.5)), (100, 1e-4), (500, 1e-4)]:
        assert float(lr(step)) == pytest.approx(want, rel=1e-5, abs=1e-9), step


def test_constant_after_warmup():
    lr = learning_rate_schedule(OptimizerConfig(learning_rate=2e-4, warmup_steps=4))
    assert [float(lr(s)) for s in (0, 2, 4, 1000)] == pytest.approx([0.0, 1e-4, 2e-4, 2e-4])


def test_decay_mask_and_skip_count():
    params = {"w": jnp.ones((2, 3)), "final_norm": {"weight": jnp.ones((3,))}, "q_bias": jnp.ones((2, 3))}
    opt = make_optimizer(OptimizerConfig(learning_rate=0.1, weight_decay=0.5))
    state = opt.init(params)
    zeros = {k: (jnp.zeros_like(v) if not isinstance(v, dict) else {"weight": jnp.zeros(3)})
             for k, v in params.items()}
    updates, state = opt.update(zeros, state, params)
    np.testing.assert_allclose(updates["w"], -0.1 * 0.5 * np.ones((2, 3)), rtol=1e-6)  # decayed
    assert np.all(np.asarray(updates["final_norm"]["weight"]) == 0)  # norm scale: not decayed
    assert np.all(np.asarray(updates["q_bias"]) == 0)  # bias: not decayed
    bad = dict(zeros, w=zeros["w"].at[0, 0].set(jnp.nan))
    updates, state = opt.update(bad, state, params)
    assert all(np.all(np.asarray(u) == 0) for u in (updates["w"], updates["q_bias"]))
    assert int(skipped_updates(state)) == 1
