"""Slot engine (sampling/engine.py, sampling/slot_pool.py): a rollout's tokens are round mode's.

The pool (8 slots) is smaller than the 11 rollouts and contexts arrive while others decode, so
rollouts start in reused slots, in later chunks, beside different rows; each must still equal what one
round-mode ``Sampler.generate`` call gives it (same seed, context id and sample index).
"""

import numpy as np
import pytest

from passrate_jax.sampling import Context, Sampler, SamplingConfig
from passrate_jax.sampling.slot_pool import SlotEngine
from test_sampling import EOS, tiny_model

BUCKETS = dict(row_buckets=(8,), context_buckets=(16, 32), prefill_row_buckets=(8,), generation_buckets=(8,),
               max_new_tokens=8)
GREEDY = SamplingConfig(temperature=0.0, **BUCKETS)
SAMPLE = SamplingConfig(temperature=0.7, top_k=20, top_p=0.9, **BUCKETS)
NARROW = SamplingConfig(temperature=0.7, top_k=20, top_p=0.9, narrow_slots=4, **BUCKETS)
RNG = np.random.default_rng(1)
CONTEXTS = [Context(RNG.integers(3, 64, n).tolist(), num_samples=k, context_id=10 + i, first_sample_index=f,
                    max_new_tokens=b)
            for i, (n, k, f, b) in enumerate([(3, 3, 0, 8), (9, 2, 4, 5), (6, 4, 0, 8), (12, 2, 1, 3)])]


def engine_rollouts(sampler: Sampler, seed: int, rows: int = 8, chunk: int = 3, lagged: bool = True):
    """{(context id, sample index): Finished} of every context, the later ones added every other chunk."""
    pool = SlotEngine(sampler, rows=rows, chunk=chunk).pool(sampler.kv_store(), seed=seed, lagged=lagged)
    pending, got = list(CONTEXTS), {}
    while pending or not pool.idle:
        if pending and pool.chunks % 2 == 0:
            c = pending.pop(0)
            pool.add(c, tag=c.context_id)
        for f in pool.advance():
            assert (f.tag, f.sample_index) not in got
            got[(f.tag, f.sample_index)] = f
    return pool, got


@pytest.mark.parametrize("cfg,lagged", [(GREEDY, True), (SAMPLE, True), (SAMPLE, False), (NARROW, True)],
                         ids=["greedy", "sampled", "sampled-at-once", "sampled-narrow"])
def test_engine_tokens_equal_round_mode(cfg, lagged):
    sampler = Sampler(tiny_model(), cfg, eos_id=EOS)
    sampler.reserve_store(8, 32)
    rounds = sampler.generate(CONTEXTS, seed=5, store=sampler.kv_store())
    pool, got = engine_rollouts(sampler, seed=5, lagged=lagged)
    assert pool.chunks > 4 and pool.inserts >= 4 and 0 < pool.utilization < 1
    assert len(got) == len(rounds.lengths) == sum(c.num_samples for c in CONTEXTS)
    for row, ci in enumerate(rounds.context_index):
        f = got[(CONTEXTS[ci].context_id, int(rounds.sample_index[row]))]
        assert f.ids == rounds.completion(row) and f.stopped == rounds.stopped[row], row
        np.testing.assert_allclose(f.policy_logprobs, rounds.policy_logprobs[row, :len(f.ids)], atol=1e-5)
    assert len(set(rounds.lengths.tolist())) > 1  # rows of different lengths: stops and budgets
    assert pool.generated == int(rounds.lengths.sum())
    assert (pool.narrow_chunks > 0) == (cfg is NARROW)


def test_narrow_chunks_decode_only_occupied_rows_and_count_them():
    """``sampling.narrow_slots``: chunks dispatched while at most 4 of the 8 rows are occupied decode those
    rows only. The same rollouts come out in the same chunks (above: each equals round mode's), the live
    rows decoded are the same, and the rows decoded, utilization's denominator, are fewer: 4 a decode
    step in a narrow chunk, not 8 (counting the pool's rows there fails this)."""
    counts = {}
    for cfg in (SAMPLE, NARROW):
        sampler = Sampler(tiny_model(), cfg, eos_id=EOS)
        sampler.reserve_store(8, 32)
        pool, got = engine_rollouts(sampler, seed=5)
        counts[cfg is NARROW] = (pool, {k: f.ids for k, f in got.items()})
    (wide, wide_ids), (narrow, narrow_ids) = counts[False], counts[True]
    assert narrow_ids == wide_ids and narrow.chunks == wide.chunks and wide.narrow_chunks == 0
    assert 0 < narrow.narrow_chunks < narrow.chunks
    assert narrow.live_steps == wide.live_steps
    assert wide.slot_steps - narrow.slot_steps > 0 and (wide.slot_steps - narrow.slot_steps) % 4 == 0
    assert narrow.utilization > wide.utilization


def test_the_pool_refills_as_the_simulators_model_of_it_does():
    """The real pool against ``tests/test_sim_engine.py``'s host model of it (which the simulator is
    cross-checked against), fed the real answers' lengths: every ``advance`` delivers the same rollouts,
    in the same number of chunks. With 2 slots for 11 rollouts the queue is rarely empty, so this checks
    that a slot freed in one chunk takes a queued rollout in the next (harvesting after the dispatch
    alone refills a chunk later and fails it)."""
    from types import SimpleNamespace

    from tests.test_sim_engine import PoolModel
    sampler = Sampler(tiny_model(), GREEDY, eos_id=EOS)
    sampler.reserve_store(8, 32)
    pool = SlotEngine(sampler, rows=2, chunk=3).pool(sampler.kv_store(), seed=5)
    for c in CONTEXTS:
        pool.add(c, tag=c.context_id)
    real = []
    while not pool.idle:
        real.append([(f.tag, f.sample_index, len(f.ids)) for f in pool.advance()])
    lengths = {(tag, index): n for call in real for tag, index, n in call}
    assert len(lengths) == 11 and len(set(lengths.values())) > 1
    model = PoolModel(SimpleNamespace(lengths=lengths), slots=2, chunk=3)
    for c in CONTEXTS:
        model.add(SimpleNamespace(num_rollouts=c.num_samples, first_index=c.first_sample_index,
                                  prompt_id=c.context_id), tag=c.context_id)
    modelled = []
    while not model.idle:
        modelled.append([(tag, index, lengths[key]) for tag, index, key in model.advance()])
    assert real == modelled and pool.chunks == model.chunks


def test_a_pool_harvesting_at_once_delivers_a_rollout_with_the_chunk_it_ends_in():
    """``lagged=False`` (``sampling.harvest``): each ``advance`` returns what its own chunk finished, so
    the last rollout comes back with the last chunk; a lagged pool needs one more ``advance`` to read it
    (and, not knowing its rows are done, dispatches one more chunk first). Both deliver the same rollouts."""
    sampler = Sampler(tiny_model(), SAMPLE, eos_id=EOS)
    sampler.reserve_store(8, 32)
    delivered = {}
    for lagged in (True, False):
        pool = SlotEngine(sampler, rows=8, chunk=3).pool(sampler.kv_store(), seed=5, lagged=lagged)
        pool.add(CONTEXTS[0], tag=0)
        calls = []
        while not pool.idle:
            calls.append([(f.sample_index, tuple(f.ids)) for f in pool.advance()])
        delivered[lagged] = sorted(x for call in calls for x in call)
        assert len(calls) == pool.chunks + (1 if lagged else 0), lagged
        if not lagged:  # a rollout comes back with the chunk of its last token; the last with the last chunk
            assert calls[-1]
            ends = {index: max(1, -(-(len(ids) - 1) // 3)) for index, ids in delivered[lagged]}
            assert {i: n for n, call in enumerate(calls, 1) for i, _ in call} == ends
    assert delivered[True] == delivered[False] and len(delivered[True]) == 3
