"""LoRA on the model's parameter state: which leaves train, the adapters-off reference, and the merge.

The adapters are ``nnx.LoRAParam`` variables beside the weights they adapt (``q_lora_a`` [L, d, r],
``q_lora_b`` [L, r, h, e], ...; see ``transformer._Init.adapter``), so Flax NNX's variable filters
split them from the frozen base weights:

    adapters, base = nnx.split_state(params, TRAINABLE_WITH_LORA, ...)
    ref = reference_params(params)          # the KL reference: the same base, adapters off
    merged = merge_lora(params, model.cfg)  # plain weights W + (alpha / r) A B, no adapter leaves
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from passrate_jax.model.config import LoRAConfig, ModelConfig
from passrate_jax.model.transformer import Transformer

TRAINABLE_WITH_LORA = nnx.LoRAParam
_SUFFIXES = ("_lora_a", "_lora_b")


def has_adapters(params: nnx.State) -> bool:
    """True when ``params`` holds LoRA adapters (then only they train)."""
    return any(isinstance(v, nnx.LoRAParam)
               for v in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, nnx.Variable)))


def reference_params(params: nnx.State) -> nnx.State:
    """``params`` with every adapter's B factor zeroed: the base model exactly, sharing the base weights'
    buffers (no second copy of the model; only the small B factors are new)."""
    def off(path, v):
        return v.replace(jnp.zeros_like(v.get_value())) if str(path[-1]).endswith("_lora_b") else v

    return nnx.from_flat_state({p: off(p, v) for p, v in nnx.to_flat_state(params)})


def merge_lora(params: nnx.State, cfg: ModelConfig) -> nnx.State:
    """Plain weights ``W + (alpha / rank) A B`` (computed in float32, stored in W's dtype) with the adapter
    leaves dropped: the state of a model built with ``cfg.lora.rank = 0`` (see :func:`without_lora`)."""
    flat = dict(nnx.to_flat_state(params))
    out = {}
    for path, var in flat.items():
        if str(path[-1]).endswith(_SUFFIXES):
            continue
        a = flat.get(path[:-1] + (f"{path[-1]}_lora_a",))
        if a is not None:
            b = flat[path[:-1] + (f"{path[-1]}_lora_b",)]
            # Adapted weights are per-layer stacks [L, ...]: contract the rank layer by layer.
            delta = jax.vmap(lambda x, y: jnp.tensordot(x, y, axes=1))(a.get_value().astype(jnp.float32),
                                                                       b.get_value().astype(jnp.float32))
            w = var.get_value()
            var = var.replace((w.astype(jnp.float32) + cfg.lora.scale * delta).astype(w.dtype))
        out[path] = var
    return nnx.from_flat_state(out)


def without_lora(cfg: ModelConfig) -> ModelConfig:
    """``cfg`` with the adapters off (rank 0)."""
    return dataclasses.replace(cfg, lora=LoRAConfig())


def merged_model(model: Transformer) -> Transformer:
    """A plain :class:`Transformer` (no adapters) computing what ``model`` does with its adapters on."""
    if not model.cfg.lora.rank:
        return model
    cfg = without_lora(model.cfg)
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    return nnx.merge(graphdef, merge_lora(nnx.state(model), model.cfg))
