"""Rotary position embeddings (RoPE) as transformers computes them: the inverse frequencies with
llama3 / linear scaling, the cos / sin tables of a batch's positions, and the rotation of queries and keys."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from passrate_jax.model.config import ModelConfig


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """RoPE inverse frequencies [head_dim / 2] (float64 numpy), with llama3 / linear scaling applied
    exactly as transformers' ``ROPE_INIT_FUNCTIONS`` does."""
    dim = cfg.resolved_head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    rs = cfg.rope_scaling
    if rs.rope_type == "linear":
        return inv_freq / rs.factor
    if rs.rope_type == "llama3":
        low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
        high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / rs.factor, inv_freq)
        smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
            rs.high_freq_factor - rs.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
        is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return np.where(is_medium, smoothed, scaled)
    return inv_freq


def rope_tables(positions_bt: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """cos, sin [B, T, 1, head_dim] float32, in the rotate-half layout transformers uses."""
    # transformers keeps inv_freq in float32; rounding it the same way keeps long positions matched.
    inv_freq = jnp.asarray(rope_inv_freq(cfg), jnp.float32)
    angles = positions_bt.astype(jnp.float32)[..., None] * inv_freq
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x_bthe: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """``x`` [B, T, heads, head_dim] rotated by the tables of :func:`rope_tables` (rotate-half layout)."""
    half = x_bthe.shape[-1] // 2
    x = x_bthe.astype(jnp.float32)
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return (x * cos + rotated * sin).astype(x_bthe.dtype)
