"""Speed of the allocation simulator: a sweep grid of one method's knobs, vmapped, after its compile.

    python benchmarks/simulator.py --json                 # SARA (fill), 10 x 10 (tau_abandon, tau_confirm)
    python benchmarks/simulator.py --method uniform+ps --grid gains

Default simulator (200 steps, 512 prompts, B = 8, N = 8, 5 seeds): the grid's 100 settings x 5 seeds run
as vmapped calls, the grid split into ``--threads`` equal parts (default: one per core) run on threads
(``passrate_jax.study.sweep.run_grid``). Reported: the compile (wall), then the run after it
(wall and process CPU seconds, best of ``--repeats``), and ``load_avg_1m`` (the machine is shared). The
whole ``passrate-jax simulate`` reports its own ``wall_s``.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from passrate_jax.allocation.config import AllocationConfig, PrefixSamplingConfig
from passrate_jax.study.simulate import SimulatorConfig
from passrate_jax.study.sweep import base_knobs, compile_grid, run_parts, sweep_knobs


def grid_knobs(base, grid: str):
    """A 10 x 10 grid of two of ``base``'s knobs (flattened to 100 settings)."""
    if grid == "thresholds":
        a, c = np.meshgrid(np.linspace(0.2, 0.75, 10), np.linspace(0.6, 0.99, 10), indexing="ij")
        return sweep_knobs(base, tau_abandon=a.ravel(), tau_confirm=c.ravel())
    eta, rho = np.meshgrid(np.linspace(0.01, 0.2, 10), np.linspace(0.5, 0.98, 10), indexing="ij")
    return sweep_knobs(base, gains_step=eta.ravel(), gains_ema_decay=rho.ravel())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--method", default="sara")
    parser.add_argument("--grid", choices=("thresholds", "gains"), default="thresholds")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="parts of the grid run at once (default: CPUs)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    sim, alloc, ps = SimulatorConfig(), AllocationConfig(), PrefixSamplingConfig()
    knobs = grid_knobs(base_knobs(args.method, sim, alloc, ps), args.grid)
    start = time.perf_counter()
    compiled, parts, rest = compile_grid(args.method, sim, alloc, ps, knobs, args.threads)
    compile_s = time.perf_counter() - start
    walls, cpus = [], []
    for _ in range(args.repeats):
        start, cpu = time.perf_counter(), time.process_time()
        out = run_parts(compiled, parts, rest)
        walls.append(time.perf_counter() - start)
        cpus.append(time.process_time() - cpu)
    valid = np.asarray(out["valid"]).sum(-1)
    rpv = np.asarray(out["spent"]).sum(-1).mean(-1) / np.maximum(valid.mean(-1), 1)
    report = {"method": args.method, "grid": args.grid, "settings": int(valid.shape[0]), "threads": len(parts),
              "seeds": sim.seeds, "steps": sim.steps, "num_prompts": sim.num_prompts, "compile_s": round(compile_s, 2),
              "run_s": round(min(walls), 2), "run_cpu_s": round(min(cpus), 2),
              "rollouts_per_valid_group_range": [round(float(rpv.min()), 2), round(float(rpv.max()), 2)],
              "load_avg_1m": round(os.getloadavg()[0], 2)}
    print(json.dumps(report) if args.json else "\n".join(f"{k}: {v}" for k, v in report.items()))


if __name__ == "__main__":
    main()
