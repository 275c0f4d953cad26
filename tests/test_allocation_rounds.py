"""The round machine's behaviours that issue 15 fixed: SARA's fill mode, Pilot-Commit's single
observation and buffer age, DPS's per-step decay of every prompt, and rejected (unobserved) results."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from passrate_jax.allocation import Allocator, Result, queue_push, selection_init, selection_update
from passrate_jax.allocation.config import AllocationConfig, PrefixSamplingConfig, SaraConfig, SelectionConfig

B, N = 4, 8


def make(method, num_prompts, selection="none", ps=False, **kw):
    cfg = AllocationConfig(method=method, num_prompts=B, group_size=N, **kw)
    cfg = dataclasses.replace(cfg, selection=dataclasses.replace(cfg.selection, method=selection))
    return Allocator(cfg, PrefixSamplingConfig(enabled=ps), num_prompts)


def step(allocator, state, rates, rng, observed=True):
    """One step with Bernoulli outcomes; returns (result, state, requests)."""
    run = allocator.start_step(state)
    seen = []
    while reqs := run.requests():
        seen += reqs
        run.observe([Result(r.group_key, tuple(int(x) for x in rng.random(r.num_rollouts) < rates[r.prompt_id]),
                            observed) for r in reqs])
    result, state = run.finish()
    return result, state, seen


def test_sara_fill_reaches_b_valid_groups_on_a_mixed_population():
    allocator = make("sara", 64)
    rates = np.where(np.arange(64) % 4 == 0, 0.5, 0.0)  # a quarter of the prompts are mixed
    rng = np.random.default_rng(0)
    state = allocator.init(jax.random.PRNGKey(0))
    for _ in range(3):
        result, state, _ = step(allocator, state, rates, rng)
        assert len(result.groups) == B and all(g.valid and len(g.rewards) == N for g in result.groups)
        # The fixed-budget mode could not: B * N rollouts do not pay for the probes of 3 useless prompts per
        # useful one.
        assert result.rollouts_spent > B * N


def test_sara_fill_stops_at_the_ds_cap_without_mixed_prompts():
    allocator = make("sara", 400)
    cap = 3 * 10 * B * N
    assert allocator.budget == cap
    result, _, seen = step(allocator, allocator.init(jax.random.PRNGKey(0)), np.zeros(400), np.random.default_rng(0))
    assert result.groups == []
    # A prompt opens only while the cap can still complete it, so the step ends within N of the cap.
    assert cap - N < result.rollouts_spent <= cap
    assert all((n, s) == (4, 0) for _, n, s in result.abandoned) and {r.num_rollouts for r in seen} == {2}


def test_sara_fixed_budget_mode_spends_at_most_b_times_n():
    allocator = make("sara", 64, sara=SaraConfig(mode="fixed_budget"))
    rates = np.where(np.arange(64) % 4 == 0, 0.5, 0.0)
    result, _, _ = step(allocator, allocator.init(jax.random.PRNGKey(0)), rates, np.random.default_rng(0))
    assert allocator.budget == B * N and result.rollouts_spent <= B * N and len(result.groups) < B


def test_pilot_commit_selection_update_sees_the_full_group_once():
    allocator = make("pilot_commit", 48, selection="mopps")
    state = allocator.init(jax.random.PRNGKey(0))
    rates = np.full(48, 0.5)
    result, new, seen = step(allocator, state, rates, np.random.default_rng(1))
    total = np.asarray(new.selection.alpha + new.selection.beta)
    committed = {g.prompt_id for g in result.groups}
    assert committed and all(len(g.rewards) == N for g in result.groups)
    # Prior alpha0 + beta0 = 2 stays 2 after lam-decay toward it; an observation adds its n outcomes.
    for p in committed:
        assert total[p] == 2 + N  # pilot (n_p) + commit (n_c) as one observation of N
    piloted = {r.prompt_id for r in seen if r.first_index == 0}
    kept = set(np.asarray(new.policy.buffer.prompt_id)[np.asarray(new.policy.buffer.valid)].tolist())
    for p in piloted - committed - kept:
        assert total[p] == 2 + 2  # skipped or evicted pilot: its n_p = 2 outcomes, now
    for p in kept:
        assert total[p] == 2  # still buffered: observed when committed or when it expires


def test_pilot_is_committable_for_exactly_buffer_max_age_steps():
    cfg_kw = dict(pilot_commit=AllocationConfig().pilot_commit)
    max_age = cfg_kw["pilot_commit"].buffer_max_age
    allocator = make("pilot_commit", 48, **cfg_kw)
    rewards = np.zeros((1, N), np.int8)
    rewards[0, :2] = (1, 0)

    def with_pilot(step_now, stamp):
        state = allocator.init(jax.random.PRNGKey(0))
        buf = queue_push(state.policy.buffer, jnp.array([7]), jnp.array([1000]), jnp.array([2]), jnp.array([1]),
                         rewards, jnp.zeros(1, jnp.int32), jnp.zeros(1, jnp.int32), stamp, jnp.array([True]))
        return state.replace(step=jnp.int32(step_now), policy=state.policy.replace(buffer=buf),
                             next_group_key=jnp.int32(2000))

    rates = np.zeros(48)  # fresh pilots all fail: only the buffered pilot can be committed
    for age, committable in ((max_age, True), (max_age + 1, False)):
        # A pilot of step 10 is at age `age` at step 10 + age; it is still there only if the finish of step
        # 10 + age - 1 kept it, so run that step first with nothing affordable (budget 1 < n_p).
        tight = make("pilot_commit", 48, budget=1, **cfg_kw)
        state = with_pilot(10 + age - 1, 10)
        _, state, seen = step(tight, state, rates, np.random.default_rng(0))
        assert seen == [] and int(state.step) == 10 + age
        _, _, seen = step(allocator, state, rates, np.random.default_rng(0))
        commits = [r for r in seen if r.group_key == 1000]
        assert bool(commits) == committable
        if committable:
            assert (commits[0].first_index, commits[0].num_rollouts) == (2, N - 2)


def test_an_uncommitted_pilot_is_observed_once_when_it_expires():
    """Pilot-Commit's end hook hands a pilot leaving its buffer uncommitted to the selection models: its
    n_p = 2 outcomes (one success), at the step it expires and not before."""
    max_age = AllocationConfig().pilot_commit.buffer_max_age
    tight = make("pilot_commit", 48, selection="mopps", budget=1)  # budget 1 < n_p: nothing is ever requested
    rewards = np.zeros((1, N), np.int8)
    rewards[0, :2] = (1, 0)
    state = tight.init(jax.random.PRNGKey(0))
    buf = queue_push(state.policy.buffer, jnp.array([7]), jnp.array([1000]), jnp.array([2]), jnp.array([1]), rewards,
                     jnp.zeros(1, jnp.int32), jnp.zeros(1, jnp.int32), 10, jnp.array([True]))
    state = state.replace(step=jnp.int32(10 + max_age - 1), policy=state.policy.replace(buffer=buf))
    totals = []
    for _ in range(2):  # the pilot of step 10 is still committable at step 10 + max_age, and expires after it
        _, state, seen = step(tight, state, np.zeros(48), np.random.default_rng(0))
        assert seen == []
        totals.append(float(state.selection.alpha[7] + state.selection.beta[7]))
    # MoPPS from Beta(1, 1) with lambda 0.5: alpha <- 1 + 1 success, beta <- 1 + 1 failure.
    assert totals == [2.0, 4.0] and not bool(state.policy.buffer.valid.any())


def test_a_prompt_waiting_in_the_pilot_buffer_is_not_piloted_again():
    """Pilot-Commit's held_prompts hook: with every other prompt piloted in the first round (8 prompts, 3 pilots
    per missing slot), the buffered prompt is committed, never opened as a fresh pilot."""
    allocator = make("pilot_commit", 8)
    rewards = np.zeros((1, N), np.int8)
    rewards[0, :2] = (1, 0)
    state = allocator.init(jax.random.PRNGKey(0))
    buf = queue_push(state.policy.buffer, jnp.array([7]), jnp.array([1000]), jnp.array([2]), jnp.array([1]), rewards,
                     jnp.zeros(1, jnp.int32), jnp.zeros(1, jnp.int32), 0, jnp.array([True]))
    state = state.replace(policy=state.policy.replace(buffer=buf), next_group_key=jnp.int32(2000))
    _, _, seen = step(allocator, state, np.zeros(8), np.random.default_rng(0))
    piloted = {r.prompt_id for r in seen if r.first_index == 0}
    assert piloted == set(range(7)) and [(r.group_key, r.first_index) for r in seen if r.prompt_id == 7] == [(1000, 2)]


def test_dps_decays_and_propagates_unobserved_prompts():
    cfg = SelectionConfig(method="dps", dps_lambda=0.7, dps_alpha0=1.0)
    state = selection_init(2, cfg)
    counts0 = np.array([[5.0, 1.0, 1.0], [2.0, 3.0, 1.0], [1.0, 1.0, 4.0]])
    last0 = np.array([0.0, 1.0, 0.0])
    state = state.replace(counts=state.counts.at[0].set(counts0), last=state.last.at[0].set(last0))
    c, belief = counts0.copy(), last0.copy()
    for _ in range(3):  # three steps in which prompt 0 is not observed (prompt 1 is, as a full mixed group)
        belief = belief @ (c / c.sum(1, keepdims=True))
        c = 0.7 * c + 0.3 * 1.0
        state = selection_update(state, jnp.array([1, 0]), jnp.array([N, 0]), jnp.array([3, 0]),
                                 jnp.array([True, False]), cfg, N)
    np.testing.assert_allclose(state.counts[0], c, rtol=1e-6)
    np.testing.assert_allclose(state.last[0], belief, rtol=1e-6)
    np.testing.assert_allclose(c, 0.7**3 * counts0 + (1 - 0.7**3), rtol=1e-12)
    np.testing.assert_allclose(state.last[1], [0, 1, 0])
    # Its prediction is the belief moved one more transition: P(mixed) = sum_i belief_i T_i,mixed.
    from passrate_jax.allocation import dps_mixed_probability
    t = c / c.sum(1, keepdims=True)
    np.testing.assert_allclose(dps_mixed_probability(state, jnp.array([0])), [belief @ t[:, 1]], rtol=1e-6)


def test_rejected_results_change_no_controller_or_selection_state():
    allocator = make("sara", 48, selection="dps", ps=True)
    rates = np.random.default_rng(0).beta(0.5, 0.5, 48)
    rng = np.random.default_rng(0)
    state = allocator.init(jax.random.PRNGKey(0))
    for _ in range(2):  # a state with replay sources and informed models
        _, state, _ = step(allocator, state, rates, rng)
    assert np.asarray(state.replay_queue.valid).any()
    result, after, seen = step(allocator, state, rates, rng, observed=False)
    assert seen and result.rollouts_spent == sum(r.num_rollouts for r in seen) and result.groups == []
    assert any(r.prefix is not None for r in seen)
    np.testing.assert_array_equal(after.prefix_control.ratio, state.prefix_control.ratio)
    np.testing.assert_array_equal(after.prefix_control.ema, state.prefix_control.ema)
    np.testing.assert_array_equal(result.replay_rollouts, 0)
    # Selection: only the passage of one step (DPS decay and propagation), no observation.
    nothing = selection_update(state.selection, jnp.zeros(1, jnp.int32), jnp.zeros(1, jnp.int32),
                               jnp.zeros(1, jnp.int32), jnp.zeros(1, bool), allocator.cfg.selection, N)
    jax.tree.map(np.testing.assert_array_equal, after.selection, nothing)
    assert result.abandoned == [] and not np.asarray(after.replay_queue.valid).any()


def test_closed_groups_free_their_rows_and_each_is_observed_once():
    """A fill-mode step on hopeless prompts opens far more groups than the table has rows: every
    abandoned probe is closed (its row reused) and still reaches the selection model, once."""
    allocator = make("sara", 400, selection="mopps")
    state = allocator.init(jax.random.PRNGKey(0))
    result, new, _ = step(allocator, state, np.zeros(400), np.random.default_rng(0))
    prompts = [p for p, _, _ in result.abandoned]
    assert len(prompts) == len(set(prompts)) > 10 * allocator.setup.capacity
    changed = np.nonzero(np.asarray(new.selection.beta) != np.asarray(state.selection.beta))[0]
    assert sorted(prompts) == changed.tolist()
    # MoPPS with lambda 0.5 from Beta(1, 1): beta <- 0.5 * 1 + 0.5 * 1 + 4 failures.
    np.testing.assert_allclose(np.asarray(new.selection.beta)[changed], 5.0)


def test_random_permutation_is_a_uniform_permutation():
    from passrate_jax.allocation.table import random_permutation
    for num, size in ((1, 4), (5, 16), (512, 1024), (1000, 1024)):
        perm = np.asarray(random_permutation(jax.random.PRNGKey(num), num))
        assert sorted(perm.tolist()) == list(range(size))
    # The first of 5 prompts in the order, over 5,000 keys: uniform (chi-square, 4 dof, p = 0.001: 18.47).
    draws = jax.vmap(lambda k: random_permutation(k, 5))(jax.random.split(jax.random.PRNGKey(7), 5000))
    firsts = [row[row < 5][0] for row in np.asarray(draws)]
    counts = np.bincount(firsts, minlength=5)
    assert ((counts - 1000) ** 2 / 1000).sum() < 18.47


def test_table_parts_hold_the_fields_of_their_shape():
    """plan_round leaves the table's per-prompt part unselected when a round does not go, and _pack
    maps over the row part: a per-prompt field in another part would be selected (safe), a row field in
    another part would not be packed (rows would keep a closed group's values)."""
    from passrate_jax.allocation.table import table_init
    g, p = 7, 50
    t = table_init(g, N, 4, 0, jnp.zeros(p, bool), jax.random.PRNGKey(0))
    assert all(jnp.shape(x)[:1] == (g,) for x in jax.tree.leaves(t.rows))
    assert all(jnp.shape(x)[:1] in ((p,), ()) for x in jax.tree.leaves(t.prompts))
    assert all(jnp.shape(x)[:1] != (p,) and jnp.shape(x)[:1] != (g,) for x in jax.tree.leaves((t.counters, t.rng)))
    # Fields read and replace by name through their parts.
    t2 = t.replace(status=t.status + 1, trained=jnp.int32(3), used=~t.used)
    assert (t2.rows.status == 1).all() and int(t2.counters.trained) == 3 and bool(t2.prompts.used.all())
    assert t2.rows.key is t.rows.key and t2.rng is t.rng  # what was not replaced is kept
