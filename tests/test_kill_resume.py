"""kill -9 at any moment, with the shipped checkpoint defaults (asynchronous Orbax saves), then resume:
the run equals an uninterrupted one on every metrics.jsonl row (timings and compile counts aside) and
in its final parameters, bit for bit on CPU, with no step recorded twice or missing.

One interrupted run is killed three times, at three kinds of moment, and resumed after each:
  1. before its first checkpoint (a resume then starts afresh and must drop the records written);
  2. between checkpoints (the resume repeats the steps after the last complete one);
  3. inside a real asynchronous Orbax save: the process is killed while Orbax's temporary checkpoint
     directory exists (checked after the kill), so the save never completes.
The verifier is the deterministic hash of tests/test_train_e2e.py so groups are mixed on a tiny model.
"""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np

from passrate_jax.run.checkpoint import RunCheckpointer
from passrate_jax.run.metrics import read_jsonl
from tests.conftest import saved_params
from tests.test_train_e2e import TINY, _comparable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 6
# The shipped checkpoint defaults (async_save=true, keep=3) except how often: every 2 steps leaves
# room between checkpoints.
OVERRIDES = [o for o in TINY if not o.startswith("checkpoint.")] + [
    f"steps={STEPS}", "allocation.method=sara", "prefix_sampling.enabled=true",
    "allocation.selection.method=dps", "checkpoint.every_steps=2"]
TMP_MARK = ".orbax-checkpoint-tmp"


def _cmd(run_dir):
    code = ("import sys, tests.test_train_e2e as t; from passrate_jax.run.session import Session;"
            "Session.score = lambda self, r, x: t.hash_reward(r, x);"
            "from passrate_jax.cli.main import main; sys.exit(main(sys.argv[1:]))")
    return [sys.executable, "-c", code, "train", "--run-dir", str(run_dir), "--no-progress", *OVERRIDES]


def _env(cache_dir):
    # A persistent compilation cache shared by the five processes: the same executables, less compiling.
    return dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=str(cache_dir),
                JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")


def _steps_written(run_dir):
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    lines = path.read_text().splitlines(keepends=True)
    return [json.loads(line)["step"] for line in lines if line.endswith("\n")]  # complete lines only


def _checkpoint_names(run_dir):
    path = run_dir / "checkpoints"
    return os.listdir(path) if path.is_dir() else []


def _kill_when(run_dir, env, moment):
    """Start the run, SIGKILL it as soon as ``moment(run_dir)`` holds (polled every millisecond)."""
    proc = subprocess.Popen(_cmd(run_dir), cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.time() + 600
    while proc.poll() is None and time.time() < deadline:
        if moment(run_dir):
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.001)
    out = proc.communicate(timeout=60)[0].decode()
    assert proc.returncode == -signal.SIGKILL, f"the run ended before the moment it was to be killed at:\n{out[-3000:]}"


def _latest_checkpoint(run_dir):
    ckpt = RunCheckpointer(run_dir)
    try:
        return ckpt.latest_step()
    finally:
        ckpt.close()


def test_kill_9_at_three_moments_then_resume_equals_uninterrupted_run(tmp_path):
    env = _env(tmp_path / "jax_cache")
    full, cut = tmp_path / "full", tmp_path / "cut"
    subprocess.run(_cmd(full), check=True, cwd=ROOT, env=env, timeout=600, capture_output=True)

    # 1. Before the first checkpoint: step 1's record is written, no checkpoint exists.
    _kill_when(cut, env, lambda d: 1 in _steps_written(d))
    assert _latest_checkpoint(cut) is None and _steps_written(cut)[:2] == [0, 1]
    # 2. Between checkpoints: step 2's checkpoint is complete, step 3 is recorded, 4 is not reached.
    _kill_when(cut, env, lambda d: 3 in _steps_written(d) and "2" in _checkpoint_names(d))
    assert _latest_checkpoint(cut) == 2
    # 3. Inside the asynchronous save of step 4 (or 6): Orbax's temporary directory exists.
    _kill_when(cut, env, lambda d: any(n.endswith(TMP_MARK) and int(n.split(".")[0]) >= 4
                                       for n in _checkpoint_names(d)))
    assert any(n.endswith(TMP_MARK) for n in _checkpoint_names(cut)), "the kill missed the save"
    assert _latest_checkpoint(cut) in (2, 4)

    out = subprocess.run(_cmd(cut), check=True, cwd=ROOT, env=env, timeout=600, capture_output=True, text=True)
    assert "resuming" in out.stdout + out.stderr
    a, b = read_jsonl(full / "metrics.jsonl"), read_jsonl(cut / "metrics.jsonl")
    assert [r["step"] for r in b] == list(range(STEPS + 1))  # nothing duplicated, nothing missing
    assert _comparable(a) == _comparable(b)
    assert sum(r.get("groups_trained", 0) > 0 for r in a) >= 2  # the compared steps did update the model
    for x, y in zip(saved_params(full, STEPS), saved_params(cut, STEPS)):
        np.testing.assert_array_equal(x, y)
