"""The slot engine on 8 fake CPU devices (rows split over the data axes, parameters over fsdp and
tensor) gives the same rollouts as on one device; the device count is fixed when jax initialises, so
the comparison runs in a subprocess (as tests/test_sampling_sharded.py does for round mode)."""

import json
import os
import subprocess
import sys

SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import jax
from passrate_jax.run.config import MeshConfig
from passrate_jax.sampling import Sampler
from passrate_jax.sharding import make_mesh
from test_engine_slots import GREEDY, SAMPLE, engine_rollouts
from test_sampling import EOS, tiny_model

assert len(jax.devices()) == 8, jax.devices()
meshes = {"1": make_mesh(MeshConfig(), jax.devices()[:1]), "data8": make_mesh(MeshConfig()),
          "2x2x2": make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))}
out = {}
for name, mesh in meshes.items():
    for scan in (True, False):
        for cfg_name, cfg in (("greedy", GREEDY), ("sampled", SAMPLE)):
            sampler = Sampler(tiny_model(scan_layers=scan), cfg, eos_id=EOS, mesh=mesh)
            sampler.reserve_store(8, 32)
            pool, got = engine_rollouts(sampler, seed=5)
            out[f"{name} scan={scan} {cfg_name}"] = {
                "rows": pool.engine.rows, "chunks": pool.chunks,
                "rollouts": {f"{k[0]}/{k[1]}": f.ids for k, f in sorted(got.items())},
                "lp": {f"{k[0]}/{k[1]}": f.policy_logprobs.tolist() for k, f in sorted(got.items())}}
print("RESULT" + json.dumps(out))
"""


def test_engine_on_eight_fake_devices_matches_one_device():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.run([sys.executable, "-c", SCRIPT, tests_dir], env=env, capture_output=True, text=True,
                          timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.split("RESULT", 1)[1])
    assert out["data8 scan=True greedy"]["rows"] == 8 and out["1 scan=True greedy"]["chunks"] > 4
    for cfg_name in ("greedy", "sampled"):
        one = out[f"1 scan=True {cfg_name}"]
        for key, run in out.items():
            if key.endswith(cfg_name):
                assert run["rollouts"] == one["rollouts"] and run["chunks"] == one["chunks"], key
                assert max(abs(a - b) for k in one["lp"] for a, b in zip(run["lp"][k], one["lp"][k])) < 1e-5, key
