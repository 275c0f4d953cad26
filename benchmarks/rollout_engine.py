"""Round mode against the slot engine on the default preset: seconds per rollout, rollouts and sampler
calls per step, decode slot utilization, per method, in one process from one warm start (cached).

    python benchmarks/rollout_engine.py --json --set sampling.slots=64   # 5 methods x 2 engines, 4 steps, seed 0
    python benchmarks/rollout_engine.py --steps 6 --seeds 0 1 --methods grpo sara_fill --engines slots
    python benchmarks/rollout_engine.py --json --config testbed --methods grpo   # varied answer lengths

Each (method, engine, seed) is a short real training run (``train`` with ``configs/<preset>.yaml``,
evaluation only at the ends, on 64 held-out prompts). A run's first step compiles, so it is left out:
seconds per rollout = ``time/rollout_s`` summed over steps 2..S / rollouts spent over those steps.
Utilization and sampler calls are means over the same steps; ``trained_length`` is the mean length
(tokens) of the answers trained on, the no-length-bias check (the engine's against round mode's).
The ratios the issue names (37, "What it must show") are printed under ``ratios``; ``chunk_ratios``
compares chunks (sampler calls) per rollout spent the same way: a count, the same under any machine
load, which bounds the seconds ratio where a chunk costs the same in every method; ``slot_step_ratios``
compares the rows decoded per rollout (rows a chunk decodes summed over its decode steps: a narrow chunk,
``sampling.narrow_slots``, decodes fewer than the pool's), what a chunk costs on this CPU, where each
costs all the rows it decodes, live or not.

``--host-device`` emulates an accelerator beside its host on this CPU: the process gets two CPU devices,
every run's mesh is the first, and the allocation machine runs on the second, as it runs on the host's
CPU beside a GPU or TPU (``passrate_jax.allocation.step.decision_device``, which keeps it with the state
on a CPU-only run, is replaced here). The two devices still share this machine's cores.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
if "--host-device" in sys.argv:  # before JAX starts: its CPU platform's device count is fixed then
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"

import jax  # noqa: E402

from passrate_jax.allocation import allocator as allocator_module  # noqa: E402
from passrate_jax.rollout import loop as loop_module  # noqa: E402
from passrate_jax.run import session as session_module  # noqa: E402
from passrate_jax.run import train as train_module  # noqa: E402
from passrate_jax.run.config import load_config  # noqa: E402
from passrate_jax.run.metrics import read_jsonl  # noqa: E402

PRESETS = {"grpo": "default", "ds": "ds", "sara_fill": "sara", "sara_fixed": "sara_fixed",
           "pilot_commit": "pilot_commit"}
# Another base config (--config, e.g. testbed: the repair task, whose answer lengths vary, p90 / median
# about 2.1) takes each method as the overrides its default preset makes.
METHOD_OVERRIDES = {"grpo": [], "ds": ["allocation.method=ds"], "sara_fill": ["allocation.method=sara"],
                    "sara_fixed": ["allocation.method=sara", "allocation.sara.mode=fixed_budget"],
                    "pilot_commit": ["allocation.method=pilot_commit", "allocation.pilot_commit.mode=budgeted",
                                     "allocation.pilot_commit.pilot_budget_fraction=0.5",
                                     "allocation.pilot_commit.pilot_fraction=0.5",
                                     "allocation.pilot_commit.p_low=0.25", "allocation.pilot_commit.p_high=0.25"]}
ENGINES = ("rounds", "slots")


def _trained_lengths(store: list):
    """Wrap ``rollout_metrics`` to record the mean generated length of each step's trained answers."""
    original = loop_module.rollout_metrics

    def metrics(allocator, rollouts, backend):
        out = original(allocator, rollouts, backend)
        groups = backend.store.groups
        lengths = [len(groups[g.group_key].trajectories[i]) for g in rollouts.result.groups
                   for i in range(len(g.rewards)) if i in groups[g.group_key].trajectories]
        store.append(float(np.mean(lengths)) if lengths else float("nan"))
        return out
    return original, metrics


def run_one(method: str, engine: str, seed: int, steps: int, extra: list[str], base: str = "default") -> dict:
    overrides = [f"steps={steps}", f"seed={seed}", f"eval_every={steps}", "eval_samples=0", "data.eval_size=64",
                 "logging.tensorboard=false", f"sampling.engine={engine}", *extra]
    preset = PRESETS[method] if base == "default" else base
    if base != "default":
        overrides = METHOD_OVERRIDES[method] + overrides
    cfg = load_config(os.path.join(ROOT, "configs", f"{preset}.yaml"), overrides)
    lengths: list = []
    original, wrapped = _trained_lengths(lengths)
    train_module.rollout_metrics = wrapped
    try:
        with tempfile.TemporaryDirectory() as run_dir:
            t0 = time.perf_counter()
            train_module.train(cfg, run_dir, progress=False, log=lambda *a: None)
            wall = time.perf_counter() - t0
            records = [r for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl")) if r["step"] >= 2]
    finally:
        train_module.rollout_metrics = original
    spent = sum(r["rollouts_step"] for r in records)
    seconds = sum(r["time/rollout_s"] for r in records)
    mean = lambda key: float(np.mean([r[key] for r in records if key in r])) if records else float("nan")  # noqa: E731
    generated = sum(r["rollouts_step"] + r.get("rollouts/speculative_unused", 0) for r in records)
    return {"method": method, "engine": engine, "seed": seed, "config": base, "steps_measured": len(records),
            "s_per_rollout": seconds / max(spent, 1), "rollout_s_per_step": seconds / max(len(records), 1),
            "rollouts_per_step": spent / max(len(records), 1), "generated_per_step": generated / max(len(records), 1),
            "sampler_calls_per_step": mean("sampler_calls"),
            "chunks_per_rollout": sum(r["sampler_calls"] for r in records) / max(spent, 1),
            "narrow_chunks_per_step": mean("sampler_calls/narrow"),
            "slot_steps_per_rollout": sum(r.get("slot_steps", 0) for r in records) / max(spent, 1),
            "slot_utilization": mean("slot_utilization"), "aborted_per_step": mean("rollouts/aborted"),
            "wasted_tokens_per_step": mean("tokens/wasted"), "speculative_per_step": mean("rollouts/speculative"),
            "speculative_unused_per_step": mean("rollouts/speculative_unused"),
            "trained_length": float(np.nanmean(lengths[1:])),
            "valid_group_fraction": mean("valid_group_fraction"), "wall_s": wall}


def ratios(rows: list[dict], key: str = "s_per_rollout") -> dict:
    """``key`` (seconds per rollout by default) of each method and engine against GRPO's, each averaged
    over seeds first."""
    spr = {}
    for r in rows:
        spr.setdefault((r["method"], r["engine"]), []).append(r[key])
    spr = {k: float(np.mean(v)) for k, v in spr.items()}
    out = {}
    for (method, engine), value in spr.items():
        for base in ENGINES:
            if ("grpo", base) in spr:
                out[f"{method}[{engine}] / grpo[{base}]"] = value / spr[("grpo", base)]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", nargs="+", default=list(PRESETS), choices=list(PRESETS))
    p.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES))
    p.add_argument("--steps", type=int, default=4, help="steps per run; step 1 (compiles) is not measured")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--config", default="default", help="base config: default (each method's preset) or a file "
                   "in configs/ (e.g. testbed: varied answer lengths) with each method's overrides")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--set", nargs="*", default=[], dest="overrides", metavar="KEY=VALUE",
                   help="config overrides for every run, e.g. --set sampling.slots=64")
    p.add_argument("--host-device", action="store_true", help="two CPU devices: the runs on the first, the "
                   "allocation machine on the second (an accelerator beside its host, emulated)")
    args = p.parse_args(argv)
    if args.host_device:
        if len(jax.devices()) < 2:
            raise SystemExit("--host-device: JAX started with one CPU device; pass the flag on the command line")
        make_mesh = session_module.make_mesh
        session_module.make_mesh = lambda cfg, devices=None: make_mesh(cfg, devices or jax.devices()[:1])
        allocator_module.decision_device = lambda state: jax.devices()[1]
    rows = []
    for seed in args.seeds:
        for method in args.methods:
            for engine in args.engines:
                rows.append(run_one(method, engine, seed, args.steps, args.overrides, args.config))
                print(json.dumps(rows[-1]), file=sys.stderr if args.json else sys.stdout, flush=True)
    result = {"command": "python benchmarks/rollout_engine.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "devices": [str(d) for d in jax.devices()],
              "runs": rows, "ratios": ratios(rows), "chunk_ratios": ratios(rows, "chunks_per_rollout"),
              "slot_step_ratios": ratios([r for r in rows if r["engine"] == "slots"], "slot_steps_per_rollout")}
    print(json.dumps(result, indent=1) if args.json else json.dumps(result["ratios"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
