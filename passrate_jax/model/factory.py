"""The model a config asks for: a Hugging Face checkpoint or random weights, placed on a mesh."""

from __future__ import annotations

import dataclasses

import jax
from flax import nnx

from passrate_jax.model.config import ModelConfig
from passrate_jax.model.hf_io import load_pretrained
from passrate_jax.model.transformer import Transformer
from passrate_jax.sharding import param_shardings


def create_model(cfg: ModelConfig, seed: int = 0, mesh: jax.sharding.Mesh | None = None) -> Transformer:
    """The model a config asks for: ``cfg.pretrained`` loaded (with ``cfg.dtype`` / ``cfg.param_dtype``)
    when set, else a randomly initialised :class:`Transformer` built in one compiled program.

    With ``mesh`` the weights are created (or loaded) directly in their shardings, so no device ever
    holds the whole model. Random init under one jit also avoids eager mode's compile per op.
    """
    if cfg.pretrained is None:
        return nnx.merge(*_random_init(cfg, seed, mesh, ...))
    base = load_pretrained(cfg.pretrained, cfg.dtype, mesh, param_dtype=cfg.param_dtype)
    # The checkpoint fixes the shape; how the layers run and which adapters train come from cfg.
    cfg = dataclasses.replace(base.cfg, lora=cfg.lora, scan_layers=cfg.scan_layers, remat=cfg.remat)
    if not cfg.lora.rank:
        base.cfg = cfg
        return base
    graphdef, adapters = _random_init(cfg, seed, mesh, nnx.LoRAParam)  # fresh adapters, B = 0
    return nnx.merge(graphdef, nnx.state(base), adapters)


def _random_init(cfg: ModelConfig, seed: int, mesh, which) -> tuple[nnx.GraphDef, nnx.State]:
    """The graphdef and the ``which`` part of a random model's state, built in one jitted program (XLA
    drops the draws of the weights not returned)."""
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(seed))))
    out_shardings = None
    if mesh is not None:
        out_shardings = param_shardings(nnx.filter_state(abstract, which), mesh)
    state = jax.jit(lambda: nnx.state(Transformer(cfg, rngs=nnx.Rngs(seed)), which), out_shardings=out_shardings)()
    return graphdef, state
