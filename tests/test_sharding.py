"""Mesh construction, the logical-axis table, and a sharded forward on 8 fake CPU devices."""

import os
import subprocess
import sys
import textwrap

import jax
import pytest
from jax.sharding import AbstractMesh, PartitionSpec as P

from passrate_jax.run.config import MeshConfig
from passrate_jax.sharding import LOGICAL_AXIS_RULES, logical_to_spec, make_mesh

MESH_222 = AbstractMesh((2, 2, 2), ("data", "fsdp", "tensor"))


def test_make_mesh_sizes_must_match_device_count():
    fake = [object()] * 6  # sizes are checked before any device is touched
    with pytest.raises(ValueError, match=r"\(2, 2, 2\).*product 8 != device count 6"):
        make_mesh(MeshConfig(data=2, fsdp=2, tensor=2), devices=fake)
    with pytest.raises(ValueError, match=r"\(-1, 4, 1\).*device count 6"):
        make_mesh(MeshConfig(data=-1, fsdp=4, tensor=1), devices=fake)


def test_make_mesh_fills_the_rest_with_auto_axes():
    mesh = make_mesh(MeshConfig(data=-1, fsdp=1, tensor=1))
    assert mesh.axis_names == ("data", "fsdp", "tensor")
    assert dict(mesh.shape) == {"data": jax.device_count(), "fsdp": 1, "tensor": 1}
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)


def test_logical_rules_map_weights_to_mesh_axes():
    assert logical_to_spec(("vocab", "embed"), (64, 32), MESH_222) == P("tensor", "fsdp")
    assert logical_to_spec(("embed", "heads", "head_dim"), (32, 4, 8), MESH_222) == P("fsdp", "tensor",
                                                                                        None)
    assert logical_to_spec(("mlp", "embed"), (48, 32), MESH_222) == P("tensor", "fsdp")
    assert logical_to_spec(("norm",), (32,), MESH_222) == P(None)
    assert logical_to_spec(("batch", None), (8, 5), MESH_222) == P(("data", "fsdp"), None)
    # One kv head cannot be split over tensor=2: it stays replicated instead of failing to place.
    assert logical_to_spec(("embed", "kv_heads", "head_dim"), (32, 1, 8), MESH_222) == P("fsdp", None, None)
    # A mesh axis is used at most once per array.
    assert logical_to_spec(("heads", "mlp"), (4, 8), MESH_222) == P("tensor", None)
    with pytest.raises(ValueError, match="'experts'"):
        logical_to_spec(("experts",), (4,), MESH_222)
    assert set(LOGICAL_AXIS_RULES) >= {"vocab", "embed", "heads", "kv_heads", "head_dim", "mlp", "norm", "batch"}


# Runs in a fresh interpreter: the fake device count must be set before jax initialises, and this
# pytest process has initialised jax already.
_EIGHT_DEVICE_SCRIPT = textwrap.dedent("""
    import tempfile
    import jax, numpy as np
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P
    from passrate_jax.run.config import MeshConfig
    from passrate_jax.model import ModelConfig, create_model, init_cache, load_pretrained, save_pretrained
    from passrate_jax.sharding import (KV_CACHE_AXES, batch_sharding, logical_sharding, make_mesh,
                                       param_shardings, shard_model)

    assert jax.device_count() == 8, jax.devices()
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, qk_norm=True, tie_embeddings=False)
    model = create_model(cfg, seed=0)
    graphdef, state = nnx.split(model)
    tokens = np.random.default_rng(0).integers(0, 64, (8, 6))
    fwd = lambda s, t: nnx.merge(graphdef, s)(t)
    ref = np.asarray(jax.jit(fwd)(state, tokens))

    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    shardings = param_shardings(state, mesh)
    sharded = jax.device_put(state, shardings)
    assert sharded["embed"][...].sharding.spec == P("tensor", "fsdp")
    assert sharded["layers"]["attn"]["k"][...].sharding.spec == P(None, "fsdp", "tensor", None)
    down = sharded["layers"]["mlp"]["down"][...]
    assert down.addressable_shards[0].data.shape == (2, 48 // 2, 32 // 2)
    out_sharding = NamedSharding(mesh, P(("data", "fsdp"), None, "tensor"))
    sharded_fwd = jax.jit(fwd, in_shardings=(shardings, batch_sharding(mesh, 2)), out_shardings=out_sharding)
    out = sharded_fwd(sharded, jax.device_put(tokens, batch_sharding(mesh, 2)))
    assert out.sharding == out_sharding
    err = np.abs(np.asarray(out) - ref).max()
    assert err < 1e-5, err

    # Prefill through a KV cache sharded over batch and kv heads gives the same logits.
    cache = init_cache(cfg, 8, 8)
    cache_sharding = logical_sharding(mesh, KV_CACHE_AXES, cache.k.shape)
    assert cache_sharding.spec == P(None, ("data", "fsdp"), None, "tensor", None)
    cache = jax.device_put(cache, cache_sharding)
    prefill = jax.jit(lambda s, t, c: nnx.merge(graphdef, s)(t, cache=c), out_shardings=(None, cache_sharding))
    logits, cache = prefill(sharded, jax.device_put(tokens, batch_sharding(mesh, 2)), cache)
    assert cache.k.sharding == cache_sharding
    np.testing.assert_allclose(np.asarray(logits), ref, atol=1e-5)

    # Created directly in its shardings: same values as the single-device model.
    born_sharded = nnx.state(create_model(cfg, seed=0, mesh=mesh))
    assert born_sharded["lm_head"][...].sharding.spec == P("fsdp", "tensor")
    np.testing.assert_array_equal(np.asarray(born_sharded["lm_head"][...]), np.asarray(state["lm_head"][...]))

    # Loaded straight into the shardings; shard_model places an existing model in place.
    with tempfile.TemporaryDirectory() as d:
        save_pretrained(model, d)
        loaded = nnx.state(load_pretrained(d, mesh=mesh))
    assert loaded["layers"]["attn"]["o"][...].sharding.spec == P(None, "tensor", None, "fsdp")
    np.testing.assert_array_equal(np.asarray(loaded["layers"]["attn"]["o"][...]),
                                  np.asarray(state["layers"]["attn"]["o"][...]))
    placed = shard_model(create_model(cfg, seed=0), mesh)
    assert placed.embed[...].sharding.spec == P("tensor", "fsdp")
    print("EIGHT_DEVICES_OK", err)
""")


def test_sharded_forward_on_eight_fake_devices_equals_single_device():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", _EIGHT_DEVICE_SCRIPT], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0 and "EIGHT_DEVICES_OK" in proc.stdout, proc.stdout + proc.stderr[-4000:]
