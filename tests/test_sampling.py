"""Sampler: cached decode against the full forward, prefill sharing, prefix replay, stops, randomness.

One module-scoped sampler with single buckets keeps this file to a few compiled programs.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from passrate_jax.model import ModelConfig, Transformer
from passrate_jax.sampling import Context, Sampler, SamplingConfig, bucket, filter_logits, training_rows

EOS = 2
G = 8       # generation bucket
WIDTH = 24  # reference-forward buffer: longest context (16) + G
BUCKETS = dict(row_buckets=(8,), context_buckets=(16,), prefill_row_buckets=(8,), generation_buckets=(G,),
               max_new_tokens=G)
GREEDY = SamplingConfig(temperature=0.0, **BUCKETS)
SAMPLE = SamplingConfig(temperature=0.7, top_k=20, top_p=0.9, **BUCKETS)


def tiny_model(seed: int = 0, scan_layers: bool = True) -> Transformer:
    """Qwen3-shaped (GQA, q/k norm) with numpy-random weights: matrices of std 0.2, so that next-token
    distributions are peaked and argmax never hinges on float rounding; numpy, because an eager or
    jitted random init would cost more compile time than the tests themselves. The weights do not depend
    on ``scan_layers``."""
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, qk_norm=True, scan_layers=scan_layers)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(seed)
    state = jax.tree.map(lambda x: jnp.asarray(
        rng.normal(0, 0.2, x.shape) if len(x.shape) >= 2 else 1 + 0.1 * rng.normal(size=x.shape), x.dtype), state)
    return nnx.merge(graphdef, state)


@pytest.fixture(scope="module")
def setup():
    model = tiny_model()
    sampler = Sampler(model, SAMPLE, eos_id=EOS)
    graphdef, params = nnx.split(model)

    @jax.jit
    def forward(tokens_bt, mask_bt):
        return nnx.merge(graphdef, params)(tokens_bt, None, mask_bt)

    return sampler, forward


RNG = np.random.default_rng(0)
CONTEXTS = [  # mixed lengths in one batch, one with a replayed prefix
    Context(RNG.integers(3, 64, 3).tolist(), num_samples=2),
    Context(RNG.integers(3, 64, 9).tolist(), prefix_ids=RNG.integers(3, 64, 4).tolist(), num_samples=3),
    Context(RNG.integers(3, 64, 6).tolist(), num_samples=1),
]


def teacher_forced(forward, seqs: list[list[int]]) -> np.ndarray:
    """Full no-cache forward of right-padded sequences: logits [N, WIDTH, V]."""
    tokens = np.zeros((8, WIDTH), np.int32)
    mask = np.zeros((8, WIDTH), np.int32)
    for i, s in enumerate(seqs):
        tokens[i, : len(s)], mask[i, : len(s)] = s, 1
    return np.asarray(forward(tokens, mask))[: len(seqs)]


def test_greedy_equals_stepwise_argmax_of_full_forward(setup):
    sampler, forward = setup
    result = sampler.generate(CONTEXTS, cfg=GREEDY)
    seqs = [list(CONTEXTS[c].ids) for c in result.context_index]
    reference = [[] for _ in seqs]
    for _ in range(G):  # step-by-step argmax, no cache, ignoring stops
        logits = teacher_forced(forward, seqs)
        for i, s in enumerate(seqs):
            token = int(np.argmax(logits[i, len(s) - 1]))
            s.append(token)
            reference[i].append(token)
    for i, ref in enumerate(reference):
        stop = next((k for k, t in enumerate(ref) if t == EOS), None)
        expected = ref if stop is None else ref[: stop + 1]
        assert result.completion(i) == expected
        assert result.finish_reason[i] == ("length" if stop is None else "stop")
        assert np.all(result.tokens[i, len(expected):] == 0)  # padding after the finish
    # rows of one context under greedy are identical; the prefill ran once per context
    np.testing.assert_array_equal(result.tokens[0], result.tokens[1])
    np.testing.assert_allclose(result.logprobs, 0.0)  # greedy: a point mass


@pytest.mark.parametrize("cfg", [SAMPLE, SamplingConfig(temperature=1.0, **BUCKETS)], ids=["filtered", "unfiltered"])
def test_logprobs_equal_teacher_forced_forward(setup, cfg):
    sampler, forward = setup
    result = sampler.generate(CONTEXTS, cfg=cfg, seed=3)
    seqs = [list(CONTEXTS[c].ids) + result.completion(i) for i, c in enumerate(result.context_index)]
    logits = teacher_forced(forward, seqs)
    # log-softmax of the raw and of the filtered logits at every position, in one call each
    flat = logits.reshape(-1, logits.shape[-1])
    policy_all = np.asarray(jax.nn.log_softmax(flat)).reshape(logits.shape)
    filtered = jax.jit(functools.partial(filter_logits, temperature=cfg.temperature, top_k=cfg.top_k,
                                         top_p=cfg.top_p))(flat)
    sampled_all = np.asarray(jax.nn.log_softmax(filtered)).reshape(logits.shape)
    for i, c in enumerate(result.context_index):
        n_ctx, n = len(CONTEXTS[c].ids), int(result.lengths[i])
        steps, toks = np.arange(n_ctx - 1, n_ctx - 1 + n), np.asarray(result.completion(i))
        np.testing.assert_allclose(result.policy_logprobs[i, :n], policy_all[i, steps, toks], atol=1e-5)
        np.testing.assert_allclose(result.logprobs[i, :n], sampled_all[i, steps, toks], atol=1e-5)
        assert np.all(result.policy_logprobs[i, n:] == 0) and result.loss_mask[i].sum() == n
    rows = training_rows(CONTEXTS, result)
    i = 2  # first row of context 1: 9 prompt tokens, 4 replayed, then the completion
    n = int(result.lengths[i])
    assert rows["tokens"][i, : 13 + n].tolist() == seqs[i]
    assert rows["replayed_mask"][i].tolist() == [9 <= k < 13 for k in range(rows["tokens"].shape[1])]
    assert rows["loss_mask"][i].tolist() == [13 <= k < 13 + n for k in range(rows["tokens"].shape[1])]
    np.testing.assert_allclose(rows["policy_logprobs"][i, 13: 13 + n], result.policy_logprobs[i, :n])


def test_shared_prefill_equals_independent_prefill(setup):
    sampler, _ = setup
    shared = sampler.generate(CONTEXTS, seed=5)
    calls = sampler.prefill_calls
    # Same rows, each prefilled on its own: one context per row, same ids and sample indices.
    independent = [Context(CONTEXTS[c].prompt_ids, CONTEXTS[c].prefix_ids, num_samples=1, context_id=int(c),
                           first_sample_index=int(j))
                   for c, j in zip(shared.context_index, shared.sample_index)]
    alone = sampler.generate(independent, seed=5)
    assert sampler.prefill_calls - calls == len(independent) == 6
    np.testing.assert_array_equal(shared.tokens, alone.tokens)
    np.testing.assert_allclose(shared.policy_logprobs, alone.policy_logprobs, atol=1e-5)
    # the three continuations of context 1 differ from each other (fresh randomness per index)
    assert len({tuple(shared.completion(i)) for i in (2, 3, 4)}) > 1


def test_sampling_reproducible_under_batch_composition(setup):
    sampler, _ = setup
    target = Context(CONTEXTS[1].prompt_ids, CONTEXTS[1].prefix_ids, num_samples=4, context_id=42)
    alone = sampler.generate([target], seed=11)
    # Samples 2 and 3 again, now after other contexts in the batch and with a resumed sample index.
    resumed = Context(target.prompt_ids, target.prefix_ids, num_samples=2, context_id=42, first_sample_index=2)
    mixed = sampler.generate([CONTEXTS[0], CONTEXTS[2], resumed], seed=11)
    np.testing.assert_array_equal(mixed.tokens[3:5], alone.tokens[2:4])
    np.testing.assert_array_equal(mixed.sample_index[3:5], [2, 3])
    other_seed = sampler.generate([target], seed=12)
    assert not np.array_equal(other_seed.tokens, alone.tokens)


def test_prefix_continuation_equals_original_sequence(setup):
    sampler, _ = setup
    prompt = CONTEXTS[0].prompt_ids
    original = sampler.generate([Context(prompt)], cfg=GREEDY)
    full = original.completion(0)
    cut = min(3, len(full) - 1)
    replay = sampler.generate([Context(prompt, prefix_ids=full[:cut], max_new_tokens=G - cut)], cfg=GREEDY)
    assert replay.completion(0) == full[cut:]
    np.testing.assert_allclose(replay.policy_logprobs[0, : G - cut], original.policy_logprobs[0, cut:G],
                               atol=1e-5)


def test_stop_ids_and_length_limits(setup):
    sampler, _ = setup
    free = sampler.generate(CONTEXTS, cfg=GREEDY)  # greedy tokens do not depend on the stop settings
    row = int(np.argmax(free.lengths))
    assert free.lengths[row] > 3
    stop_token = int(free.tokens[row, 3])
    cfg = SamplingConfig(temperature=0.0, stop_token_ids=(stop_token,), **BUCKETS)
    budget = (G, 5, 2)
    stopped = sampler.generate([Context(c.prompt_ids, c.prefix_ids, c.num_samples, max_new_tokens=m)
                                for c, m in zip(CONTEXTS, budget)], cfg=cfg)
    for i, c in enumerate(stopped.context_index):
        ref = free.completion(i)
        hit = next((k for k, t in enumerate(ref[: budget[c]]) if t in (EOS, stop_token)), None)
        n = budget[c] if hit is None else hit + 1
        assert stopped.completion(i) == ref[:n]
        assert stopped.finish_reason[i] == ("length" if hit is None else "stop")
        assert stopped.loss_mask[i].tolist() == [k < n for k in range(G)]
    assert stopped.lengths[row] <= 4 and stopped.finish_reason[row] == "stop"
    assert set(stopped.finish_reason) == {"stop", "length"}


def test_compile_counter_and_buckets(setup):
    assert [bucket(n, (8, 16)) for n in (1, 8, 9, 17, 40)] == [8, 8, 16, 32, 48]
    assert bucket(5, (8,), multiple=3) == 9  # rows also divisible by the data-parallel shards
    sampler, _ = setup
    before = sampler.compilations
    sampler.generate(CONTEXTS[:1], seed=1)  # fewer rows and contexts, same buckets: no new program
    sampler.generate(CONTEXTS, seed=2)
    sampler.generate(CONTEXTS, cfg=GREEDY)
    assert sampler.compilations == before


def test_filter_logits_top_k_top_p_and_sampling_frequencies():
    logits = jnp.log(jnp.asarray([[0.5, 0.25, 0.15, 0.1]]))
    kept = lambda **kw: np.asarray(filter_logits(logits, temperature=1.0, **kw) > -1e29)[0].tolist()
    assert kept(top_k=2) == [True, True, False, False]
    assert kept(top_p=0.7) == [True, True, False, False]   # 0.5 < 0.7, 0.75 >= 0.7
    assert kept(top_p=0.75) == [True, True, False, False]
    assert kept(top_p=0.76) == [True, True, True, False]
    from passrate_jax.sampling.distributions import sample_tokens
    n = 8000
    draw = jax.jit(lambda keys: sample_tokens(jnp.repeat(logits, n, 0), keys, temperature=1.0, top_k=3))
    tokens, lp, _ = draw(jax.random.split(jax.random.key(0), n))
    freq = np.bincount(np.asarray(tokens), minlength=4) / n
    # 4 standard errors of a frequency near 0.5 at n = 8000 is 0.022
    np.testing.assert_allclose(freq, [0.5 / 0.9, 0.25 / 0.9, 0.15 / 0.9, 0.0], atol=0.022)
    np.testing.assert_allclose(np.exp(np.asarray(lp)[np.asarray(tokens) == 0]), 0.5 / 0.9, rtol=1e-5)


@pytest.mark.parametrize("top_k", [0, 3])
def test_traced_temperature_draws_what_each_static_temperature_draws(top_k):
    """One program for every temperature (greedy evaluation shares the sampler's decode program): a traced
    temperature picks the branch a Python number compiles alone, with the same tokens and log-probs."""
    from passrate_jax.sampling.distributions import sample_tokens
    logits = jax.random.normal(jax.random.key(0), (16, 40)) * 3
    keys = jax.random.split(jax.random.key(1), 16)
    traces = []

    def draw(t):
        traces.append(t)  # runs once per trace, i.e. once per compiled program
        return sample_tokens(logits, keys, temperature=t, top_k=top_k, top_p=0.9)

    traced = jax.jit(draw)
    for temperature in (0.0, 1.0, 0.7):
        want = sample_tokens(logits, keys, temperature=temperature, top_k=top_k, top_p=0.9)
        got = traced(jnp.float32(temperature))
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_allclose(got[1], want[1], atol=1e-5)
        np.testing.assert_allclose(got[2], want[2], atol=1e-5)
    assert len(traces) == 1
