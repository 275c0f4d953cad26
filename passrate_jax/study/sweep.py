"""Sweeps: many settings of one method's knobs as one vmapped simulation, split over the CPU's cores.

    base = base_knobs("sara", sim, alloc, ps)                      # the knobs the configs set
    knobs = sweep_knobs(base, tau_abandon=a, tau_confirm=c)       # a, c: arrays, the grid's leading axes
    metrics = run_grid("sara", sim, alloc, ps, knobs)             # numpy, leading axes [grid..., seeds, T]
    rpv, vgps = sweep("sara", sim, alloc, ps, knobs)              # per setting and seed

XLA's CPU backend runs a vmapped round loop on one core, so :func:`run_grid` splits the grid's first
axis into equal parts (one per core by default) and runs them on threads: one compile serves every
part, and each setting's numbers are the same as in one call.
"""

from __future__ import annotations

import concurrent.futures
import os

import jax
import jax.numpy as jnp
import numpy as np

from passrate_jax.allocation.allocator import Allocator
from passrate_jax.allocation.config import AllocationConfig, PrefixSamplingConfig
from passrate_jax.allocation.composition import Knobs
from passrate_jax.study.simulate import SimulatorConfig, grid_axes, method_configs, prepare


def base_knobs(name: str, sim: SimulatorConfig, alloc: AllocationConfig, ps: PrefixSamplingConfig) -> Knobs:
    """The knobs that method ``name``'s configs set (a sweep's starting point)."""
    return Allocator(*method_configs(name, alloc, ps), sim.num_prompts).knobs


def sweep_knobs(base: Knobs, **grids) -> Knobs:
    """``base`` with a grid of settings: each keyword (a Knobs field, or ``gains_<field>``) maps to an
    array whose leading axes are the grid's (the same for all); the other knobs keep their base value
    and stay unbatched (vmap does not broadcast them)."""
    gains = {k[len("gains_"):]: v for k, v in grids.items() if k.startswith("gains_")}
    plain = {k: v for k, v in grids.items() if not k.startswith("gains_")}
    knobs = base.replace(**{k: jnp.asarray(v, getattr(base, k).dtype) for k, v in plain.items()})
    return knobs.replace(gains=knobs.gains.replace(**{k: jnp.asarray(v, jnp.float32) for k, v in gains.items()}))


def grid_parts(knobs: Knobs, base: Knobs, parts: int) -> list[Knobs]:
    """``knobs`` split along the grid's first axis into the largest number <= ``parts`` of equal parts."""
    rank, axes = grid_axes(knobs, base)
    if rank == 0:
        return [knobs]
    is_axis = lambda x: x is None  # noqa: E731
    size = next(k.shape[0] for ax, k in zip(jax.tree.leaves(axes, is_leaf=is_axis), jax.tree.leaves(knobs)) if ax == 0)
    count = max(d for d in range(1, max(parts, 1) + 1) if size % d == 0)
    chunk = size // count
    return [jax.tree.map(lambda ax, k, i=i: k if ax is None else k[i * chunk:(i + 1) * chunk], axes, knobs,
                         is_leaf=is_axis) for i in range(count)]


def compile_grid(name: str, sim: SimulatorConfig, alloc: AllocationConfig, ps: PrefixSamplingConfig, knobs: Knobs,
                 threads: int | None = None):
    """(compiled run of one part, the parts, the other arguments) for :func:`run_parts`; ``threads``
    (default: the CPU count) is how many parts at most."""
    parts = grid_parts(knobs, base_knobs(name, sim, alloc, ps), threads or os.cpu_count() or 1)
    run, args = prepare(name, sim, alloc, ps, parts[0])
    return run.lower(*args).compile(), parts, args[1:]


def run_parts(compiled, parts: list[Knobs], rest) -> dict:
    """Run every part (on its own thread; XLA runs without the GIL) and join them along the grid axis."""
    if len(parts) == 1:
        return jax.device_get(compiled(parts[0], *rest))
    with concurrent.futures.ThreadPoolExecutor(len(parts)) as pool:
        outs = list(pool.map(lambda knobs: jax.device_get(compiled(knobs, *rest)), parts))
    return jax.tree.map(lambda *xs: np.concatenate(xs), *outs)


def run_grid(name: str, sim: SimulatorConfig, alloc: AllocationConfig, ps: PrefixSamplingConfig, knobs: Knobs,
             threads: int | None = None) -> dict:
    """Per-step metrics of method ``name`` for every setting of a grid of ``knobs`` and every seed
    (numpy, leading axes [grid..., seeds, T]): :func:`~.simulate.run_method` over a grid, split over
    ``threads`` cores."""
    return run_parts(*compile_grid(name, sim, alloc, ps, knobs, threads))


def sweep(name: str, sim: SimulatorConfig, alloc: AllocationConfig, ps: PrefixSamplingConfig, knobs: Knobs):
    """Rollouts per valid group and valid groups per step of method ``name`` for every setting of a
    grid of ``knobs`` (see :func:`sweep_knobs`): (rpv, vgps), each [grid..., seeds]."""
    m = run_grid(name, sim, alloc, ps, knobs)
    valid = m["valid"].sum(-1)
    return m["spent"].sum(-1) / np.maximum(valid, 1), valid / sim.steps
