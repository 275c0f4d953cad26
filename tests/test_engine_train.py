"""Training on the slot engine end to end (tiny model, the deterministic hash verifier of
tests/test_train_e2e.py): every method trains with its counters, and kill -9 mid-run then resume equals
an uninterrupted run (the engine's decisions depend on rollout lengths and outcomes, never on timing)."""

import subprocess

import numpy as np
import pytest

from passrate_jax.run.config import load_config
from passrate_jax.run.metrics import read_jsonl
from passrate_jax.run.train import train
from tests.conftest import saved_params
import tests.test_kill_resume as kr
from tests.test_kill_resume import ROOT, _checkpoint_names, _env, _latest_checkpoint, _signal_when, _steps_written
from tests.test_train_e2e import TINY, _comparable, fake_verifier  # noqa: F401 - the fixture

ENGINE = ["sampling.engine=slots", "sampling.slots=32", "sampling.chunk_tokens=4"]


@pytest.mark.parametrize("method, ps, selection", [
    ("ds", True, "dps"), ("sara", False, "dps"), ("pilot_commit", True, "none")])
def test_every_method_trains_on_the_engine(tmp_path, fake_verifier, method, ps, selection):  # noqa: F811
    size = ["allocation.group_size=8"] if method == "pilot_commit" else []
    cfg = load_config(None, TINY + ENGINE + size + [
        "steps=3", f"allocation.method={method}", f"prefix_sampling.enabled={ps}",
        f"allocation.selection.method={selection}"])
    train(cfg, str(tmp_path), progress=False, log=lambda *a: None)
    records = read_jsonl(tmp_path / "metrics.jsonl")[1:]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert any(r["groups_trained"] > 0 for r in records)
    for r in records:
        assert r["sampler_calls"] > 0 and 0 < r["slot_utilization"] <= 1
        assert r["rollouts/aborted"] >= 0 and r["tokens/wasted"] >= 0
        assert r["prefill_tokens"] == r["context_tokens"]  # still one prefill per distinct context a step
    # Each step's rollouts come from its own parameters, and the engine's two programs compile once.
    assert records[-1]["compilations/sampler"] == records[0]["compilations/sampler"]


def test_engine_kill_9_then_resume_equals_uninterrupted_run(tmp_path, monkeypatch):
    """One kill between checkpoints (tests/test_kill_resume.py covers the other moments in round mode)."""
    monkeypatch.setattr(kr, "OVERRIDES", kr.OVERRIDES + ENGINE)
    env = _env()
    full, cut = tmp_path / "full", tmp_path / "cut"
    subprocess.run(kr._cmd(full), check=True, cwd=ROOT, env=env, timeout=900, capture_output=True)
    _signal_when(cut, env, lambda d: 3 in _steps_written(d) and "2" in _checkpoint_names(d))
    assert _latest_checkpoint(cut) == 2
    out = subprocess.run(kr._cmd(cut), check=True, cwd=ROOT, env=env, timeout=900, capture_output=True, text=True)
    assert "resuming" in out.stdout + out.stderr
    a, b = read_jsonl(full / "metrics.jsonl"), read_jsonl(cut / "metrics.jsonl")
    assert [r["step"] for r in b] == list(range(kr.STEPS + 1))
    assert _comparable(a) == _comparable(b) and "slot_utilization" in a[-1]
    for x, y in zip(saved_params(full, kr.STEPS), saved_params(cut, kr.STEPS)):
        np.testing.assert_array_equal(x, y)

