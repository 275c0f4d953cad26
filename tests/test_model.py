"""The transformer against transformers' PyTorch reference, padding, the KV cache and bfloat16."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import forward, torch_logits
from passrate_jax.model import (KVCache, ModelConfig, RopeScaling, Transformer, create_model, init_cache,
                                load_pretrained, save_pretrained)
from passrate_jax.model.rope import rope_inv_freq


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_logits_match_transformers(kind, hf_checkpoint):
    directory, hf_model = hf_checkpoint(kind)
    model = load_pretrained(directory)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, model.cfg.vocab_size, (2, 9))
    # Row 0 starts at position 100: past llama3's original context, so scaled RoPE bands matter.
    positions = np.stack([np.arange(9) + 100, np.arange(9)])
    expected = torch_logits(hf_model, tokens, positions)
    np.testing.assert_allclose(forward(model, tokens, positions), expected, atol=1e-4, rtol=0)


def test_loaded_config_matches_family(hf_checkpoint):
    cfgs = {kind: load_pretrained(hf_checkpoint(kind)[0]).cfg for kind in ("llama", "qwen2", "qwen3")}
    assert cfgs["llama"].tie_embeddings and cfgs["llama"].rope_scaling.rope_type == "llama3"
    assert cfgs["qwen2"].attention_bias and not cfgs["qwen2"].tie_embeddings
    assert cfgs["qwen3"].qk_norm and cfgs["qwen3"].resolved_head_dim == 16 != 32 // 4


def test_llama3_rope_scaling_bands():
    # head_dim 8, theta 1e4 -> wavelengths 6.3, 63, 628, 6283 against the [16, 64] smoothing band.
    rs = RopeScaling(rope_type="llama3", factor=8.0, original_max_position_embeddings=64)
    cfg = ModelConfig(hidden_size=32, num_heads=4, rope_theta=1e4, rope_scaling=rs)
    inv = rope_inv_freq(cfg)
    base = 1e4 ** -(np.arange(0, 8, 2) / 8)
    assert inv[0] == base[0]  # high frequency: untouched
    assert base[1] / 8 < inv[1] < base[1]  # medium: smoothed between the two
    np.testing.assert_allclose(inv[2:], base[2:] / 8)  # low frequency: divided by factor


def test_padding_left_and_right_equals_unpadded(hf_checkpoint):
    model = load_pretrained(hf_checkpoint("qwen2")[0])
    rng = np.random.default_rng(1)
    long, short = rng.integers(3, 96, 7), rng.integers(3, 96, 4)
    # Causal: the first 4 logits of short + anything equal those of short alone.
    ref = forward(model, np.stack([long, np.r_[short, long[:3]]]))
    pad = np.zeros(3, np.int64)
    # Row 1 right-padded, row 2 left-padded; padding positions are arbitrary (here 0) and masked out.
    tokens = np.stack([long, np.r_[short, pad], np.r_[pad, short]])
    positions = np.stack([np.arange(7), np.r_[np.arange(4), pad], np.r_[pad, np.arange(4)]])
    mask = np.stack([np.ones(7), np.r_[np.ones(4), pad], np.r_[pad, np.ones(4)]]).astype(bool)
    logits = forward(model, tokens, positions, mask)
    assert np.isfinite(logits).all()
    np.testing.assert_allclose(logits[0], ref[0], atol=1e-5)
    np.testing.assert_allclose(logits[1, :4], ref[1, :4], atol=1e-5)
    np.testing.assert_allclose(logits[2, 3:], ref[1, :4], atol=1e-5)


def test_padded_batch_matches_transformers(hf_checkpoint):
    directory, hf_model = hf_checkpoint("qwen3")
    model = load_pretrained(directory)
    tokens = np.random.default_rng(2).integers(1, 96, (2, 6))
    mask = np.array([[1] * 6, [0, 0, 1, 1, 1, 1]])
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    expected = torch_logits(hf_model, tokens, positions, mask)
    logits = forward(model, tokens, positions, mask)
    np.testing.assert_allclose(logits[mask.astype(bool)], expected[mask.astype(bool)], atol=1e-4)


def test_kv_cache_prefill_then_decode_equals_full_forward(hf_checkpoint):
    model = load_pretrained(hf_checkpoint("qwen3")[0])
    graphdef, state = nnx.split(model)

    # The sampler's calling convention: a pure function of (graphdef, state) with merge inside jit.
    @jax.jit
    def step(state, tokens, positions, mask, cache):
        return nnx.merge(graphdef, state)(tokens, positions, mask, cache=cache)

    rng = np.random.default_rng(3)
    lengths, extra, width = np.array([5, 3]), 4, 5
    full = rng.integers(3, 96, (2, 9))
    ref = forward(model, full)  # causal: row 1's first 7 logits are those of its 7-token sequence
    # Right-padded prompts of different lengths: the padding slots of row 1 must not be written.
    prompt = np.where(np.arange(width) < lengths[:, None], full[:, :width], 0)
    mask = np.arange(width) < lengths[:, None]
    cache = init_cache(model.cfg, 2, 16, jnp.float32)
    logits, cache = step(state, prompt, np.broadcast_to(np.arange(width), (2, width)), mask, cache)
    assert isinstance(cache, KVCache) and cache.k.shape == (2, 2, 16, 2, 16)
    got = [[np.asarray(logits[b, lengths[b] - 1])] for b in range(2)]
    for j in range(extra):
        pos = lengths + j
        logits, cache = step(state, full[np.arange(2), pos][:, None], pos[:, None], np.ones((2, 1), bool),
                             cache)
        for b in range(2):
            got[b].append(np.asarray(logits[b, 0]))
    for b in range(2):
        np.testing.assert_allclose(np.stack(got[b]), ref[b, lengths[b] - 1:lengths[b] + extra], atol=1e-5)
    # Slots past each row's last position stay untouched (zero).
    assert not np.asarray(cache.k[:, 1, lengths[1] + extra:]).any()


@pytest.mark.parametrize("kind", ["llama", "qwen2"])  # tied and untied LM heads
def test_logits_at_one_column_per_row_equal_the_full_logits(kind, hf_checkpoint):
    model = load_pretrained(hf_checkpoint(kind)[0])
    tokens = np.random.default_rng(5).integers(3, 96, (3, 7))
    at = np.array([6, 0, 3])
    full = forward(model, tokens)
    graphdef, state = nnx.split(model)
    cache = init_cache(model.cfg, 3, 8, jnp.float32)
    picked, _ = jax.jit(lambda s, t, c, a: nnx.merge(graphdef, s)(t, cache=c, logits_at_b=a))(state, tokens, cache, at)
    assert picked.shape == (3, model.cfg.vocab_size)
    np.testing.assert_allclose(np.asarray(picked), full[np.arange(3), at], atol=1e-5)


def test_random_init_eager_equals_create_model():
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                      num_kv_heads=2, qk_norm=True, attention_bias=True, tie_embeddings=False)
    eager = nnx.state(Transformer(cfg, rngs=nnx.Rngs(7)))
    jitted = nnx.state(create_model(cfg, seed=7))
    for (path, a), (_, b) in zip(nnx.to_flat_state(eager), nnx.to_flat_state(jitted)):
        np.testing.assert_array_equal(np.asarray(a[...]), np.asarray(b[...]), err_msg=str(path))
    layers = Transformer(cfg, rngs=nnx.Rngs(8)).layers  # weights stacked [L, ...]
    assert abs(float(jnp.std(layers.mlp.down[...][1])) - 0.02) < 0.005
    assert not np.asarray(layers.attn.q_bias[...]).any()
    assert (np.asarray(layers.input_norm.weight[...]) == 1).all()
    # Different layers get different draws.
    assert not np.array_equal(np.asarray(layers.attn.q[...][1]), np.asarray(layers.attn.q[...][0]))


def test_bfloat16_params_and_compute(hf_checkpoint, tmp_path):
    directory, _ = hf_checkpoint("llama")
    f32 = load_pretrained(directory)
    bf16 = load_pretrained(directory, dtype="bfloat16")
    assert bf16.embed[...].dtype == jnp.bfloat16 and bf16.cfg.dtype == "bfloat16"
    tokens = np.random.default_rng(4).integers(0, 96, (2, 8))
    ref = forward(f32, tokens)
    out = forward(bf16, tokens)
    assert out.dtype == np.float32 and np.isfinite(out).all()
    scale = np.abs(ref).max()
    assert 0 < np.abs(out - ref).max() < 0.05 * scale
    mixed = load_pretrained(directory, dtype="bfloat16", param_dtype="float32")
    assert mixed.embed[...].dtype == jnp.float32
    assert np.abs(forward(mixed, tokens) - ref).max() < 0.05 * scale
    # bfloat16 weights survive a safetensors round trip bit for bit.
    save_pretrained(bf16, tmp_path)
    again = load_pretrained(tmp_path, dtype="bfloat16")
    np.testing.assert_array_equal(np.asarray(again.layers.attn.q[...][0]), np.asarray(bf16.layers.attn.q[...][0]))


def test_config_validation_names_field():
    with pytest.raises(ValueError, match="num_kv_heads = 3"):
        Transformer(dataclasses.replace(ModelConfig(), num_kv_heads=3), rngs=nnx.Rngs(0))


def _loss_and_grads(model, tokens):
    graphdef, state = nnx.split(model)

    def loss(s):
        logits = nnx.merge(graphdef, s)(tokens)
        return jnp.mean(jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, tokens[..., None], -1)[..., 0])

    return jax.jit(jax.value_and_grad(loss))(state)


@pytest.mark.parametrize("scan_layers, remat", [(False, "none"), (True, "full"), (True, "dots"), (False, "dots")])
def test_scanned_unrolled_and_remat_give_equal_logits_and_gradients(scan_layers, remat):
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4,
                      num_kv_heads=2, qk_norm=True, tie_embeddings=False)
    scanned = create_model(cfg, seed=3)
    other = nnx.merge(nnx.graphdef(create_model(dataclasses.replace(cfg, scan_layers=scan_layers, remat=remat))),
                      nnx.state(scanned))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 7)))
    np.testing.assert_allclose(forward(other, tokens), forward(scanned, tokens), atol=1e-5, rtol=0)
    (loss_a, grads_a), (loss_b, grads_b) = _loss_and_grads(scanned, tokens), _loss_and_grads(other, tokens)
    np.testing.assert_allclose(loss_a, loss_b, rtol=1e-6)
    for (path, a), (_, b) in zip(nnx.to_flat_state(grads_a), nnx.to_flat_state(grads_b)):
        assert np.abs(np.asarray(a[...])).max() > 0, path  # every layer's weights get a gradient
        np.testing.assert_allclose(np.asarray(b[...]), np.asarray(a[...]), atol=1e-6, rtol=1e-5, err_msg=str(path))
    # The cached path too: one prefill then a decode step, scanned vs unrolled.
    cache = init_cache(cfg, 2, 8, jnp.float32)
    (la, ca), (lb, cb) = (jax.jit(lambda m, t, c: m(t, cache=c))(m, tokens, cache) for m in (scanned, other))
    np.testing.assert_allclose(np.asarray(lb), np.asarray(la), atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(cb.k), np.asarray(ca.k), atol=1e-6, rtol=0)


def test_decode_form_cache_and_sliced_layer_weights_equal_the_stacked_path():
    """KVCache.decode_form (per-layer keys [B, kv, e, S], values [B, kv, S, e]) with
    Transformer.layer_weights: the same logits and cache as the stacked [L, B, S, kv, e] path, for a
    one-token decode step and a three-token append; stacked() inverts decode_form()."""
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4,
                      num_kv_heads=2, qk_norm=True, tie_embeddings=False, scan_layers=False)
    model = create_model(cfg, seed=5)
    rng = np.random.default_rng(2)
    tokens = jnp.asarray(rng.integers(0, 64, (2, 5)))
    _, cache = jax.jit(lambda m, t, c: m(t, cache=c))(model, tokens, init_cache(cfg, 2, 12, jnp.float32))
    decode_form = cache.decode_form()
    assert decode_form.slots == cache.slots == 12 and decode_form.k[0].shape == (2, 2, 8, 12)
    np.testing.assert_array_equal(np.asarray(decode_form.stacked().k), np.asarray(cache.k))
    for width in (1, 3):
        new = jnp.asarray(rng.integers(0, 64, (2, width)))
        positions = jnp.asarray([[5 + i for i in range(width)], [7 + i for i in range(width)]])  # row 1 skips 2
        step = jax.jit(lambda m, c, w: m(new, positions, cache=c, layer_weights=w))
        want_logits, want = step(model, cache, None)
        got_logits, got = step(model, decode_form, model.layer_weights())
        np.testing.assert_allclose(np.asarray(got_logits), np.asarray(want_logits), atol=1e-5, rtol=0)
        for a, b in ((got.stacked().k, want.k), (got.stacked().v, want.v)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=0)
    scanned = nnx.merge(nnx.graphdef(create_model(dataclasses.replace(cfg, scan_layers=True))), nnx.state(model))
    with pytest.raises(ValueError, match="need unrolled layers"):
        scanned(tokens[:, :1], cache=decode_form)


@pytest.mark.parametrize("x_shape, w_shape, n_in, spec", [
    ((2, 5, 6), (6, 3, 4), 1, "btd,dhe->bthe"),   # q/k/v: out wider than in (x on the left in dW)
    ((2, 5, 3, 4), (3, 4, 6), 2, "bthe,hed->btd"),  # o: two input dims
    ((2, 5, 16), (16, 6), 1, "btf,fd->btd"),        # down: in wider than out (transposed dW)
])
def test_project_equals_einsum_in_value_and_gradients(x_shape, w_shape, n_in, spec):
    """matmul.project writes its gradient out (for XLA CPU's layouts); value and both gradients must be
    einsum's."""
    from passrate_jax.model.matmul import project
    rng = np.random.default_rng(3)
    x, w = rng.normal(size=x_shape).astype(np.float32), rng.normal(size=w_shape).astype(np.float32)
    out_shape = jax.eval_shape(lambda a, b: jnp.einsum(spec, a, b), x, w).shape
    c = rng.normal(size=out_shape).astype(np.float32)
    want = jax.value_and_grad(lambda a, b: (jnp.einsum(spec, a, b) * c).sum(), argnums=(0, 1))(x, w)
    got = jax.jit(jax.value_and_grad(lambda a, b: (project(a, b, n_in) * c).sum(), argnums=(0, 1)))(x, w)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for g, h in zip(got[1], want[1]):
        assert g.shape == h.shape and g.dtype == h.dtype
        np.testing.assert_allclose(g, h, rtol=1e-5, atol=1e-5)
