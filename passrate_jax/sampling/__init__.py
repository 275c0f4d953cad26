"""Rollout sampling: static-shape KV cache, one prefill per distinct context, jitted and sharded.

Host API: :class:`Sampler`, :class:`Context`, :class:`SampleResult`, :func:`training_rows`; KV reuse
across calls: :class:`PrefixStore` (a step's prefilled contexts) and :class:`LiveRows` (episodes' caches).
Functional core (no jit inside): :mod:`passrate_jax.sampling.core` (``prefill``, ``decode``) and
:mod:`passrate_jax.sampling.distributions` (``filter_logits``, ``sample_tokens``).
The slot engine (continuous batching, docs/engine.md): :class:`SlotEngine` / ``SlotPool`` over the pure
:mod:`passrate_jax.sampling.engine` (``init_slots``, ``insert``, ``generate_chunk``, ``extend``).
"""

import importlib

from passrate_jax.sampling.config import SamplingConfig

# passrate_jax.run.config imports sampling.config while the sampler imports passrate_jax.run.config (via
# sharding): the heavy names load on first use so that importing the config tree stays acyclic.
_LAZY = {"Sampler": "sampler", "Context": "rows", "SampleResult": "rows", "training_rows": "rows", "bucket": "rows",
         "PrefixStore": "prefix_store", "LiveRows": "prefix_store", "filter_logits": "distributions",
         "sample_tokens": "distributions", "SlotEngine": "slot_pool", "SlotPool": "slot_pool",
         "Continue": "slot_pool"}


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(f"passrate_jax.sampling.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'passrate_jax.sampling' has no attribute {name!r}")


__all__ = ["SamplingConfig", *_LAZY]
