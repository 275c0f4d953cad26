"""Rollouts started ahead of the machine's requests (rollout/ahead.py) on the fake slot stream of
tests/test_engine_events.py: what is guessed, in which order, how many, and that guesses never change a
decision (only the chunks a step takes)."""

import dataclasses

from passrate_jax.allocation import machine
from passrate_jax.allocation import step as step_module
from passrate_jax.allocation.config import AllocationConfig, PrefixSamplingConfig
from passrate_jax.allocation.step import StepRun
from passrate_jax.rollout.events import collect_rollouts_events
from passrate_jax.rollout.loop import collect_rollouts
from tests.test_engine_events import METHODS, N, FakeBackend, _decisions, _length_favours_easy_and_right, run_steps


def test_fresh_guesses_stop_at_what_the_step_still_needs(monkeypatch):
    """``machine.fresh_needed``: fresh groups are guessed ahead only up to ``FRESH_MARGIN`` times the step's
    estimate of the fresh groups it still needs. On SARA fill (64 slots), guessing the whole window
    instead decodes groups the step never opens: more unused guesses, and rows taken from the guesses
    the step does use, so more chunks; the decisions are the same either way."""
    allocation, ps = METHODS["sara_fill"]

    def retrace():  # the margin is read when the machine's lookahead is traced
        for program in (step_module._event_step, step_module._plan_and_look, step_module._lookahead):
            program.clear_cache()

    def run():
        retrace()
        return run_steps(collect_rollouts_events, allocation, ps,
                         FakeBackend(_length_favours_easy_and_right, slots=64, chunk=2))

    bounded = run()
    monkeypatch.setattr(machine, "FRESH_MARGIN", None)
    whole = run()
    monkeypatch.undo()
    retrace()  # the tests after this one trace the shipped margin
    for b, w in zip(bounded, whole):
        assert sorted(g[:3] for g in b["groups"]) == sorted(g[:3] for g in w["groups"])
        assert (b["spent"], b["abandoned"], b["state"]) == (w["spent"], w["abandoned"], w["state"])
    unused, chunks = ([sum(x["engine"][key] for x in run_) for run_ in (bounded, whole)]
                      for key in ("rollouts/speculative_unused", "sampler_calls"))
    assert unused[0] < unused[1] and chunks[0] < chunks[1]


def test_sara_fill_decides_on_whole_guessed_groups_without_waiting_for_a_chunk():
    """The next fresh groups are guessed whole (their first request, then the rest of the group), and
    SARA fill (retiring in any order) decides on requests its finished guesses cover at once, without
    dispatching a chunk. With every answer one chunk long in an unbounded pool, the first chunk decodes
    every requested rollout and every guess and the next delivers them, so each step ends in 2 chunks,
    making round mode's decisions (guessing only first requests, a step of several decision levels took
    6: one chunk a level). The chain of dependent decisions no longer costs a chunk per level."""
    allocation, ps = METHODS["sara_fill"]
    rounds = run_steps(collect_rollouts, allocation, ps, FakeBackend(length=lambda rollout: 6, chunk=6))
    events = run_steps(collect_rollouts_events, allocation, ps, FakeBackend(length=lambda rollout: 6, chunk=6))
    for r, e in zip(rounds, events):
        assert _decisions(e, any_order=True) == _decisions(r, any_order=True)
    assert max(r["rounds"] for r in rounds) >= 3  # several levels of decisions in a step
    assert [e["engine"]["sampler_calls"] for e in events] == [2, 2, 2]


def test_sara_fill_starts_sure_next_requests_before_other_guesses(monkeypatch):
    """Guesses go first to the requests the policy will surely make (machine.next_request: SARA's rule on
    every outcome of the rollouts in flight), for opened groups and for fresh groups guessed ahead, then to
    fresh groups' first requests, then to the rest of groups. On the default preset's shape (B = 16,
    N = 8, 64 slots, 32 fresh groups ahead; answers long when wrong and short on easy prompts) that takes
    fewer chunks than guessing without it (the same order, no sure requests), with the same decisions."""
    allocation = AllocationConfig(method="sara", num_prompts=16, group_size=N)

    def run():
        backend = FakeBackend(_length_favours_easy_and_right, slots=64, chunk=2, lookahead=32)
        return run_steps(collect_rollouts_events, allocation, PrefixSamplingConfig(), backend)

    sure = run()
    lookahead = StepRun.lookahead
    monkeypatch.setattr(StepRun, "next_requests", lambda self, n, s, waiting, probes, width=8: [0] * len(n))
    monkeypatch.setattr(StepRun, "lookahead", lambda self, m: dataclasses.replace(lookahead(self, m), sure=[]))
    blind = run()
    for a, b in zip(sure, blind):  # rounds count events here, which the guesses regroup
        assert {**_decisions(a, any_order=True), "rounds": 0} == {**_decisions(b, any_order=True), "rounds": 0}
    chunks = [sum(x["engine"]["sampler_calls"] for x in run_) for run_ in (sure, blind)]
    assert chunks[0] < chunks[1], chunks


def test_guesses_follow_ups_compile_one_program_a_run(monkeypatch):
    """``StepRun.next_requests`` pads to the guess window, so the follow-ups of fresh groups guessed ahead
    compile one program however many groups a call gives (padding each call to its own count compiled a
    new program, about 0.3 s on this CPU, whenever the count first crossed 8 or 16: inside measured steps)."""
    counts = []
    plain = StepRun.next_requests
    monkeypatch.setattr(StepRun, "next_requests", lambda self, n, *rest, **kw: (counts.append(len(n)),
                                                                               plain(self, n, *rest, **kw))[1])
    step_module._next_request.clear_cache()
    allocation = AllocationConfig(method="sara", num_prompts=16, group_size=N)
    run_steps(collect_rollouts_events, allocation, PrefixSamplingConfig(),
              FakeBackend(_length_favours_easy_and_right, slots=128, chunk=2, lookahead=32), steps=2)
    assert min(c for c in counts if c) <= 8 < 16 < max(counts), counts  # calls on both sides of a power of two
    assert step_module._next_request._cache_size() == 1
