"""benchmarks/regime.py: group saturation, sampled accuracy and response length of a checkpoint."""

import importlib.util
import pathlib

import numpy as np
import pytest

from passrate_jax.run.config import load_config
from passrate_jax.run.session import Session

from test_train_e2e import TINY

_spec = importlib.util.spec_from_file_location(
    "regime_bench", pathlib.Path(__file__).parents[1] / "benchmarks" / "regime.py")
regime = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(regime)


@pytest.fixture(scope="module")
def session():
    s = Session.create(load_config(None, TINY + ["data.eval_size=6"]), log=lambda *a: None)
    yield s
    s.close()


def test_saturation_and_accuracy_follow_the_rewards(session, monkeypatch):
    solved = {id(r) for r in session.heldout[::2]}  # every other held-out prompt always right, the rest never
    monkeypatch.setattr(session, "score", lambda records, texts: np.array(
        [float(id(r) in solved) for r in records], np.float32))
    out = regime.regime_stats(session, session.params, num_samples=4, seed=0)
    share = len(solved) / len(session.heldout)
    assert out["prompts"] == 6 and out["sampled_accuracy"] == pytest.approx(share)
    assert (out["all_right"], out["all_wrong"], out["saturated"]) == (pytest.approx(share), pytest.approx(1 - share), 1.0)
    assert out["pass@1"] == pytest.approx(share) and out["pass@4"] == pytest.approx(share)
    assert 1 <= out["response_tokens_mean"] <= session.cfg.sampling.max_new_tokens
    assert out["response_lines_mean"] >= 1


def test_mixed_groups_are_not_saturated(session, monkeypatch):
    # Reward by response length parity: with distinct random samples, groups mix.
    monkeypatch.setattr(session, "score", lambda records, texts: np.array([len(t) % 2 for t in texts], np.float32))
    out = regime.regime_stats(session, session.params, num_samples=8, seed=0)
    assert out["saturated"] == pytest.approx(out["all_right"] + out["all_wrong"])
    assert 0 < out["sampled_accuracy"] < 1 and out["sampled_accuracy_se"] > 0
    assert out["pass@1"] == pytest.approx(out["sampled_accuracy"])
    assert out["pass@8"] == pytest.approx(1 - out["all_wrong"])


def test_train_mixture_weights_the_levels():
    by_level = {1: {"sampled_accuracy": 0.9, "all_wrong": 0.0, "all_right": 0.6},
                2: {"sampled_accuracy": 0.5, "all_wrong": 0.1, "all_right": 0.1},
                3: {"sampled_accuracy": 0.0, "all_wrong": 1.0, "all_right": 0.0}}
    mix = regime.train_mixture(by_level, [1, 2, 3], (2, 1, 1))
    assert mix == {"level_weights": [2.0, 1.0, 1.0], "sampled_accuracy": pytest.approx(0.575),
                   "all_wrong": pytest.approx(0.275), "all_right": pytest.approx(0.325),
                   "saturated": pytest.approx(0.6)}
