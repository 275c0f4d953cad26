"""Prefix Sampling's three switches (docs/design.md 2.4): timing (next_step / same_step), placement
(in_place / on_top) and granularity (tokens / lines): config errors, the round machine on scripted
outcomes, the line cut against a reference, and one short training run with all three switched."""

import math

import jax
import numpy as np
import pytest

from passrate_jax.allocation import Allocator, Prefix, Request, Result
from passrate_jax.allocation.config import AllocationConfig, PrefixSamplingConfig
from passrate_jax.run.config import load_config
from passrate_jax.configlib import ConfigError
from passrate_jax.rollout.store import TrajectoryStore
from passrate_jax.rollout.text import TextRollouts, cut_prefix
from tests.test_train_e2e import TINY, fake_verifier  # noqa: F401 - fixture

B, N, P = 8, 8, 64
R = 4  # replay slots: int(0.5 * B)


# --------------------------------------------------------------------------- config
@pytest.mark.parametrize("key, value", [("timing", "later"), ("placement", "beside"), ("granularity", "words")])
def test_a_bad_switch_names_its_field_and_value(key, value):
    with pytest.raises(ConfigError, match=f"prefix_sampling.{key} = '{value}': must be one of"):
        load_config(None, [f"prefix_sampling.{key}={value}"])


def test_switch_combinations_that_cannot_work_are_refused():
    # Same step, in place, every slot held for replays: no fresh group is left to produce one.
    with pytest.raises(ConfigError, match="prefix_sampling.max_replay_share = 1.0"):
        load_config(None, ["prefix_sampling.enabled=true", "prefix_sampling.timing=same_step",
                           "prefix_sampling.max_replay_share=1.0"])
    load_config(None, ["prefix_sampling.enabled=true", "prefix_sampling.timing=same_step",
                       "prefix_sampling.placement=on_top", "prefix_sampling.max_replay_share=1.0"])
    # Environments cut at assistant turns.
    with pytest.raises(ConfigError, match="prefix_sampling.granularity = 'lines'"):
        load_config(None, ["data.source=env", "warm_start.misread_rate=0", "prefix_sampling.enabled=true",
                           "prefix_sampling.granularity=lines"])
    defaults = load_config(None, []).prefix_sampling
    assert (defaults.timing, defaults.placement, defaults.granularity) == ("next_step", "in_place", "tokens")


# --------------------------------------------------------------------------- the round machine
def _allocator(timing="next_step", placement="in_place"):
    return Allocator(AllocationConfig(method="uniform", num_prompts=B, group_size=N),
                     PrefixSamplingConfig(enabled=True, timing=timing, placement=placement), P)


def _run_step(allocator, state, successes_of):
    """One step on scripted outcomes: a fresh group of prompt p gets ``successes_of(p)`` successes of N,
    a re-rollout group 4. Returns (result, state, rounds: the requests of each round)."""
    run, rounds = allocator.start_step(state), []
    while reqs := run.requests():
        rounds.append(reqs)
        run.observe([Result(r.group_key, tuple(int(j < (4 if r.prefix else successes_of(r.prompt_id)))
                                               for j in range(r.first_index, r.first_index + r.num_rollouts)))
                     for r in reqs])
    result, state = run.finish()
    return result, state, rounds


SKEWED = lambda p: (1, 2, 6, 7)[p % 4]  # noqa: E731 - every fresh group replay-eligible
BALANCED = lambda p: 4  # noqa: E731 - none


def test_next_step_in_place_replays_last_steps_groups_in_round_zero():
    a = _allocator()
    result, state, rounds = _run_step(a, a.init(jax.random.PRNGKey(0)), SKEWED)
    assert len(rounds) == 1 and not any(r.prefix for r in rounds[0]) and len(result.groups) == B
    step0 = {g.group_key for g in result.groups}
    result, state, rounds = _run_step(a, state, SKEWED)
    replays = [r for r in rounds[0] if r.prefix]
    assert len(rounds) == 1 and len(replays) == R and {r.prefix.source_group for r in replays} <= step0
    assert len(result.groups) == B and result.rollouts_spent == B * N


def test_same_step_in_place_replays_this_steps_groups_in_a_later_round():
    a = _allocator(timing="same_step")
    assert int(a.knobs.max_rounds) == 2  # uniform's one round, plus one for the replays
    state = a.init(jax.random.PRNGKey(0))
    for _ in range(2):  # every fresh group skewed: the held slots are all replays
        result, state, rounds = _run_step(a, state, SKEWED)
        assert [len(r) for r in rounds] == [B - R, R]
        assert not any(r.prefix for r in rounds[0]) and all(r.prefix for r in rounds[1])
        round0 = {r.group_key for r in rounds[0]}
        assert {r.prefix.source_group for r in rounds[1]} <= round0  # sources of this very step
        trained = [g for g in result.groups if g.prefix]
        assert len(result.groups) == B and len(trained) == R and result.rollouts_spent == B * N
        assert not round0 & result.retained_keys  # a source is not kept for another step
        assert result.replay_rollouts.sum() == R * N
    # No skewed group: the held slots go back to fresh prompts in the second round.
    result, state, rounds = _run_step(a, state, BALANCED)
    assert [len(r) for r in rounds] == [B - R, R] and not any(r.prefix for rr in rounds for r in rr)
    assert len(result.groups) == B and result.rollouts_spent == B * N


def test_on_top_trains_replays_beyond_b_and_pays_for_them():
    a = _allocator(placement="on_top")
    assert a.budget == (B + R) * N and a.max_groups == B + R
    result, state, _ = _run_step(a, a.init(jax.random.PRNGKey(0)), SKEWED)
    assert len(result.groups) == B and result.rollouts_spent == B * N  # nothing to replay yet
    result, state, rounds = _run_step(a, state, SKEWED)
    assert len(rounds) == 1 and sum(bool(r.prefix) for r in rounds[0]) == R
    assert len(result.groups) == B + R and sum(g.prefix is None for g in result.groups) == B
    assert result.rollouts_spent == (B + R) * N
    assert sorted(g.group_key for g in result.groups) == sorted(r.group_key for r in rounds[0])


def test_same_step_on_top_adds_a_round_of_replays_after_b_fresh_groups():
    a = _allocator(timing="same_step", placement="on_top")
    result, state, rounds = _run_step(a, a.init(jax.random.PRNGKey(0)), SKEWED)
    assert [len(r) for r in rounds] == [B, R] and all(r.prefix for r in rounds[1])
    assert len(result.groups) == B + R and result.rollouts_spent == (B + R) * N
    result, state, rounds = _run_step(a, state, BALANCED)  # nothing skewed: no second round
    assert [len(r) for r in rounds] == [B] and len(result.groups) == B and result.rollouts_spent == B * N


def test_same_step_ds_fills_held_slots_with_replays_not_another_batch():
    a = Allocator(AllocationConfig(method="ds", num_prompts=B, group_size=N),
                  PrefixSamplingConfig(enabled=True, timing="same_step"), P)
    result, _, rounds = _run_step(a, a.init(jax.random.PRNGKey(0)), SKEWED)
    # Round 0: one generation batch of 3B, B - R trained; round 1: R replays and no second batch.
    assert [len(r) for r in rounds] == [3 * B, R] and all(r.prefix for r in rounds[1])
    assert len(result.groups) == B and result.rollouts_spent == (3 * B + R) * N


# --------------------------------------------------------------------------- the line cut
NL = 0


def _reference_lines(response, ratio):
    """The first round(ratio * L) whole lines (half up, clipped to [1, L - 1]); None for one line."""
    lines, line = [], []
    for tok in response:
        line.append(tok)
        if tok == NL:
            lines.append(line)
            line = []
    lines += [line] if line else []
    if len(lines) < 2:
        return None
    k = min(max(math.floor(ratio * len(lines) + 0.5), 1), len(lines) - 1)
    return [tok for ln in lines[:k] for tok in ln]


def test_line_cut_matches_a_reference_on_random_responses():
    rng = np.random.default_rng(0)
    for _ in range(2000):
        response = [int(x) for x in rng.integers(0, 4, size=rng.integers(2, 30))]  # about 1 token in 4 a line break
        ratio = float(rng.uniform(0.01, 0.99))
        got = cut_prefix(response, ratio, NL, "lines")
        want = _reference_lines(response, ratio)
        if want is None:  # one line: the token cut
            assert got == cut_prefix(response, ratio, NL, "tokens")
        else:
            assert got == want and got[-1] == NL and 0 < len(got) < len(response)
    assert cut_prefix([5, 6, NL, 7, 8, NL, 9], 0.5, NL, "lines") == [5, 6, NL, 7, 8, NL]  # round(1.5) = 2 of 3
    assert cut_prefix([5, 6, 7, 8], 0.5, NL) == [5, 6]  # the default is the token cut


def test_text_backend_cuts_replays_at_its_granularity():
    def backend(granularity):
        b = TextRollouts(None, lambda i: [1], decode=str, verify=None, max_new_tokens=20, pad_id=3, newline_id=NL,
                         prefix_granularity=granularity)
        b.contexts([Request(7, 0, 1, 0)])
        b.store.groups[7].trajectories[0] = [5, 5, NL, 6, 6, 6, 6, 6, 6, 6, NL, 2]
        return list(b.contexts([Request(8, 0, 4, 0, Prefix(7, 0, 0.4, 0, True))])[0].prefix_ids)
    assert backend("tokens") == [5, 5, NL, 6]  # 4 of 12 tokens (no line break in the last 10% of the cut)
    assert backend("lines") == [5, 5, NL]  # round(0.4 * 3) = 1 of 3 lines


# --------------------------------------------------------------------------- a short training run
def test_all_three_switches_train_with_one_update_program(tmp_path, monkeypatch, fake_verifier):  # noqa: F811
    from passrate_jax.run.metrics import read_jsonl
    from passrate_jax.run.train import train
    batch_rows = []
    original = TrajectoryStore.batch
    monkeypatch.setattr(TrajectoryStore, "batch", lambda self, groups, rows: batch_rows.append(rows) or original(
        self, groups, rows))
    cfg = load_config(None, TINY + ["steps=3", "allocation.method=uniform", "allocation.num_prompts=4",
                                    "prefix_sampling.enabled=true", "prefix_sampling.timing=same_step",
                                    "prefix_sampling.placement=on_top", "prefix_sampling.granularity=lines"])
    train(cfg, str(tmp_path), progress=False, log=lambda *a: None)
    records = read_jsonl(tmp_path / "metrics.jsonl")[1:]
    b, r, n = 4, 2, 4
    assert batch_rows == [(b + r) * n] * 3  # every batch padded to B + replay slots groups: one update shape
    assert records[-1]["compilations/update"] == 1
    assert all(r_["rollouts_step"] == (b + r_["replay_groups"]) * n for r_ in records)  # replays paid on top
    assert sum(r_["replay_groups"] for r_ in records) > 0

