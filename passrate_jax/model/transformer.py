"""Decoder-only transformer (Llama 3 / Qwen2 / Qwen3 family) in Flax NNX, with a static-shape KV cache.

Layout of the weights (``L`` layers, ``d`` model width, ``h`` query heads, ``k`` kv heads, ``e`` head_dim,
``f`` mlp). Every per-layer weight is stacked along a leading layer axis, so the layers run as one
``lax.scan`` body and compile once whatever the depth:

    embed               [V, d]       ("vocab", "embed")
    layers.attn.q       [L, d, h, e] ("layers", "embed", "heads", "head_dim")   (+ bias [L, h, e])
    layers.attn.k / v   [L, d, k, e] ("layers", "embed", "kv_heads", "head_dim") (+ bias [L, k, e])
    layers.attn.o       [L, h, e, d] ("layers", "heads", "head_dim", "embed")
    layers.mlp.gate/up  [L, d, f]    ("layers", "embed", "mlp"), down [L, f, d] ("layers", "mlp", "embed")
    layers.*_norm       [L, d] or [L, e] ("layers", "norm"); final_norm [d] ("norm",)
    lm_head             [d, V]       ("embed", "vocab")  (absent when tie_embeddings)

The logical axis names live in each Param's ``out_sharding`` metadata with ``eager_sharding=False``, so
building a model needs no mesh; ``passrate_jax.sharding`` maps the names to mesh axes.
"""

from __future__ import annotations

from typing import Protocol

import jax
import jax.numpy as jnp
from flax import nnx, struct

from passrate_jax.model.config import ModelConfig
from passrate_jax.model.matmul import project
from passrate_jax.model.params import Init, const, weight
from passrate_jax.model.rope import apply_rope, rope_tables

# Finite stand-in for -inf: a query with no visible key (a padding query) then gets a uniform softmax
# instead of NaN, so garbage at padding positions never poisons gradients through where/sum.
_MASK_VALUE = -1e30


@struct.dataclass
class KVCache:
    """Per-layer keys and values, slot ``s`` holding the token at absolute position ``s``.

    k: [layers, B, S, kv_heads, head_dim], or in the decode form (:meth:`decode_form`) a tuple of
      ``layers`` arrays [B, kv_heads, head_dim, S]
    v: [layers, B, S, kv_heads, head_dim], or in the decode form a tuple of arrays [B, kv_heads, S, head_dim]
    """
    k: jax.Array | tuple[jax.Array, ...]
    v: jax.Array | tuple[jax.Array, ...]

    @property
    def is_decode_form(self) -> bool:
        return isinstance(self.k, tuple)

    @property
    def slots(self) -> int:
        """S, the cache slots of a row."""
        return self.v[0].shape[2] if self.is_decode_form else self.k.shape[2]

    def decode_form(self) -> KVCache:
        """One buffer per layer, laid out for a one-token query (unrolled layers' decode loop).

        Each layer then writes and reads its own buffer in place, where a layer of the stacked array is
        copied out whole before its attention reads it (XLA CPU materialises the slice). Keys [B, kv, e, S]
        and values [B, kv, S, e] make both attention products plain batched matmuls (q @ K, p @ V) that
        XLA CPU runs several times faster than the multiply-reduce over the [B, S, kv, e] layout.
        """
        if self.is_decode_form:
            return self
        n = self.k.shape[0]
        return KVCache(k=tuple(jnp.transpose(self.k[i], (0, 2, 3, 1)) for i in range(n)),
                       v=tuple(jnp.transpose(self.v[i], (0, 2, 1, 3)) for i in range(n)))

    def stacked(self) -> KVCache:
        """The [layers, B, S, kv, e] form (the inverse of :meth:`decode_form`)."""
        if not self.is_decode_form:
            return self
        return KVCache(k=jnp.stack([jnp.transpose(k, (0, 3, 1, 2)) for k in self.k]),
                       v=jnp.stack([jnp.transpose(v, (0, 2, 1, 3)) for v in self.v]))


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=None) -> KVCache:
    """An all-zero cache for ``batch`` rows of ``max_len`` slots; ``dtype`` defaults to ``cfg.dtype``."""
    shape = (cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.resolved_head_dim)
    dtype = jnp.dtype(dtype if dtype is not None else cfg.dtype)
    return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))


class RMSNorm(nnx.Module):
    """Root-mean-square norm over the last axis, statistics in float32 (as transformers computes them)."""

    def __init__(self, dim: int, eps: float, dtype, param_dtype, init: Init):
        self.eps = eps
        self.dtype = dtype
        self.weight = init.const(1.0, (dim,), param_dtype, ("norm",))

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...].astype(self.dtype) * normed.astype(self.dtype)


class Attention(nnx.Module):
    """Grouped-query self-attention with RoPE, optional q/k/v biases (Qwen2) and q/k RMSNorm (Qwen3)."""

    def __init__(self, cfg: ModelConfig, init: Init):
        d, h, k, e = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim
        pdt, self.dtype = jnp.dtype(cfg.param_dtype), jnp.dtype(cfg.dtype)
        self.q = init.normal((d, h, e), pdt, ("embed", "heads", "head_dim"))
        self.k = init.normal((d, k, e), pdt, ("embed", "kv_heads", "head_dim"))
        self.v = init.normal((d, k, e), pdt, ("embed", "kv_heads", "head_dim"))
        self.o = init.normal((h, e, d), pdt, ("heads", "head_dim", "embed"))
        if cfg.attention_bias:
            self.q_bias = init.const(0.0, (h, e), pdt, ("heads", "head_dim"))
            self.k_bias = init.const(0.0, (k, e), pdt, ("kv_heads", "head_dim"))
            self.v_bias = init.const(0.0, (k, e), pdt, ("kv_heads", "head_dim"))
        if cfg.qk_norm:
            self.q_norm = RMSNorm(e, cfg.rms_norm_eps, self.dtype, pdt, init)
            self.k_norm = RMSNorm(e, cfg.rms_norm_eps, self.dtype, pdt, init)
        self.attention_bias = cfg.attention_bias
        self.lora_scale = cfg.lora.scale
        for name in "qkv":
            init.adapter(self, name, cfg, in_dims=1)
        init.adapter(self, "o", cfg, in_dims=2)
        self.qk_norm = cfg.qk_norm

    def _project(self, x_btd, name, bias_name):
        y = project(x_btd, weight(self, name, self.dtype))  # [B, T, heads, e]
        if self.attention_bias:
            y = y + getattr(self, bias_name)[...].astype(self.dtype)
        return y

    def __call__(self, x_btd, cos, sin, mask_bts, cache=None, layer=0, slot_bt=None):
        """Attention output [B, T, d]; with ``cache=(k, v)``, also the updated arrays: the full
        [L, ...] cache arrays, this layer's at ``layer``, or with ``layer=None`` this layer's own arrays in
        :meth:`KVCache.decode_form`."""
        q = self._project(x_btd, "q", "q_bias")
        k = self._project(x_btd, "k", "k_bias")
        v = self._project(x_btd, "v", "v_bias")
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            # Scatter each row's new keys into slot == position; padding tokens carry slot S (out of
            # range) and mode="drop" discards them, so they never clobber a real token's slot.
            cache_k, cache_v = cache
            rows = jnp.arange(x_btd.shape[0])[:, None]
            if layer is None:  # this layer's own arrays in the decode form (KVCache.decode_form)
                cache_k = cache_k.at[rows, :, :, slot_bt].set(k.astype(cache_k.dtype), mode="drop")
                cache_v = cache_v.at[rows, :, slot_bt].set(v.astype(cache_v.dtype), mode="drop")
                out = _attend_decode_form(q, cache_k.astype(self.dtype), cache_v.astype(self.dtype), mask_bts)
                return project(out, weight(self, "o", self.dtype), 2), (cache_k, cache_v)
            cache_k = cache_k.at[layer, rows, slot_bt].set(k.astype(cache_k.dtype), mode="drop")
            cache_v = cache_v.at[layer, rows, slot_bt].set(v.astype(cache_v.dtype), mode="drop")
            k, v = cache_k[layer].astype(self.dtype), cache_v[layer].astype(self.dtype)
            cache = (cache_k, cache_v)
        out = _attend(q, k, v, mask_bts)
        return project(out, weight(self, "o", self.dtype), 2), cache


def _attend_decode_form(q_bthe, k_bkes, v_bkse, mask_bts):
    """:func:`_attend` over one layer's cache in the decode form (keys [B, kv, e, S], values
    [B, kv, S, e]): both products are batched matmuls over (row, kv head); same numerics."""
    b, t, h, e = q_bthe.shape
    kv, s = k_bkes.shape[1], k_bkes.shape[3]
    g = h // kv
    # Queries of a kv head as the rows m = (t, g) of one [m, e] @ [e, S] matmul. The products are written
    # with the output in row-major (b, k, m) order: asked for [B, T, kv, g, e] directly, XLA CPU swaps
    # the operands of p @ V into a transposed dot that it runs ~4x slower.
    q = q_bthe.reshape(b, t, kv, g, e).transpose(0, 2, 1, 3, 4).reshape(b, kv, t * g, e).astype(jnp.float32)
    scores = jnp.einsum("bkme,bkes->bkms", q, k_bkes.astype(jnp.float32)) * (e ** -0.5)
    scores = jnp.where(mask_bts[:, None, :, None, :], scores.reshape(b, kv, t, g, s), _MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).reshape(b, kv, t * g, s)
    out = jnp.einsum("bkms,bkse->bkme", probs, v_bkse.astype(jnp.float32))
    return out.reshape(b, kv, t, g, e).transpose(0, 2, 1, 3, 4).reshape(b, t, h, e).astype(v_bkse.dtype)


def _attend(q_bthe, k_bske, v_bske, mask_bts):
    """Softmax attention with GQA; scores and softmax in float32."""
    b, t, h, e = q_bthe.shape
    kv = k_bske.shape[2]
    if t == 1:
        # One query per row (cached decode): a broadcast multiply-reduce over the cache reads K and V in
        # their stored [B, S, kv, e] layout, where the einsum below makes XLA CPU transpose a copy of the
        # whole cache in every layer at every step (measured 34% slower per decode step).
        q1 = q_bthe.reshape(b, 1, kv, h // kv, e).astype(jnp.float32)
        scores = jnp.sum(q1 * k_bske[:, :, :, None, :].astype(jnp.float32), axis=-1) * (e ** -0.5)
        scores = jnp.where(mask_bts[:, 0, :, None, None], scores, _MASK_VALUE)
        probs = jax.nn.softmax(scores, axis=1)  # over the cache slots: [B, S, kv, g]
        out = jnp.sum(probs[..., None] * v_bske[:, :, :, None, :].astype(jnp.float32), axis=1)
        return out.reshape(b, 1, h, e).astype(v_bske.dtype)
    # Same numerics as the explicit einsums it replaced (float32 scores and softmax, GQA by grouping, a
    # masked-out row gets a uniform softmax, not NaN) and measured faster on CPU for B=8, T=256, 16 / 8
    # heads of 128 (benchmarks/attention.py): forward 0.15 vs 0.18 CPU s, forward + backward about 8% less.
    return jax.nn.dot_product_attention(q_bthe, k_bske, v_bske, mask=mask_bts[:, None], implementation="xla")


class MLP(nnx.Module):
    """SwiGLU feed-forward: down(silu(gate x) * up x)."""

    def __init__(self, cfg: ModelConfig, init: Init):
        d, f, pdt = cfg.hidden_size, cfg.intermediate_size, jnp.dtype(cfg.param_dtype)
        self.dtype = jnp.dtype(cfg.dtype)
        self.gate = init.normal((d, f), pdt, ("embed", "mlp"))
        self.up = init.normal((d, f), pdt, ("embed", "mlp"))
        self.down = init.normal((f, d), pdt, ("mlp", "embed"))
        self.lora_scale = cfg.lora.scale
        for name in ("gate", "up", "down"):
            init.adapter(self, name, cfg, in_dims=1)

    def __call__(self, x_btd):
        gate = project(x_btd, weight(self, "gate", self.dtype))
        up = project(x_btd, weight(self, "up", self.dtype))
        return project(jax.nn.silu(gate) * up, weight(self, "down", self.dtype))


class Block(nnx.Module):
    """Pre-norm residual block: x + attn(norm x), then x + mlp(norm x).

    The Transformer builds one Block whose weights hold every layer ([L, ...]); it is called on one
    layer's slice of them (``nnx.merge(graphdef, state_of_layer_i)``, see :func:`run_layers`).
    """

    def __init__(self, cfg: ModelConfig, init: Init):
        dt, pdt = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dt, pdt, init)
        self.attn = Attention(cfg, init)
        self.post_attention_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dt, pdt, init)
        self.mlp = MLP(cfg, init)

    def __call__(self, x_btd, cos, sin, mask_bts, cache=None, layer=0, slot_bt=None):
        """Block output [B, T, d] and the (possibly updated) cache arrays."""
        attn_out, cache = self.attn(self.input_norm(x_btd), cos, sin, mask_bts, cache, layer, slot_bt)
        x_btd = x_btd + attn_out
        return x_btd + self.mlp(self.post_attention_norm(x_btd)), cache


class Layout(Protocol):
    """Where a sharded model's per-layer weights and activations should live inside the layer scan."""

    def layer_weights(self, state: nnx.State) -> nnx.State:
        """One layer's weights (the [L, ...] stacks' slice) as its matmuls should see them."""

    def activations(self, x_btd: jax.Array) -> jax.Array:
        """The residual stream [B, T, d] between layers."""


_REMAT_POLICIES = {"full": None, "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}


def _layer_slices(stacked: nnx.State, num_layers: int) -> tuple[nnx.State, ...]:
    """Layer i's weights out of the [L, ...] stacks, for each i."""
    return tuple(jax.tree.map(lambda w, i=i: w[i], stacked) for i in range(num_layers))


def run_layers(cfg: ModelConfig, layers: Block, x_btd, inputs: tuple, cache_arrays, layout: Layout | None,
               layer_weights: tuple[nnx.State, ...] | None = None):
    """All layers over ``x_btd``: one ``lax.scan`` over the stacked weights (``cfg.scan_layers``) or the
    same body unrolled, each layer rematerialised per ``cfg.remat``.

    ``inputs = (cos, sin, mask_bts, slot_bt)`` are shared by every layer; ``cache_arrays`` is None, the
    full (k, v) cache arrays [L, B, S, kv, e], carried whole so each layer updates its slice in place, or
    (unrolled layers only) the per-layer tuples of :meth:`KVCache.decode_form`, each layer updating its own.
    ``layer_weights`` (unrolled layers only): each layer's weights already sliced out of the stacks
    (:meth:`Transformer.layer_weights`), so a loop around this call (decode) does not copy them out
    again at every step.
    Returns the output [B, T, d] and the cache arrays in the form they came.
    """
    graphdef, stacked = nnx.split(layers)
    cos, sin, mask_bts, slot_bt = inputs

    dtype = jnp.dtype(cfg.dtype)

    def body(carry, layer_state):
        x, arrays, i = carry
        # The layer would cast each weight to the compute dtype at use anyway; casting first makes a
        # sharded layout gather (and its gradient scatter) move compute-dtype bytes.
        layer_state = jax.tree.map(lambda w: w.astype(dtype) if jnp.issubdtype(w.dtype, jnp.floating) else w,
                                   layer_state)
        if layout is not None:
            layer_state = layout.layer_weights(layer_state)
        x, arrays = nnx.merge(graphdef, layer_state)(x, cos, sin, mask_bts, arrays, i, slot_bt)
        if layout is not None:
            x = layout.activations(x)
        return (x, arrays, None if i is None else i + 1), None

    if cfg.remat != "none":
        body = jax.checkpoint(body, policy=_REMAT_POLICIES[cfg.remat], prevent_cse=not cfg.scan_layers)
    per_layer = cache_arrays is not None and isinstance(cache_arrays[0], tuple)  # decode form
    if cfg.scan_layers:
        if per_layer or layer_weights is not None:
            raise ValueError("a decode-form cache and layer_weights need unrolled layers (scan_layers=False)")
        carry, _ = jax.lax.scan(body, (x_btd, cache_arrays, jnp.zeros((), jnp.int32)), stacked)
        return carry[0], carry[1]
    x, arrays = x_btd, cache_arrays
    for i, weights in enumerate(layer_weights or _layer_slices(stacked, cfg.num_layers)):
        if per_layer:
            (x, (k, v), _), _ = body((x, (arrays[0][i], arrays[1][i]), None), weights)
            arrays = tuple(a[:i] + (new,) + a[i + 1:] for a, new in zip(arrays, (k, v)))
        else:
            (x, arrays, _), _ = body((x, arrays, jnp.int32(i)), weights)
    return x, arrays


class Transformer(nnx.Module):
    """Decoder-only language model; see the module docstring for the weight layout."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        cfg.validate()
        self.cfg = cfg
        pdt, self.dtype = jnp.dtype(cfg.param_dtype), jnp.dtype(cfg.dtype)
        init = Init()
        self.embed = init.normal((cfg.vocab_size, cfg.hidden_size), pdt, ("vocab", "embed"))
        self.layers = Block(cfg, init.stacked(cfg.num_layers))  # every weight [L, ...]
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, self.dtype, pdt, init)
        if not cfg.tie_embeddings:
            self.lm_head = init.normal((cfg.hidden_size, cfg.vocab_size), pdt, ("embed", "vocab"))
        init.fill(rngs.params())

    def layer_weights(self) -> tuple[nnx.State, ...]:
        """Each layer's weights sliced out of the [L, ...] stacks. XLA CPU copies a slice out whole
        wherever it is taken, so a decode loop over unrolled layers takes these once before the loop
        rather than at every step (measured ~9% of a small model's decode step)."""
        return _layer_slices(nnx.state(self.layers), self.cfg.num_layers)

    def __call__(self, tokens_bt, positions_bt=None, attention_mask_bt=None, cache: KVCache | None = None,
                 logits_at_b: jax.Array | None = None, layout: Layout | None = None,
                 layer_weights: tuple[nnx.State, ...] | None = None):
        """Next-token logits.

        Args:
          tokens_bt: int32 [B, T] token ids.
          positions_bt: int32 [B, T] absolute positions; default ``arange(T)`` in every row.
          attention_mask_bt: bool/int [B, T], 1 = real token; default all real.
          cache: optional :class:`KVCache`. Real tokens are written at slot == position (padding is
            not written; a position >= the cache length is silently dropped, so size the cache for
            prompt + generation) and queries attend to cache slots ``s <= position``.
          logits_at_b: optional int32 [B]: only the logits at column ``logits_at_b[b]`` of each row are
            computed (a prefill needs the last position's alone; the full [B, T, V] LM head would cost
            ``T`` times the matmul and memory, e.g. 15 GB for 64 x 400 tokens of a 152k vocabulary).
          layout: optional sharding constraints for the layers' weights and activations
            (:class:`Layout`; e.g. ``passrate_jax.sharding.FsdpLayout``); None lets XLA propagate.
          layer_weights: optional, unrolled layers only: :meth:`layer_weights`, computed once outside
            a loop that calls the model many times.

        Returns:
          ``logits_btv`` float32 [B, T, V] (``[B, V]`` with ``logits_at_b``) without a cache; with one,
          ``(logits, new_cache)``.
        """
        b, t = tokens_bt.shape
        if positions_bt is None:
            positions_bt = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        real_bt = (jnp.ones((b, t), bool) if attention_mask_bt is None
                   else attention_mask_bt.astype(bool))
        positions_bt = positions_bt.astype(jnp.int32)
        cos, sin = rope_tables(positions_bt, self.cfg)
        x = self.embed[...][tokens_bt].astype(self.dtype)
        if layout is not None:
            x = layout.activations(x)

        if cache is None:
            # Causal by position, not by index: rows may be left- or right-padded or packed.
            mask_bts = (positions_bt[:, None, :] <= positions_bt[:, :, None]) & real_bt[:, None, :]
            x, _ = run_layers(self.cfg, self.layers, x, (cos, sin, mask_bts, None), None, layout, layer_weights)
        else:
            s = cache.slots
            mask_bts = jnp.arange(s)[None, None, :] <= positions_bt[:, :, None]
            slot_bt = jnp.where(real_bt, positions_bt, s)
            x, arrays = run_layers(self.cfg, self.layers, x, (cos, sin, mask_bts, slot_bt), (cache.k, cache.v),
                                   layout, layer_weights)
            cache = KVCache(k=arrays[0], v=arrays[1])

        if logits_at_b is not None:
            x = x[jnp.arange(b), logits_at_b][:, None]  # [B, 1, D]: the LM head runs on one column per row
        x = self.final_norm(x)
        if self.cfg.tie_embeddings:
            logits = project(x, self.embed[...].astype(self.dtype).T)
        else:
            logits = project(x, self.lm_head[...].astype(self.dtype))
        logits = logits.astype(jnp.float32)
        if logits_at_b is not None:
            logits = logits[:, 0]
        return logits if cache is None else (logits, cache)
