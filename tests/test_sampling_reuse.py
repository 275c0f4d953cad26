"""KV reuse across sampler calls: a step's prefix store and live rows give the same tokens as
prefilling every context again, greedy and sampled with the same key, and compute each context's KV once.
"""

import numpy as np
import pytest

from passrate_jax.sampling import Context, Sampler, SamplingConfig
from test_sampling import EOS, tiny_model

# Small buckets so that a store grows in both contexts and slots within one test.
BUCKETS = dict(row_buckets=(8, 16), context_buckets=(16, 32, 64), prefill_row_buckets=(2, 4, 8),
               generation_buckets=(8,), max_new_tokens=8)
CFGS = {"greedy": SamplingConfig(temperature=0.0, **BUCKETS),
        "sampled": SamplingConfig(temperature=0.8, top_k=30, **BUCKETS)}
RNG = np.random.default_rng(1)
PROMPTS = [RNG.integers(3, 64, n).tolist() for n in (5, 12, 9, 20)]


@pytest.fixture(scope="module")
def sampler():
    return Sampler(tiny_model(), CFGS["sampled"], eos_id=EOS)


def assert_same_rows(a, b):
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.lengths, b.lengths)
    np.testing.assert_allclose(a.policy_logprobs, b.policy_logprobs, atol=1e-5)


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_store_rounds_equal_reprefilling(sampler, mode):
    cfg = CFGS[mode]
    # SARA-like rounds: a probe of 2, then the continuation (samples 2..5) of two contexts plus new ones,
    # the last longer than any before (the store grows in contexts and in slots).
    rounds = [[Context(PROMPTS[0], num_samples=2, context_id=10), Context(PROMPTS[1], num_samples=2, context_id=11)],
              [Context(PROMPTS[1], num_samples=4, context_id=11, first_sample_index=2),
               Context(PROMPTS[2], num_samples=2, context_id=12),
               Context(PROMPTS[0], num_samples=4, context_id=10, first_sample_index=2)],
              [Context(PROMPTS[3], prefix_ids=PROMPTS[1], num_samples=3, context_id=13),
               Context(PROMPTS[2], num_samples=1, context_id=12, first_sample_index=2)]]
    store = sampler.kv_store()
    calls = sampler.prefill_calls
    fresh = sampler.store_capacity == (0, 0)  # the module's first store starts empty, then grows
    capacities = []
    for contexts in rounds:
        reused = sampler.generate(contexts, seed=7, cfg=cfg, store=store)
        assert_same_rows(reused, sampler.generate(contexts, seed=7, cfg=cfg))
        capacities.append(store.capacity)
    distinct = [PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[3] + PROMPTS[1]]
    assert store.prefilled == 4 and store.prefill_tokens == sum(map(len, distinct))
    assert store.context_tokens == sum(map(len, distinct))
    # prefilling every call in full (no reuse) computes each context once per round it appears in
    assert store.unshared_tokens == sum(len(c.ids) for contexts in rounds for c in contexts)
    assert capacities[-1] == sampler.store_capacity == (4, 32)
    if fresh:
        assert capacities[0][0] < capacities[1][0] and capacities[1][1] < capacities[2][1]
    # the store prefilled 4 contexts, the three re-prefilling calls 2 + 3 + 2
    assert sampler.prefill_calls - calls == 4 + 7
    with pytest.raises(ValueError, match="not both"):
        sampler.generate(rounds[0], params=sampler.params, store=store)


def test_next_step_store_compiles_nothing_new(sampler):
    contexts = [Context(PROMPTS[0], num_samples=2, context_id=10), Context(PROMPTS[3], num_samples=2)]
    first = sampler.kv_store()
    sampler.generate(contexts, seed=1, store=first)
    capacity = first.capacity
    first.release()
    before = sampler.compilations
    second = sampler.kv_store()  # starts at the first store's capacity: same programs
    sampler.generate(contexts, seed=2, store=second)
    sampler.generate(contexts[:1], seed=3, store=second)
    assert sampler.compilations == before and second.capacity == capacity != (0, 0)


def test_later_round_reuses_the_store_filling_prefill_program():
    """Default prefill buckets: a later round's few new contexts pad to the 16 rows that filled the step's
    store, so that round compiles no prefill program of its own (one program less in the default run)."""
    sampler = Sampler(tiny_model(), SamplingConfig(max_new_tokens=8, generation_buckets=(8,), context_buckets=(16,)),
                      eos_id=EOS)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, 64, 6).tolist() for _ in range(21)]
    store = sampler.kv_store()
    sampler.generate([Context(p, num_samples=4, context_id=i) for i, p in enumerate(prompts[:16])], store=store)
    assert sampler.compilations == 2 and store.capacity == (16, 16)  # prefill and decode of 64 rows
    sampler.generate([Context(p, num_samples=4, context_id=16 + i) for i, p in enumerate(prompts[16:])], store=store)
    assert sampler.compilations == 2 and store.prefilled == 21


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_live_turns_equal_reprefilling_the_conversation(sampler, mode):
    cfg = CFGS[mode]
    store = sampler.kv_store()
    starts = [Context(PROMPTS[0], num_samples=3, context_id=20), Context(PROMPTS[2], num_samples=2, context_id=21)]
    out, live = sampler.generate_live(starts, live_len=64, seed=4, cfg=cfg, store=store)
    assert_same_rows(out, sampler.generate(starts, seed=4, cfg=cfg))
    appended_before, context_before = store.prefill_tokens, store.context_tokens
    unshared_before = store.unshared_tokens
    rows = list(range(len(out.lengths)))
    for turn in range(2):
        # An observation per surviving row (rows 1 and 3 end after the first turn), then the next turn
        # from the whole conversation, with a turn-specific context id per row.
        parents = rows[::2] if turn == 0 else rows
        contexts = [Context(live.tokens[p] + tuple(RNG.integers(3, 64, 3 + p).tolist()), num_samples=1,
                            context_id=100 * turn + p, max_new_tokens=6) for p in parents]
        out, new_live = sampler.extend_live(live, parents, contexts, seed=4, cfg=cfg)
        assert_same_rows(out, sampler.generate(contexts, seed=4, cfg=cfg))
        # Only the appended tokens ran: each observation plus the row's last generated token.
        assert store.prefill_tokens - appended_before == sum(len(c.ids) - live.valid[p]
                                                             for p, c in zip(parents, contexts))
        assert all(len(c.ids) - live.valid[p] == 4 + p for p, c in zip(parents, contexts))
        # Each context adds its row's action and observation to the row's context.
        assert store.context_tokens - context_before == sum(len(c.ids) - live.context_len[p]
                                                            for p, c in zip(parents, contexts))
        assert store.unshared_tokens - unshared_before == sum(len(c.ids) for c in contexts)
        appended_before, context_before = store.prefill_tokens, store.context_tokens
        unshared_before = store.unshared_tokens
        live, rows = new_live, list(range(len(parents)))
    with pytest.raises(ValueError, match="do not extend live row 0"):
        sampler.extend_live(live, [0], [Context((1,) + live.tokens[0])], cfg=cfg)
    with pytest.raises(ValueError, match="the live rows' slots = 64"):
        sampler.extend_live(live, [0], [Context(live.tokens[0] + (5,), max_new_tokens=64)], cfg=cfg)
    with pytest.raises(ValueError, match="live_len = 16"):
        sampler.generate_live([Context(PROMPTS[3], max_new_tokens=8)], live_len=16, cfg=cfg)


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_unrolled_layers_decode_the_scanned_models_tokens(sampler, mode):
    """Unrolled layers decode in KVCache.decode_form (per-layer buffers, keys [B, kv, e, S]) with the
    layer weights sliced once: the same rows as the scanned model over a store's rounds and live turns."""
    cfg = CFGS[mode]
    unrolled = Sampler(tiny_model(scan_layers=False), CFGS["sampled"], eos_id=EOS)
    contexts = [Context(PROMPTS[0], num_samples=3, context_id=60), Context(PROMPTS[3], num_samples=2, context_id=61)]
    later = [Context(PROMPTS[3], num_samples=2, context_id=61, first_sample_index=2),
             Context(PROMPTS[1], prefix_ids=PROMPTS[2], num_samples=2, context_id=62)]
    scanned_store, unrolled_store = sampler.kv_store(), unrolled.kv_store()
    for call in (contexts, later):
        assert_same_rows(unrolled.generate(call, seed=5, cfg=cfg, store=unrolled_store),
                         sampler.generate(call, seed=5, cfg=cfg, store=scanned_store))
    lives = [s.generate_live(contexts, live_len=48, seed=5, cfg=cfg)[1] for s in (sampler, unrolled)]
    turn = [Context(lives[0].tokens[p] + (7, 8, 9), context_id=70 + p, max_new_tokens=6) for p in (0, 3)]
    (scanned_out, _), (unrolled_out, _) = (s.extend_live(live, [0, 3], turn, seed=5, cfg=cfg)
                                           for s, live in zip((sampler, unrolled), lives))
    assert lives[0].tokens == lives[1].tokens
    assert_same_rows(unrolled_out, scanned_out)


def test_equal_turns_share_one_append(sampler):
    store = sampler.kv_store()
    _, live = sampler.generate_live([Context(PROMPTS[1], num_samples=2, context_id=30)], live_len=48,
                                    cfg=CFGS["greedy"], store=store)
    assert live.tokens[0] == live.tokens[1]  # greedy: both rows took the same turn
    before, contexts_before = store.prefill_tokens, store.context_tokens
    contexts = [Context(live.tokens[0] + (7, 8, 9), context_id=40 + p, max_new_tokens=6) for p in (0, 1)]
    out, _ = sampler.extend_live(live, [0, 1], contexts, seed=2, cfg=CFGS["sampled"])
    assert store.prefill_tokens - before == 1 + 3  # one append: the last action token and the observation
    assert store.context_tokens - contexts_before == len(contexts[0].ids) - len(PROMPTS[1])
    assert_same_rows(out, sampler.generate(contexts, seed=2, cfg=CFGS["sampled"]))
    assert out.completion(0) != out.completion(1)  # each row still draws with its own context id


def test_rows_are_recycled_least_recently_used_first(sampler):
    cfg = CFGS["sampled"]
    store = sampler.kv_store()
    a, b, c, d, e = (Context(PROMPTS[i % 4][: 4 + i], num_samples=2, context_id=50 + i) for i in range(5))
    for call in ([a, b], [c, d], [e]):
        sampler.generate(call, seed=3, cfg=cfg, store=store)
    # a's row was recycled (it was least recently used): it is prefilled again, with the same tokens.
    assert store.lookup(a.ids) is None and store.prefilled == 5
    assert_same_rows(sampler.generate([a, e], seed=3, cfg=cfg, store=store), sampler.generate([a, e], seed=3, cfg=cfg))
    assert store.prefilled == 6 and store.capacity[0] <= 4  # one call's contexts, not the step's five
    assert store.context_tokens == sum(len(x.ids) for x in (a, b, c, d, e))  # a counted once as a context


def test_reserved_store_serves_rounds_and_evaluation_with_one_program_per_bucket():
    """A reserved store: calls of 1 to 12 contexts (more than the largest prefill bucket, so prefilled in
    batches), 16- and 32-token contexts, greedy and sampled, shared step stores and one-call stores, over
    two steps, compile one prefill program per context bucket and one decode program per row bucket, and
    give the tokens of a sampler that sizes every store for the call."""
    buckets = dict(BUCKETS, prefill_row_buckets=(8,))
    cfg = SamplingConfig(temperature=0.8, **buckets)
    reserved = Sampler(tiny_model(), cfg, eos_id=EOS)
    plain = Sampler(tiny_model(), cfg, eos_id=EOS)
    assert reserved.reserve_store(12, 20 + 8) == (16, 32)  # 12 contexts -> 2 x 8; 28 slots -> 32
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 64, n).tolist() for n in [5, 14, 9, 3, 12, 7, 10, 6, 11, 4, 8, 13]]
    long = rng.integers(3, 64, 20).tolist()  # a 32-token context bucket
    calls = [  # (contexts, greedy, shared)
        ([Context(p, num_samples=1, context_id=i) for i, p in enumerate(prompts)], True, False),   # eval
        ([Context(p, num_samples=1, context_id=i) for i, p in enumerate(prompts[:4])], False, False),
        ([Context(prompts[0], num_samples=2, context_id=0), Context(long, num_samples=2, context_id=50)], False, True),
        ([Context(p, num_samples=1, context_id=i, first_sample_index=2) for i, p in enumerate(prompts)], False, True),
    ]
    for step in range(2):
        stores = {s: s.kv_store() for s in (reserved, plain)}
        for contexts, greedy, shared in calls:
            call_cfg = SamplingConfig(temperature=0.0, **buckets) if greedy else cfg
            out = {s: s.generate(contexts, seed=step, cfg=call_cfg, **({"store": stores[s]} if shared else {}))
                   for s in (reserved, plain)}
            assert_same_rows(out[reserved], out[plain])
        for store in stores.values():
            store.release()
    # prefill: 16- and 32-token contexts; decode: 8 and 16 rows (greedy and sampled share each)
    assert reserved.compilations == 4 and reserved.store_capacity == (16, 32)
    assert plain.compilations > reserved.compilations
    # per step, 12 new contexts ran as 2 batches of 8 (twice: 11 in the last call), 4 and 2 as one each
    assert reserved.prefill_batches == plain.prefill_batches == 2 * (2 + 1 + 1 + 2)
    with pytest.raises(ValueError, match="contexts=0"):
        reserved.reserve_store(0, 8)
