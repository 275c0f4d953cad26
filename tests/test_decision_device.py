"""Where the allocation machine runs (``passrate_jax.allocation.step.decision_device``): on the host's CPU
where the allocator state lives on an accelerator, so that its programs do not queue behind the decoding;
with the state on a CPU-only run, however many CPU devices it has. A machine run on another device than
the state's makes the same decisions and hands the state back where it was. Two CPU devices exist only if
JAX starts with them, so that part runs in a subprocess."""

import json
import os
import subprocess
import sys
import types

import jax

from passrate_jax.allocation.step import host_cpu_beside

SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import jax
import numpy as np
from passrate_jax.allocation import Result
from passrate_jax.allocation.step import StepRun
from test_allocation_allocator import RATES, make

d0, d1 = jax.devices()
devices = lambda tree: sorted({str(d) for x in jax.tree.leaves(tree) if isinstance(x, jax.Array) for d in x.devices()})
out = {}
for method in ("sara",):  # the device is the same mechanism for every policy; SARA decides the most per step
    runs = {}
    for where, device in (("machine_on_d1", d1), ("default", None)):
        allocator = make(method)
        state = jax.device_put(allocator.init(jax.random.PRNGKey(0)), d0)
        rng, log, seen, apart = np.random.default_rng(0), [], [], []
        for _ in range(3):
            run = allocator.start_step(state) if device is None else StepRun(allocator.setup, allocator.knobs, state,
                                                                              device)
            seen.append(devices(run.state))
            apart.append(run.apart)
            while reqs := run.requests():
                log += [(r.group_key, r.prompt_id, r.num_rollouts) for r in reqs]
                run.observe([Result(r.group_key, tuple(int(x) for x in rng.random(r.num_rollouts) < RATES[r.prompt_id]))
                             for r in reqs])
            res, state = run.finish()
            log.append([(g.group_key, g.rewards) for g in res.groups])
        runs[where] = {"log": log, "machine": seen, "apart": apart, "state_after": devices(state)}
    out[method] = runs
print("RESULT" + json.dumps(out))
"""


class _Device(types.SimpleNamespace):
    __hash__ = object.__hash__


def test_the_machine_goes_to_the_host_cpu_only_beside_an_accelerator():
    gpu = _Device(platform="gpu")
    assert host_cpu_beside({gpu}) == jax.local_devices(backend="cpu")[0]
    assert host_cpu_beside({gpu, jax.devices("cpu")[0]}) is None  # a CPU device decodes: nothing is apart
    assert host_cpu_beside({jax.devices("cpu")[0]}) is None and host_cpu_beside(set()) is None


def test_a_machine_on_another_device_decides_alike_and_hands_the_state_back():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.run([sys.executable, "-c", SCRIPT, tests_dir], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.split("RESULT", 1)[1])
    for method in ("sara",):
        moved, default = out[method]["machine_on_d1"], out[method]["default"]
        assert moved["machine"] == [["cpu:1"]] * 3 and moved["apart"] == [True] * 3, method
        # Two CPU devices: a CPU-only run, so by default the machine stays with the state.
        assert default["machine"] == [["cpu:0"]] * 3 and default["apart"] == [False] * 3, method
        assert moved["state_after"] == default["state_after"] == ["cpu:0"], method
        assert moved["log"] == default["log"], method
