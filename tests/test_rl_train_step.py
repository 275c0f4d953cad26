"""The jitted GRPO training step on a tiny Qwen3-shaped model (few compiles: two step configs, one
forward, plus a subprocess with 8 fake CPU devices for the sharded check)."""

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from passrate_jax.run.config import MeshConfig
from passrate_jax.model.config import ModelConfig
from passrate_jax.model.transformer import Transformer
from passrate_jax.rl import losses
from passrate_jax.rl.batch import check_batch, make_train_batch
from passrate_jax.rl.config import OptimizerConfig, RLConfig
from passrate_jax.rl.optimizer import make_optimizer
from passrate_jax.rl.train_step import make_train_step, policy_logprobs
from passrate_jax.sharding import make_mesh

TINY = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2,
                   head_dim=8, qk_norm=True)
B, T, PROMPT = 16, 12, 4
# Several updates per step, accumulation, KL, dual clip, sampler logprobs: every code path at once.
MULTI = RLConfig(ppo_epochs=2, minibatches=2, grad_accum=2, kl_coef=0.05, dual_clip=3.0,
                 recompute_old_logprobs=False)


def tiny_batch(seed=0, with_ref=False):
    """16 rollouts in 4 groups of 4 (group 3 saturated), 4 prompt tokens, ragged right padding,
    a replayed prefix in rows 8..11 (mask 0 on it), and one all-padding row (row 15)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(3, TINY.vocab_size, (B, T))
    lengths = rng.integers(PROMPT + 3, T + 1, B)
    attention = (np.arange(T)[None] < lengths[:, None]).astype(np.int32)
    loss_mask = attention.copy()
    loss_mask[:, :PROMPT] = 0
    loss_mask[8:12, PROMPT:PROMPT + 2] = 0  # replayed prefix tokens
    attention[15] = 0
    loss_mask[15] = 0
    tokens = np.where(attention == 1, tokens, 0)
    rewards = np.array([1, 0, 0, 1, 1, 1, 0, 1, 0, 0, 1, 0, 1, 1, 1, 1], np.float32)
    old = -rng.exponential(3.0, (B, T)).astype(np.float32)
    ref = (old + rng.normal(0, 0.1, (B, T))).astype(np.float32) if with_ref else None
    return make_train_batch(tokens, attention, loss_mask, rewards, np.repeat(np.arange(4), 4),
                            old_logprobs=old, ref_logprobs=ref)


@pytest.fixture(scope="module")
def model_parts():
    return nnx.split(Transformer(TINY, rngs=nnx.Rngs(0)))


@pytest.fixture(scope="module")
def mesh():
    return make_mesh(MeshConfig(data=1, fsdp=1, tensor=1), jax.devices()[:1])


def _fresh(params, fns):
    # The step donates its params; every test starts from its own copy, placed on the step's
    # shardings (an unplaced input has no mesh in its type and would cost a second compile).
    return jax.device_put(jax.tree.map(jnp.copy, params), fns.param_shardings)


@pytest.fixture(scope="module")
def default_step(model_parts, mesh):
    graphdef, params = model_parts
    return make_train_step(graphdef, params, RLConfig(), make_optimizer(OptimizerConfig(learning_rate=3e-3)), mesh)


@pytest.fixture(scope="module")
def multi_step(model_parts, mesh):
    graphdef, params = model_parts
    return make_train_step(graphdef, params, MULTI, make_optimizer(OptimizerConfig(learning_rate=3e-3)), mesh)


@pytest.fixture(scope="module")
def logprobs_fn(model_parts):
    graphdef, _ = model_parts
    return jax.jit(lambda p, b: policy_logprobs(graphdef, p, b.tokens, b.positions, b.attention_mask)[0])


def _objective(cfg, logp, old, batch):
    return float(losses.grpo_loss(cfg, logp, old, batch.advantages, batch.loss_mask)[0])


def test_batch_convention():
    batch = tiny_batch()
    check_batch(batch)
    assert np.all(np.asarray(batch.advantages)[12:] == 0.0)  # saturated group and padding row


def test_one_step_lowers_the_loss(model_parts, default_step, logprobs_fn):
    _, params = model_parts
    batch = tiny_batch()
    p0 = _fresh(params, default_step)
    old = logprobs_fn(p0, batch)
    before = _objective(RLConfig(), old, old, batch)
    opt = default_step.init(p0)
    p1, _, metrics = default_step.step(p0, opt, batch, jax.random.key(0))
    after = _objective(RLConfig(), logprobs_fn(p1, batch), old, batch)
    assert after < before - 1e-3, (before, after)
    assert metrics["tokens"] == np.asarray(batch.loss_mask).sum()
    assert metrics["skipped_steps"] == 0 and metrics["updates"] == 1
    # One on-policy update: ratio == 1, nothing clipped, loss = -token-mean advantage.
    assert metrics["clip_frac_low"] == 0 and metrics["clip_frac_high"] == 0
    np.testing.assert_allclose(metrics["loss"], before, rtol=1e-5, atol=1e-6)
    assert metrics["grad_norm"] > 0 and metrics["entropy"] > 0


def test_zero_variance_batch_gives_zero_gradient(model_parts, default_step):
    _, params = model_parts
    batch = tiny_batch()
    batch = batch.replace(advantages=jnp.zeros_like(batch.advantages))  # every group saturated
    p0 = _fresh(params, default_step)
    keep = jax.tree.map(np.asarray, p0)
    p1, _, metrics = default_step.step(p0, default_step.init(p0), batch, jax.random.key(0))
    assert metrics["grad_norm"] == 0.0 and metrics["skipped_steps"] == 0
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, p1), keep)


def test_non_finite_batch_is_skipped_and_counted(model_parts, multi_step):
    _, params = model_parts
    p = _fresh(params, multi_step)
    keep = jax.tree.map(np.asarray, p)
    opt = multi_step.init(p)
    batch = tiny_batch(with_ref=True)
    poisoned = batch.replace(old_logprobs=jnp.where(batch.loss_mask == 1, jnp.nan, batch.old_logprobs))
    p, opt, metrics = multi_step.step(p, opt, poisoned, jax.random.key(1))
    assert metrics["skipped_steps"] == 4 and metrics["total_skipped_steps"] == 4  # 2 epochs x 2 minibatches
    assert np.isnan(metrics["loss"]) and np.isnan(metrics["grad_norm"])  # nothing was applied
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, p), keep)  # never applied
    # One bad row poisons exactly one minibatch per epoch; the other updates go through.
    one_bad = batch.replace(advantages=batch.advantages.at[0].set(jnp.inf))
    p, opt, metrics = multi_step.step(p, opt, one_bad, jax.random.key(2))
    assert metrics["skipped_steps"] == 2 and metrics["total_skipped_steps"] == 6
    assert np.isfinite(metrics["loss"]) and np.isfinite(metrics["grad_norm"])  # the applied half
    p, opt, metrics = multi_step.step(p, opt, batch, jax.random.key(3))
    assert metrics["skipped_steps"] == 0 and metrics["total_skipped_steps"] == 6
    assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(p))
    assert not all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(keep)))


def test_masked_slots_do_not_change_the_update(model_parts, multi_step):
    _, params = model_parts
    batch = tiny_batch(with_ref=True)
    masked = batch.loss_mask == 0
    garbage = batch.replace(
        old_logprobs=jnp.where(masked, jnp.inf, batch.old_logprobs),
        ref_logprobs=jnp.where(masked, -1e6, batch.ref_logprobs),
        advantages=batch.advantages.at[15].set(123.0))  # row 15 has no target token
    results = []
    for b in (batch, garbage):
        p = _fresh(params, multi_step)
        p, _, metrics = multi_step.step(p, multi_step.init(p), b, jax.random.key(4))
        results.append((jax.tree.map(np.asarray, p), {k: np.asarray(v) for k, v in metrics.items()}))
    (p1, m1), (p2, m2) = results
    jax.tree.map(np.testing.assert_array_equal, p1, p2)  # bit for bit
    assert all(np.array_equal(m1[k], m2[k]) for k in m1), (m1, m2)
    assert m1["skipped_steps"] == 0 and m1["kl"] > 0 and m1["clip_frac_high"] + m1["clip_frac_low"] > 0


_SHARDED_SCRIPT = textwrap.dedent("""
    import json, jax, jax.numpy as jnp, numpy as np
    from flax import nnx
    from passrate_jax.run.config import MeshConfig
    from passrate_jax.model.transformer import Transformer
    from passrate_jax.rl.config import OptimizerConfig
    from passrate_jax.rl.optimizer import make_optimizer
    from passrate_jax.rl.train_step import make_train_step
    from passrate_jax.sharding import make_mesh
    from tests.test_rl_train_step import MULTI, TINY, tiny_batch

    assert jax.device_count() == 8, jax.devices()
    graphdef, params = nnx.split(Transformer(TINY, rngs=nnx.Rngs(0)))
    batch = tiny_batch(with_ref=True)
    # eps 1e-6 (not 1e-8): Adam's first update g / (|g| + eps) amplifies reduction-order noise in
    # near-zero gradients by lr / eps, which would swamp a 1e-5 comparison without being a bug.
    opt_cfg = OptimizerConfig(learning_rate=1e-3, eps=1e-6)
    out = {}
    for name, mesh_cfg, devices in [("single", MeshConfig(1, 1, 1), jax.devices()[:1]),
                                    ("sharded", MeshConfig(2, 2, 2), None), ("fsdp4", MeshConfig(1, 4, 2), None)]:
        mesh = make_mesh(mesh_cfg, devices)
        fns = make_train_step(graphdef, params, MULTI, make_optimizer(opt_cfg), mesh)
        p = jax.device_put(jax.tree.map(jnp.copy, params), fns.param_shardings)
        o = fns.init(p)
        for i in range(2):
            p, o, m = fns.step(p, o, jax.device_put(batch, fns.batch_sharding), jax.random.key(i))
        n_shards = max(len(x.sharding.device_set) for x in jax.tree.leaves(p))
        # Fraction of each weight-shaped array (parameters, Adam moments) that one device holds.
        big = [x for x in jax.tree.leaves((p, o)) if x.size >= 512]
        held = max(x.addressable_shards[0].data.size / x.size for x in big)
        out[name] = dict(params=[np.asarray(x).ravel().tolist() for x in jax.tree.leaves(p)],
                         metrics={k: float(v) for k, v in m.items()}, devices=n_shards, held=held,
                         tensor_split=str(fns.param_shardings["layers"]["attn"]["q"].get_value().spec))
    print("RESULT" + json.dumps(out))
""")


def test_sharded_step_matches_single_device():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", _SHARDED_SCRIPT], env=env, cwd=root, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT"))
    out = json.loads(line[len("RESULT"):])
    single = out["single"]
    assert single["devices"] == 1
    # fsdp 4 x tensor 2: every weight and Adam moment (all dims divide) is split 8 ways.
    assert out["fsdp4"]["held"] == 1 / 8
    for sharded in (out["sharded"], out["fsdp4"]):
        assert sharded["devices"] == 8
        assert "tensor" in sharded["tensor_split"] and "fsdp" in sharded["tensor_split"]
        for a, b in zip(single["params"], sharded["params"]):
            np.testing.assert_allclose(np.array(b), np.array(a), rtol=1e-5, atol=1e-5)
        for k in single["metrics"]:
            np.testing.assert_allclose(sharded["metrics"][k], single["metrics"][k], rtol=1e-5, atol=1e-5, err_msg=k)
    assert single["metrics"]["updates"] == 4 and single["metrics"]["skipped_steps"] == 0
