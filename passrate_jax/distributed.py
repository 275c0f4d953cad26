"""Multi-process runs on JAX's own runtime: one process per host, every process runs the same program.

How the host-side loop stays identical on every host: **all hosts decide identically from the same
gathered outcomes**. The sampler's output rows are split over the hosts' devices; :func:`to_host`
gathers them (``process_allgather``) so every host holds every completion, scores every completion
with the same deterministic verifier, and feeds the same results to the same pure allocator functions.
No host broadcasts decisions, so there is no second channel to keep in order and no host waits on
another's Python; the price is that each host verifies every response (cheap next to generation for
the built-in verifiers; the math-verify pool runs on every host). :func:`check_same_on_every_host`
guards the assumption: a step whose decisions differ between hosts (a non-deterministic verifier, a
host-dependent file) fails loudly instead of training on diverged batches.

Checkpoints are written by Orbax from every process (each writes its own shards; Orbax coordinates the
commit); metrics, ``config.yaml`` and the warm-start cache are written by process 0 only.
"""

from __future__ import annotations

import hashlib
import os

import jax
import numpy as np

ENV_FLAG = "PASSRATE_JAX_DISTRIBUTED"


def initialize(cfg) -> bool:
    """Start ``jax.distributed`` when ``cfg.initialize`` (a :class:`~passrate_jax.run.config.DistributedConfig`)
    or the environment's ``PASSRATE_JAX_DISTRIBUTED=1`` asks for it; a no-op when already started.
    Must run before any other JAX call. Returns whether this run is multi-process."""
    wanted = cfg.initialize or os.environ.get(ENV_FLAG, "") not in ("", "0")
    if wanted and not jax.distributed.is_initialized():
        kwargs = {}
        if cfg.coordinator_address:
            kwargs = dict(coordinator_address=cfg.coordinator_address, num_processes=cfg.num_processes,
                          process_id=cfg.process_id)
        jax.distributed.initialize(**kwargs)
    return jax.process_count() > 1


def is_primary() -> bool:
    """Process 0: the one that writes metrics, logs and caches."""
    return jax.process_index() == 0


def to_host(tree):
    """Numpy copies of every array in ``tree``. Arrays split over other processes' devices are gathered
    first (every process gets the whole array); others are fetched as they are."""
    from jax.experimental import multihost_utils

    def one(x):
        if isinstance(x, jax.Array) and not (x.is_fully_addressable or x.is_fully_replicated):
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(jax.device_get(x))

    return jax.tree.map(one, tree)


def fingerprint(*values) -> np.ndarray:
    """A 128-bit hash of ``repr(values)`` as four int32 words (JAX's default integer width): cheap to
    compare across hosts."""
    return np.frombuffer(hashlib.sha256(repr(values).encode()).digest()[:16], np.int32).copy()


def check_same_on_every_host(what: str, *values) -> None:
    """Raise on every host when ``values`` differ between hosts (no-op in a single process)."""
    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    mine = fingerprint(*values)
    every = np.asarray(multihost_utils.process_allgather(mine)).reshape(-1, mine.size)
    if np.any(every != mine[None]):
        differ = [i for i in range(len(every)) if np.any(every[i] != every[0])]
        raise RuntimeError(f"{what} differs between hosts (processes {differ} disagree with process 0): the host loop must "
                           "decide identically everywhere; is the verifier or the data deterministic?")
