"""The slot engine's functional core: a fixed pool of decode rows ("slots") that the host keeps full.

Shapes: ``R`` slots, ``S`` cache slots per row (positions), ``G`` generation buffer, ``I`` rows one
insert writes, ``C`` contexts of the step's prefix store, ``V`` vocabulary.

Four pure functions, JetStream's engine API in this project's terms (the host's
:class:`passrate_jax.sampling.slot_pool.SlotPool` runs the queues and the slots; it jits these):

* :func:`init_slots` -- an empty pool (every row free).
* :func:`insert` -- start ``I`` rollouts in given free rows: copy each one's context KV from the step's
  prefix store (so a context is still prefilled once a step), draw its first token from the context's
  stored logits, reset its output row.
* :func:`generate_chunk` -- ``k`` one-token decode steps of every live row (k static); a row that stops
  (a stop id, or its budget) is no longer live and keeps its tokens until the host harvests it.
  :func:`generate_chunk_rows` runs it on a given subset of the rows (a *narrow* chunk), so a pool
  that is mostly empty does not decode its empty rows.
* :func:`extend` -- continue rollouts in the rows they ran in (an environment's next turn): the tokens the
  row's cache lacks (its last generated token, the observation) are appended to it, and the next turn's
  first token is drawn from the logits after them, as round mode's ``Sampler.extend_live`` does.

Randomness is the round sampler's (:func:`passrate_jax.sampling.core.decode`): token ``j`` of a rollout
is drawn with ``fold_in(row_keys(seed, context id, sample index), j)``, so a rollout's tokens do not
depend on the slot it runs in, the chunk it starts in or the rows beside it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx, struct

from passrate_jax.model.config import ModelConfig
from passrate_jax.model.transformer import KVCache, Layout, init_cache
from passrate_jax.sampling.core import DecodeSettings, PrefillOutput, append, row_keys
from passrate_jax.sampling.distributions import sample_tokens


@dataclasses.dataclass(frozen=True)
class ChunkSettings:
    """Static settings of the engine's programs: the decode settings (``gen_len`` = G) and ``steps``,
    the decode steps of one chunk (k)."""
    decode: DecodeSettings
    steps: int


@struct.dataclass
class SlotInsert:
    """``I`` rollouts to start (padding entries carry ``slot_i = R``, out of range, and are dropped).

    slot_i: int32 [I] free row to start in. context_row_i: int32 [I] the context's row of the prefix store.
    context_id_i, sample_index_i: int32 [I] seed the rollout's randomness (as in round mode).
    context_len_i: int32 [I] context tokens (the first generated token's position). budget_i: int32 [I]
    new tokens allowed, 1 <= budget <= G.
    """
    slot_i: jax.Array
    context_row_i: jax.Array
    context_id_i: jax.Array
    sample_index_i: jax.Array
    context_len_i: jax.Array
    budget_i: jax.Array


@struct.dataclass
class SlotExtend:
    """``I`` rollouts to continue in their own rows (padding entries carry ``slot_i = R`` and are dropped).

    slot_i: int32 [I] the row. tokens_ia: int32 [I, A] right-padded ids to append at the row's position
    (its last generated token, which no decode step has fed yet, then the observation). length_i: int32
    [I] real appended ids (>= 1). context_id_i, sample_index_i: int32 [I] seed the next turn (round mode
    keys a later turn by a hash of the rollout and the turn). budget_i: int32 [I] new tokens allowed.
    """
    slot_i: jax.Array
    tokens_ia: jax.Array
    length_i: jax.Array
    context_id_i: jax.Array
    sample_index_i: jax.Array
    budget_i: jax.Array


@struct.dataclass
class SlotState:
    """The pool; every function returns a new one (the host donates the old).

    live_r: bool [R] the row holds a rollout still generating. last_token_r: int32 [R] its latest token,
    the next model input, at ``position_r``. stopped_r: bool [R] ended on a stop id. length_r: int32 [R]
    tokens generated (the column the next one is written to). budget_r: int32 [R]. keys_r: [R] PRNG keys.
    tokens_rg / logprobs_rg / policy_logprobs_rg: [R, G] the rollout's tokens (pad after its end) and
    log-probs (sampling distribution, raw policy; 0 after its end). live_steps: int32 [] live rows summed
    over the decode steps run (slot utilization's numerator); steps: int32 [] decode steps run;
    row_steps: int32 [] rows decoded summed over those steps (the denominator: a narrow chunk decodes
    fewer rows than the pool holds).
    cache: KV of every row, slot == position ([layers, R, S, ...], or the per-layer decode form).
    """
    live_r: jax.Array
    last_token_r: jax.Array
    position_r: jax.Array
    stopped_r: jax.Array
    length_r: jax.Array
    budget_r: jax.Array
    keys_r: jax.Array
    tokens_rg: jax.Array
    logprobs_rg: jax.Array
    policy_logprobs_rg: jax.Array
    live_steps: jax.Array
    steps: jax.Array
    row_steps: jax.Array
    cache: KVCache


def init_slots(model_cfg: ModelConfig, rows: int, slots: int, settings: ChunkSettings) -> SlotState:
    """An empty pool of ``rows`` rows of ``slots`` positions (the cache in the form decode uses)."""
    g, pad = settings.decode.gen_len, settings.decode.pad_id
    cache = init_cache(model_cfg, rows, slots)
    if not model_cfg.scan_layers:
        cache = cache.decode_form()
    zi = jnp.zeros((rows,), jnp.int32)
    return SlotState(live_r=jnp.zeros((rows,), bool), last_token_r=zi + pad, position_r=zi,
                     stopped_r=jnp.zeros((rows,), bool), length_r=zi, budget_r=zi,
                     keys_r=row_keys(jnp.int32(0), zi, zi), tokens_rg=jnp.full((rows, g), pad, jnp.int32),
                     logprobs_rg=jnp.zeros((rows, g), jnp.float32),
                     policy_logprobs_rg=jnp.zeros((rows, g), jnp.float32),
                     live_steps=jnp.zeros((), jnp.int32), steps=jnp.zeros((), jnp.int32),
                     row_steps=jnp.zeros((), jnp.int32), cache=cache)


def _put_rows(cache: KVCache, slot_i, k_lisd, v_lisd) -> KVCache:
    """Write ``I`` rows of stored KV ([layers, I, S, kv, e]) into rows ``slot_i`` of the pool's cache."""
    if not cache.is_decode_form:
        return KVCache(k=cache.k.at[:, slot_i].set(k_lisd.astype(cache.k.dtype), mode="drop"),
                       v=cache.v.at[:, slot_i].set(v_lisd.astype(cache.v.dtype), mode="drop"))
    ks = tuple(k.at[slot_i].set(jnp.transpose(k_lisd[i], (0, 2, 3, 1)).astype(k.dtype), mode="drop")
               for i, k in enumerate(cache.k))
    vs = tuple(v.at[slot_i].set(jnp.transpose(v_lisd[i], (0, 2, 1, 3)).astype(v.dtype), mode="drop")
               for i, v in enumerate(cache.v))
    return KVCache(k=ks, v=vs)


def _write(state: SlotState, rows, active, token, sample_lp, policy_lp, stop_ids: jax.Array) -> SlotState:
    """Record one drawn token for the ``active`` entries of ``rows`` (int32 [K] row indices, each at its
    own column ``length``), and the finish flags."""
    g = state.tokens_rg.shape[1]
    col = jnp.where(active, state.length_r[rows], g)  # inactive entries write out of range: dropped
    length = state.length_r[rows] + active
    stop_now = active & jnp.isin(token, stop_ids)
    ended = stop_now | (length >= state.budget_r[rows])
    row = jnp.where(active, rows, state.live_r.shape[0])
    put = lambda a, v: a.at[row].set(v, mode="drop")  # noqa: E731
    return state.replace(
        tokens_rg=state.tokens_rg.at[rows, col].set(token, mode="drop"),
        logprobs_rg=state.logprobs_rg.at[rows, col].set(sample_lp, mode="drop"),
        policy_logprobs_rg=state.policy_logprobs_rg.at[rows, col].set(policy_lp, mode="drop"),
        length_r=put(state.length_r, length), last_token_r=put(state.last_token_r, token),
        stopped_r=put(state.stopped_r, stop_now), live_r=put(state.live_r, ~ended))


def insert(state: SlotState, store: PrefillOutput, new: SlotInsert, seed: jax.Array, stop_ids: jax.Array,
           temperature: jax.Array, *, settings: ChunkSettings) -> SlotState:
    """Start the rollouts ``new`` in their rows: context KV copied from ``store`` (the step's prefix store,
    [layers, C, T, ...] with T <= S: slots past T start as zeros, and past the context they are written
    before they are read), the row's output reset, and its first token drawn from the context's stored
    last logits (round mode's first token). A rollout whose first token ends it is inserted not live."""
    d = settings.decode
    r, t = state.live_r.shape[0], store.cache.k.shape[2]
    s = state.cache.slots
    take = lambda x: jnp.pad(jnp.take(x, new.context_row_i, axis=1)[:, :, :s],  # noqa: E731
                             ((0, 0), (0, 0), (0, max(s - t, 0)), (0, 0), (0, 0)))
    cache = _put_rows(state.cache, new.slot_i, take(store.cache.k), take(store.cache.v))
    logits = jnp.take(store.last_logits_cv, new.context_row_i, axis=0)
    return _start(state.replace(cache=cache), new.slot_i, new.context_len_i, new.budget_i,
                  row_keys(seed, new.context_id_i, new.sample_index_i), logits, stop_ids, temperature, d)


def extend(params: nnx.State, state: SlotState, new: SlotExtend, seed: jax.Array, stop_ids: jax.Array,
           temperature: jax.Array, *, graphdef: nnx.GraphDef, settings: ChunkSettings,
           layout: Layout | None = None) -> SlotState:
    """Continue the rollouts ``new`` in their rows (see :class:`SlotExtend`): their appended ids' keys and
    values written at the rows' positions by round mode's :func:`~passrate_jax.sampling.core.append` (what
    the cache already holds is not recomputed), the output rows reset, and the next turn's first token
    drawn from the logits after the last appended id."""
    r = state.live_r.shape[0]
    row = jnp.minimum(new.slot_i, r - 1)  # padding entries read some row; their writes are dropped
    start = state.position_r[row]
    live, parent = state.cache, row
    if live.is_decode_form:  # append reads the stacked form: gather the rows first
        live = _cache_rows(live, row).stacked()
        parent = jnp.arange(row.shape[0], dtype=jnp.int32)
    out = append(params, live, parent, new.tokens_ia, start, new.length_i, graphdef=graphdef, layout=layout)
    cache = _put_rows(state.cache, new.slot_i, out.cache.k, out.cache.v)
    return _start(state.replace(cache=cache), new.slot_i, start + new.length_i, new.budget_i,
                  row_keys(seed, new.context_id_i, new.sample_index_i), out.last_logits_cv, stop_ids, temperature,
                  settings.decode)


def _start(state: SlotState, slot_i, position_i, budget_i, keys_i, logits_iv, stop_ids, temperature,
           d: DecodeSettings) -> SlotState:
    """Rows ``slot_i`` (R: dropped) begin generating at ``position_i``: outputs reset, keys set, and the first
    token drawn from ``logits_iv`` with the rollout's key for token 0 (round mode's first token)."""
    r, g = state.live_r.shape[0], state.tokens_rg.shape[1]
    row = jnp.where(slot_i < r, slot_i, r)
    put = lambda a, v: a.at[row].set(v, mode="drop")  # noqa: E731
    state = state.replace(
        live_r=put(state.live_r, True), position_r=put(state.position_r, position_i),
        stopped_r=put(state.stopped_r, False), length_r=put(state.length_r, 0),
        budget_r=put(state.budget_r, budget_i), keys_r=state.keys_r.at[row].set(keys_i, mode="drop"),
        tokens_rg=state.tokens_rg.at[row].set(jnp.full((g,), d.pad_id, jnp.int32), mode="drop"),
        logprobs_rg=state.logprobs_rg.at[row].set(0.0, mode="drop"),
        policy_logprobs_rg=state.policy_logprobs_rg.at[row].set(0.0, mode="drop"))
    draw_keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys_i, 0)
    drawn = sample_tokens(logits_iv, draw_keys, temperature=temperature, top_k=d.top_k, top_p=d.top_p)
    return _write(state, slot_i, slot_i < r, *drawn, stop_ids)


def generate_chunk(params: nnx.State, state: SlotState, stop_ids: jax.Array, temperature: jax.Array, *,
                   graphdef: nnx.GraphDef, settings: ChunkSettings, layout: Layout | None = None) -> SlotState:
    """Up to ``settings.steps`` decode steps of every live row (the loop exits early once none is live).

    Each step feeds a live row's last token at its position (writing its KV there), then draws and
    records its next token, exactly as round mode's loop does; rows that are not live are masked out of
    the cache writes and keep their outputs. ``live_steps`` and ``steps`` count the work for utilization.
    """
    model = nnx.merge(graphdef, params)
    layer_weights = None if model.cfg.scan_layers else model.layer_weights()
    d = settings.decode
    r = state.live_r.shape[0]
    rows = jnp.arange(r, dtype=jnp.int32)

    def cond(carry):
        i, s = carry
        return (i < settings.steps) & jnp.any(s.live_r)

    def body(carry):
        i, s = carry
        live = s.live_r
        logits, cache = model(s.last_token_r[:, None], s.position_r[:, None], live[:, None], cache=s.cache,
                              layout=layout, layer_weights=layer_weights)
        s = s.replace(cache=cache, position_r=s.position_r + live, live_steps=s.live_steps + jnp.sum(live),
                      steps=s.steps + 1, row_steps=s.row_steps + r)
        keys = jax.vmap(jax.random.fold_in)(s.keys_r, s.length_r)
        drawn = sample_tokens(logits[:, 0], keys, temperature=temperature, top_k=d.top_k, top_p=d.top_p)
        return i + 1, _write(s, rows, live, *drawn, stop_ids)

    _, state = jax.lax.while_loop(cond, body, (jnp.zeros((), jnp.int32), state))
    return state


_ROW_FIELDS = ("live_r", "last_token_r", "position_r", "stopped_r", "length_r", "budget_r", "keys_r", "tokens_rg",
               "logprobs_rg", "policy_logprobs_rg")


def _row_axis(cache: KVCache) -> int:
    """The rows' axis of every cache buffer: [R, ...] per layer in the decode form, [layers, R, ...] else."""
    return 0 if cache.is_decode_form else 1


def _cache_rows(cache: KVCache, rows: jax.Array) -> KVCache:
    """Rows ``rows`` (int32 [Q], in range) of every layer's keys and values, in the cache's own form."""
    axis = _row_axis(cache)
    return jax.tree.map(lambda a: jnp.take(a, rows, axis=axis), cache)


def _take_rows(state: SlotState, rows_q: jax.Array) -> SlotState:
    """The pool restricted to rows ``rows_q`` (int32 [Q]), counters kept."""
    return state.replace(cache=_cache_rows(state.cache, rows_q), **{f: getattr(state, f)[rows_q] for f in _ROW_FIELDS})


def _put_back(state: SlotState, sub: SlotState, rows_q: jax.Array) -> SlotState:
    """``state`` with rows ``rows_q`` replaced by ``sub``'s rows and ``sub``'s counters."""
    at = (slice(None),) * _row_axis(state.cache) + (rows_q,)
    cache = jax.tree.map(lambda a, b: a.at[at].set(b), state.cache, sub.cache)
    rows = {f: getattr(state, f).at[rows_q].set(getattr(sub, f)) for f in _ROW_FIELDS}
    return state.replace(cache=cache, live_steps=sub.live_steps, steps=sub.steps, row_steps=sub.row_steps, **rows)


def generate_chunk_rows(params: nnx.State, state: SlotState, rows_q: jax.Array, stop_ids: jax.Array,
                        temperature: jax.Array, *, graphdef: nnx.GraphDef, settings: ChunkSettings,
                        layout: Layout | None = None) -> SlotState:
    """:func:`generate_chunk` on rows ``rows_q`` only (int32 [Q], distinct, holding every live row): their
    KV and outputs are gathered, decoded, and written back; the other rows are untouched. A rollout's
    tokens do not depend on its row or the rows beside it, so this decodes exactly what the full chunk
    would, at the cost of Q rows a step instead of R."""
    sub = generate_chunk(params, _take_rows(state, rows_q), stop_ids, temperature, graphdef=graphdef,
                         settings=settings, layout=layout)
    return _put_back(state, sub, rows_q)
