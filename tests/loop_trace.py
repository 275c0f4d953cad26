"""Run ``train`` on the real path and write a trace of what each step decided, for comparisons between
device layouts (tests/test_sharding_loop.py, tests/test_multihost.py).

    python -m tests.loop_trace OUT.json RUN_DIR CONFIG [overrides ...] [--mesh data,fsdp,tensor ...]

Each ``--mesh`` runs the same config once more on that mesh (in this process, so the fake device
count is set once); the trace holds, per run and per step, every rollout's generated tokens
(replayed prefix included) and reward, the length of every rollout the slot engine decoded (scored,
aborted or an unused guess), the allocator's decisions (trained groups with their success
bits and prefix, abandoned groups, rounds), the ``metrics.jsonl`` records and the final parameters.
Nothing is replaced: the wrapper only reads what the run's rollout loop (``collect_rollouts`` in round mode,
``collect_rollouts_events`` on the slot engine) returned.
"""

import json
import sys

import jax
import numpy as np

from passrate_jax import distributed
from passrate_jax.run import train as train_module
from passrate_jax.run.config import load_config
from passrate_jax.run.metrics import read_jsonl


class _RecordingStream:
    """A slot-engine stream that notes the length of every rollout it decoded, scored or not (aborted,
    unused guesses): a flip in a rollout that is never scored changes only the pool's counters, and the
    comparison must see it to tell that apart from a real divergence."""

    def __init__(self, stream, decoded: list):
        self._stream, self._decoded = stream, decoded

    def __getattr__(self, name):
        return getattr(self._stream, name)

    def advance(self):
        out = self._stream.advance()
        self._decoded += [[repr(tag), int(i), int(self._stream.length(r))] for tag, i, r in out]
        return out

    def abort(self):
        out = self._stream.abort()
        self._decoded += [[repr(tag), int(i), int(tokens)] for tag, i, tokens in out]
        return out


def _traced_collect(steps: list, original):
    def collect(allocator, state, backend, params, *, seed):
        decoded: list = []
        if hasattr(backend, "stream"):
            plain = backend.stream
            backend.stream = lambda p, s, **kw: _RecordingStream(plain(p, s, **kw), decoded)
        try:
            ro = original(allocator, state, backend, params, seed=seed)
        finally:
            if hasattr(backend, "stream"):
                del backend.stream
        t = ro.table
        steps.append({
            "rollouts": [[int(k), int(i), int(r), backend.store.response(int(k), int(i)) if seen else None]
                         for k, i, r, seen in zip(t["group_key"], t["index"], t["reward"], t["observed"])],
            "groups": [[g.group_key, g.prompt_id, list(g.rewards), None if g.prefix is None else
                        [g.prefix.source_group, g.prefix.source_rollout, float(g.prefix.cut_ratio)]]
                       for g in ro.result.groups],
            "abandoned": sorted([int(x) for x in a] for a in ro.result.abandoned), "rounds": int(ro.result.rounds),
            "decoded": sorted(decoded)})
        return ro
    return collect


def trace_run(config: str, overrides: list[str], run_dir: str) -> dict:
    steps: list = []
    cfg = load_config(config, overrides)
    # The loop of the run's engine: round mode's or the slot engine's (the default).
    name = "collect_rollouts_events" if cfg.sampling.engine == "slots" else "collect_rollouts"
    original = getattr(train_module, name)
    setattr(train_module, name, _traced_collect(steps, original))
    try:
        summary = train_module.train(cfg, run_dir, progress=False, log=lambda *a: None)
    finally:
        setattr(train_module, name, original)
    assert len(steps) == len(read_jsonl(f"{run_dir}/metrics.jsonl")) - 1, "the trace missed the run's steps"
    leaves = jax.tree.leaves(summary["params"])
    # The mesh axes the parameters are really split over (none for pure data parallelism).
    axes = sorted({a for x in leaves for spec in x.sharding.spec if spec for a in
                   ((spec,) if isinstance(spec, str) else spec)})
    params = [np.asarray(x).tolist() for x in jax.tree.leaves(distributed.to_host(leaves))]
    return {"devices": jax.device_count(), "param_axes": axes, "steps": steps,
            "records": read_jsonl(f"{run_dir}/metrics.jsonl"), "params": params}


def main(argv: list[str]) -> None:
    out, run_dir, config, *rest = argv
    meshes = [rest[i + 1] for i, a in enumerate(rest) if a == "--mesh"]
    overrides = [a for i, a in enumerate(rest) if a != "--mesh" and (i == 0 or rest[i - 1] != "--mesh")]
    runs = {}
    for n, mesh in enumerate(meshes or [None]):
        sizes = [] if mesh is None else [f"mesh.{k}={v}" for k, v in zip(("data", "fsdp", "tensor"), mesh.split(","))]
        runs[mesh or "default"] = trace_run(config, overrides + sizes, f"{run_dir}/{n}")
    if distributed.is_primary():
        with open(out, "w") as f:
            json.dump(runs, f)


if __name__ == "__main__":
    main(sys.argv[1:])
