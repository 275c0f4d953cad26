"""Multi-process training on localhost CPU with ``jax.distributed`` (Gloo collectives): two processes with
one device each must train exactly like one process with two devices and the same global batch."""

import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

from passrate_jax.checkpoint import RunCheckpointer
from passrate_jax.metrics import read_jsonl
from tests.test_train_e2e import TINY, _comparable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _cmd(run_dir, *extra):
    overrides = TINY + [f"steps={STEPS}", "allocation.method=sara", "prefix_sampling.enabled=true",
                        "mesh.data=2", "mesh.devices=2", "checkpoint.every_steps=1", *extra]
    code = ("import sys, tests.test_train_e2e as t; from passrate_jax.session import Session;"
            "Session.score = lambda self, r, x: t.hash_reward(r, x);"
            "from passrate_jax.cli import main; sys.exit(main(sys.argv[1:]))")
    return [sys.executable, "-c", code, "train", "--run-dir", str(run_dir), "--no-progress", *overrides]


def _env(devices: int) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    env.pop(("PASSRATE_JAX_DISTRIBUTED"), None)
    return env


def _params(run_dir):
    ckpt = RunCheckpointer(run_dir)
    assert ckpt.latest_step() == STEPS
    state, _ = ckpt.restore_saved(STEPS)
    ckpt.close()
    return [np.asarray(x) for x in jax.tree.leaves(state["params"])]


def test_two_processes_train_like_one(tmp_path):
    single, multi = tmp_path / "single", tmp_path / "multi"
    subprocess.run(_cmd(single), check=True, cwd=ROOT, env=_env(2), timeout=600, capture_output=True)

    address = f"localhost:{_free_port()}"
    procs = [subprocess.Popen(_cmd(multi, "distributed.initialize=true", f"distributed.coordinator_address={address}",
                                   "distributed.num_processes=2", f"distributed.process_id={i}"),
                              cwd=ROOT, env=_env(1), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    outputs = []
    for p in procs:
        try:
            outputs.append(p.communicate(timeout=600)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("a distributed training process hung")
    for i, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"process {i} failed:\n{out[-3000:]}"
    # One voice: only process 0 logs the run summary.
    assert "run " in outputs[0] and "run " not in outputs[1]

    a, b = read_jsonl(single / "metrics.jsonl"), read_jsonl(multi / "metrics.jsonl")
    assert [r["step"] for r in b] == list(range(STEPS + 1))  # written once, by process 0
    assert _comparable(a) == _comparable(b)
    for x, y in zip(_params(single), _params(multi), strict=True):
        np.testing.assert_array_equal(x, y)


def test_partial_coordinator_settings_fail_before_compute():
    from passrate_jax.config import load_config
    from passrate_jax.configlib import ConfigError
    with pytest.raises(ConfigError, match="num_processes = 2"):
        load_config(None, ["distributed.num_processes=2"])
    with pytest.raises(ConfigError, match="process_id = 2"):
        load_config(None, ["distributed.coordinator_address=h:1", "distributed.num_processes=2",
                           "distributed.process_id=2"])


def test_mesh_laid_out_for_another_slice_is_refused():
    from passrate_jax.config import MeshConfig
    from passrate_jax.sharding import make_mesh
    with pytest.raises(ValueError, match=f"mesh.devices = 64: .* this run has {jax.device_count()}"):
        make_mesh(MeshConfig(data=-1, devices=64))


def test_hosts_that_disagree_are_detected(monkeypatch):
    from jax.experimental import multihost_utils

    from passrate_jax import distributed
    # Simulate a second host whose decisions differ: the gathered fingerprints disagree.
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(multihost_utils, "process_allgather",
                        lambda x: np.stack([x, distributed.fingerprint("something else")]))
    with pytest.raises(RuntimeError, match=r"step 3 differs between hosts \(processes \[1\]"):
        distributed.check_same_on_every_host("step 3", [1, 0, 1])
    monkeypatch.setattr(multihost_utils, "process_allgather", lambda x: np.stack([x, x]))
    distributed.check_same_on_every_host("step 3", [1, 0, 1])
