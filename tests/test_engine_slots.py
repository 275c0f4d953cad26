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
RNG = np.random.default_rng(1)
CONTEXTS = [Context(RNG.integers(3, 64, n).tolist(), num_samples=k, context_id=10 + i, first_sample_index=f,
                    max_new_tokens=b)
            for i, (n, k, f, b) in enumerate([(3, 3, 0, 8), (9, 2, 4, 5), (6, 4, 0, 8), (12, 2, 1, 3)])]


def engine_rollouts(sampler: Sampler, seed: int, rows: int = 8, chunk: int = 3):
    """{(context id, sample index): Finished} of every context, the later ones added every other chunk."""
    pool = SlotEngine(sampler, rows=rows, chunk=chunk).pool(sampler.kv_store(), seed=seed)
    pending, got = list(CONTEXTS), {}
    while pending or not pool.idle:
        if pending and pool.chunks % 2 == 0:
            c = pending.pop(0)
            pool.add(c, tag=c.context_id)
        for f in pool.advance():
            assert (f.tag, f.sample_index) not in got
            got[(f.tag, f.sample_index)] = f
    return pool, got


@pytest.mark.parametrize("cfg", [GREEDY, SAMPLE], ids=["greedy", "sampled"])
def test_engine_tokens_equal_round_mode(cfg):
    sampler = Sampler(tiny_model(), cfg, eos_id=EOS)
    sampler.reserve_store(8, 32)
    rounds = sampler.generate(CONTEXTS, seed=5, store=sampler.kv_store())
    pool, got = engine_rollouts(sampler, seed=5)
    assert pool.chunks > 4 and pool.inserts >= 4 and 0 < pool.utilization < 1
    assert len(got) == len(rounds.lengths) == sum(c.num_samples for c in CONTEXTS)
    for row, ci in enumerate(rounds.context_index):
        f = got[(CONTEXTS[ci].context_id, int(rounds.sample_index[row]))]
        assert f.ids == rounds.completion(row) and f.stopped == rounds.stopped[row], row
        np.testing.assert_allclose(f.policy_logprobs, rounds.policy_logprobs[row, :len(f.ids)], atol=1e-5)
    assert len(set(rounds.lengths.tolist())) > 1  # rows of different lengths: stops and budgets
    assert pool.generated == int(rounds.lengths.sum())
