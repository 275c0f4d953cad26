"""Allocation driven by group events (rollout/events.py, the machine's event mode) against round mode,
without a model: a fake slot stream whose rollouts have given lengths and rewards.

- Every answer the same length and a chunk at least that long: each round retires in one event, so the
  engine makes exactly round mode's decisions, for every method (trained groups, rollouts spent,
  rounds, abandoned prompts, and the allocator state carried to the next step), fresh groups started
  ahead of their requests (rollout/ahead.py) included.
- No length bias: with short answers right and long answers wrong, DS in the engine trains exactly
  round mode's groups (the first B valid groups in opening order), not those that finish first, and
  Pilot-Commit commits round mode's (it ranks its buffer only once no pilot is in flight).
"""

import collections
import functools
import types
import zlib

import jax
import numpy as np
import pytest

from passrate_jax.allocation import Allocator, state_to_dict
from passrate_jax.allocation.step import StepRun
from passrate_jax.allocation.config import (AllocationConfig, DSConfig, PilotCommitConfig, PrefixSamplingConfig,
                                            SaraConfig, SelectionConfig)
from passrate_jax.rollout.events import collect_rollouts_events, harvest_lagged
from passrate_jax.rollout.loop import collect_rollouts
from tests.fakes import PassThroughBackend, clean_scores

PROMPTS = 96


def reward_of(seed: int, key: int, prompt: int, index: int) -> int:
    """A success with the prompt's pass rate (prompts spread over [0, 1]), drawn from the rollout's identity."""
    u = zlib.crc32(f"{seed}/{key}/{index}".encode()) / 2 ** 32
    return int(u < (prompt % 11) / 10)


class FakeStream:
    """The slot pool's timing (see sampling/slot_pool.py): ``slots`` rows; a rollout's first token comes
    with its insert, then ``chunk`` tokens a chunk; finished rollouts are delivered one chunk late."""

    def __init__(self, backend, seed: int, lagged: bool = True):
        self.backend, self.seed, self.lagged = backend, seed, lagged
        self.queue = collections.deque()
        self.occupant = [None] * backend.slots
        self.harvests = collections.deque()
        self.chunks = self.live_steps = self.slot_steps = 0

    @property
    def idle(self):
        return not self.queue and not self.harvests and all(o is None for o in self.occupant)

    def add(self, request, tag):
        for j in range(request.num_rollouts):
            rollout = (request.group_key, request.prompt_id, request.first_index + j, self.seed)
            self.queue.append((tag, request.first_index + j, rollout, self.backend.length(rollout)))

    def advance(self):
        free = [i for i, o in enumerate(self.occupant) if o is None]
        for slot in free[:len(self.queue)]:
            self.occupant[slot] = [self.queue.popleft(), 1, self.chunks]
        dispatched = any(o is not None for o in self.occupant)
        if dispatched:
            for o in self.occupant:
                if o is not None and o[1] < o[0][3]:
                    o[1] = min(o[0][3], o[1] + self.backend.chunk)
            self.harvests.append([(s, o) for s, o in enumerate(self.occupant) if o is not None and o[1] >= o[0][3]])
            self.chunks += 1
        out = []
        while len(self.harvests) > (1 if dispatched and self.lagged else 0):
            for slot, o in self.harvests.popleft():
                if self.occupant[slot] is o:
                    out.append(o[0][:3])
                    self.occupant[slot] = None
        return out

    @property
    def free(self):
        return sum(o is None for o in self.occupant) - len(self.queue)

    def length(self, rollout):
        return self.backend.length(rollout)

    def abort(self):
        dropped = [(q[0], q[1], 0) for q in self.queue] + [(o[0][0], o[0][1], o[1]) for o in self.occupant
                                                           if o is not None]
        self.queue.clear()
        self.occupant = [None] * len(self.occupant)
        self.harvests.clear()
        return dropped

    def counters(self):
        return {"sampler_calls": self.chunks}


class ForgetfulStore:
    """The trajectory store of :class:`FakeBackend`: notes which recorded groups it is told to forget."""

    def __init__(self, backend):
        self.backend = backend

    def discard(self, keys):
        self.backend.discarded_recorded.update(set(keys) & self.backend.recorded)


class FakeBackend(PassThroughBackend):
    """Rollouts are (group key, prompt, index, seed); ``length(rollout)`` tokens each; reward :func:`reward_of`."""

    def __init__(self, length, slots: int = 100_000, chunk: int = 8, lookahead: int = 32, harvest: str = "lagged"):
        self.length, self.slots, self.chunk, self.lookahead, self.harvest = length, slots, chunk, lookahead, harvest
        self.trained_lengths = []
        self.recorded = set()  # group keys with trajectories recorded (the machine requested them)
        self.discarded_recorded = set()  # of those, keys the event loop told the store to forget
        self.store = ForgetfulStore(self)

    def generate(self, contexts, params, seed):
        return [[(r.group_key, r.prompt_id, r.first_index + j, seed) for j in range(r.num_rollouts)] for r in contexts]

    def score(self, requests, rollouts):
        flat = [x for rs in rollouts for x in rs]
        return clean_scores([reward_of(s, k, p, i) for k, p, i, s in flat])

    def record(self, requests, rollouts, table, rows):
        self.recorded.update(r.group_key for r in requests)

    def stream(self, params, seed, lagged=True):
        return FakeStream(self, seed, lagged)

    def prompt_ids(self, prompt: int) -> list[int]:
        """Prompt ids: the harder the prompt (the lower ``prompt % 11``), the longer."""
        return [0] * (11 - prompt % 11)


def run_steps(collect, allocation: AllocationConfig, ps: PrefixSamplingConfig, backend, steps: int = 3):
    allocator = Allocator(allocation, ps, num_prompts=PROMPTS)
    state, out = allocator.init(jax.random.PRNGKey(3)), []
    for step in range(steps):
        ro = collect(allocator, state, backend, None, seed=step)
        state = ro.state
        r = ro.result
        out.append({"groups": [(g.group_key, g.prompt_id, g.rewards, g.prefix) for g in r.groups],
                    "spent": r.rollouts_spent, "rounds": r.rounds, "abandoned": sorted(r.abandoned),
                    "retained": sorted(r.retained_keys), "replay": r.replay_rollouts.tolist(),
                    "state": {k: v.tolist() for k, v in state_to_dict(state).items()}, "engine": ro.engine})
    return out


B, N = 4, 8
METHODS = {
    "grpo": (AllocationConfig(method="uniform", num_prompts=B, group_size=N), PrefixSamplingConfig()),
    "ds": (AllocationConfig(method="ds", num_prompts=B, group_size=N), PrefixSamplingConfig()),
    "ideal_ds": (AllocationConfig(method="ds", num_prompts=B, group_size=N, ds=DSConfig(keep_surplus=True)),
                 PrefixSamplingConfig()),
    "sara_fill": (AllocationConfig(method="sara", num_prompts=B, group_size=N), PrefixSamplingConfig()),
    "sara_fixed": (AllocationConfig(method="sara", num_prompts=B, group_size=N,
                                    sara=SaraConfig(mode="fixed_budget")), PrefixSamplingConfig()),
    "pilot_commit": (AllocationConfig(method="pilot_commit", num_prompts=B, group_size=N), PrefixSamplingConfig()),
    "pilot_commit_budgeted": (AllocationConfig(method="pilot_commit", num_prompts=B, group_size=N,
                                               pilot_commit=PilotCommitConfig(mode="budgeted", pilot_fraction=0.5,
                                                                              p_low=0.25, p_high=0.25)),
                              PrefixSamplingConfig()),
    "mopps": (AllocationConfig(method="uniform", num_prompts=B, group_size=N,
                               selection=SelectionConfig(method="mopps")), PrefixSamplingConfig()),
    "sara_dps": (AllocationConfig(method="sara", num_prompts=B, group_size=N,
                                  selection=SelectionConfig(method="dps")), PrefixSamplingConfig()),
    "ps": (AllocationConfig(method="uniform", num_prompts=B, group_size=N), PrefixSamplingConfig(enabled=True)),
    "ps_same_step": (AllocationConfig(method="ds", num_prompts=B, group_size=N),
                     PrefixSamplingConfig(enabled=True, timing="same_step")),
    "ps_on_top_sara": (AllocationConfig(method="sara", num_prompts=B, group_size=N),
                       PrefixSamplingConfig(enabled=True, placement="on_top", mode="fixed")),
}


# Methods whose later requests were served by guesses (the rest of an opened group, a commit of a pilot,
# a fresh group the machine predicted), on these prompts and seeds.
GUESSES_CLAIMED = ("sara_fill", "sara_fixed", "ps_on_top_sara", "pilot_commit", "pilot_commit_budgeted")


def _decisions(step: dict, any_order: bool) -> dict:
    """A step's decisions (everything but the engine's counters). Where requests retire in any order
    (SARA fill) a group is trained when its last rollout is scored, so the batch holds round mode's groups
    in the order they completed, which guesses started ahead can change: compared as a set."""
    out = {k: v for k, v in step.items() if k != "engine"}
    if any_order:
        out["groups"] = sorted(out["groups"])
    return out


@pytest.mark.parametrize("harvest", ["lagged", "at_once"])
@pytest.mark.parametrize("method", list(METHODS))
def test_equal_lengths_make_round_mode_decisions(method, harvest):
    allocation, ps = METHODS[method]
    rounds = run_steps(collect_rollouts, allocation, ps, FakeBackend(length=lambda rollout: 6, chunk=6))
    backend = FakeBackend(length=lambda rollout: 6, chunk=6, harvest=harvest)
    events = run_steps(collect_rollouts_events, allocation, ps, backend)
    any_order = Allocator(allocation, ps, PROMPTS).retires_in_any_order
    for r, e in zip(rounds, events):
        assert _decisions(e, any_order) == _decisions(r, any_order)
        assert e["engine"]["rollouts/aborted"] == 0  # rounds end together: nothing left in flight
    assert all(r["groups"] for r in rounds)
    # Only guesses never requested are forgotten: never a group the machine opened (e.g. a pilot kept for
    # a later step's commit).
    assert not backend.discarded_recorded
    if method in GUESSES_CLAIMED:  # some requests were served by rollouts started ahead (rollout/ahead.py)
        assert sum(e["engine"]["rollouts/speculative"] - e["engine"]["rollouts/speculative_unused"]
                   for e in events) > 0


@pytest.mark.parametrize("slots,harvest", [(100_000, "lagged"), (24, "lagged"), (24, "at_once")])
def test_no_length_bias_ds_trains_round_mode_groups(slots, harvest):
    """The easier the prompt, the shorter its answers (and a wrong answer 5 tokens longer): the first valid
    groups to *finish* are the easiest, yet DS in the engine must train the groups round mode trains
    (its first B valid in opening order)."""
    def length(rollout):
        key, prompt, index, seed = rollout
        return 2 + 2 * (10 - prompt % 11) + 5 * (1 - reward_of(seed, key, prompt, index))

    allocation = AllocationConfig(method="ds", num_prompts=B, group_size=N)
    rounds = run_steps(collect_rollouts, allocation, PrefixSamplingConfig(), FakeBackend(length, chunk=2), steps=4)
    events = run_steps(collect_rollouts_events, allocation, PrefixSamplingConfig(),
                       FakeBackend(length, slots=slots, chunk=2, harvest=harvest), steps=4)
    for r, e in zip(rounds, events):
        assert [g[:3] for g in e["groups"]] == [g[:3] for g in r["groups"]]
    assert sum(e["engine"]["rollouts/aborted"] for e in events) > 0  # groups not needed were cut short


@pytest.mark.parametrize("slots", [100_000, 24])
def test_no_length_bias_pilot_commit_ranks_its_whole_pilot_stage(slots):
    """Pilot-Commit ranks its buffer with every pilot requested before it commits (budgeted: the step's
    pilot stage together). In the engine a pilot retires once every pilot issued before it is scored, so
    the pilots scored first are those whose answers ended first: committing from them would favour short
    answers. The engine must commit round mode's groups (answers long when wrong, and the easier the
    prompt the shorter its answers). Fails with commits made while pilots are in flight (checked: the
    engine then commits prompt 64, an easy one, where round mode commits prompt 92)."""
    def length(rollout):
        key, prompt, index, seed = rollout
        return 2 + 2 * (10 - prompt % 11) + 5 * (1 - reward_of(seed, key, prompt, index))

    allocation, ps = METHODS["pilot_commit_budgeted"]
    rounds = run_steps(collect_rollouts, allocation, ps, FakeBackend(length, chunk=2), steps=1)
    events = run_steps(collect_rollouts_events, allocation, ps, FakeBackend(length, slots=slots, chunk=2), steps=1)
    assert [g[:3] for g in events[0]["groups"]] == [g[:3] for g in rounds[0]["groups"]]
    assert rounds[0]["groups"]


def _length_favours_easy_and_right(rollout):
    key, prompt, index, seed = rollout
    return 2 + 2 * (10 - prompt % 11) + 5 * (1 - reward_of(seed, key, prompt, index))


@pytest.mark.parametrize("slots", [100_000, 24])
def test_sara_fill_retires_groups_as_scored_and_trains_round_mode_groups(slots):
    """SARA fill needs no issue order (Allocator.retires_in_any_order): each request retires when its own
    rollouts are scored, so a prompt no longer waits for an earlier prompt's longest answer (fewer chunks a
    step than retiring in issue order), and it still trains round mode's groups, spends round mode's
    rollouts, abandons round mode's prompts and carries round mode's state, with answers long when wrong
    and short on easy prompts. DS, whose groups compete for the batch, keeps issue order: retiring its
    requests as they finish trains other groups (the length bias issue order prevents).

    The chunks are compared without guesses (``lookahead=0``): guesses run SARA's chain of decisions
    ahead whatever the retirement order, and in the 24-slot pool they hide the difference (73 chunks
    against 72 with guesses; 129 against 151 without)."""
    allocation, ps = METHODS["sara_fill"]
    assert Allocator(allocation, ps, PROMPTS).retires_in_any_order
    for other in ("sara_fixed", "sara_dps", "ps_on_top_sara", "ds", "pilot_commit"):
        assert not Allocator(*METHODS[other], PROMPTS).retires_in_any_order, other

    def run(collect, lookahead=32):
        return run_steps(collect, allocation, ps, FakeBackend(_length_favours_easy_and_right, slots=slots, chunk=2,
                                                              lookahead=lookahead))

    rounds, events = run(collect_rollouts), run(collect_rollouts_events)
    for r, e in zip(rounds, events):
        assert sorted(g[:3] for g in e["groups"]) == sorted(g[:3] for g in r["groups"])
        assert (e["spent"], e["abandoned"], e["state"]) == (r["spent"], r["abandoned"], r["state"])
    chunks = [sum(x["engine"]["sampler_calls"] for x in run(collect, lookahead=0))
              for collect in (collect_rollouts_events, functools.partial(collect_rollouts_events, any_order=False))]
    assert chunks[0] < chunks[1]

    ds = METHODS["ds"]
    rounds = run_steps(collect_rollouts, *ds, FakeBackend(_length_favours_easy_and_right, chunk=2), steps=4)
    as_finished = run_steps(functools.partial(collect_rollouts_events, any_order=True), *ds,
                            FakeBackend(_length_favours_easy_and_right, slots=slots, chunk=2), steps=4)
    assert any([g[:3] for g in e["groups"]] != [g[:3] for g in r["groups"]] for r, e in zip(rounds, as_finished))


@pytest.mark.parametrize("method", ["sara_fill", "ds", "pilot_commit"])
def test_one_program_an_event_decides_as_the_calls_one_by_one(monkeypatch, method):
    """``StepRun.observe_and_issue`` (``machine.event_step``: observe, plan unless done, and the guesses'
    lookahead, as one program; a step's first requests with ``plan_and_look``) gives what
    ``observe_some``, ``issue`` and ``lookahead`` give called one by one: the same decisions, guesses,
    chunks and counters, step for step."""
    allocation, ps = METHODS[method]

    def run():
        return run_steps(collect_rollouts_events, allocation, ps,
                         FakeBackend(_length_favours_easy_and_right, slots=64, chunk=2))

    fused = run()
    monkeypatch.setattr(StepRun, "observe_and_issue", lambda self, results, m: (self.observe_some(results),
                                                                               self.issue())[1])
    plain_issue = StepRun.issue
    monkeypatch.setattr(StepRun, "issue", lambda self, m=0: plain_issue(self))
    assert run() == fused
    assert sum(x["engine"]["rollouts/speculative"] for x in fused) > 0


def test_uniform_allocation_starts_the_longest_prompts_first(monkeypatch):
    """GRPO makes every request at the step's start (``Allocator.decides_at_start``), so the engine starts
    the longest prompts first: with answers as long as their prompts, in 16 slots, a step then ends in
    fewer chunks than with its rollouts started in issue order, making the same decisions. Compositions
    that decide on their first requests' outcomes start them in issue order."""
    def length(rollout):
        return 3 * (11 - rollout[1] % 11)

    started = []

    class Recording(FakeBackend):
        def stream(self, params, seed, lagged=True):
            stream = FakeStream(self, seed, lagged)
            add = stream.add
            stream.add = lambda request, tag: (started.append(len(self.prompt_ids(request.prompt_id))),
                                               add(request, tag))
            return stream

    longest_first = run_steps(collect_rollouts_events, *METHODS["grpo"], Recording(length, slots=16, chunk=2))
    assert started == sorted(started[:B], reverse=True) + sorted(started[B:2 * B], reverse=True) + \
        sorted(started[2 * B:], reverse=True) and started[:B] != sorted(started[:B])
    monkeypatch.setattr(Allocator, "decides_at_start", property(lambda self: False))
    in_issue_order = run_steps(collect_rollouts_events, *METHODS["grpo"], FakeBackend(length, slots=16, chunk=2))
    for a, b in zip(longest_first, in_issue_order):
        assert {k: v for k, v in a.items() if k != "engine"} == {k: v for k, v in b.items() if k != "engine"}
    chunks = [sum(x["engine"]["sampler_calls"] for x in run_) for run_ in (longest_first, in_issue_order)]
    assert chunks[0] < chunks[1], chunks
    monkeypatch.undo()
    for method in ("grpo", "mopps", "ps"):
        assert Allocator(*METHODS[method], PROMPTS).decides_at_start, method
    for method in ("ds", "ideal_ds", "sara_fill", "sara_fixed", "pilot_commit", "ps_same_step"):
        assert not Allocator(*METHODS[method], PROMPTS).decides_at_start, method


def test_harvest_auto_lags_only_where_the_machine_runs_apart_or_decides_at_the_start():
    """``sampling.harvest: auto``: a CPU-only run's machine shares the decoding device, whose programs run in
    dispatch order, so a method that decides per event harvests at once; beside an accelerator (the
    machine on the host: ``StepRun.apart``) or where every request is made at the start, lagged. At once,
    SARA fill needs fewer chunks a step, making the same decisions (answers of different lengths here)."""
    apart, shared = types.SimpleNamespace(apart=True), types.SimpleNamespace(apart=False)
    assert harvest_lagged("auto", apart, decides_at_start=False)
    assert harvest_lagged("auto", shared, decides_at_start=True)
    assert not harvest_lagged("auto", shared, decides_at_start=False)
    assert harvest_lagged("lagged", shared, False) and not harvest_lagged("at_once", apart, True)
    allocator = Allocator(*METHODS["sara_fill"], num_prompts=PROMPTS)
    assert not allocator.start_step(allocator.init(jax.random.PRNGKey(0))).apart  # a CPU-only run

    def length(rollout):
        return 3 + rollout[1] % 7

    runs = {h: run_steps(collect_rollouts_events, *METHODS["sara_fill"], FakeBackend(length, slots=24, chunk=2,
                                                                                      harvest=h))
            for h in ("lagged", "at_once", "auto")}
    for lagged, at_once in zip(runs["lagged"], runs["at_once"]):
        # The same decisions; only how the harvests group them into events (rounds deep) differs.
        assert ({**_decisions(lagged, True), "rounds": 0} == {**_decisions(at_once, True), "rounds": 0})
    chunks = {h: sum(step["engine"]["sampler_calls"] for step in steps) for h, steps in runs.items()}
    assert chunks["at_once"] < chunks["lagged"] and chunks["auto"] == chunks["at_once"], chunks
