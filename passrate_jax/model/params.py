"""Weight creation for the transformer: logical-axis Params, one PRNG draw for every normal-initialised
weight, per-layer stacking and LoRA adapters; and the weight read that adds an adapter's update."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from passrate_jax.model.config import ModelConfig

_INIT_STD = 0.02  # Hugging Face initializer_range default for these families


def _param(value: jax.Array, axes: tuple[str, ...]) -> nnx.Param:
    # eager_sharding=False: the names are logical, only sharding.py knows the mesh they map to.
    return nnx.Param(value, out_sharding=axes, eager_sharding=False)


def const(fill: float, shape, dtype) -> jax.Array:
    # Built in numpy and transferred: an eager jnp.ones would compile one program per shape.
    return jnp.asarray(np.full(shape, fill, np.dtype(dtype)))


@functools.partial(jax.jit, static_argnums=(1, 2))
def _normals(key: jax.Array, shapes: tuple, dtypes: tuple) -> list[jax.Array]:
    sizes = [math.prod(s) for s in shapes]
    flat = _INIT_STD * jax.random.normal(key, (sum(sizes),), jnp.float32)
    offsets = np.cumsum([0] + sizes)
    return [flat[o:o + n].reshape(s).astype(d) for o, n, s, d in zip(offsets, sizes, shapes, dtypes)]


class Init:
    """Creates the normal-initialised weights as placeholders, then fills them all from *one* PRNG
    draw: XLA's CPU compile time grows steeply with the number of separate random kernels (tens of
    seconds for a two-layer model drawn weight by weight).

    ``stacked(L)`` gives a view whose weights carry a leading ("layers",) axis of size ``L``: the
    per-layer modules are built once, with every weight holding all layers.
    """

    def __init__(self, pending: list | None = None, adapters: list | None = None, prefix: tuple[int, ...] = (),
                 prefix_axes: tuple = ()):
        self.pending: list[nnx.Param] = [] if pending is None else pending
        self.adapters: list[tuple[nnx.LoRAParam, float]] = [] if adapters is None else adapters
        self.prefix, self.prefix_axes = prefix, prefix_axes

    def stacked(self, layers: int) -> "Init":
        return Init(self.pending, self.adapters, (layers,), ("layers",))

    def adapter(self, module: nnx.Module, name: str, cfg: ModelConfig, in_dims: int) -> None:
        """LoRA factors of weight ``module.<name>`` when ``cfg.lora`` targets it: ``<name>_lora_a``
        [in..., r] (normal, std 1 / sqrt(fan-in)) and ``<name>_lora_b`` [r, out...] (zeros, so a fresh
        adapter leaves the model unchanged), float32 whatever the base weights' dtype. The first
        ``in_dims`` dims of the weight are its inputs."""
        lora = cfg.lora
        if not lora.rank or name not in lora.targets:
            return
        weight = getattr(module, name)
        full_axes = weight.get_metadata()["out_sharding"]
        shape, axes = weight.shape[len(self.prefix):], full_axes[len(self.prefix):]
        dtype = np.dtype(np.float32)  # small; float32 keeps small updates from rounding away on bf16 bases
        a_shape, a_axes = shape[:in_dims] + (lora.rank,), axes[:in_dims] + (None,)
        a = nnx.LoRAParam(np.broadcast_to(np.zeros((), dtype), self.prefix + a_shape),
                          out_sharding=self.prefix_axes + a_axes, eager_sharding=False)
        self.adapters.append((a, 1.0 / math.sqrt(math.prod(shape[:in_dims]))))
        b = nnx.LoRAParam(const(0.0, self.prefix + (lora.rank,) + shape[in_dims:], dtype),
                          out_sharding=self.prefix_axes + (None,) + axes[in_dims:], eager_sharding=False)
        setattr(module, f"{name}_lora_a", a)
        setattr(module, f"{name}_lora_b", b)

    def normal(self, shape, dtype, axes: tuple[str, ...]) -> nnx.Param:
        """A placeholder Param of ``shape`` with logical ``axes``, filled by :meth:`fill`."""
        # A zero-stride view: no host memory even for a full-size model under nnx.eval_shape.
        shape = self.prefix + tuple(shape)
        param = _param(np.broadcast_to(np.zeros((), np.dtype(dtype)), shape), self.prefix_axes + axes)
        self.pending.append(param)
        return param

    def const(self, fill: float, shape, dtype, axes: tuple[str, ...]) -> nnx.Param:
        return _param(const(fill, self.prefix + tuple(shape), dtype), self.prefix_axes + axes)

    def fill(self, key: jax.Array) -> None:
        values = _normals(key, tuple(tuple(p.shape) for p in self.pending),
                          tuple(np.dtype(p.get_value().dtype) for p in self.pending))
        for param, value in zip(self.pending, values):
            param.set_value(value)
        if self.adapters:  # their own draw: the base weights are the same with or without adapters
            values = _normals(jax.random.fold_in(key, 1), tuple(tuple(a.shape) for a, _ in self.adapters),
                              tuple(np.dtype(a.get_value().dtype) for a, _ in self.adapters))
            for (param, std), value in zip(self.adapters, values):
                param.set_value((value * (std / _INIT_STD)).astype(value.dtype))


def weight(module: nnx.Module, name: str, dtype) -> jax.Array:
    """Weight ``name`` of ``module`` in ``dtype``, plus its LoRA update ``scale * A B`` when it has one."""
    w = getattr(module, name)[...].astype(dtype)
    a = getattr(module, f"{name}_lora_a", None)
    if a is None:
        return w
    b = getattr(module, f"{name}_lora_b")
    return w + module.lora_scale * jnp.tensordot(a[...].astype(dtype), b[...].astype(dtype), axes=1)
