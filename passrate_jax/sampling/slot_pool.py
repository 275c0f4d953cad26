"""The slot engine's host shell: queues rollouts, keeps the decode slots full, harvests finished rows.

    engine = SlotEngine(sampler, rows=64, chunk=8, length=120)     # jitted programs, once per run
    pool = engine.pool(store, seed=step_seed)                        # one step's slots (params: the store's)
    pool.add(Context(ids, num_samples=8, context_id=key), tag=key)   # queued in order
    while not pool.idle:
        for done in pool.advance():                                  # rollouts finished a chunk ago
            ...                                                      # score, decide, pool.add(...) more
    dropped = pool.abort()                                           # the step is over: (tag, index, tokens)

``advance`` starts queued rollouts in free slots (their contexts prefilled into the step's store if it
does not hold them: one prefill per distinct context a step, as in round mode), dispatches one chunk of
``chunk`` decode steps, then reads the harvest of the *previous* chunk: the device decodes chunk c while
the host scores and decides on chunk c - 1 (JAX's asynchronous dispatch), and what the host decides
starts at chunk c + 1. Rollouts already queued do not wait for a decision: while the queue holds any,
``advance`` reads the previous chunk's harvest *before* dispatching, so a slot freed in chunk c - 1 is
refilled in chunk c, not c + 1 (the device waits for that read and the inserts, not for the verifier,
which still scores while chunk c runs). A pool made with ``lagged=False`` reads each chunk's harvest as
soon as it is dispatched, so what the host decides on chunk c starts at chunk c + 1, and the device waits
for the host meanwhile: the better trade where the host's decisions would wait for the chunk in flight
anyway (the allocation's programs on the decoding device, which runs programs in dispatch order). The
lags are fixed, so which chunk a rollout starts and ends in depends only on the rollouts' lengths and
the host's decisions, never on timing: a seed gives the same run.

Multi-turn rollouts (environments) stay in their row between turns: a pool made with ``on_turn`` asks it,
for every finished rollout it harvests, whether to continue it (:class:`Continue`: the ids to append and
the next turn's key and budget) or deliver it. A continued rollout keeps its slot; its ids are appended
to the row's cache by one ``extend`` program for all the harvest's continuations, and its next turn
starts in the next chunk dispatched. Such a pool reads each harvest before dispatching the next chunk.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from passrate_jax.distributed import to_host
from passrate_jax.model.transformer import KVCache
from passrate_jax.sampling import engine as core
from passrate_jax.sampling.config import SamplingConfig
from passrate_jax.sampling.prefix_store import PrefixStore
from passrate_jax.sampling.rows import Context, bucket
from passrate_jax.sampling.sampler import Sampler


@dataclasses.dataclass(frozen=True)
class Finished:
    """A rollout the pool finished: its ``tag`` (given to :meth:`SlotPool.add`), sample index, generated
    ids (stop token included), whether it ended on a stop id, and its policy log-probs."""
    tag: object
    sample_index: int
    ids: list[int]
    stopped: bool
    policy_logprobs: np.ndarray


@dataclasses.dataclass(frozen=True)
class Continue:
    """What ``on_turn`` returns to keep a rollout in its row: ``ids`` to append to its cache (its last
    generated token, then the observation), the next turn's ``context_id`` (with the rollout's sample
    index: its randomness) and ``budget`` (new tokens allowed)."""
    ids: list[int]
    context_id: int
    budget: int


@dataclasses.dataclass(frozen=True)
class _Queued:
    context: Context
    tag: object
    sample_index: int


class SlotEngine:
    """The jitted insert and chunk programs of one sampler (model, mesh, buckets), and the pool's static
    sizes: ``rows`` slots (rounded up to the row shards), ``chunk`` decode steps per chunk, ``length``
    positions per row (every context with its budget must fit; default: the sampler's reserved store
    slots), ``insert_rows`` rollouts started per insert program (more are started by several)."""

    def __init__(self, sampler: Sampler, *, rows: int, chunk: int, length: int | None = None,
                 insert_rows: int = 16, cfg: SamplingConfig | None = None):
        self.sampler, self.cfg = sampler, cfg or sampler.cfg
        self.rows = bucket(rows, (rows,), sampler.row_shards)
        self.length = length or sampler.store_capacity[1]
        if chunk < 1 or self.length < 1:
            raise ValueError(f"SlotEngine: chunk = {chunk}, length = {self.length}: both must be >= 1 "
                             f"(length: reserve the sampler's store or pass the positions a row needs)")
        self.insert_rows = insert_rows
        gen = bucket(self.cfg.max_new_tokens, self.cfg.generation_buckets)
        self.settings = core.ChunkSettings(core.DecodeSettings(
            top_k=int(self.cfg.top_k), top_p=float(self.cfg.top_p), pad_id=sampler.pad_id, gen_len=gen), chunk)
        mesh, rows1, rows2 = sampler.mesh, sampler._rows1, sampler._rows2
        row_axes = rows1.spec[0]
        state = jax.eval_shape(lambda: core.init_slots(sampler.model_cfg, self.rows, self.length, self.settings))
        if state.cache.is_decode_form:  # per-layer [R, kv, ., .] buffers
            cache = jax.tree.map(lambda _: NamedSharding(mesh, P(row_axes)), state.cache)
        else:
            cache = KVCache(*(NamedSharding(mesh, P(None, row_axes)),) * 2)
        replicated = NamedSharding(mesh, P())
        self.state_shardings = core.SlotState(
            live_r=rows1, last_token_r=rows1, position_r=rows1, stopped_r=rows1, length_r=rows1, budget_r=rows1,
            keys_r=rows1, tokens_rg=rows2, logprobs_rg=rows2, policy_logprobs_rg=rows2, live_steps=replicated,
            steps=replicated, row_steps=replicated, cache=cache)
        self._replicated = replicated
        new = core.SlotInsert(*(replicated,) * 6)
        self._init = jax.jit(self._init_impl, out_shardings=self.state_shardings)
        self._insert = jax.jit(self._insert_impl, donate_argnums=(0,), out_shardings=self.state_shardings,
                               in_shardings=(self.state_shardings, sampler._store_shardings, new, replicated,
                                             replicated, replicated))
        self._extend = jax.jit(self._extend_impl, donate_argnums=(1,), out_shardings=self.state_shardings,
                               in_shardings=(sampler.param_shardings, self.state_shardings,
                                             core.SlotExtend(*(replicated,) * 6), replicated, replicated, replicated))
        harvest = (rows1, rows1, rows1, rows2, rows2, replicated, replicated)
        self._chunk = jax.jit(self._chunk_impl, donate_argnums=(1,), out_shardings=(self.state_shardings, harvest),
                              in_shardings=(sampler.param_shardings, self.state_shardings, replicated, replicated))
        # Narrow chunks gather their rows: across devices that would move KV between them, so they are
        # used only where the pool's rows live on one device's shard.
        n = self.cfg.narrow_slots
        self.narrow = n if 0 < n < self.rows and sampler.row_shards == 1 else 0
        self.narrow_compiled = False
        self._chunk_narrow = jax.jit(
            self._chunk_narrow_impl, donate_argnums=(1,), out_shardings=(self.state_shardings, harvest),
            in_shardings=(sampler.param_shardings, self.state_shardings, replicated, replicated, replicated))

    # ------------------------------------------------------------------ jitted programs
    def _init_impl(self):
        return core.init_slots(self.sampler.model_cfg, self.rows, self.length, self.settings)

    def _insert_impl(self, state, store, new, seed, stop_ids, temperature):
        self.sampler.compilations += 1  # once per trace, i.e. per compiled program
        return core.insert(state, store, new, seed, stop_ids, temperature, settings=self.settings)

    def _extend_impl(self, params, state, new, seed, stop_ids, temperature):
        self.sampler.compilations += 1
        return core.extend(params, state, new, seed, stop_ids, temperature, graphdef=self.sampler.graphdef,
                           settings=self.settings, layout=self.sampler.layout)

    def _chunk_impl(self, params, state, stop_ids, temperature):
        self.sampler.compilations += 1
        state = core.generate_chunk(params, state, stop_ids, temperature, graphdef=self.sampler.graphdef,
                                    settings=self.settings, layout=self.sampler.layout)
        # The harvest is copied out, so the host may read it while the next chunk updates the donated state.
        return state, self._harvest(state)

    def _chunk_narrow_impl(self, params, state, rows_q, stop_ids, temperature):
        self.sampler.compilations += 1
        state = core.generate_chunk_rows(params, state, rows_q, stop_ids, temperature, graphdef=self.sampler.graphdef,
                                         settings=self.settings, layout=self.sampler.layout)
        return state, self._harvest(state)

    @staticmethod
    def _harvest(state):
        return (state.live_r, state.length_r, state.stopped_r, state.tokens_rg, state.policy_logprobs_rg,
                state.live_steps, state.row_steps)

    def pool(self, store: PrefixStore, *, seed: int, on_turn=None, lagged: bool = True) -> SlotPool:
        """An empty pool for one step: rollouts sample under ``store.params`` with ``seed``; ``on_turn``
        (a finished rollout -> :class:`Continue` or None) makes its rollouts multi-turn; ``lagged``: a
        chunk's harvest is read after the next chunk is dispatched (False: at once)."""
        return SlotPool(self, store, seed, on_turn, lagged)


class SlotPool:
    """One step's slots (see the module docstring). Counters: ``chunks`` (chunk programs run, of which
    ``narrow_chunks`` decoded only the occupied rows), ``inserts`` (insert and extend programs run),
    ``live_steps`` / ``slot_steps`` (live rows and rows decoded, summed over the decode steps run: their
    ratio is :attr:`utilization`), ``generated`` (tokens of finished rollouts)."""

    def __init__(self, engine: SlotEngine, store: PrefixStore, seed: int,
                 on_turn: Callable[[Finished], Continue | None] | None = None, lagged: bool = True):
        self.engine, self.store, self.seed, self.on_turn, self.lagged = engine, store, int(seed), on_turn, lagged
        s = engine.sampler
        stop = list(dict.fromkeys(i for i in (s.eos_id, *engine.cfg.stop_token_ids) if i is not None))
        stop_ids = np.full(bucket(len(stop), (8,)), -1, np.int32)
        stop_ids[:len(stop)] = stop
        self._scalars = jax.device_put((np.int32(self.seed), stop_ids, np.float32(engine.cfg.temperature)),
                                       engine._replicated)
        self.state = engine._init()
        if engine.narrow and not engine.narrow_compiled:
            # Compile the narrow chunk with the engine's first pool, where the other programs compile (the
            # first step), not in whichever later step first drains: on an empty pool it decodes nothing.
            rows_q = np.arange(engine.narrow, dtype=np.int32)
            self.state, _ = engine._chunk_narrow(store.params, self.state, rows_q, *self._scalars[1:])
            engine.narrow_compiled = True
        self.queue: collections.deque[_Queued] = collections.deque()
        self.occupant: list[tuple[_Queued, int] | None] = [None] * engine.rows  # (rollout, first chunk)
        self._harvests: collections.deque = collections.deque()  # (chunk index, device arrays)
        self.chunks = self.narrow_chunks = self.inserts = self.live_steps = self.slot_steps = self.generated = 0

    @property
    def idle(self) -> bool:
        """Nothing queued, running or waiting to be harvested."""
        return not self.queue and not self._harvests and all(o is None for o in self.occupant)

    @property
    def utilization(self) -> float:
        return self.live_steps / self.slot_steps if self.slot_steps else float("nan")

    def counters(self) -> dict:
        """The step's decode counters, as a run records them (``StepRollouts.engine``)."""
        return {"sampler_calls": self.chunks, "sampler_calls/narrow": self.narrow_chunks,
                "slot_steps": self.slot_steps, "slot_utilization": self.utilization}

    def add(self, context: Context, tag) -> None:
        """Queue ``context.num_samples`` rollouts (sample indices from ``context.first_sample_index``)."""
        budget = context.max_new_tokens or self.engine.cfg.max_new_tokens
        if len(context.ids) + budget > self.engine.length:
            raise ValueError(f"context {context.context_id}: {len(context.ids)} ids + {budget} new tokens exceed "
                             f"the engine's {self.engine.length} positions per row")
        for j in range(context.num_samples):
            self.queue.append(_Queued(context, tag, context.first_sample_index + j))

    def advance(self) -> list[Finished]:
        """Start queued rollouts in free slots, dispatch one chunk, and return the rollouts that finished
        in the chunk before it (in slot order; without ``lagged``, in this chunk), freeing their slots.
        With rollouts queued, that chunk's harvest is read before the start, so its freed slots take
        queued rollouts in this chunk; in a multi-turn pool (``on_turn``) always, so a continued rollout's
        next turn runs in this chunk rather than idling through it (the environment steps while the device
        waits: it must step before the turn)."""
        out = []
        if (self.queue or self.on_turn is not None) and self._harvests:
            out += self._read(*self._harvests.popleft())
        self._start_queued()
        dispatched = any(o is not None for o in self.occupant)
        if dispatched:
            self._dispatch()
        while len(self._harvests) > (1 if dispatched and self.lagged else 0):
            out += self._read(*self._harvests.popleft())
        return out

    def _dispatch(self) -> None:
        """One chunk: narrow (only the occupied rows, padded with free ones) while at most
        ``engine.narrow`` rows are occupied, every row otherwise. Occupied rows hold every live row (a
        row leaves them only once harvested, i.e. stopped), and the choice depends only on the
        occupancy, so it is as deterministic as the rest of the pool."""
        occupied = [i for i, o in enumerate(self.occupant) if o is not None]  # at least one: a chunk to run
        q = self.engine.narrow  # 0: never narrow
        if len(occupied) <= q:
            free = [i for i, o in enumerate(self.occupant) if o is None]
            rows_q = np.asarray(occupied + free[:q - len(occupied)], np.int32)
            self.state, harvest = self.engine._chunk_narrow(self.store.params, self.state, rows_q,
                                                            *self._scalars[1:])
            self.narrow_chunks += 1
        else:
            self.state, harvest = self.engine._chunk(self.store.params, self.state, *self._scalars[1:])
        self._harvests.append((self.chunks, harvest))
        self.chunks += 1

    @property
    def free(self) -> int:
        """Slots neither running a rollout nor claimed by a queued one."""
        return sum(o is None for o in self.occupant) - len(self.queue)

    def abort(self) -> list[tuple[object, int]]:
        """End the step: drop queued and running rollouts (and finished ones not yet delivered).
        Returns (tag, sample index, tokens it had generated) per rollout dropped."""
        dropped = [(q.tag, q.sample_index, 0) for q in self.queue]
        while self._harvests:
            dropped += [(f.tag, f.sample_index, len(f.ids)) for f in self._read(*self._harvests.popleft())]
        if any(o is not None for o in self.occupant):
            length = to_host(self.state.length_r)
            dropped += [(o[0].tag, o[0].sample_index, int(length[slot])) for slot, o in enumerate(self.occupant)
                        if o is not None]
        self.queue.clear()
        self.occupant = [None] * self.engine.rows
        return dropped

    # ------------------------------------------------------------------ host steps
    def _start_queued(self) -> None:
        free = [i for i, o in enumerate(self.occupant) if o is None]
        items = [self.queue.popleft() for _ in range(min(len(free), len(self.queue)))]
        if not items:
            return
        contexts = list({id(q.context): q.context for q in items}.values())
        rows = dict(zip(map(id, contexts), self.engine.sampler._prefill_missing(self.store, contexts, self.engine.cfg)))
        n = self.engine.insert_rows
        for start in range(0, len(items), n):
            batch, slots = items[start:start + n], free[start:start + n]
            column = np.full((6, n), 0, np.int32)
            column[0] = self.engine.rows  # padding entries: out of range, dropped
            for i, (q, slot) in enumerate(zip(batch, slots)):
                c = q.context
                column[:, i] = (slot, rows[id(c)], c.context_id if c.context_id is not None else 0, q.sample_index,
                                len(c.ids), c.max_new_tokens or self.engine.cfg.max_new_tokens)
                self.occupant[slot] = (q, self.chunks)
            self.state = self.engine._insert(self.state, self.store.arrays, core.SlotInsert(*column),
                                             *self._scalars)
            self.inserts += 1

    def _read(self, chunk: int, harvest) -> list[Finished]:
        # to_host gathers rows on other hosts' devices: every host reads the whole harvest and decides alike.
        live, length, stopped, tokens, policy_lp, live_steps, row_steps = to_host(harvest)
        self.live_steps, self.slot_steps = int(live_steps), int(row_steps)
        out, continued = [], []
        for slot, o in enumerate(self.occupant):
            # A rollout started (or continued) after this chunk ran is not in its harvest.
            if o is None or o[1] > chunk or live[slot]:
                continue
            m = int(length[slot])
            done = Finished(o[0].tag, o[0].sample_index, tokens[slot, :m].tolist(), bool(stopped[slot]),
                            policy_lp[slot, :m])
            self.generated += m
            more = self.on_turn(done) if self.on_turn is not None else None
            if more is None:
                out.append(done)
                self.occupant[slot] = None
            else:  # the next turn runs from the next chunk dispatched, in the same row
                continued.append((slot, o[0].sample_index, more))
                self.occupant[slot] = (o[0], self.chunks)
        self._continue(continued)
        return out

    def _continue(self, continued: list[tuple[int, int, Continue]]) -> None:
        """Append each continued rollout's ids to its row (one program per ``insert_rows`` of them, ids
        padded to a context bucket) and draw its next turn's first token."""
        n = self.engine.insert_rows
        for start in range(0, len(continued), n):
            batch = continued[start:start + n]
            width = bucket(max(len(c.ids) for _, _, c in batch), self.engine.sampler.cfg.context_buckets)
            tokens = np.full((n, width), self.engine.sampler.pad_id, np.int32)
            column = np.zeros((5, n), np.int32)
            column[0] = self.engine.rows  # padding entries: out of range, dropped
            for i, (slot, index, c) in enumerate(batch):
                if c.budget < 1 or not c.ids:  # the caller keeps the row's length within the engine's
                    raise ValueError(f"slot {slot}: a continued rollout needs ids and a budget >= 1, got "
                                     f"{len(c.ids)} ids and budget {c.budget}")
                tokens[i, :len(c.ids)] = c.ids
                column[:, i] = (slot, len(c.ids), c.context_id, index, c.budget)
            new = core.SlotExtend(column[0], tokens, column[1], column[2], column[3], column[4])
            self.state = self.engine._extend(self.store.params, self.state, new, *self._scalars)
            self.engine.sampler._count_prefill(self.store, len(batch), sum(len(c.ids) for _, _, c in batch))
            self.inserts += 1

