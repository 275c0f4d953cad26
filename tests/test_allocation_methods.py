"""SARA, Pilot-Commit, MoPPS / DPS and Prefix Sampling: pure functions against hand-computed cases."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from passrate_jax.allocation import (ABANDON, CONFIRM, CONTINUE, EVICT, KEEP, SKIP, bucket_index, bucket_kind,
                                     bucket_successes, choose_minority, dps_mixed_probability, num_buckets,
                                     pilot_classify, pilot_priority, pilot_size, prefix_control_init,
                                     prefix_control_update, queue_expire, queue_init, queue_push, queue_take,
                                     sara_decide, select_prompts, selection_init, selection_update)
from passrate_jax.allocation.allocator import Allocator, make_setup
from passrate_jax.allocation.config import (AllocationConfig, PilotCommitConfig, PrefixSamplingConfig, SaraConfig,
                                            SelectionConfig)
from passrate_jax.allocation.machine import next_request

SARA = SaraConfig()


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([2, 3, 8, 64]), st.sampled_from([0.45, 0.98]),
       st.lists(st.tuples(st.floats(0, 1), st.floats(0, 1), st.floats(0.05, 50), st.floats(0.05, 50)),
                min_size=16, max_size=16))
def test_sara_never_abandons_a_mixed_group(N, tau_abandon, rows):
    # Fixed shapes ([16] rows), a few N and two configs (static arguments) keep compiles few.
    u, v, a, b = (np.array(c) for c in zip(*rows))
    n = 2 + np.floor(u * (N - 1)).astype(int).clip(0, N - 2)  # 2 <= n <= N
    s = 1 + np.floor(v * (n - 1)).astype(int).clip(0, n - 2)  # mixed: 0 < s < n
    cfg = SaraConfig(tau_abandon=tau_abandon, tau_confirm=0.99)
    action, p_valid, chunk = sara_decide(n, s, np.ones_like(n), a, b, cfg, N)
    assert np.all(np.asarray(action) == CONFIRM) and np.all(np.asarray(p_valid) == 1.0)
    np.testing.assert_array_equal(chunk, N - n)  # a confirmed group is completed to N


def test_sara_default_rule_at_N8():
    # Uniform prior, unanimous outcomes: P_valid = (8 - n) / 9 -> continue at n = 1..3, abandon at 4.
    n = np.array([2, 2, 4, 4, 2, 8, 8])
    s = np.array([0, 2, 0, 4, 1, 0, 3])
    probes = np.array([1, 1, 2, 2, 1, 3, 3])
    action, _, chunk = sara_decide(n, s, probes, np.ones(7), np.ones(7), SARA, 8)
    np.testing.assert_array_equal(action, [CONTINUE, CONTINUE, ABANDON, ABANDON, CONFIRM, ABANDON, CONFIRM])
    np.testing.assert_array_equal(chunk, [2, 2, 0, 0, 6, 0, 0])
    # A confident prior (the prompt nearly always fails) abandons after the first probe.
    action, _, _ = sara_decide(np.array([2]), np.array([0]), np.array([1]), np.array([1.0]), np.array([20.0]), SARA, 8)
    assert int(action[0]) == ABANDON
    # Schedule exhausted while still undecided: the remaining rollouts complete the group.
    cfg = SaraConfig(tau_abandon=0.05, tau_confirm=0.99, round_schedule=(2,))
    action, _, chunk = sara_decide(np.array([2]), np.array([0]), np.array([1]), np.array([1.0]), np.array([1.0]), cfg, 8)
    assert (int(action[0]), int(chunk[0])) == (CONTINUE, 6)


def test_sure_next_request_is_saras_rule_on_every_outcome_of_the_rollouts_in_flight():
    """machine.next_request (what the slot engine starts ahead for sure) against enumeration: for SARA,
    the smallest next request over every outcome of the rollouts still in flight, computed with
    sara_decide outcome by outcome, and 0 when some outcome abandons; for GRPO, DS and Pilot-Commit 0
    (their next request is not a function of the group's own outcomes)."""
    N, cases = 8, []
    for n in range(1, N):
        for waiting in range(n + 1):
            for s in range(n - waiting + 1):
                cases.append((n, s, waiting, n // 2))  # probes done after these: 1 at n = 2, 2 at n = 4
    n, s, waiting, probes = (np.array(c, np.int32) for c in zip(*cases))
    alloc = Allocator(AllocationConfig(method="sara", num_prompts=4, group_size=N), PrefixSamplingConfig(), 16)
    got = np.asarray(next_request(alloc.setup, alloc.knobs, n, s, waiting, probes))
    for i, (n_i, s_i, w_i, p_i) in enumerate(cases):
        sizes = [int(sara_decide(np.array([n_i]), np.array([s_i + j]), np.array([p_i]), np.ones(1), np.ones(1),
                                 SARA, N)[2][0]) for j in range(w_i + 1)]
        assert got[i] == (min(sizes) if min(sizes) > 0 else 0), cases[i]
    # Worked cases at N = 8, schedule (2, 2, 4): two probes in flight after none -> 2 for sure (a mixed
    # pair confirms: 6; a unanimous one continues: 2); two unanimous then two in flight -> 0 (may abandon).
    pick = {(c[0], c[1], c[2]): g for c, g in zip(cases, got)}
    assert (pick[(2, 0, 2)], pick[(4, 0, 2)], pick[(2, 1, 0)], pick[(4, 0, 0)]) == (2, 0, 6, 0)
    for method in ("uniform", "ds", "pilot_commit"):
        other = Allocator(AllocationConfig(method=method, num_prompts=4, group_size=N), PrefixSamplingConfig(), 16)
        assert not np.any(np.asarray(next_request(other.setup, other.knobs, n, s, waiting, probes))), method
    # The simulator's setup (every policy in one compile) switches to the method's own rule.
    family = make_setup(alloc.cfg, alloc.ps, 16, family=True)
    np.testing.assert_array_equal(next_request(family, alloc.knobs, n, s, waiting, probes), got)


def test_mopps_update_hand_computed():
    cfg = SelectionConfig(method="mopps", mopps_lambda=0.5, mopps_alpha0=1.0, mopps_beta0=1.0)
    state = selection_init(5, cfg).replace(alpha=jnp.array([1.0, 3.0, 1, 1, 1]), beta=jnp.array([1.0, 5.0, 1, 1, 1]))
    new = selection_update(state, jnp.array([1, 3, 0]), jnp.array([8, 4, 2]), jnp.array([6, 0, 1]),
                           jnp.array([True, True, False]), cfg, 8)
    # prompt 1: alpha = 0.5*3 + 0.5*1 + 6 = 8, beta = 0.5*5 + 0.5*1 + 2 = 5; prompt 3: (1, 1 + 4).
    np.testing.assert_allclose(new.alpha, [1, 8, 1, 1, 1])
    np.testing.assert_allclose(new.beta, [1, 5, 1, 5, 1])


def test_dps_update_and_prediction_hand_computed():
    cfg = SelectionConfig(method="dps", dps_lambda=0.7, dps_alpha0=1.0)
    state = selection_init(3, cfg)
    # Prompt 0: a full mixed group. Counts: 0.7*1 + 0.3*1 + outer(1/3, e_mixed) -> column 1 becomes 4/3.
    state = selection_update(state, jnp.array([0]), jnp.array([8]), jnp.array([3]), jnp.array([True]), cfg, 8)
    want = np.ones((3, 3))
    want[:, 1] += 1 / 3
    np.testing.assert_allclose(state.counts[0], want, rtol=1e-6)
    np.testing.assert_allclose(state.last[0], [0, 1, 0])
    # Again all-correct: counts <- 0.7 C + 0.3 + outer(e_mixed, e_correct).
    state = selection_update(state, jnp.array([0]), jnp.array([8]), jnp.array([8]), jnp.array([True]), cfg, 8)
    want = 0.7 * want + 0.3
    want[1, 2] += 1
    np.testing.assert_allclose(state.counts[0], want, rtol=1e-6)
    # Prediction from the all-correct state: row 2 normalised, mixed column.
    np.testing.assert_allclose(dps_mixed_probability(state, jnp.array([0])), [want[2, 1] / want[2].sum()], rtol=1e-6)
    np.testing.assert_allclose(dps_mixed_probability(state, jnp.array([1])), [1 / 3], rtol=1e-6)  # unseen
    # A partial unanimous group splits its evidence by the validity predictor: 2 failures of 8 -> 6/9 mixed.
    state = selection_update(state, jnp.array([2]), jnp.array([2]), jnp.array([0]), jnp.array([True]), cfg, 8)
    np.testing.assert_allclose(state.last[2], [1 / 3, 2 / 3, 0], atol=1e-6)


def test_selection_prefers_predicted_mixed_prompts():
    cfg = SelectionConfig(method="dps", pool_ratio=8)
    state = selection_init(64, cfg)
    mixed = jnp.arange(0, 64, 2)  # even prompts were mixed twice, odd ones all-wrong twice
    for _ in range(2):
        state = selection_update(state, jnp.arange(64), jnp.full(64, 8), jnp.where(jnp.arange(64) % 2 == 0, 4, 0),
                                 jnp.ones(64, bool), cfg, 8)
    ids, ok = select_prompts(state, jax.random.PRNGKey(0), jnp.ones(64, bool), 4, 8, cfg)
    assert np.asarray(ok).sum() == 4 and np.all(np.asarray(ids)[:4] % 2 == 0) and len(set(np.asarray(ids)[:4])) == 4
    avail = jnp.zeros(64, bool).at[mixed[:2]].set(True)
    ids, ok = select_prompts(state, jax.random.PRNGKey(1), avail, 4, 8, cfg)
    assert sorted(np.asarray(ids)[np.asarray(ok)].tolist()) == [0, 2]  # only what is available
    ids, ok = select_prompts(state, jax.random.PRNGKey(1), jnp.ones(64, bool), 3, 8,
                             dataclasses.replace(cfg, method="mopps"))
    assert np.asarray(ok).sum() == 3


def test_prefix_buckets_any_group_size():
    assert bucket_successes(8) == [1, 2, 6, 7]
    np.testing.assert_array_equal(bucket_index(jnp.arange(9), 8), [-1, 0, 1, -1, -1, -1, 2, 3, -1])
    np.testing.assert_array_equal(bucket_kind(jnp.arange(9), 8), [0, 2, 2, 1, 1, 1, 3, 3, 0])
    for N in (2, 3, 4, 5, 12, 16, 33):
        h = N // 4
        assert num_buckets(N) == 2 * h
        idx = np.asarray(bucket_index(jnp.arange(N + 1), N))
        assert sorted(idx[idx >= 0].tolist()) == list(range(2 * h))  # each skewed count its own bucket
        assert [s for s in range(N + 1) if idx[s] >= 0] == bucket_successes(N)


def test_prefix_controller_direction_and_deadzone():
    cfg = PrefixSamplingConfig(enabled=True)
    state = prefix_control_init(8, cfg)  # buckets [1, 2 | 6, 7]: hard, hard, easy, easy
    ones = np.full(4, 8.0)
    too_easy = prefix_control_update(state, 0.9 * ones, ones, cfg)  # every bucket's re-rollouts pass 90%
    # ema = 0.9*0.5 + 0.1*0.9 = 0.54 > 0.53: hard buckets shorten the head start, easy ones lengthen the handicap.
    np.testing.assert_allclose(too_easy.ema, 0.54, rtol=1e-6)
    np.testing.assert_allclose(too_easy.ratio, [0.20, 0.20, 0.30, 0.30], rtol=1e-6)
    too_hard = prefix_control_update(state, 0.1 * ones, ones, cfg)
    np.testing.assert_allclose(too_hard.ratio, [0.30, 0.30, 0.20, 0.20], rtol=1e-6)
    inside = prefix_control_update(state, 0.75 * ones, ones, cfg)  # ema 0.525: inside the deadzone
    np.testing.assert_allclose(inside.ratio, 0.25)
    unseen = prefix_control_update(state, 0.9 * ones, np.array([8.0, 0, 8, 0]), cfg)  # no re-rollouts: no change
    np.testing.assert_allclose(unseen.ratio, [0.20, 0.25, 0.30, 0.25], rtol=1e-6)
    np.testing.assert_allclose(unseen.ema, [0.54, 0.5, 0.54, 0.5], rtol=1e-6)
    fixed = prefix_control_update(state, 0.9 * ones, ones, dataclasses.replace(cfg, mode="fixed"))
    np.testing.assert_allclose(fixed.ratio, 0.25)
    # Clipping at the ratio bounds.
    low = state.replace(ratio=jnp.full(4, 0.06))
    np.testing.assert_allclose(prefix_control_update(low, 0.0 * ones, ones, cfg).ratio, [0.11, 0.11, 0.05, 0.05],
                               rtol=1e-6)


def test_choose_minority_picks_a_minority_rollout():
    rewards = jnp.array([[1, 0, 0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1, 0, 1], [0, 1, 0, 1, 0, 0, 0, 0]])
    for seed in range(5):
        src = np.asarray(choose_minority(jax.random.PRNGKey(seed), rewards, jnp.full(3, 8)))
        assert src[0] == 0 and src[1] == 6 and src[2] in (1, 3)


def test_pilot_band_and_buffer_order():
    cfg = PilotCommitConfig()
    assert pilot_size(cfg, 8) == 2 and pilot_size(cfg, 16) == 4
    verdict = pilot_classify(jnp.array([2, 2, 2, 4, 8, 4]), jnp.array([0, 1, 2, 3, 7, 4]), cfg)
    # The band is inclusive: 3/4 = 1 - p_high is kept, 7/8 is too easy (skipped, not evicted).
    np.testing.assert_array_equal(verdict, [SKIP, KEEP, EVICT, KEEP, SKIP, EVICT])
    q = queue_init(4, 8)
    rewards = np.zeros((3, 8), np.int8)
    q = queue_push(q, jnp.array([10, 11, 12]), jnp.array([0, 1, 2]), jnp.array([4, 4, 4]), jnp.array([1, 2, 2]),
                   rewards, jnp.zeros(3, jnp.int32), jnp.zeros(3, jnp.int32), 0, jnp.array([True, True, True]))
    q = queue_push(q, jnp.array([13, 14]), jnp.array([3, 4]), jnp.array([4, 4]), jnp.array([2, 1]), rewards[:2],
                   jnp.zeros(2, jnp.int32), jnp.zeros(2, jnp.int32), 1, jnp.array([True, True]))
    # Capacity 4: the fifth entry overwrote the oldest (stamp 0, first free order) slot.
    assert sorted(np.asarray(q.group_key)[np.asarray(q.valid)].tolist()) == [1, 2, 3, 4]
    slots, ok, q2 = queue_take(q, 3, pilot_priority(q))
    taken = np.asarray(q.group_key)[np.asarray(slots)][np.asarray(ok)].tolist()
    assert taken == [3, 2, 1]  # variance 0.25 first, newest first among equals; then 0.1875
    assert np.asarray(q2.valid).sum() == 1
    q3, dropped = queue_expire(q, 5, 4)
    assert np.asarray(dropped).sum() == 2 and np.asarray(q3.valid).sum() == 2
