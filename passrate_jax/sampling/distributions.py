"""Next-token distributions: temperature, top-k and top-p filtering, and per-row sampling.

All functions are pure and jit-compatible; the filter settings are Python scalars (static), so a
disabled filter costs nothing in the compiled program; the temperature may also be traced (see
:func:`sample_tokens`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

# Finite stand-in for -inf: a filtered-out token gets probability exactly 0 after softmax, while
# arithmetic on the masked logits (e.g. logsumexp of an all-masked row) never produces NaN.
NEG_INF = -1e30


def _sortable(x_rv: jax.Array) -> jax.Array:
    """int32 keys ordered like the float32 values (for finite floats): flip the magnitude bits of negatives."""
    i = jax.lax.bitcast_convert_type(x_rv.astype(jnp.float32), jnp.int32)
    return i ^ ((i >> 31) & 0x7FFFFFFF)


def _largest_threshold(key_rv: jax.Array, weight_rv: jax.Array, target_r: jax.Array) -> jax.Array:
    """Per row, the largest int32 ``t`` with ``sum(weight[key >= t]) >= target`` (bisection, 32 rounds).

    Why not sort or ``lax.top_k``: on XLA:CPU both cost ~100x more than 32 masked sums over the vocabulary.
    Assumes the whole row's weight reaches ``target``.
    """
    lo = jnp.min(key_rv, axis=-1)  # invariant: the predicate holds at lo, fails at hi
    hi = jnp.max(key_rv, axis=-1)

    def body(_, bounds):
        lo, hi = bounds
        mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)  # floor((lo + hi) / 2) without int32 overflow
        ok = jnp.sum(jnp.where(key_rv >= mid[:, None], weight_rv, 0), axis=-1) >= target_r
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    # hi itself may satisfy the predicate (the max entry alone reaches target): test it first.
    top_ok = jnp.sum(jnp.where(key_rv >= hi[:, None], weight_rv, 0), axis=-1) >= target_r
    lo, _ = jax.lax.fori_loop(0, 32, body, (lo, hi))
    return jnp.where(top_ok, hi, lo)


def filter_logits(logits_rv: jax.Array, *, temperature: float, top_k: int = 0, top_p: float = 1.0) -> jax.Array:
    """Logits of the sampling distribution: divided by ``temperature`` (> 0), then restricted to the
    ``top_k`` largest (0 = off), then to the smallest set of most likely tokens whose probability
    reaches ``top_p`` (1 = off).

    Filtered-out entries are set to a large negative number, so ``log_softmax`` of the result is the
    sampling distribution's log-probability (natural log). The order matches transformers' generate
    (temperature, top-k, top-p). Ties at a top-k/top-p threshold are all kept.

    Args:
      logits_rv: float [R, V] raw policy logits.
    Returns:
      float32 [R, V].
    """
    if isinstance(temperature, (int, float)) and temperature <= 0:
        raise ValueError(f"temperature = {temperature}: filter_logits needs > 0 (0 is greedy)")
    logits = logits_rv.astype(jnp.float32) / temperature
    r, vocab = logits.shape
    if 0 < top_k < vocab:
        key = _sortable(logits)
        kth = _largest_threshold(key, jnp.ones_like(logits), jnp.full((r,), top_k, jnp.float32))
        logits = jnp.where(key >= kth[:, None], logits, NEG_INF)
    if top_p < 1.0:
        probs = jax.nn.softmax(logits, axis=-1)
        key = _sortable(probs)
        cut = _largest_threshold(key, probs, top_p * jnp.sum(probs, axis=-1))
        logits = jnp.where(key >= cut[:, None], logits, NEG_INF)
    return logits


def argmax_first(x_rv: jax.Array) -> jax.Array:
    """int32 [R]: index of the first maximum of each row (same result as ``jnp.argmax``).

    Two plain reductions instead of XLA:CPU's variadic (value, index) reduction, which is several times
    slower over a 32k-150k vocabulary.
    """
    top = jnp.max(x_rv, axis=-1, keepdims=True)
    iota = jax.lax.broadcasted_iota(jnp.int32, x_rv.shape, x_rv.ndim - 1)
    return jnp.min(jnp.where(x_rv == top, iota, x_rv.shape[-1]), axis=-1)


def _inverse_cdf(logits_rv: jax.Array, keys_r: jax.Array, block: int = 128) -> tuple[jax.Array, jax.Array]:
    """One draw per row from softmax(logits_rv) by inverting its CDF with one uniform per row; also
    ``logsumexp(logits_rv)`` per row, from the same pass over the vocabulary (the drawn token's log-prob
    needs it: a second pass would cost about as much as the draw).

    Why not ``jax.random.categorical``: its Gumbel trick draws V random numbers per row per step, which
    on CPU costs more than the model's decode step; here the randomness is one float per row. The CDF is
    built in two levels (block sums, then one block's prefix sums) because a flat cumsum over V is
    slow on XLA:CPU. Tokens with probability 0 (filtered) are never returned.
    """
    r, v = logits_rv.shape
    nb = -(-v // block)
    padded = jnp.pad(logits_rv, ((0, 0), (0, nb * block - v)), constant_values=NEG_INF)
    top_r = jnp.max(padded, axis=-1)
    p_rbk = jnp.exp(padded - top_r[:, None]).reshape(r, nb, block)
    mass_rb = p_rbk.sum(-1)
    cdf_rb = jnp.cumsum(mass_rb, axis=-1)
    u_r = jax.vmap(jax.random.uniform)(keys_r) * cdf_rb[:, -1]  # in [0, total)
    iota_b = jnp.arange(nb)
    # First block whose cumulative mass exceeds u (a block without mass never does: its cdf equals
    # the previous block's); rounding at the top end falls back to the last block with mass.
    last_b = jnp.max(jnp.where(mass_rb > 0, iota_b, 0), axis=-1)
    b_r = jnp.minimum(jnp.sum(cdf_rb <= u_r[:, None], axis=-1), last_b)
    p_rk = jnp.take_along_axis(p_rbk, b_r[:, None, None], axis=1)[:, 0]
    before = jnp.take_along_axis(cdf_rb - mass_rb, b_r[:, None], axis=-1)
    inner = before + jnp.cumsum(p_rk, axis=-1)
    iota_k = jnp.arange(block)
    last_k = jnp.max(jnp.where(p_rk > 0, iota_k, 0), axis=-1)
    j_r = jnp.min(jnp.where((inner > u_r[:, None]) & (p_rk > 0), iota_k, block), axis=-1)
    return (b_r * block + jnp.minimum(j_r, last_k)).astype(jnp.int32), top_r + jnp.log(cdf_rb[:, -1])


def _logprob_of(logits_rv: jax.Array, tokens_r: jax.Array, log_norm_r: jax.Array | None = None) -> jax.Array:
    """log softmax(logits)[token] per row, without materialising the [R, V] log-softmax; ``log_norm_r``:
    ``logsumexp(logits_rv)`` when already known."""
    picked = jnp.take_along_axis(logits_rv, tokens_r[:, None], axis=-1)[:, 0]
    return picked - (jax.nn.logsumexp(logits_rv, axis=-1) if log_norm_r is None else log_norm_r)


def sample_tokens(logits_rv: jax.Array, keys_r: jax.Array, *, temperature: float | jax.Array, top_k: int = 0,
                  top_p: float = 1.0) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Draw one token per row, each row with its own PRNG key.

    Args:
      logits_rv: float [R, V] raw policy logits.
      keys_r: [R] typed PRNG keys; row r's draw depends only on ``keys_r[r]`` and ``logits_rv[r]``.
      temperature: 0 = greedy (first argmax of the raw logits; ``keys_r`` unused). A Python number
        compiles only its own case; a traced float32 scalar (>= 0) compiles greedy, temperature 1 and
        any other temperature as branches of one ``lax.switch``, so greedy evaluation and sampling share
        one program and each draw runs only its branch.
    Returns:
      tokens_r int32 [R];
      sample_logprobs_r float32 [R]: natural-log probability of the token under the distribution it was
        drawn from (temperature-scaled and filtered; exactly 0 for greedy, a point mass);
      policy_logprobs_r float32 [R]: log-probability under the raw policy (``log_softmax(logits)``,
        temperature 1, no filtering), which is what a teacher-forced forward pass gives.
    """
    logits_rv = logits_rv.astype(jnp.float32)
    if not isinstance(temperature, (int, float)):
        branches = [functools.partial(sample_tokens, keys_r=keys_r, temperature=t, top_k=top_k, top_p=top_p)
                    for t in (0.0, 1.0)]
        branches.append(lambda x: _sample_scaled(x, keys_r, temperature, top_k, top_p))
        case = jnp.where(temperature == 0, 0, jnp.where(temperature == 1, 1, 2))
        return jax.lax.switch(case, branches, logits_rv)
    if temperature == 0:
        tokens = argmax_first(logits_rv)
        return tokens, jnp.zeros(tokens.shape, jnp.float32), _logprob_of(logits_rv, tokens)
    if temperature == 1.0 and top_p >= 1.0 and not 0 < top_k < logits_rv.shape[-1]:  # the policy itself
        tokens, log_norm = _inverse_cdf(logits_rv, keys_r)
        sample_lp = _logprob_of(logits_rv, tokens, log_norm)
        return tokens, sample_lp, sample_lp
    return _sample_scaled(logits_rv, keys_r, temperature, top_k, top_p)


def _sample_scaled(logits_rv, keys_r, temperature, top_k, top_p):
    """:func:`sample_tokens` for a temperature > 0 (a number or a traced scalar) with the filters applied."""
    filtered = filter_logits(logits_rv, temperature=temperature, top_k=top_k, top_p=top_p)
    tokens, log_norm = _inverse_cdf(filtered, keys_r)
    return tokens, _logprob_of(filtered, tokens, log_norm), _logprob_of(logits_rv, tokens)
