"""The model a config asks for: a Hugging Face checkpoint or random weights, placed on a mesh."""

from __future__ import annotations

import jax
from flax import nnx

from passrate_jax.model.config import ModelConfig
from passrate_jax.model.hf_io import load_pretrained
from passrate_jax.model.transformer import Transformer


def create_model(cfg: ModelConfig, seed: int = 0, mesh: jax.sharding.Mesh | None = None) -> Transformer:
    """The model a config asks for: ``cfg.pretrained`` loaded (with ``cfg.dtype`` / ``cfg.param_dtype``)
    when set, else a randomly initialised :class:`Transformer` built in one compiled program.

    With ``mesh`` the weights are created (or loaded) directly in their shardings, so no device ever
    holds the whole model. Random init under one jit also avoids eager mode's compile per op.
    """
    if cfg.pretrained is not None:
        return load_pretrained(cfg.pretrained, cfg.dtype, mesh, param_dtype=cfg.param_dtype)
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(seed))))
    out_shardings = None
    if mesh is not None:
        from passrate_jax.sharding import param_shardings  # sharding never imports the model
        out_shardings = param_shardings(abstract, mesh)
    state = jax.jit(lambda: nnx.split(Transformer(cfg, rngs=nnx.Rngs(seed)))[1],
                    out_shardings=out_shardings)()
    return nnx.merge(graphdef, state)
