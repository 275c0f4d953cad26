"""Gradient accumulation is a memory setting only: ``rl.grad_accum = k`` gives the update of one big
batch, for each loss aggregation mode.

The micro-batch losses divide by the *minibatch's* token / sequence totals, so their sum is the
minibatch loss and the accumulated gradient is the minibatch gradient up to float32 summation order.

Tolerance: plain SGD makes the parameter change exactly ``-lr * grad``, so comparing the changes
compares the accumulated gradients themselves: relative 1e-5 of each change plus four float32
spacings of the parameter (the reduction order over the micro-batches differs in the last bits, and
``p + change`` is rounded to the parameter's own spacing). With the shipped AdamW (default eps
1e-8) the first update is ``lr * g / (|g| + eps)``, which amplifies last-bit noise on near-zero
gradient entries, so there the loss and gradient-norm metrics are compared (1e-5) and the parameters
are compared with an absolute tolerance of ``lr * 1e-3``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from passrate_jax.run.config import MeshConfig
from passrate_jax.model.transformer import Transformer
from passrate_jax.rl.config import OptimizerConfig, RLConfig
from passrate_jax.rl.optimizer import make_optimizer
from passrate_jax.rl.train_step import make_train_step
from passrate_jax.sharding import make_mesh
from tests.test_rl_train_step import TINY, tiny_batch

MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
LR = 1e-2
COMPARED = ("loss", "grad_norm", "kl", "entropy", "clip_frac_low", "clip_frac_high", "tokens", "skipped_steps")


def _sgd():
    # The trainer reads apply_if_finite's skip counter, so wrap SGD the way make_optimizer wraps AdamW.
    return optax.apply_if_finite(optax.sgd(LR), max_consecutive_errors=2**31 - 1)


def _run(cfg, optimizer, steps=2):
    graphdef, params = nnx.split(Transformer(TINY, rngs=nnx.Rngs(0)))
    mesh = make_mesh(MeshConfig(data=1, fsdp=1, tensor=1), jax.devices()[:1])
    fns = make_train_step(graphdef, params, cfg, optimizer, mesh)
    start = jax.tree.map(np.asarray, params)
    p = jax.device_put(jax.tree.map(jnp.copy, params), fns.param_shardings)
    o = fns.init(p)
    metrics = []
    for i in range(steps):
        p, o, m = fns.step(p, o, tiny_batch(seed=i, with_ref=True), jax.random.key(i))
        metrics.append({k: float(v) for k, v in m.items()})
    return start, jax.tree.map(np.asarray, p), metrics


def _assert_metrics_close(m1, mk):
    for a, b in zip(m1, mk):
        for k in COMPARED:
            np.testing.assert_allclose(b[k], a[k], rtol=1e-5, atol=1e-6, err_msg=k)


@pytest.mark.parametrize("mode", MODES)
def test_grad_accum_gives_the_big_batch_update(mode):
    # Two minibatches per step (reshuffled rows), the recomputed old log-probabilities, a KL term and
    # a replayed prefix / padding row in the batch: accumulation must be invisible in all of them.
    base = RLConfig(loss_aggregation=mode, loss_norm_constant=8.0, kl_coef=0.1, minibatches=2)
    start, p1, m1 = _run(base, _sgd())
    _, p4, m4 = _run(RLConfig(**{**base.__dict__, "grad_accum": 4}), _sgd())  # 2-row micro-batches
    _assert_metrics_close(m1, m4)
    assert m1[-1]["kl"] > 0 and m1[-1]["grad_norm"] > 0
    changes = 0
    for s, a, b in zip(jax.tree.leaves(start), jax.tree.leaves(p1), jax.tree.leaves(p4)):
        d1, d4 = a - s, b - s
        # Plus a few float32 spacings of the parameter itself: p + d is rounded to the parameter's ulp.
        np.testing.assert_allclose(d4, d1, rtol=1e-5, atol=1e-5 * np.abs(d1).max() + 4 * np.spacing(np.abs(s)).max())
        changes += int(np.abs(d1).max() > 0)
    assert changes == len(jax.tree.leaves(start))  # every parameter moved, so nothing compared zeros


def test_grad_accum_with_the_shipped_optimizer():
    base = RLConfig()  # the defaults: token_mean, one update per step
    opt = OptimizerConfig(learning_rate=LR)  # default eps 1e-8, clipping at 1.0
    _, p1, m1 = _run(base, make_optimizer(opt))
    _, p8, m8 = _run(RLConfig(**{**base.__dict__, "grad_accum": 8}), make_optimizer(opt))
    _assert_metrics_close(m1, m8)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(b, a, rtol=0, atol=LR * 1e-3), p1, p8)
