"""The simulator's rollout modes (study/sim_engine.py): the slot engine's jit-compatible pool against
a hand count and against the real event loop (rollout/events.py), and against round mode.

- A tiny step counted by hand: slot-steps, live steps and chunks of both modes.
- The jitted pool and event loop make the decisions and count the chunks, decode steps, aborted
  rollouts and wasted tokens of ``collect_rollouts_events`` driving a host model of ``SlotPool``.
- Every answer the same length and a chunk at least that long (and slots for every rollout): the
  engine's numbers are round mode's for every method.
- No length bias: failed answers three times longer than successful ones, DS admits exactly round
  mode's groups and SARA's trained groups keep round mode's pass-rate distribution.
- Out-of-order retirement frees its positions: the requests in flight stay in issue order, renumbered.
"""

import collections
import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from passrate_jax.allocation import Allocator
from passrate_jax.allocation.config import AllocationConfig, PrefixSamplingConfig, SaraConfig
from passrate_jax.rollout.events import collect_rollouts_events
from passrate_jax.study.sim_engine import Timing, _empty, push, retire, retiring, run_step_events, run_step_rounds
from passrate_jax.study.simulate import SimulatorConfig, World, _retires_in_any_order, make_world, run_method
from passrate_jax.study.lengths import LengthModel
from passrate_jax.sampling.config import SamplingConfig
from tests.fakes import PassThroughBackend, clean_scores


def _stepper(run, allocator, timing):
    """``step(state, rewards [P, N], lengths [P, N])``: one jitted step of ``run`` in which rollout j of
    prompt i scores rewards[i, j] after lengths[i, j] tokens."""
    def step(state, rewards, lengths):
        outcomes = lambda st, t: (rewards[t.prompt].astype(jnp.int8), jnp.ones(t.prompt.shape, bool))  # noqa: E731
        return run(allocator.setup, allocator.knobs, state, outcomes, lambda t, r: lengths[t.prompt], timing)
    return jax.jit(step)


def test_tiny_step_counted_by_hand():
    """One prompt, N = 4 answers of 5, 2, 7 and 1 tokens (L - 1 decode steps each: 4, 1, 6, 0).
    Rounds: one call of 4 rows x 6 steps = 24 slot-steps, 11 live. Engine, 2 slots, chunks of 3:
    chunk 0 runs answers 0, 1 (3 steps: 6 slot-steps); answers are still queued, so chunk 0's harvest is
    read before chunk 1 starts: answer 1's slot takes answer 2, and chunk 1 finishes answer 0 and runs
    answer 2 (3 steps: 6); answer 0's slot takes answer 3 (ended at its first token) in chunk 2, which
    finishes answer 2 (3 steps: 6); chunk 3 runs no step and delivers the last two: 18 slot-steps, 11
    live, 4 chunks. (Harvesting after the dispatch alone, slots would refill a chunk later: 20, 5.)"""
    allocator = Allocator(AllocationConfig(method="uniform", num_prompts=1, group_size=4), PrefixSamplingConfig(), 1)
    state = allocator.init(jax.random.PRNGKey(0))
    lengths, rewards = [[5, 2, 7, 1]], [[1, 0, 1, 0]]
    timing = Timing(slots=2, chunk=3, max_chunks=100, row_buckets=(4,))
    _, t, rounds = _stepper(run_step_rounds, allocator, timing)(state, np.array(rewards), np.array(lengths))
    _, e, engine = _stepper(run_step_events, allocator, timing)(state, np.array(rewards), np.array(lengths))
    assert {k: int(v) for k, v in rounds.items() if k in ("slot_steps", "live_steps", "chunks")} == {
        "slot_steps": 24, "live_steps": 11, "chunks": 1}
    assert {k: int(v) for k, v in engine.items()} == {"chunks": 4, "slot_steps": 18, "live_steps": 11, "aborted": 0,
                                                      "wasted": 0, "limit_hit": 0, "stuck": 0, "overflow": 0}
    assert int(t.trained) == int(e.trained) == 1


def test_narrow_chunks_counted_by_hand():
    """The same answers (4, 1, 6 and 0 decode steps) in 4 slots, chunks of 2. Chunks 0 and 1 run with
    4 slots occupied (2 steps x 4 rows each; answers 1 and 3, ended in chunk 0, are harvested after
    chunk 1 is dispatched); chunk 2 runs answers 0 (already ended) and 2 with 2 slots occupied: with
    ``narrow=2`` it decodes 2 rows (2 steps: 4 slot-steps), without it 4 (8); chunk 3 runs no step."""
    allocator = Allocator(AllocationConfig(method="uniform", num_prompts=1, group_size=4), PrefixSamplingConfig(), 1)
    state = allocator.init(jax.random.PRNGKey(0))
    lengths, rewards = np.array([[5, 2, 7, 1]]), np.array([[1, 0, 1, 0]])
    counted = {}
    for narrow in (0, 2):
        timing = Timing(slots=4, chunk=2, max_chunks=100, row_buckets=(4,), narrow=narrow)
        _, _, engine = _stepper(run_step_events, allocator, timing)(state, rewards, lengths)
        counted[narrow] = {k: int(engine[k]) for k in ("chunks", "slot_steps", "live_steps")}
    assert counted == {0: {"chunks": 4, "slot_steps": 24, "live_steps": 11},
                       2: {"chunks": 4, "slot_steps": 20, "live_steps": 11}}


class PoolModel:
    """A host model of ``sampling/slot_pool.py``'s ``SlotPool`` for ``collect_rollouts_events``: queued
    rollouts start in the lowest free slots, a chunk decodes up to ``chunk`` steps of every live row (a
    rollout's first token comes with its insert), and a chunk's finished rows are delivered by the next
    ``advance``: before it starts queued rollouts when any are queued (their slots are refilled at once),
    else after it dispatches. Counts chunks, slot-steps and live steps."""

    def __init__(self, backend, slots: int, chunk: int):
        self.backend, self.chunk = backend, chunk
        self.queue, self.occupant, self.pending = collections.deque(), [None] * slots, collections.deque()
        self.chunks = self.slot_steps = self.live_steps = 0

    @property
    def idle(self):
        return not self.queue and not self.pending and all(o is None for o in self.occupant)

    def add(self, request, tag):
        for j in range(request.num_rollouts):
            index = request.first_index + j
            self.queue.append({"out": (tag, index, (request.prompt_id, index)), "left": 0, "tokens": 1,
                               "length": self.backend.lengths[request.prompt_id, index]})

    def _deliver(self, out):
        for slot, o in self.pending.popleft():
            if self.occupant[slot] is o:
                out.append(o["out"])
                self.occupant[slot] = None

    def advance(self):
        out = []
        if self.queue and self.pending:
            self._deliver(out)
        for slot in [i for i, o in enumerate(self.occupant) if o is None][:len(self.queue)]:
            o = self.occupant[slot] = self.queue.popleft()
            o["left"], o["start"] = o["length"] - 1, self.chunks
        dispatched = any(o is not None for o in self.occupant)
        if dispatched:
            gains = [min(o["left"], self.chunk) if o is not None else 0 for o in self.occupant]
            for o, g in zip(self.occupant, gains):
                if o is not None:
                    o["left"], o["tokens"] = o["left"] - g, o["tokens"] + g
            self.slot_steps += max(gains) * len(self.occupant)
            self.live_steps += sum(gains)
            self.pending.append([(s, o) for s, o in enumerate(self.occupant) if o is not None and o["left"] == 0])
            self.chunks += 1
        while len(self.pending) > (1 if dispatched else 0):
            self._deliver(out)
        return out

    def abort(self):
        """(tag, sample index, tokens generated) per rollout dropped, as ``SlotPool.abort`` returns them."""
        dropped = [(q["out"][0], q["out"][1], 0) for q in self.queue]
        dropped += [(o["out"][0], o["out"][1], o["tokens"]) for o in self.occupant if o is not None]
        self.queue.clear()
        self.occupant = [None] * len(self.occupant)
        self.pending.clear()
        return dropped

    def counters(self):
        return {"chunks": self.chunks, "slot_steps": self.slot_steps, "live_steps": self.live_steps}


class TableBackend(PassThroughBackend):
    """Rollout (prompt, index) scores rewards[prompt, index] after lengths[prompt, index] tokens."""
    harvest = "lagged"  # the simulator models an accelerator's run: the machine on the host

    def __init__(self, rewards, lengths, slots, chunk):
        self.rewards, self.lengths, self.slots, self.chunk = rewards, lengths, slots, chunk

    def score(self, requests, rollouts):
        flat = [x for rs in rollouts for x in rs]
        return clean_scores([self.rewards[p, i] for p, i in flat])

    def record(self, requests, rollouts, table, rows):
        pass

    def stream(self, params, seed, lagged=True):
        assert lagged
        return PoolModel(self, self.slots, self.chunk)


PROMPTS, B, N = 48, 4, 8
CROSS_CHECKED = {
    "ds": AllocationConfig(method="ds", num_prompts=B, group_size=N),
    "sara_fill": AllocationConfig(method="sara", num_prompts=B, group_size=N),
    "pilot_commit": AllocationConfig(method="pilot_commit", num_prompts=B, group_size=N),
}


@pytest.mark.parametrize("method", [pytest.param(m, marks=pytest.mark.slow) if m == "pilot_commit" else m
                                    for m in CROSS_CHECKED])
def test_pool_matches_the_event_loop(method):
    """Three steps (the allocator state carried), 12 slots, chunks of 4, answers of 1 to 40 tokens, a
    failed answer longer: the jitted engine step trains the same groups, spends, aborts and wastes the
    same, and runs the same chunks, slot-steps and live steps as the host loop."""
    allocator = Allocator(CROSS_CHECKED[method], PrefixSamplingConfig(), PROMPTS)
    rng = np.random.default_rng(7)
    timing = Timing(slots=12, chunk=4, max_chunks=10_000, row_buckets=(64,),
                    any_order=allocator.retires_in_any_order)  # SARA fill: each request retires when scored
    state_jit = state_host = allocator.init(jax.random.PRNGKey(1))
    step_jit = _stepper(run_step_events, allocator, timing)
    for step in range(3):
        rate = rng.uniform(0, 1, (PROMPTS, 1))
        rewards = (rng.uniform(0, 1, (PROMPTS, N)) < rate).astype(np.int8)
        lengths = np.minimum(rng.integers(1, 25, (PROMPTS, N)) + 15 * (1 - rewards), 40)
        backend = TableBackend(rewards, lengths, timing.slots, timing.chunk)
        host = collect_rollouts_events(allocator, state_host, backend, None, seed=step)
        state_jit, t, counters = step_jit(state_jit, rewards, lengths)
        t = jax.device_get(t)
        order = np.argsort(np.where(t.rank >= 0, t.rank, t.capacity))[:int(t.trained)]
        assert [(int(t.key[g]), int(t.prompt[g])) for g in order] == [
            (g.group_key, g.prompt_id) for g in host.result.groups]
        assert int(t.spent) == host.result.rollouts_spent
        assert {k: int(counters[k]) for k in ("chunks", "slot_steps", "live_steps", "aborted", "wasted")} == {
            **{k: host.engine[k] for k in ("chunks", "slot_steps", "live_steps")},
            "aborted": host.engine["rollouts/aborted"], "wasted": host.engine["tokens/wasted"]}
        state_host = host.state
    assert counters["limit_hit"] == counters["stuck"] == counters["overflow"] == 0


SIM = SimulatorConfig(steps=30, num_prompts=128, seeds=2, warmup=1)
ALLOC = AllocationConfig(num_prompts=B, group_size=N)
DECISIONS = ("spent", "trained", "valid", "useful", "hist", "abandoned", "replay_successes", "replay_rollouts",
             "trained_rollouts", "trained_tokens", "evicted")


def _world(mode: str, lengths: LengthModel, slots: int, chunk: int) -> World:
    return World(SIM.steps, SIM.drift, SIM.ps_response_power, mode, Timing(slots, chunk, 4096, (64, 128, 256)), lengths)


# Round mode's decisions do not depend on lengths: both tests below read them from this one world (one compile).
TWENTY = LengthModel("constant", 64, median=20.0)
ROUNDS = _world("rounds", TWENTY, 1024, 20)


@functools.lru_cache(maxsize=None)
def _run(name: str, world: World) -> dict:
    return run_method(name, SIM, ALLOC, PrefixSamplingConfig(), world=world)


def test_equal_lengths_engine_equals_rounds_for_every_method():
    """Every answer 20 tokens, chunks of 20 and a slot for every rollout in flight: each round retires
    in one event, so every method's every per-step number is round mode's; and nothing is aborted."""
    slots = _world("slots", TWENTY, 1024, 20)
    for name in SIM.methods:
        r, e = _run(name, ROUNDS), _run(name, slots)
        for key in DECISIONS:
            np.testing.assert_array_equal(e[key], r[key], err_msg=f"{name}: {key}")
        assert e["aborted"].sum() == 0 and e["limit_hit"].sum() == 0 and r["trained"].sum() > 0, name


def test_completion_order_never_biases_admission():
    """Failed answers three times longer (lognormal lengths) and a pool of 16 slots in chunks of 4: the
    groups that finish first are the easy ones, yet DS trains exactly round mode's groups and SARA's
    trained groups keep round mode's pass-rate histogram (within sampling noise)."""
    slots = _world("slots", LengthModel("lognormal", 256, median=20.0, sigma=0.8, fail_factor=3.0), 16, 4)
    ds_r, ds_e = _run("ds", ROUNDS), _run("ds", slots)
    np.testing.assert_array_equal(ds_e["hist"], ds_r["hist"])
    assert ds_e["aborted"].sum() > 0  # groups not needed were cut short: completion order did differ
    sara_r, sara_e = _run("sara", ROUNDS), _run("sara", slots)
    hr, he = (m["hist"].sum((0, 1)) / m["hist"].sum() for m in (sara_r, sara_e))
    mean = lambda h: float(np.dot(h, np.arange(N + 1)))  # noqa: E731
    assert abs(mean(he) - mean(hr)) < 0.25 and np.abs(he - hr).max() < 0.06


def test_make_world_reads_sampling_and_the_length_table():
    world = make_world(SimulatorConfig(), SamplingConfig(slots=32, chunk_tokens=4, max_new_tokens=56), "slots")
    assert (world.timing.slots, world.timing.chunk, world.lengths.limit, world.engine) == (32, 4, 56, "slots")
    assert world.lengths.kind == "table" and abs(world.lengths.success_cdf[-1] - 1) < 1e-6


def test_the_simulator_retires_in_any_order_exactly_where_the_real_loop_does():
    """``prepare`` gives the simulated engine the allocator's retirement order (SARA fill: as scored),
    and issue order where a sweep varies what that order depends on (here the budget)."""
    for name, cfg, expected in (("sara_fill", CROSS_CHECKED["sara_fill"], True), ("ds", CROSS_CHECKED["ds"], False),
                                ("sara_fixed", AllocationConfig(method="sara", num_prompts=B, group_size=N,
                                                                sara=SaraConfig(mode="fixed_budget")), False)):
        allocator = Allocator(cfg, PrefixSamplingConfig(), PROMPTS)
        assert _retires_in_any_order(allocator, None) is expected, name
        assert _retires_in_any_order(allocator, allocator.knobs) is expected, name
        swept = allocator.knobs.replace(budget=jnp.asarray([int(allocator.knobs.budget), B * N], jnp.int32))
        assert _retires_in_any_order(allocator, swept) is False, name


def test_retiring_out_of_order_frees_positions_and_renumbers_slots():
    """Three positions. Request 0 is long (a rollout still decoding), request 1 is complete, request 2 has
    a rollout in a slot: ``any_order`` retires request 1 alone (issue order retires nothing), the live
    requests move down with their slots' numbers, and a fourth request then fits. A ring that drops
    requests only from its head overflowed here (the long-tail simulation's SARA fill: 20 of 1,000
    steps); without renumbering, the slot of request 2 would deliver to the wrong request."""
    f, p = _empty(3, 2, 2)
    t = types.SimpleNamespace(key=jnp.array([10, 11, 12]), n=jnp.zeros(3, jnp.int32))
    f, full = push(f, t, jnp.array([2, 2, 2]), jnp.full((3, 2), 5))
    f = f.replace(started_q=jnp.array([2, 2, 1]), delivered_q=jnp.array([1, 2, 0]))
    p = p.replace(seq_s=jnp.array([0, 2]))
    assert retiring(f, any_order=False).tolist() == [False, False, False]
    now = retiring(f, any_order=True)
    assert now.tolist() == [False, True, False] and not bool(full)
    f, p = retire(f, p, now)
    assert int(f.count) == 2 and f.key_q[:2].tolist() == [10, 12] and f.started_q[:2].tolist() == [2, 1]
    assert p.seq_s.tolist() == [0, 1]
    t = types.SimpleNamespace(key=jnp.array([13, 0, 0]), n=jnp.zeros(3, jnp.int32))
    f, full = push(f, t, jnp.array([2, 0, 0]), jnp.full((3, 2), 5))
    assert not bool(full) and int(f.count) == 3 and f.key_q.tolist() == [10, 12, 13]
    f, full = push(f, t, jnp.array([2, 0, 0]), jnp.full((3, 2), 5))
    assert bool(full)  # a fourth live request does not fit: the step is flagged, not silently wrong
