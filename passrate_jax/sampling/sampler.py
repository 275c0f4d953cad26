"""The sampler's host shell: contexts in, padded static-shape batches to the jitted core, results out.

    sampler = Sampler(model, SamplingConfig(temperature=1.0), eos_id=tok.eos_id, mesh=mesh)
    result = sampler.generate([Context(prompt_ids=ids, num_samples=8, context_id=17)], seed=step)
    result.tokens[i, :result.lengths[i]]   # row i's completion

Each call prefills every distinct context once, then decodes all continuations in one batch. Batches are
padded to the buckets of :class:`SamplingConfig`, so a run compiles a handful of programs; the counters
``compilations``, ``prefill_calls`` (contexts prefilled), ``prefill_batches`` and ``prefill_tokens``
report what happened.

KV reuse beyond one call (``prefix_store.py``): the calls of one step share a ``store =
sampler.kv_store(params)``, so a context is prefilled once per step however many rounds sample from it;
a multi-turn episode keeps its rows live (``generate_live``, then ``extend_live`` per turn), so each
turn runs only its new tokens (the observation) through the model instead of the whole conversation.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from passrate_jax import sharding as shd
from passrate_jax.distributed import to_host
from passrate_jax.model.transformer import KVCache, init_cache
from passrate_jax.sampling import core
from passrate_jax.sampling.config import SamplingConfig
from passrate_jax.sampling.prefix_store import LiveRows, PrefixStore
# The host-side row types live in rows.py; imported here too, where callers have always found them.
from passrate_jax.sampling.rows import Context, SampleResult, bucket, training_rows  # noqa: F401


class Sampler:
    """Jitted, sharded rollout sampler for one model architecture (see the module docstring).

    Args:
      model: the policy (its parameters are the default for ``generate``).
      cfg: sampling controls and padding buckets.
      eos_id: end-of-sequence id (None: only ``cfg.stop_token_ids`` stop a row).
      pad_id: id written after a row finished and used to pad contexts.
      mesh: device mesh; decode rows are split over the data-parallel axes, parameters follow
        ``sharding.param_shardings``. Default: every device on the data axis.
    """

    def __init__(self, model: nnx.Module, cfg: SamplingConfig, *, eos_id: int | None, pad_id: int = 0,
                 mesh: Mesh | None = None):
        self.cfg = cfg
        self.mesh = mesh if mesh is not None else shd.make_mesh(shd.MeshConfig())
        self.model_cfg = model.cfg
        self.graphdef, params = nnx.split(model)
        self.param_shardings = shd.param_shardings(params, self.mesh)
        self.layout = shd.FsdpLayout(self.mesh)
        self.params = jax.device_put(params, self.param_shardings)
        self.eos_id, self.pad_id = eos_id, int(pad_id)
        row_axes = shd.batch_sharding(self.mesh, 1).spec[0]
        row_axes = () if row_axes is None else (row_axes,) if isinstance(row_axes, str) else tuple(row_axes)
        self.row_shards = math.prod(self.mesh.shape[a] for a in row_axes)
        rows1 = NamedSharding(self.mesh, P(row_axes))
        rows2 = NamedSharding(self.mesh, P(row_axes, None))
        cache = KVCache(*(NamedSharding(self.mesh, P(None, row_axes)),) * 2)  # rows are dim 1 of k, v
        self._rows1, self._rows2 = rows1, rows2
        replicated = NamedSharding(self.mesh, P())
        self.compilations = 0
        self.prefill_calls = 0    # contexts prefilled (appends included)
        self.prefill_batches = 0  # prefill and append program executions
        self.prefill_tokens = 0   # real tokens run through those programs
        # Decode loop steps summed over rows: live ones, and all (padding included). A call runs (longest
        # - 1) steps, a row being live for its length - 1 of them (its first token comes from the prefill).
        self.decode_live_steps = self.decode_row_steps = 0
        self._store_capacity = (0, 0)  # the largest shared store so far: the next step's starts there
        self._reserved = (0, 0)  # reserve_store's capacity: every store starts there
        prefilled = core.PrefillOutput(last_logits_cv=rows2, cache=cache)
        rowspec = core.RowSpec(*(rows1,) * 5)
        state = core.SamplingState(
            step=replicated, last_token_r=rows1, position_r=rows1, done_r=rows1, stopped_r=rows1,
            length_r=rows1, tokens_rg=rows2, logprobs_rg=rows2, policy_logprobs_rg=rows2, keys_r=rows1,
            budget_r=rows1, cache=None)
        self._store_shardings = prefilled
        store_in = (self.param_shardings, prefilled, rows2, rows1, rows1)
        # The store is donated (updated in place) unless it grows: a larger output cannot reuse its buffers.
        self._store_prefill = {grows: jax.jit(self._store_prefill_impl, donate_argnums=() if grows else (1,),
                                              static_argnums=(5,), in_shardings=store_in, out_shardings=prefilled)
                               for grows in (False, True)}
        self._append = jax.jit(self._append_impl, in_shardings=(self.param_shardings, cache, rows1, rows2, rows1, rows1),
                               out_shardings=prefilled)
        decode_in = (self.param_shardings, prefilled, rowspec, replicated, replicated, replicated)
        self._decode = jax.jit(functools.partial(self._decode_impl, keep_cache=False), static_argnums=(6,),
                               in_shardings=decode_in, out_shardings=state)
        self._decode_live = jax.jit(functools.partial(self._decode_impl, keep_cache=True), static_argnums=(6,),
                                    in_shardings=decode_in, out_shardings=state.replace(cache=cache))

    # ------------------------------------------------------------------ jitted programs
    def _store_prefill_impl(self, params, store, tokens_ct, length_c, slot_c, capacity):
        self.compilations += 1  # runs once per trace, i.e. once per compiled program
        return core.store_prefill(params, store, tokens_ct, length_c, slot_c, graphdef=self.graphdef,
                                  model_cfg=self.model_cfg, capacity=capacity, layout=self.layout)

    def _append_impl(self, params, live, parent_c, tokens_ca, start_c, length_c):
        self.compilations += 1
        return core.append(params, live, parent_c, tokens_ca, start_c, length_c, graphdef=self.graphdef,
                           layout=self.layout)

    def _decode_impl(self, params, prefilled, rows, seed, stop_ids, temperature, settings, *, keep_cache):
        self.compilations += 1
        final = core.decode(params, prefilled, rows, seed, stop_ids, temperature, graphdef=self.graphdef,
                            settings=settings, layout=self.layout)
        # Unless the rows stay live, the cache dies inside the program instead of being returned.
        return final if keep_cache else final.replace(cache=None)

    # ------------------------------------------------------------------ public API
    @property
    def store_capacity(self) -> tuple[int, int]:
        """(contexts, slots) of the largest step store so far; a new :meth:`kv_store` starts there."""
        return self._store_capacity

    def reserve_store(self, contexts: int, slots: int) -> tuple[int, int]:
        """Size every prefix store from now on for ``contexts`` contexts of up to ``slots`` tokens (each
        rounded up to its bucket), and decode every call from that many context slots: a run whose calls
        stay within it compiles one prefill program per context-length bucket and one decode program
        per row bucket, evaluation (greedy or sampled) included, instead of compiling them again
        whenever a round outgrows its step's store. The cost: decode attends over the reserved slots
        even where a call's contexts are shorter. Returns the reserved (contexts, slots)."""
        if contexts < 1 or slots < 1:
            raise ValueError(f"reserve_store(contexts={contexts}, slots={slots}): both must be >= 1")
        cfg = self.cfg
        self._reserved = (bucket(contexts, cfg.prefill_row_buckets, self.row_shards),
                          bucket(slots, cfg.context_buckets))
        self._store_capacity = tuple(max(a, b) for a, b in zip(self._store_capacity, self._reserved))
        return self._reserved

    def kv_store(self, params: nnx.State | None = None) -> PrefixStore:
        """A prefix store for ``params`` (default: the model's at construction), to pass to every
        ``generate`` of one step: each distinct context is prefilled once however many calls sample
        from it. Give a new step (new parameters) a new store, and ``release`` the old one."""
        return PrefixStore(self._place(params), shared=True)

    def generate(self, contexts: Sequence[Context], *, seed: int = 0, params: nnx.State | None = None,
                 cfg: SamplingConfig | None = None, store: PrefixStore | None = None) -> SampleResult:
        """Sample ``ctx.num_samples`` continuations of every context.

        Args:
          contexts: each is prefilled once and its cache shared by its continuations.
          seed: int in [0, 2**31); with each row's (context_id, sample_index) it fixes the row's sample.
          params: parameter state to sample from (default: the model's at construction); placed with
            ``param_shardings`` (a no-op when already there). Not with ``store``, which holds its own.
          cfg: override of the sampling controls for this call (buckets included).
          store: a step's :meth:`kv_store`: contexts it holds are not prefilled again, new ones are added.
        """
        result, _ = self._generate(contexts, seed, params, cfg or self.cfg, store, live_len=None)
        return result

    def generate_live(self, contexts: Sequence[Context], *, live_len: int, seed: int = 0,
                      params: nnx.State | None = None, cfg: SamplingConfig | None = None,
                      store: PrefixStore | None = None) -> tuple[SampleResult, LiveRows]:
        """:meth:`generate`, keeping every row's cache live for :meth:`extend_live` (the next turn of a
        multi-turn episode). ``live_len``: the most tokens a row's context and generation may reach over
        all its turns (rounded up to a context bucket); each context's ids plus budget must fit in it."""
        return self._generate(contexts, seed, params, cfg or self.cfg, store, live_len=live_len)

    def extend_live(self, live: LiveRows, parents: Sequence[int], contexts: Sequence[Context], *, seed: int = 0,
                    cfg: SamplingConfig | None = None) -> tuple[SampleResult, LiveRows]:
        """Sample continuations of contexts that extend live rows: ``contexts[i].ids`` must start with
        row ``parents[i]``'s tokens (its context and generation); only the tokens past what the row's
        cache holds are run through the model (the observation, and the row's last generated token).
        Rows not named in ``parents`` are dropped. Returns the result and the new live rows."""
        cfg = cfg or self.cfg
        if len(parents) != len(contexts) or not contexts:
            raise ValueError(f"extend_live needs one parent row per context, got {len(parents)} and {len(contexts)}")
        for p, c in zip(parents, contexts):
            if not 0 <= p < len(live.tokens) or c.ids[:len(live.tokens[p])] != live.tokens[p] \
                    or len(c.ids) <= live.valid[p]:
                raise ValueError(f"context {c.context_id}: its ids do not extend live row {p}")
        _check_reach(contexts, cfg, live.slots, "the live rows' slots")
        rows: dict[tuple[int, ...], int] = {}  # equal contexts (e.g. equal greedy turns) share one append
        firsts = []  # the first context of each distinct ids
        for i, c in enumerate(contexts):
            if c.ids not in rows:
                rows[c.ids] = len(firsts)
                firsts.append(i)
        appended = [contexts[i].ids[live.valid[parents[i]]:] for i in firsts]
        n = len(firsts)
        # Padded like decode rows (an episode's later turns have about one row per context), so the append
        # and decode programs see the same few row counts the live rows already have.
        c_pad = bucket(n, cfg.row_buckets, self.row_shards)
        tokens = np.full((c_pad, bucket(max(map(len, appended)), cfg.context_buckets)), self.pad_id, np.int32)
        for i, a in enumerate(appended):
            tokens[i, :len(a)] = a
        column = lambda xs: np.pad(np.asarray(xs, np.int32), (0, c_pad - n))  # noqa: E731
        prefilled = self._append(live.store.params, live.cache, column([parents[i] for i in firsts]), tokens,
                                 column([live.valid[parents[i]] for i in firsts]), column([len(a) for a in appended]))
        for p, c in zip(parents, contexts):
            live.store.note_context(c.ids, len(c.ids) - live.context_len[p])
        self._count_prefill(live.store, n, sum(map(len, appended)))
        return self._sample(live.store, prefilled, contexts, [rows[c.ids] for c in contexts], seed, cfg,
                            context_len=live.slots, live_len=live.slots)

    # ------------------------------------------------------------------ host steps
    def _place(self, params):
        return self.params if params is None else jax.device_put(params, self.param_shardings)

    def _generate(self, contexts, seed, params, cfg, store, live_len):
        if not contexts:
            raise ValueError("generate needs at least one context")
        if store is None:
            store = PrefixStore(self._place(params), shared=False)
        elif params is not None:
            raise ValueError("pass params or a store, not both: a store holds the KV rows of one parameter state")
        t = max(bucket(max(len(c.ids) for c in contexts), cfg.context_buckets), self._reserved[1])
        if live_len is not None:
            _check_reach(contexts, cfg, live_len, "live_len")
            live_len = max(bucket(live_len, cfg.context_buckets), t)
        slots = self._prefill_missing(store, contexts, cfg)
        return self._sample(store, store.arrays, contexts, slots, seed, cfg, context_len=t, live_len=live_len)

    def _prefill_missing(self, store: PrefixStore, contexts: Sequence[Context], cfg: SamplingConfig) -> list[int]:
        """The store row of every context, prefilling those it does not hold in one batch."""
        store.begin_call()
        slots: list[int | None] = []
        new: dict[object, int] = {}  # a new context (its ids; an unshared store: its position) -> its index
        ids = []
        for i, c in enumerate(contexts):
            store.note_context(c.ids, len(c.ids))
            slots.append(store.lookup(c.ids))
            key = c.ids if store.shared else i
            if slots[-1] is None and key not in new:
                new[key] = len(ids)
                ids.append(c.ids)
        if not ids:
            return slots
        keep = {s for s in slots if s is not None}
        t = bucket(max(map(len, ids)), cfg.context_buckets)
        capacity = self._capacity(store, len(keep) + len(ids), t, cfg)
        rows = store.place(ids, capacity[0], keep)
        # More new contexts than the largest prefill bucket run as several batches of that bucket: one
        # program whatever the call's size (an evaluation's 64 prompts and a round's few), and the
        # prefill's activations stay bounded.
        chunk = bucket(cfg.prefill_row_buckets[-1], cfg.prefill_row_buckets, self.row_shards)
        for start in range(0, len(ids), chunk):
            self._prefill_batch(store, ids[start:start + chunk], rows[start:start + chunk], t, capacity, cfg)
        return [rows[new[c.ids if store.shared else i]] if s is None else s
                for i, (c, s) in enumerate(zip(contexts, slots))]

    def _prefill_batch(self, store: PrefixStore, ids, rows, t: int, capacity, cfg: SamplingConfig) -> None:
        """Prefill contexts ``ids`` (at most the largest prefill bucket) into ``rows`` of a store of ``capacity``."""
        c_pad = bucket(len(ids), cfg.prefill_row_buckets, self.row_shards)
        tokens = np.full((c_pad, t), self.pad_id, np.int32)
        for i, x in enumerate(ids):
            tokens[i, :len(x)] = x
        length = np.zeros(c_pad, np.int32)
        length[:len(ids)] = [len(x) for x in ids]
        slot = np.full(c_pad, capacity[0], np.int32)  # padding contexts: out of range, dropped
        slot[:len(ids)] = rows
        grows = capacity != store.capacity
        store.arrays = self._store_prefill[grows](store.params, store.arrays, jax.device_put(tokens, self._rows2),
                                                  jax.device_put(length, self._rows1),
                                                  jax.device_put(slot, self._rows1), capacity)
        store.prefilled += len(ids)
        self._count_prefill(store, len(ids), int(length.sum()))

    def _capacity(self, store: PrefixStore, contexts: int, slots: int, cfg: SamplingConfig) -> tuple[int, int]:
        """A capacity of at least ``contexts`` rows of ``slots`` tokens. A shared store starts at the
        largest capacity used before (so later steps compile nothing new), any store at least at the
        :meth:`reserve_store` capacity, and grows by buckets; an empty store is allocated here (zeros,
        placed), a full one grows inside the prefill program."""
        c, t = store.capacity
        start = self._store_capacity if store.shared else self._reserved
        c, t = max(c, start[0]), max(t, start[1])
        need = (bucket(contexts, cfg.prefill_row_buckets, self.row_shards) if contexts > c else c, max(t, slots))
        if store.arrays is None:
            shapes = jax.eval_shape(lambda: core.PrefillOutput(
                jnp.zeros((need[0], self.model_cfg.vocab_size), jnp.float32), init_cache(self.model_cfg, *need)))
            store.arrays = jax.tree.map(lambda x, where: jnp.zeros(x.shape, x.dtype, device=where), shapes,
                                        self._store_shardings)
        if store.shared:
            self._store_capacity = need
        return need

    def _count_prefill(self, store: PrefixStore, contexts: int, tokens: int) -> None:
        """One prefill or append program ran ``tokens`` real tokens of ``contexts`` contexts."""
        store.prefill_tokens += tokens
        self.prefill_tokens += tokens
        self.prefill_calls += contexts
        self.prefill_batches += 1

    def _sample(self, store, prefilled, contexts, slots, seed, cfg, *, context_len, live_len):
        """Decode every context's continuations from its prefilled row ``slots[i]`` of ``prefilled``."""
        lengths = [len(c.ids) for c in contexts]
        budgets = [c.max_new_tokens or cfg.max_new_tokens for c in contexts]
        n_ctx, n_rows = len(contexts), sum(c.num_samples for c in contexts)
        g = bucket(max(budgets), cfg.generation_buckets)
        r_pad = bucket(max(n_rows, 1), cfg.row_buckets, self.row_shards)
        ctx_index = np.repeat(np.arange(n_ctx), [c.num_samples for c in contexts]).astype(np.int32)
        sample_index = np.concatenate(
            [np.arange(c.num_samples) + c.first_sample_index for c in contexts]).astype(np.int32)
        ids = [i if c.context_id is None else c.context_id for i, c in enumerate(contexts)]

        def rows_of(per_row):
            out = np.zeros(r_pad, np.int32)  # padding rows: context 0, budget 0 (done before step 0)
            out[:n_rows] = per_row
            return out

        def per_context(values):
            return rows_of(np.asarray(values, np.int32)[ctx_index])

        rows = core.RowSpec(
            context_row_r=per_context(slots), context_id_r=per_context(ids),
            sample_index_r=rows_of(sample_index), context_len_r=per_context(lengths),
            budget_r=per_context(budgets))
        rows = jax.device_put(rows, core.RowSpec(*(self._rows1,) * 5))
        stop = list(dict.fromkeys(i for i in (self.eos_id, *cfg.stop_token_ids) if i is not None))
        stop_ids = np.full(bucket(len(stop), (8,)), -1, np.int32)  # -1 never matches a token
        stop_ids[: len(stop)] = stop
        # Row i writes positions below len(context) + budget. A reserved store is sized for every row's
        # reach: generated keys then go into the empty context slots past each row's context and the
        # decode cache needs no slots of its own (without a reservation, keep one cache length per bucket).
        fits = self._reserved[1] > 0 and max(n + b for n, b in zip(lengths, budgets)) <= context_len
        settings = core.DecodeSettings(top_k=int(cfg.top_k), top_p=float(cfg.top_p), pad_id=self.pad_id,
                                       gen_len=g, context_len=context_len,
                                       cache_len=live_len or context_len + (0 if fits else g))
        replicated = NamedSharding(self.mesh, P())
        decode = self._decode if live_len is None else self._decode_live
        scalars = jax.device_put((np.int32(seed), stop_ids, np.float32(cfg.temperature)), replicated)
        final = decode(store.params, prefilled, rows, *scalars, settings)
        # to_host gathers rows living on other hosts' devices: every host gets every completion.
        out = to_host((final.tokens_rg, final.logprobs_rg, final.policy_logprobs_rg, final.length_r,
                       final.stopped_r))
        tok, lp, plp, length, stopped = (np.asarray(x)[:n_rows] for x in out)
        self.decode_live_steps += int(np.maximum(length - 1, 0).sum())
        self.decode_row_steps += r_pad * max(int(length.max(initial=0)) - 1, 0)
        result = SampleResult(
            context_index=ctx_index, sample_index=sample_index, tokens=tok, logprobs=lp, policy_logprobs=plp,
            lengths=length, stopped=stopped, loss_mask=np.arange(g)[None, :] < length[:, None])
        if live_len is None:
            return result, None
        tokens = [contexts[c].ids + tuple(result.completion(i)) for i, c in enumerate(ctx_index)]
        context_len = [len(contexts[c].ids) for c in ctx_index]
        valid = [n + max(int(m) - 1, 0) for n, m in zip(context_len, length)]
        return result, LiveRows(final.cache, tokens, context_len, valid, store)


def _check_reach(contexts: Sequence[Context], cfg: SamplingConfig, limit: int, name: str) -> None:
    """Live rows hold ``limit`` positions: every context with its budget must fit, checked before any compute."""
    reach = max(len(c.ids) + (c.max_new_tokens or cfg.max_new_tokens) for c in contexts)
    if reach > limit:
        raise ValueError(f"{name} = {limit}: a context and its budget reach {reach} tokens")
