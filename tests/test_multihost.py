"""Multi-process training on localhost CPU with ``jax.distributed`` (Gloo collectives).

Two processes with one device each run the shipped path with a (tiny) supervised warm start; in the slow
test they are both killed with SIGKILL between checkpoints and resumed. The run must equal, bit for bit,
one process with two devices and the same global batch (the same programs on the same mesh shape), and
(slow test) a single-device run of the same global batch within float tolerance: the same rewards and
allocation decisions (every host-side number of ``metrics.jsonl`` exactly), ``update/*`` metrics within
``RTOL`` / ``ATOL``, final parameters within ``PARAM_ATOL``. The verifier is the deterministic hash of
tests/test_train_e2e.py, so a sampled token that flipped between layouts would change a reward and fail
the test: none did.
Measured against one device: ``update/loss`` differs by 1.5e-6 relative (step 2; the other steps are
equal), final parameters by 1.4e-7.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from passrate_jax.run.metrics import read_jsonl
from tests.conftest import saved_params
from tests.test_train_e2e import TINY, _comparable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 4
# TINY with a warm start small enough for a test; checkpoints every 2 steps leave a step to repeat.
OVERRIDES = [o for o in TINY if o != "warm_start.enabled=false"] + [
    "warm_start.steps=8", "data.max_level=1", "warm_start.batch_size=8", "warm_start.max_len=48", f"steps={STEPS}",
    "allocation.method=sara", "prefix_sampling.enabled=true", "checkpoint.every_steps=2"]
RTOL, ATOL = 1e-4, 1e-6  # update/* metrics, one device against two
# Adam's normalisation turns reduction-order noise on gradients near zero (|g| <~ eps) into up to
# lr * |noise| / eps: a tenth of one step at lr 1e-4 still fails a missing or wrong update.
PARAM_ATOL = 1e-5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _cmd(run_dir, devices, *extra):
    # Each run warm-starts itself: its own cache directory, empty at its start.
    overrides = OVERRIDES + [f"mesh.devices={devices}", f"warm_start.cache_dir={run_dir}_cache", *extra]
    code = ("import sys, tests.test_train_e2e as t; from passrate_jax.run.session import Session;"
            "Session.score = lambda self, r, x: t.hash_reward(r, x);"
            "from passrate_jax.cli.main import main; sys.exit(main(sys.argv[1:]))")
    return [sys.executable, "-c", code, "train", "--run-dir", str(run_dir), "--no-progress", *overrides]


def _env(devices: int, cache_dir) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
               JAX_COMPILATION_CACHE_DIR=str(cache_dir), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    env.pop(("PASSRATE_JAX_DISTRIBUTED"), None)
    return env


def _steps_written(run_dir):
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines(keepends=True) if path.exists() else []
    return [json.loads(line)["step"] for line in lines if line.endswith("\n")]


def _checkpoint_names(run_dir):
    path = run_dir / "checkpoints"
    return os.listdir(path) if path.is_dir() else []


def _start_two(run_dir, env):
    address = f"localhost:{_free_port()}"
    return [subprocess.Popen(_cmd(run_dir, 2, "distributed.initialize=true",
                                  f"distributed.coordinator_address={address}", "distributed.num_processes=2",
                                  f"distributed.process_id={i}"),
                             cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for i in range(2)]


def _wait(procs) -> list[str]:
    outputs = []
    for p in procs:
        try:
            outputs.append(p.communicate(timeout=600)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("a distributed training process hung")
    return outputs


def _wait_ok(procs) -> list[str]:
    """Wait for ``procs``; each must exit 0 (else its output's tail is shown)."""
    outputs = _wait(procs)
    for i, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"process {i} failed:\n{out[-3000:]}"
    return outputs


def _kill_both_when(procs, moment) -> list[str]:
    deadline = time.time() + 600
    while all(p.poll() is None for p in procs) and time.time() < deadline:
        if moment():
            for p in procs:
                p.send_signal(signal.SIGKILL)
            break
        time.sleep(0.002)
    outputs = _wait(procs)
    assert all(p.returncode == -signal.SIGKILL for p in procs), \
        "a process ended before the moment it was to be killed at:\n" + outputs[0][-3000:]
    return outputs


def _start_one(run_dir, devices, cache_dir):
    """One process with ``devices`` devices: a reference run."""
    return subprocess.Popen(_cmd(run_dir, devices), cwd=ROOT, env=_env(devices, cache_dir), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _assert_equal_runs(reference, multi):
    """The two-process run equals the one-process, two-device ``reference`` bit for bit: every metrics
    record (written once, by process 0) and the final parameters; and the compared steps did train."""
    a, b = read_jsonl(reference / "metrics.jsonl"), read_jsonl(multi / "metrics.jsonl")
    assert [r["step"] for r in b] == list(range(STEPS + 1))  # written once, by process 0, none twice
    assert _comparable(a) == _comparable(b)
    assert sum(r.get("groups_trained", 0) > 0 for r in a) >= 2  # the compared steps did update the model
    for x, y in zip(saved_params(reference, STEPS), saved_params(multi, STEPS), strict=True):
        np.testing.assert_array_equal(x, y)
    return b


def test_two_processes_train_like_one_process_with_two_devices(tmp_path):
    """The default run's multi-host check: the two processes (warm start included) and the one-process
    reference run side by side, uninterrupted, and must agree bit for bit. The kill-and-resume test
    below adds the single-device comparison and a SIGKILL of both processes; it is the slow one."""
    cache, reference, multi = tmp_path / "jax_cache", tmp_path / "two_devices", tmp_path / "multi"
    outputs = _wait_ok([_start_one(reference, 2, cache), *_start_two(multi, _env(1, cache))])
    assert "warm start: 8 steps" in outputs[1], "the two processes did not warm-start"
    _assert_equal_runs(reference, multi)


@pytest.mark.slow
def test_two_processes_warm_start_kill_and_resume_train_like_one(tmp_path):
    cache = tmp_path / "jax_cache"
    two_devices, one_device, multi = tmp_path / "two_devices", tmp_path / "one_device", tmp_path / "multi"
    _wait_ok([_start_one(d, n, cache) for d, n in ((two_devices, 2), (one_device, 1))])

    # Killed once step 2's checkpoint is complete and step 3 is recorded, before step 4's checkpoint.
    first = _kill_both_when(_start_two(multi, _env(1, cache)), lambda: 3 in _steps_written(multi)
                            and "2" in _checkpoint_names(multi) and "4" not in _checkpoint_names(multi))
    assert "warm start: 8 steps" in first[0], "the two processes did not warm-start"
    outputs = _wait_ok(_start_two(multi, _env(1, cache)))
    # One voice: only process 0 logs the resume and the run summary.
    assert "resuming" in outputs[0] and "run " in outputs[0] and "run " not in outputs[1]

    b = _assert_equal_runs(two_devices, multi)

    c = _comparable(read_jsonl(one_device / "metrics.jsonl"))
    assert len(c) == len(b)
    for one, multi_record in zip(c, _comparable(b)):
        assert one.keys() == multi_record.keys()
        for k, v in one.items():
            if k.startswith("update/"):
                np.testing.assert_allclose(multi_record[k], v, rtol=RTOL, atol=ATOL, err_msg=f"step {one['step']} {k}")
            else:
                assert multi_record[k] == v, f"step {one['step']} {k}: one device {v}, two processes {multi_record[k]}"
    for x, y in zip(saved_params(one_device, STEPS), saved_params(multi, STEPS), strict=True):
        np.testing.assert_allclose(y, x, rtol=0, atol=PARAM_ATOL)


def test_partial_coordinator_settings_fail_before_compute():
    from passrate_jax.run.config import load_config
    from passrate_jax.configlib import ConfigError
    with pytest.raises(ConfigError, match="num_processes = 2"):
        load_config(None, ["distributed.num_processes=2"])
    with pytest.raises(ConfigError, match="process_id = 2"):
        load_config(None, ["distributed.coordinator_address=h:1", "distributed.num_processes=2",
                           "distributed.process_id=2"])


def test_mesh_laid_out_for_another_slice_is_refused():
    from passrate_jax.run.config import MeshConfig
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
