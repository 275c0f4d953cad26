"""Metrics sinks: JSONL records, TensorBoard events, truncation on resume."""

import glob
import math
import os

import jax.numpy as jnp
import numpy as np

from passrate_jax.run.metrics import MetricsWriter, read_jsonl, to_python


def test_to_python():
    assert to_python({"a": jnp.float32(1.5), "b": np.arange(3), "c": float("nan"), "d": (1, jnp.inf)}) == {
        "a": 1.5, "b": [0, 1, 2], "c": None, "d": [1, None]}


def test_jsonl_tensorboard_and_truncation(tmp_path):
    w = MetricsWriter(tmp_path, tensorboard=True)
    for step in range(1, 5):
        w.write({"step": step, "loss": jnp.float32(1.0 / step), "ps": {"ratio": 0.25}, "bad": math.inf})
    w.close()
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert records[1]["loss"] == 0.5 and records[0]["ps"] == {"ratio": 0.25} and records[0]["bad"] is None
    events = glob.glob(os.path.join(tmp_path, "tensorboard", "events.out.tfevents.*"))
    assert events and os.path.getsize(events[0]) > 0
    # Resuming from the checkpoint of step 2 drops steps 3 and 4 before appending.
    w = MetricsWriter(tmp_path, tensorboard=False, truncate_after=2)
    w.write({"step": 3, "loss": 9.0})
    w.close()
    assert [(r["step"], r["loss"]) for r in read_jsonl(tmp_path / "metrics.jsonl")] == [(1, 1.0), (2, 0.5), (3, 9.0)]


def test_killed_writes_are_dropped_on_restart(tmp_path):
    path = tmp_path / "metrics.jsonl"
    # A process killed in the middle of writing step 3's record, after step 2's checkpoint.
    path.write_text('{"step": 0}\n{"step": 1}\n{"step": 2}\n{"step": 3, "lo')
    w = MetricsWriter(tmp_path, tensorboard=False, truncate_after=2)
    w.write({"step": 3})
    w.close()
    assert [r["step"] for r in read_jsonl(path)] == [0, 1, 2, 3]
    # A run killed before its first checkpoint starts afresh: its step-0 record is not kept twice.
    w = MetricsWriter(tmp_path, tensorboard=False, truncate_after=-1)
    w.write({"step": 0})
    w.close()
    assert [r["step"] for r in read_jsonl(path)] == [0]
    assert os.listdir(tmp_path) == ["metrics.jsonl"]  # the atomic rewrite leaves no temporary file


def test_remote_run_directory_is_rewritten_whole(tmp_path, monkeypatch):
    # gs:// has no append: the writer keeps the records and rewrites the file (exercised on a local path).
    from passrate_jax.run import metrics
    monkeypatch.setattr(metrics, "is_remote", lambda path: True)
    w = metrics.MetricsWriter(tmp_path, tensorboard=False)
    assert w._file is None
    for step in range(1, 4):
        w.write({"step": step, "x": float(step)})
    w.close()
    assert [r["step"] for r in metrics.read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 3]
    w = metrics.MetricsWriter(tmp_path, tensorboard=False, truncate_after=2)  # a resume from step 2
    w.write({"step": 3, "x": 30.0})
    w.close()
    assert [(r["step"], r["x"]) for r in metrics.read_jsonl(tmp_path / "metrics.jsonl")] == [(1, 1.0), (2, 2.0),
                                                                                            (3, 30.0)]
