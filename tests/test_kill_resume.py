"""kill -9 at any moment, and Ctrl-C during an asynchronous save, with the shipped checkpoint defaults
(asynchronous Orbax saves), then resume: the run equals an uninterrupted one on every metrics.jsonl row
(timings and compile counts aside) and in its final parameters, bit for bit on CPU, with no step
recorded twice or missing.

One interrupted run is stopped four times, at four kinds of moment, and resumed after each:
  1. SIGKILL before its first checkpoint (a resume then starts afresh and must drop the records written);
  2. SIGKILL between checkpoints (the resume repeats the steps after the last complete one);
  3. SIGKILL inside a real asynchronous Orbax save: the process is killed while Orbax's temporary
     checkpoint directory exists (checked after the kill), so the save never completes;
  4. SIGINT (Ctrl-C) inside a real asynchronous save: the run finishes the step it is in, checkpoints it
     (after the save in flight completes) and exits 0, its last recorded step its latest checkpoint.
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
STEPS = 8
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


def _env():
    # The suite's compile cache (tests/conftest.py exports it) is inherited: the five processes and
    # every other test's runs share their compiled programs.
    return dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")


def _steps_written(run_dir):
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    lines = path.read_text().splitlines(keepends=True)
    return [json.loads(line)["step"] for line in lines if line.endswith("\n")]  # complete lines only


def _checkpoint_names(run_dir):
    path = run_dir / "checkpoints"
    return os.listdir(path) if path.is_dir() else []


def _signal_when(run_dir, env, moment, signum=signal.SIGKILL) -> str:
    """Start the run, send it ``signum`` as soon as ``moment(run_dir)`` holds (polled every millisecond);
    returns its output once it has exited."""
    proc = subprocess.Popen(_cmd(run_dir), cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.time() + 600
    while proc.poll() is None and time.time() < deadline:
        if moment(run_dir):
            proc.send_signal(signum)
            break
        time.sleep(0.001)
    out = proc.communicate(timeout=120)[0].decode()
    want = -signal.SIGKILL if signum == signal.SIGKILL else 0
    assert proc.returncode == want, f"exit code {proc.returncode} where {want} was expected:\n{out[-3000:]}"
    return out


def _saving(step_range, since: float):
    """The moment an asynchronous save of a step in ``step_range`` is in flight: Orbax's temporary
    directory for it written after ``since`` (a killed attempt's leftover one does not count)."""
    def moment(run_dir):
        return any(n.endswith(TMP_MARK) and int(n.split(".")[0]) in step_range
                   and _mtime(run_dir / "checkpoints" / n) > since for n in _checkpoint_names(run_dir))
    return moment


def _mtime(path) -> float:
    try:
        return os.stat(path).st_mtime
    except FileNotFoundError:  # Orbax renamed it in the meantime
        return 0.0


def _latest_checkpoint(run_dir):
    ckpt = RunCheckpointer(run_dir)
    try:
        return ckpt.latest_step()
    finally:
        ckpt.close()


def test_kill_9_at_three_moments_and_ctrl_c_then_resume_equals_uninterrupted_run(tmp_path):
    env = _env()
    full, cut = tmp_path / "full", tmp_path / "cut"
    subprocess.run(_cmd(full), check=True, cwd=ROOT, env=env, timeout=600, capture_output=True)

    # 1. Before the first checkpoint: step 1's record is written, no checkpoint exists.
    _signal_when(cut, env, lambda d: 1 in _steps_written(d))
    assert _latest_checkpoint(cut) is None and _steps_written(cut)[:2] == [0, 1]
    # 2. Between checkpoints: step 2's checkpoint is complete, step 3 is recorded, 4 is not reached.
    _signal_when(cut, env, lambda d: 3 in _steps_written(d) and "2" in _checkpoint_names(d))
    assert _latest_checkpoint(cut) == 2
    # 3. Inside the asynchronous save of step 4 (or 6): Orbax's temporary directory exists.
    _signal_when(cut, env, _saving(range(4, 7), time.time()))
    assert any(n.endswith(TMP_MARK) for n in _checkpoint_names(cut)), "the kill missed the save"
    resumed_from = _latest_checkpoint(cut)
    assert resumed_from in (2, 4)
    # 4. Ctrl-C while the resumed run's next asynchronous save is in flight (step 4 or 6, before the last):
    # the run finishes its step, checkpoints it and exits cleanly.
    out = _signal_when(cut, env, _saving(range(resumed_from + 2, STEPS), time.time()), signal.SIGINT)
    last = _steps_written(cut)[-1]
    assert f"interrupted: checkpoint of step {last} saved" in out and last < STEPS, out[-3000:]
    assert _latest_checkpoint(cut) == last

    out = subprocess.run(_cmd(cut), check=True, cwd=ROOT, env=env, timeout=600, capture_output=True, text=True)
    assert f"from the checkpoint of step {last}" in out.stdout + out.stderr
    a, b = read_jsonl(full / "metrics.jsonl"), read_jsonl(cut / "metrics.jsonl")
    assert [r["step"] for r in b] == list(range(STEPS + 1))  # nothing duplicated, nothing missing
    assert _comparable(a) == _comparable(b)
    assert sum(r.get("groups_trained", 0) > 0 for r in a) >= 2  # the compared steps did update the model
    for x, y in zip(saved_params(full, STEPS), saved_params(cut, STEPS)):
        np.testing.assert_array_equal(x, y)
