"""Device mesh and partition rules: logical axis names on parameters -> ("data", "fsdp", "tensor").

Every function takes the mesh explicitly; nothing here sets global mesh state.

    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    model = shard_model(model, mesh)
    tokens = jax.device_put(tokens_bt, batch_sharding(mesh, 2))
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import jax
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from passrate_jax.configlib import ConfigError, option

MESH_AXES = ("data", "fsdp", "tensor")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Device mesh: the product of the axis sizes must equal the device count; -1 means "the rest"."""
    data: int = option(-1, ge=-1, doc="data-parallel axis size (-1: fill)")
    fsdp: int = option(1, ge=-1, doc="fully-sharded data-parallel axis size")
    tensor: int = option(1, ge=-1, doc="tensor-parallel axis size")
    devices: int = option(0, ge=0, doc="devices (all hosts) the preset is laid out for; 0: any. A mismatch fails "
                                       "at startup instead of running a mesh the preset never meant")

    def validate(self) -> None:
        sizes = (self.data, self.fsdp, self.tensor)
        if any(s == 0 for s in sizes):
            raise ConfigError(f"(data, fsdp, tensor) = {sizes}: each must be >= 1 or -1")
        if sum(s == -1 for s in sizes) > 1:
            raise ConfigError(f"(data, fsdp, tensor) = {sizes}: at most one axis may be -1")


# Logical name -> mesh axis (or tuple of axes, or None = replicated). Weights are split over "fsdp"
# along the model width and over "tensor" along heads / mlp / vocab (Megatron-style column/row
# splits); activations' batch dimension over both data-parallel axes.
LOGICAL_AXIS_RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": ("data", "fsdp"),
    "embed": "fsdp",
    "vocab": "tensor",
    "heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "head_dim": None,
    "norm": None,
    "layers": None,
    "length": None,
}

# Logical axes of a KVCache's k / v arrays [layers, B, S, kv_heads, head_dim].
KV_CACHE_AXES = ("layers", "batch", "length", "kv_heads", "head_dim")


def make_mesh(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ("data", "fsdp", "tensor") mesh with Auto axis types over ``devices`` (default: all).

    One axis size may be -1 ("the rest"). Raises ValueError naming the sizes when their product does
    not equal the device count.
    """
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    if cfg.devices and cfg.devices != n:
        raise ValueError(f"mesh.devices = {cfg.devices}: the preset is laid out for {cfg.devices} devices, "
                         f"this run has {n} ({jax.process_count()} process(es))")
    sizes = [cfg.data, cfg.fsdp, cfg.tensor]
    if -1 in sizes:
        known = math.prod(s for s in sizes if s != -1)
        if n % known:
            raise ValueError(f"mesh (data, fsdp, tensor) = {tuple(sizes)}: the fixed sizes (product {known}) "
                             f"do not divide the device count {n}")
        sizes[sizes.index(-1)] = n // known
    if math.prod(sizes) != n:
        raise ValueError(f"mesh (data, fsdp, tensor) = {tuple(sizes)}: product {math.prod(sizes)} != "
                         f"device count {n}")
    # Auto, not jax.make_mesh's Explicit default: explicit-sharding mode rejects the embedding gather
    # and would force sharding annotations on every op; Auto lets XLA propagate from the params.
    return jax.make_mesh(tuple(sizes), MESH_AXES, axis_types=(AxisType.Auto,) * 3, devices=devices)


def logical_to_spec(names: Sequence[str | None], shape: Sequence[int], mesh: Mesh,
                    rules: dict = LOGICAL_AXIS_RULES) -> PartitionSpec:
    """PartitionSpec for an array of ``shape`` whose dims carry logical ``names``.

    A mesh axis is dropped (that dim replicated) when the dim is not divisible by its size or the axis
    is already used by an earlier dim, so e.g. 2 kv heads on a tensor axis of 4 stay replicated.
    """
    if len(names) != len(shape):
        raise ValueError(f"logical axes {tuple(names)} do not match shape {tuple(shape)}")
    used: set[str] = set()
    spec = []
    for name, dim in zip(names, shape):
        if name is not None and name not in rules:
            raise ValueError(f"logical axis {name!r} has no rule; known: {sorted(rules)}")
        target = rules.get(name) if name is not None else None
        axes = (target,) if isinstance(target, str) else tuple(target or ())
        axes = tuple(a for a in axes if mesh.shape[a] > 1 and a not in used)
        if axes and dim % math.prod(mesh.shape[a] for a in axes):
            axes = ()
        used.update(axes)
        spec.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*spec)


def logical_sharding(mesh: Mesh, names: Sequence[str | None], shape: Sequence[int],
                     rules: dict = LOGICAL_AXIS_RULES) -> NamedSharding:
    """NamedSharding for one array with logical axis ``names``, e.g. a KV cache with
    :data:`KV_CACHE_AXES`: ``jax.device_put(cache, logical_sharding(mesh, KV_CACHE_AXES, cache.k.shape))``."""
    return NamedSharding(mesh, logical_to_spec(names, shape, mesh, rules))


def param_shardings(state: nnx.State, mesh: Mesh, rules: dict = LOGICAL_AXIS_RULES) -> nnx.State:
    """NamedShardings matching ``state`` (each Variable's value replaced by its sharding), from the
    Variables' ``out_sharding`` logical names; unannotated arrays are replicated. Usable as jit
    ``in_shardings`` / ``out_shardings`` for the state and as a ``jax.device_put`` target."""

    def one(x):
        if isinstance(x, nnx.Variable):
            names = x.get_metadata().get("out_sharding") or (None,) * len(x.shape)
            return x.replace(NamedSharding(mesh, logical_to_spec(names, x.shape, mesh, rules)))
        return NamedSharding(mesh, PartitionSpec())

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def shard_model(model: nnx.Module, mesh: Mesh, rules: dict = LOGICAL_AXIS_RULES) -> nnx.Module:
    """Place ``model``'s variables on ``mesh`` according to their logical axes (in place; returned)."""
    state = nnx.state(model)
    nnx.update(model, jax.device_put(state, param_shardings(state, mesh, rules)))
    return model


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _gather(w: jax.Array, gathered: NamedSharding, split: NamedSharding) -> jax.Array:
    return jax.lax.with_sharding_constraint(w, gathered)


def _gather_fwd(w, gathered, split):
    return _gather(w, gathered, split), None


def _gather_bwd(gathered, split, _, g):
    # The weight's gradient leaves the layer split like the weight (a reduce-scatter), so the scan's
    # stacked gradient, like the parameters, is never whole on one device.
    return (jax.lax.with_sharding_constraint(g, split),)


_gather.defvjp(_gather_fwd, _gather_bwd)


@dataclasses.dataclass(frozen=True)
class FsdpLayout:
    """Fully-sharded data parallelism inside the model's layer scan (a ``passrate_jax.model.Layout``).

    Each layer's weights are all-gathered over ``fsdp`` just before the layer uses them (still split over
    ``tensor``) and their gradients reduce-scattered back, while the residual stream stays split by rows
    over (data, fsdp). Without these constraints XLA may instead keep the weights split and all-gather
    the activations, which for long sequences costs far more memory than one layer's weights.
    """
    mesh: Mesh
    rules: tuple = tuple(LOGICAL_AXIS_RULES.items())

    def layer_weights(self, state: nnx.State) -> nnx.State:
        rules = dict(self.rules)
        gathered_rules = {k: _without(v, "fsdp") for k, v in rules.items()}

        def one(v):
            if not isinstance(v, nnx.Variable):
                return v
            names = tuple(v.get_metadata().get("out_sharding") or (None,) * v.ndim)[-v.ndim:]
            split = logical_sharding(self.mesh, names, v.shape, rules)
            gathered = logical_sharding(self.mesh, names, v.shape, gathered_rules)
            return v.replace(_gather(v.get_value(), gathered, split))

        return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))

    def activations(self, x_btd: jax.Array) -> jax.Array:
        rows = self.mesh.shape["data"] * self.mesh.shape["fsdp"]
        if x_btd.shape[0] % rows:
            return x_btd  # a batch that does not split evenly is left to XLA
        return jax.lax.with_sharding_constraint(x_btd, batch_sharding(self.mesh, x_btd.ndim))


def _without(target, axis: str):
    axes = (target,) if isinstance(target, str) else tuple(target or ())
    kept = tuple(a for a in axes if a != axis)
    return None if not kept else kept[0] if len(kept) == 1 else kept


def batch_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
    """Split dim 0 over ("data", "fsdp"), replicate the other ``ndim - 1`` dims."""
    return NamedSharding(mesh, PartitionSpec(("data", "fsdp"), *([None] * (ndim - 1))))


def replicated(mesh: Mesh) -> NamedSharding:
    """A fully replicated sharding on ``mesh``."""
    return NamedSharding(mesh, PartitionSpec())


__all__ = ["MeshConfig", "MESH_AXES", "LOGICAL_AXIS_RULES", "KV_CACHE_AXES", "make_mesh", "logical_to_spec",
           "logical_sharding", "param_shardings",
           "shard_model", "batch_sharding", "replicated", "FsdpLayout"]
