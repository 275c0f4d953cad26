"""Pilot-Commit in its paper's budgeted form (configs/pilot_commit.yaml, docs/design.md 2.3): it never
spends more than its per-step budget (on Bernoulli prompts and on a real short run), its first round is
the pilot stage, and commits go to the pilots of highest variance, which a pilot of 4 can rank."""

import dataclasses

import jax
import numpy as np
import pytest

from passrate_jax.allocation import Allocator, Result
from passrate_jax.allocation.config import AllocationConfig, PilotCommitConfig, PrefixSamplingConfig
from passrate_jax.configlib import ConfigError
from passrate_jax.run.config import load_config
from passrate_jax.run.metrics import read_jsonl
from passrate_jax.run.train import train
from tests.test_train_e2e import TINY, fake_verifier  # noqa: F401 - fixture

B, N = 4, 8
BUDGETED = PilotCommitConfig(mode="budgeted", pilot_budget_fraction=0.5, pilot_fraction=0.5, p_low=0.25, p_high=0.25)


def make(num_prompts, ps=False, budget=None, **pc):
    cfg = AllocationConfig(method="pilot_commit", num_prompts=B, group_size=N, budget=budget,
                           pilot_commit=dataclasses.replace(BUDGETED, **pc))
    return Allocator(cfg, PrefixSamplingConfig(enabled=ps), num_prompts)


def run_step(allocator, state, outcome):
    """One step; ``outcome(request)`` gives each request's rewards. Returns (result, state, rounds of requests)."""
    run, rounds = allocator.start_step(state), []
    while reqs := run.requests():
        rounds.append(reqs)
        run.observe([Result(r.group_key, tuple(int(x) for x in outcome(r))) for r in reqs])
    result, state = run.finish()
    return result, state, rounds


@pytest.mark.parametrize("ps", [False, True])
def test_budgeted_pilot_commit_never_exceeds_its_budget(ps):
    allocator = make(64, ps=ps)
    assert allocator.budget == B * N  # GRPO's budget by default
    rng = np.random.default_rng(0)
    rates = rng.choice([0.0, 0.2, 0.5, 0.8, 1.0], size=64)  # saturated and mixed prompts
    state, spent = allocator.init(jax.random.PRNGKey(0)), []
    for _ in range(12):
        result, state, rounds = run_step(allocator, state, lambda r: rng.random(r.num_rollouts) < rates[r.prompt_id])
        asked = sum(r.num_rollouts for reqs in rounds for r in reqs)
        assert asked == result.rollouts_spent <= B * N
        assert len(result.groups) <= B
        spent.append(result.rollouts_spent)
    # It spends its budget rather than stopping at the pilot stage: most steps use all but a pilot's worth.
    assert np.mean(spent) > B * N - N


def test_the_pilot_stage_is_the_first_round_and_a_set_budget_is_respected():
    allocator = make(64, budget=48, pilot_budget_fraction=0.75)
    result, _, rounds = run_step(allocator, allocator.init(jax.random.PRNGKey(1)), lambda r: np.arange(r.num_rollouts) % 2)
    # Three quarters of 48 rollouts in pilots of n_p = 4: nine pilots, nothing committed before they are
    # ranked (a later round pilots only what it could also commit: 48 // 8 = 6).
    assert [(r.first_index, r.num_rollouts) for r in rounds[0]] == [(0, 4)] * 9
    # Every pilot scores 2 of 4 and is kept; the 12 rollouts left pay three commits of n_c = 4.
    assert [(r.first_index, r.num_rollouts) for r in rounds[1]] == [(4, 4)] * 3
    assert result.rollouts_spent == 48 and len(result.groups) == 3


def test_commits_go_to_the_highest_variance_pilots():
    # Six pilots of 4 (three quarters of a 32-rollout budget) leave 8 rollouts: two commits of n_c = 4.
    allocator = make(64, budget=32, pilot_budget_fraction=0.75)
    wins = {p: 2 if p % 2 == 0 else 1 for p in range(64)}  # even prompts pilot 2 of 4 (p(1-p) = 1/4), odd 1 of 4

    def outcome(r):
        return np.arange(r.num_rollouts) < (wins[r.prompt_id] if r.first_index == 0 else 2)

    for seed in range(20):  # a draw of pilots with both kinds and more than two even ones
        result, state, rounds = run_step(allocator, allocator.init(jax.random.PRNGKey(seed)), outcome)
        piloted = [r.prompt_id for r in rounds[0]]
        if sum(p % 2 == 0 for p in piloted) >= 2 and any(p % 2 for p in piloted):
            break
    committed = [g.prompt_id for g in result.groups]
    assert len(committed) == 2 and all(p % 2 == 0 for p in committed), (piloted, committed)


def test_a_pilot_stage_too_small_for_one_pilot_is_refused():
    with pytest.raises(ConfigError, match="pilot_commit.pilot_budget_fraction = 0.1"):
        AllocationConfig(method="pilot_commit", num_prompts=2, group_size=8,
                         pilot_commit=dataclasses.replace(BUDGETED, pilot_budget_fraction=0.1)).validate()


def test_budgeted_preset_stays_within_grpo_budget_on_a_real_run(tmp_path, fake_verifier):  # noqa: F811
    preset = load_config("configs/pilot_commit.yaml")
    assert preset.allocation.pilot_commit.mode == "budgeted" and preset.allocation.budget is None
    fill = load_config("configs/pilot_commit_fill.yaml")
    assert fill.allocation.pilot_commit.mode == "fill"
    cfg = load_config(None, TINY + ["steps=3", "allocation.method=pilot_commit", "allocation.group_size=8",
                                    "allocation.num_prompts=4", "allocation.pilot_commit.mode=budgeted",
                                    "allocation.pilot_commit.pilot_fraction=0.5", "allocation.pilot_commit.p_low=0.25",
                                    "allocation.pilot_commit.p_high=0.25"])
    train(cfg, str(tmp_path), progress=False, log=lambda *a: None)
    steps = read_jsonl(tmp_path / "metrics.jsonl")[1:]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(0 < r["rollouts_step"] <= 4 * 8 for r in steps)
    assert sum(r["groups_trained"] for r in steps) > 0


@pytest.mark.parametrize("evict_steps", [0, 3])
def test_an_evicted_prompt_returns_after_evict_steps(evict_steps):
    """Prompts 0-7 always succeed (a pilot of 4 all right evicts), the rest never: an evicted prompt is
    not opened in the ``evict_steps`` steps after its eviction's, then may be again (never, with 0)."""
    allocator = make(16, evict_steps=evict_steps)
    state, evicted_at, reopened = allocator.init(jax.random.PRNGKey(2)), {}, []
    for t in range(12):
        _, state, rounds = run_step(allocator, state, lambda r: np.full(r.num_rollouts, r.prompt_id < 8))
        for p in {r.prompt_id for reqs in rounds for r in reqs if r.first_index == 0}:
            if p in evicted_at:
                assert t - evicted_at[p] > evict_steps > 0  # reopened only once its eviction expired
                reopened.append(p)
            if p < 8:
                evicted_at[p] = t
        out = np.asarray(state.evicted_until) > int(state.step)
        assert out.sum() == sum(t - s < evict_steps or not evict_steps for s in evicted_at.values())
    assert len(evicted_at) == 8 and (len(reopened) > 0) == (evict_steps > 0)
