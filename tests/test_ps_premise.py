"""benchmarks/ps_premise.py on a synthetic model whose replays are known to be decided, mixed, or shifted
by the cut ratio: the probe must tell them apart (issue 38)."""

import importlib.util
import pathlib
from typing import NamedTuple

import numpy as np
import pytest

from passrate_jax.allocation.prefix_control import bucket_successes
from tests.fakes import PassThroughBackend

_spec = importlib.util.spec_from_file_location(
    "ps_premise_bench", pathlib.Path(__file__).parents[1] / "benchmarks" / "ps_premise.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

N = 8


class Answer(NamedTuple):
    ids: list
    success: bool


class FakeModel(PassThroughBackend):
    """A RolloutBackend whose outcomes are known: a fresh answer to prompt p succeeds with rates[p]; a
    continuation of a replayed prefix follows ``replay(source_success, ratio, rng)``. Answers are 10 tokens,
    a fifth of them 30 (a repair), so p90 / median = 3."""

    def __init__(self, rates, replay, seed=0):
        self.rates, self.replay, self.rng = rates, replay, np.random.default_rng(seed)
        self.outcomes: dict[tuple[int, int], bool] = {}

    def generate(self, contexts, params, seed):
        out = []
        for r in contexts:
            if r.prefix is None:
                wins = self.rng.random(r.num_rollouts) < self.rates[r.prompt_id]
            else:
                src = self.outcomes[r.prefix.source_group, r.prefix.source_rollout]
                assert src == r.prefix.success  # the probe replays the minority trajectory
                wins = [self.replay(src, r.prefix.cut_ratio, self.rng) for _ in range(r.num_rollouts)]
            out.append([Answer([0] * (30 if self.rng.random() < 0.2 else 10), bool(w)) for w in wins])
        return out

    def score(self, requests, rollouts):
        return {"reward": np.array([int(a.success) for answers in rollouts for a in answers])}

    def record(self, requests, rollouts, table, rows):
        for r, answers in zip(requests, rollouts):
            for j, a in enumerate(answers):
                self.outcomes[r.group_key, r.first_index + j] = a.success


RATES = np.tile([0.1, 0.2, 0.8, 0.9], 50)  # 200 prompts, most groups of 8 skewed


def probe(replay, ratios=(0.1, 0.5, 0.9)):
    return bench.ps_premise(FakeModel(RATES, replay), None, list(range(len(RATES))), n=N, ratios=ratios, batch=16)


def test_a_prefix_that_decides_the_outcome_gives_no_mixed_group():
    out = probe(lambda src, ratio, rng: src)  # every continuation repeats the source's result
    assert set(out["by_bucket"]) == {str(s) for s in bucket_successes(N)}
    for s, by_ratio in out["by_bucket"].items():
        for cell in by_ratio.values():
            # Hard buckets replay a success (all right), easy ones a failure (all wrong): decided, none mixed.
            assert cell["mixed"] == 0.0 and cell["mean_pass_rate"] == (1.0 if int(s) <= N // 4 else 0.0)
            assert cell["groups"] == out["fresh_hist"][int(s)]  # one re-rollout group per skewed group and ratio
    assert out["best_mixed"] == {b: 0.0 for b in out["by_bucket"]}
    assert out["fresh_groups"] == len(RATES)


def test_a_prefix_that_shifts_the_outcome_gives_mixed_groups_at_its_ratio():
    out = probe(lambda src, ratio, rng: rng.random() < 0.5)  # a coin whatever the prefix
    for by_ratio in out["by_bucket"].values():
        for cell in by_ratio.values():
            assert cell["mixed"] >= 0.9 and abs(cell["mean_pass_rate"] - 0.5) < 0.15
    # A success prefix of ratio r makes success likely r: the per-ratio pass rate follows r in hard buckets.
    out = probe(lambda src, ratio, rng: rng.random() < (ratio if src else 1 - ratio))
    hard = out["by_bucket"]["1"]
    assert [round(hard[r]["mean_pass_rate"], 1) for r in ("0.1", "0.5", "0.9")] == pytest.approx([0.1, 0.5, 0.9], abs=0.11)
    assert hard["0.5"]["mixed"] > hard["0.1"]["mixed"] and hard["0.5"]["mixed"] > hard["0.9"]["mixed"]


def test_answer_length_spread():
    out = probe(lambda src, ratio, rng: src, ratios=(0.5,))
    assert out["length_median"] == 10 and out["length_p90_over_median"] == pytest.approx(3.0)
