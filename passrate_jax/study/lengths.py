"""Answer lengths for the simulator: how many tokens each simulated rollout decodes.

Three distributions (``sim.lengths``), each drawn from one uniform number per rollout (so that every
method, in both rollout modes, sees the same length for the same rollout), given its outcome:

* ``table`` (default): the default preset's measured answer lengths
  (``answer_lengths_default.json``, written by ``benchmarks/answer_lengths.py`` from a real run of
  configs/default.yaml, the command stored in the file): one histogram for successful answers and one
  for failed ones, so the measured correlation of length with reward is kept.
* ``lognormal``: a long tail, median ``sim.length_median`` tokens and log-sd ``sim.length_sigma``
  (p99 / median = exp(2.326 sigma): 6.4 at the default 0.8).
* ``constant``: every answer ``sim.length_median`` tokens (the equivalence of the two modes).

``sim.length_fail_factor`` multiplies a failed answer's length (> 1: wrong answers run longer), and
every length is clipped to [1, token limit]. A Prefix Sampling re-rollout continues a replayed prefix
cut at ratio r, so it decodes (1 - r) of a drawn length (at least 1 token).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os

import jax.numpy as jnp
import numpy as np
from jax.scipy.special import ndtri

from passrate_jax.configlib import ConfigError

TABLE_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "answer_lengths_default.json")
KINDS = ("table", "lognormal", "constant")


@functools.lru_cache(maxsize=None)
def read_table(path: str = TABLE_PATH) -> dict:
    """The stored length table (see ``benchmarks/answer_lengths.py``)."""
    with open(path) as f:
        return json.load(f)


@dataclasses.dataclass(frozen=True)
class LengthModel:
    """Static description of a length distribution (hashable: a jit constant). ``limit``: the token
    limit; ``success_cdf`` / ``failure_cdf``: for ``table``, the CDF over lengths 1 .. len(cdf)."""
    kind: str
    limit: int
    median: float = 38.0
    sigma: float = 0.8
    fail_factor: float = 1.0
    success_cdf: tuple[float, ...] = ()
    failure_cdf: tuple[float, ...] = ()

    @classmethod
    def build(cls, kind: str, limit: int, median: float, sigma: float, fail_factor: float,
              path: str = TABLE_PATH) -> LengthModel:
        if kind not in KINDS:
            raise ConfigError(f"sim.lengths = {kind!r}: must be one of {', '.join(KINDS)}")
        if kind != "table":
            return cls(kind, limit, median, sigma, fail_factor)
        data = read_table(path)
        ok, bad = np.asarray(data["success_counts"], float), np.asarray(data["failure_counts"], float)
        pooled = ok + bad
        cdf = lambda c: tuple(np.cumsum(c / c.sum()).round(6).tolist())  # noqa: E731
        return cls(kind, limit, median, sigma, fail_factor, cdf(ok if ok.sum() else pooled),
                   cdf(bad if bad.sum() else pooled))


def draw_lengths(model: LengthModel, u, success, cut=None):
    """Tokens decoded by each rollout, int32 of ``u``'s shape: ``u`` uniform draws in [0, 1), ``success``
    the rollouts' outcomes (bool or 0/1), ``cut`` (optional, broadcast) the replayed prefix ratio of a
    re-rollout (0 for a fresh rollout)."""
    success = jnp.asarray(success).astype(bool)
    if model.kind == "table":
        ok, bad = jnp.asarray(model.success_cdf), jnp.asarray(model.failure_cdf)
        length = 1 + jnp.where(success, jnp.searchsorted(ok, u, side="right"),
                               jnp.searchsorted(bad, u, side="right"))
        length = length.astype(jnp.float32)
    elif model.kind == "lognormal":
        length = model.median * jnp.exp(model.sigma * ndtri(jnp.clip(u, 1e-7, 1 - 1e-7)))
    else:
        length = jnp.full(jnp.shape(u), model.median, jnp.float32)
    length = length * jnp.where(success, 1.0, model.fail_factor)
    if cut is not None:
        length = length * (1 - cut)
    return jnp.clip(jnp.round(length), 1, model.limit).astype(jnp.int32)
