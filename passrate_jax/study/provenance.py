"""Which arithmetic made a study run, so that a seed's runs are compared only when one machine made them.

A study pairs its methods within a seed: same warm start, same random streams, different allocation. That
holds only if every run of the seed computes with the same floating-point arithmetic. XLA compiles for
the machine it runs on (its CPU's instructions, XLA's version and flags), and one flipped sampled token
sends a run down another trajectory. Study v4 met exactly this: runs of one seed made a day apart, by the
same code and the same jax, drew different rollouts from step 1 (docs/results.md, *Why v5*).

So each study run records, once per attempt (a run resumed elsewhere records both), a **numerics
fingerprint**: the bits of a fixed computation (a small transformer's log-probabilities and tokens drawn
from them, one compiled program) under this process's JAX settings, hashed. Two machines with the same
fingerprint compute these programs alike; different fingerprints mean a seed's runs are not paired, and
the analysis leaves that seed out of the comparisons between them (:func:`unpaired_seeds`). Runs made
before this record existed have none and are taken as paired (the report says how many).
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import json
import os
import platform

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from passrate_jax import __version__
from passrate_jax.model.config import ModelConfig
from passrate_jax.model.factory import create_model

FILE = "provenance.jsonl"


@functools.cache
def numerics_fingerprint() -> str:
    """16 hex digits: the hash of a default-shaped model's log-probabilities on fixed tokens and of the
    tokens drawn from them with a fixed key (about a second, once per process)."""
    cfg = ModelConfig()
    graphdef, state = nnx.split(create_model(cfg, seed=0))
    tokens = (np.arange(4 * 48, dtype=np.int32).reshape(4, 48) * 7) % cfg.vocab_size

    @jax.jit
    def probe(state, tokens):
        logprobs = jax.nn.log_softmax(nnx.merge(graphdef, state)(tokens).astype(jnp.float32), axis=-1)
        return logprobs, jax.random.categorical(jax.random.key(0), logprobs)

    logprobs, drawn = jax.device_get(probe(state, tokens))
    return hashlib.sha256(np.asarray(logprobs).tobytes() + np.asarray(drawn).tobytes()).hexdigest()[:16]


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")
    except OSError:
        return platform.processor() or "?"


def record(run_dir: str) -> dict:
    """Append this attempt's provenance to ``run_dir``'s record and return it."""
    entry = {"numerics": numerics_fingerprint(), "time": datetime.datetime.now(datetime.UTC).isoformat(
        timespec="seconds"), "platform": platform.platform(), "cpu": _cpu_model(), "cores": os.cpu_count(),
        "backend": jax.default_backend(), "jax": jax.__version__, "passrate_jax": __version__,
        "xla_flags": os.environ.get("XLA_FLAGS", "")}
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, FILE), "a") as f:
        f.write(json.dumps(entry) + "\n")
    return entry


def fingerprints(run_dir: str) -> frozenset[str]:
    """The numerics fingerprints of every attempt of a run (empty: made before runs recorded them)."""
    path = os.path.join(run_dir, FILE)
    if not os.path.exists(path):
        return frozenset()
    with open(path) as f:
        return frozenset(json.loads(line)["numerics"] for line in f if line.strip())


def load_fingerprints(plan, runs: dict[str, dict[int, list[dict]]]) -> dict[str, dict[int, frozenset[str]]]:
    """method -> seed -> fingerprints, for the runs of ``plan`` the analysis read (``analysis.load_runs``)."""
    return {m: {s: fingerprints(plan.run_dir(m, s)) for s in by_seed} for m, by_seed in runs.items()}


def unpaired_seeds(prints: dict[str, dict[int, frozenset[str]]], method: str, base: str) -> list[int]:
    """Seeds on which ``method``'s and ``base``'s runs were not computed alike: together their attempts
    carry more than one fingerprint. A run with no record counts as agreeing (made before the record)."""
    a, b = prints.get(method, {}), prints.get(base, {})
    return sorted(s for s in set(a) & set(b) if len(a[s] | b[s]) > 1)


def pairing_lines(prints: dict[str, dict[int, frozenset[str]]], label) -> list[str]:
    """The report's paragraph on pairing: how many runs recorded a fingerprint, and every seed whose runs
    disagree, with the methods under each fingerprint (``label``: a method's display name)."""
    runs = [(m, s, frozenset(f)) for m, by_seed in prints.items() for s, f in by_seed.items()]
    if not runs:
        return []
    recorded = [r for r in runs if r[2]]
    text = (f"**Pairing**: {len(recorded)} of {len(runs)} runs recorded the numerics fingerprint of the machine "
            "that made them (`passrate_jax/study/provenance.py`; the others were made before runs recorded it)")
    if not recorded:
        return [text + ": nothing here checks that a seed's runs were computed alike.", ""]
    groups: dict[int, dict[frozenset[str], list[str]]] = {}  # seed -> a run's fingerprints -> its methods
    for m, s, f in recorded:
        groups.setdefault(s, {}).setdefault(f, []).append(label(m))
    mixed = [f"seed {s}: " + "; ".join(f"`{' + '.join(sorted(f))}` {', '.join(ms)}" for f, ms in g.items())
             for s, g in sorted(groups.items()) if len(g) > 1 or any(len(f) > 1 for f in g)]
    if not mixed:
        return [text + "; every seed's recorded runs share one.", ""]
    return [text + ". **Seeds whose runs were computed differently** (each comparison leaves out the seeds on "
            "which its two methods disagree): " + " | ".join(mixed) + ".", ""]
