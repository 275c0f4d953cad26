"""The sampler's functional core: pure prefill and decode over (parameter state, sampling state).

Shapes: ``C`` prefilled contexts, ``T`` context length (padded), ``R`` decode rows, ``G`` generation
buffer length, ``S = T + G`` cache slots, ``V`` vocabulary.

* :func:`prefill` runs each distinct context once (right-padded, positions ``0..len-1``) and returns the
  logits of its last real token and its KV cache.
* :func:`store_prefill` prefills new contexts into given rows of a prefix store (a :class:`PrefillOutput`
  kept for a whole step, so later rounds continue a context without computing its KV again), growing
  the store first when it is too small.
* :func:`append` continues live rows (decode caches kept from an earlier call): it gathers each new
  context's parent row and runs only the appended tokens (an environment's observation) through the model.
* :func:`decode` gathers each row's context cache (rows of one context share one prefill), draws the
  first token from the prefill logits, then runs a ``lax.while_loop`` of one-token steps that exits as
  soon as every row has stopped or spent its budget.

Neither function calls ``jit``; :class:`passrate_jax.sampling.sampler.Sampler` does, with shardings.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx, struct

from passrate_jax.model.config import ModelConfig
from passrate_jax.model.transformer import KVCache, Layout, init_cache
from passrate_jax.sampling.distributions import sample_tokens


@dataclasses.dataclass(frozen=True)
class DecodeSettings:
    """Static (hashable) settings of one compiled decode program; arrays never live here (the
    temperature is one: greedy evaluation and sampling at any temperature share a program).

    pad_id: id written after a row has finished.
    gen_len: G, the output buffer length (a generation bucket, >= every row's budget).
    context_len: cache slots taken from the prefill cache (0: all of them); a prefix store's capacity
      may exceed the contexts of one call.
    cache_len: S, cache slots of the decode rows (0: ``context_len``, for a prefill cache sized with room
      for G); the slots past ``context_len`` start empty. A live row that later calls extend keeps its S.
    """
    top_k: int
    top_p: float
    pad_id: int
    gen_len: int
    context_len: int = 0
    cache_len: int = 0


@struct.dataclass
class PrefillOutput:
    """Result of :func:`prefill`.

    last_logits_cv: float32 [C, V] logits after each context's last real token.
    cache: KVCache with k, v [layers, C, S, kv_heads, head_dim]; slots >= the context length are empty.
    """
    last_logits_cv: jax.Array
    cache: KVCache


@struct.dataclass
class RowSpec:
    """Which context each decode row continues, and with which randomness and budget.

    context_row_r: int32 [R] index into the prefill batch (rows of one context share it).
    context_id_r: int32 [R] caller's stable id of the context (seeds the row's randomness).
    sample_index_r: int32 [R] index of the continuation within its context (seeds the randomness).
    context_len_r: int32 [R] number of context tokens (= position of the first generated token).
    budget_r: int32 [R] max new tokens of the row, <= G; 0 marks a padding row.
    """
    context_row_r: jax.Array
    context_id_r: jax.Array
    sample_index_r: jax.Array
    context_len_r: jax.Array
    budget_r: jax.Array


@struct.dataclass
class SamplingState:
    """Decode-loop state; every step returns a new one.

    step: int32 [] number of tokens generated so far (the column the next token is written to).
    last_token_r: int32 [R] most recent token, the next model input.
    position_r: int32 [R] absolute position of ``last_token_r`` (= cache slot it is written to).
    done_r: bool [R] row has stopped or spent its budget.
    stopped_r: bool [R] row ended on a stop id (finish reason "stop"; otherwise "length").
    length_r: int32 [R] generated tokens, including the stop token.
    tokens_rg: int32 [R, G] generated tokens, ``pad_id`` after the row finished.
    logprobs_rg: float32 [R, G] log-prob under the sampling distribution (see sample_tokens); 0 after.
    policy_logprobs_rg: float32 [R, G] log-prob under the raw policy; 0 after the row finished.
    keys_r: [R] per-row PRNG keys; step t draws with ``fold_in(keys_r, t)``.
    budget_r: int32 [R] per-row max new tokens.
    cache: KVCache with k, v [layers, R, S, kv_heads, head_dim].
    """
    step: jax.Array
    last_token_r: jax.Array
    position_r: jax.Array
    done_r: jax.Array
    stopped_r: jax.Array
    length_r: jax.Array
    tokens_rg: jax.Array
    logprobs_rg: jax.Array
    policy_logprobs_rg: jax.Array
    keys_r: jax.Array
    budget_r: jax.Array
    cache: KVCache


def row_keys(seed: jax.Array, context_id_r: jax.Array, sample_index_r: jax.Array) -> jax.Array:
    """Per-row PRNG keys ``fold_in(fold_in(key(seed), context_id), sample_index)`` [R].

    A row's key, hence its sample, depends only on (seed, context id, sample index), never on which
    other rows share its batch or where it sits in it.
    """
    base = jax.random.key(seed)
    return jax.vmap(lambda c, i: jax.random.fold_in(jax.random.fold_in(base, c), i))(context_id_r, sample_index_r)


def prefill(params: nnx.State, tokens_ct: jax.Array, length_c: jax.Array, *, graphdef: nnx.GraphDef,
            model_cfg: ModelConfig, cache_len: int, layout: Layout | None = None) -> PrefillOutput:
    """Run every context once through the model, filling a cache of ``cache_len`` slots per context.

    Args:
      params: the model's state (``nnx.split(model)[1]``).
      tokens_ct: int32 [C, T] right-padded context ids.
      length_c: int32 [C] real tokens per context (>= 1 for real contexts; 0 for padding rows).
    """
    model = nnx.merge(graphdef, params)
    c, t = tokens_ct.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (c, t))
    real = positions < length_c[:, None]
    cache = init_cache(model_cfg, c, cache_len)
    last = jnp.maximum(length_c - 1, 0)
    last_logits_cv, cache = model(tokens_ct, positions, real, cache=cache, logits_at_b=last, layout=layout)
    return PrefillOutput(last_logits_cv=last_logits_cv, cache=cache)


def store_prefill(params: nnx.State, store: PrefillOutput, tokens_ct: jax.Array, length_c: jax.Array,
                  slot_c: jax.Array, *, graphdef: nnx.GraphDef, model_cfg: ModelConfig, capacity: tuple[int, int],
                  layout: Layout | None = None) -> PrefillOutput:
    """Prefill ``C`` new contexts of ``T`` tokens into rows ``slot_c`` of ``store``, returned with
    ``capacity = (contexts, slots)`` (the store's own or larger: it is padded with empty rows and slots
    first, so growing costs no program of its own). A padding context carries an out-of-range slot and
    is dropped."""
    c, t = store.cache.k.shape[1:3]
    pad = ((0, 0), (0, capacity[0] - c), (0, capacity[1] - t), (0, 0), (0, 0))
    new = prefill(params, tokens_ct, length_c, graphdef=graphdef, model_cfg=model_cfg,
                  cache_len=tokens_ct.shape[1], layout=layout)
    t = tokens_ct.shape[1]
    put = lambda old, x: jnp.pad(old, pad).at[:, slot_c, :t].set(x.astype(old.dtype), mode="drop")  # noqa: E731
    logits = jnp.pad(store.last_logits_cv, ((0, capacity[0] - c), (0, 0)))
    return PrefillOutput(last_logits_cv=logits.at[slot_c].set(new.last_logits_cv, mode="drop"),
                         cache=KVCache(k=put(store.cache.k, new.cache.k), v=put(store.cache.v, new.cache.v)))


def append(params: nnx.State, live: KVCache, parent_c: jax.Array, tokens_ca: jax.Array, start_c: jax.Array,
           length_c: jax.Array, *, graphdef: nnx.GraphDef, layout: Layout | None = None) -> PrefillOutput:
    """Extend live rows by appended tokens, without recomputing what their cache already holds.

    Args:
      live: decode caches [layers, R, S, ...] of an earlier call (slot == position).
      parent_c: int32 [C] the live row each new context extends (rows may be repeated or dropped).
      tokens_ca: int32 [C, A] right-padded appended ids, written at positions ``start_c + j``.
      start_c: int32 [C] the first appended position (slots from it on are overwritten; slots before it
        must hold the context's keys and values).
      length_c: int32 [C] real appended tokens (0 for padding contexts).
    Returns the logits after each context's last appended token and the extended caches [layers, C, S, ...].
    """
    model = nnx.merge(graphdef, params)
    cache = KVCache(k=jnp.take(live.k, parent_c, axis=1), v=jnp.take(live.v, parent_c, axis=1))
    positions = start_c[:, None] + jnp.arange(tokens_ca.shape[1], dtype=jnp.int32)[None, :]
    real = jnp.arange(tokens_ca.shape[1])[None, :] < length_c[:, None]
    logits, cache = model(tokens_ca, positions, real, cache=cache, logits_at_b=jnp.maximum(length_c - 1, 0),
                          layout=layout)
    return PrefillOutput(last_logits_cv=logits, cache=cache)


def _record(state: SamplingState, token_r, sample_lp_r, policy_lp_r, settings: DecodeSettings,
            stop_ids: jax.Array) -> SamplingState:
    """Write the tokens drawn at ``state.step`` for rows still running and update the finish flags."""
    active = ~state.done_r
    token_r = jnp.where(active, token_r, settings.pad_id)
    col = state.step
    length = state.length_r + active
    stopped_now = active & jnp.isin(token_r, stop_ids)
    return state.replace(
        step=col + 1,
        last_token_r=token_r,
        done_r=state.done_r | stopped_now | (length >= state.budget_r),
        stopped_r=state.stopped_r | stopped_now,
        length_r=length,
        tokens_rg=jax.lax.dynamic_update_slice(state.tokens_rg, token_r[:, None], (0, col)),
        logprobs_rg=jax.lax.dynamic_update_slice(
            state.logprobs_rg, jnp.where(active, sample_lp_r, 0.0)[:, None], (0, col)),
        policy_logprobs_rg=jax.lax.dynamic_update_slice(
            state.policy_logprobs_rg, jnp.where(active, policy_lp_r, 0.0)[:, None], (0, col)),
    )


def _draw(logits_rv, state: SamplingState, temperature: jax.Array, settings: DecodeSettings):
    keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(state.keys_r, state.step)
    return sample_tokens(logits_rv, keys, temperature=temperature, top_k=settings.top_k, top_p=settings.top_p)


def decode(params: nnx.State, prefilled: PrefillOutput, rows: RowSpec, seed: jax.Array, stop_ids: jax.Array,
           temperature: jax.Array, *, graphdef: nnx.GraphDef, settings: DecodeSettings,
           layout: Layout | None = None) -> SamplingState:
    """Generate up to ``rows.budget_r`` tokens per row, continuing ``rows.context_row_r``'s prefill.

    The prefill cache rows are gathered on device into the decode rows, so every continuation of one
    context reuses that context's single prefill. Returns the final :class:`SamplingState`; its
    ``tokens_rg``, ``logprobs_rg``, ``policy_logprobs_rg``, ``length_r`` and ``stopped_r`` are the
    output. ``seed`` is an int32 scalar; ``stop_ids`` int32 [K] the ids that end a row (EOS and extra
    stop ids, padded with -1; an array, not a static setting, so changing them compiles nothing);
    ``temperature`` a float32 scalar >= 0 (0: greedy), also an array. The stop token is kept in the output.
    """
    g = settings.gen_len
    r = rows.context_row_r.shape[0]
    t = settings.context_len or prefilled.cache.k.shape[2]
    pad = ((0, 0), (0, 0), (0, (settings.cache_len or t) - t), (0, 0), (0, 0))

    def rows_of(x):  # each row's context slots, then empty slots for what it generates
        return jnp.pad(jnp.take(x, rows.context_row_r, axis=1)[:, :, :t], pad)

    cache = KVCache(k=rows_of(prefilled.cache.k), v=rows_of(prefilled.cache.v))
    state = SamplingState(
        step=jnp.zeros((), jnp.int32),
        last_token_r=jnp.full((r,), settings.pad_id, jnp.int32),
        position_r=rows.context_len_r.astype(jnp.int32),
        done_r=rows.budget_r <= 0,
        stopped_r=jnp.zeros((r,), bool),
        length_r=jnp.zeros((r,), jnp.int32),
        tokens_rg=jnp.full((r, g), settings.pad_id, jnp.int32),
        logprobs_rg=jnp.zeros((r, g), jnp.float32),
        policy_logprobs_rg=jnp.zeros((r, g), jnp.float32),
        keys_r=row_keys(seed, rows.context_id_r, rows.sample_index_r),
        budget_r=rows.budget_r.astype(jnp.int32),
        cache=cache,
    )
    # The first token comes from the prefill's last logits; the loop then feeds each token back once.
    first_logits = jnp.take(prefilled.last_logits_cv, rows.context_row_r, axis=0)
    state = _record(state, *_draw(first_logits, state, temperature, settings), settings, stop_ids)
    model = nnx.merge(graphdef, params)
    layer_weights = None
    if not model.cfg.scan_layers:  # unrolled layers decode in per-layer buffers and weights, sliced once
        state = state.replace(cache=state.cache.decode_form())
        layer_weights = model.layer_weights()

    def cond(s: SamplingState):
        return (s.step < g) & ~jnp.all(s.done_r)

    def body(s: SamplingState):
        logits, cache = model(s.last_token_r[:, None], s.position_r[:, None], cache=s.cache, layout=layout,
                              layer_weights=layer_weights)
        s = s.replace(cache=cache, position_r=s.position_r + 1)
        return _record(s, *_draw(logits[:, 0], s, temperature, settings), settings, stop_ids)

    state = jax.lax.while_loop(cond, body, state)
    return state.replace(cache=state.cache.stacked())
