"""One training step on the slot engine: allocation driven by group events, not global rounds.

The round loop (:mod:`.loop`) waits for a whole round before the machine decides. Here requests go into
a stream of decode slots (:class:`RolloutStream`; text answers: ``passrate_jax.sampling.slot_pool``),
each finished rollout is scored as soon as its chunk is harvested (while the device decodes the next
chunk), and a request is *retired* once all its rollouts are scored. Requests retire in the order they
were issued, never in the order they finish: a request that finished early waits for those issued
before it. The retired requests of one harvest are one event: the machine observes them
(``StepRun.observe_some``) and may issue new requests at once, while later ones are still in flight.

Why issue order: completion order favours short answers, and short answers correlate with correctness,
so training "the first B valid groups to finish" would bias the batch. Retiring in issue order, the
machine admits trained groups in the order it opened them (DS's first B valid groups of a generation
batch are the same as in round mode), and every decision is a function of the rollouts' outcomes and
lengths alone, never of timing: a seed gives the same ``metrics.jsonl``. With every answer the same
length and a chunk at least the token limit, each round retires in one event and the step makes round
mode's decisions exactly.

One method need not wait: SARA fill (no set budget, selection or replays) keeps trained plus pending
groups within B, so every group it confirms is trained and no group competes with another for the batch;
its requests retire as soon as they are scored (``Allocator.retires_in_any_order`` says why the trained
groups are still round mode's), so one prompt's long answer no longer holds every later decision.

The step ends when the machine is done (``StepRun.done``: its batch is complete, or its budget or
round limit is reached, and no request it still needs is in flight). Rollouts then still queued or
running are aborted: counted (``rollouts/aborted``, ``tokens/wasted``), spent, never trained.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from passrate_jax.allocation import Allocator, AllocatorState
from passrate_jax.configlib import ConfigError
from passrate_jax.rollout.ahead import Ahead, AheadTag, Flight
from passrate_jax.rollout.loop import RolloutBackend, StepRollouts, note_requests
from passrate_jax.rollout.table import RolloutTable


class RolloutStream(Protocol):
    """One step's decode slots as the event loop drives them.

    ``add(context, tag)``: queue a context's rollouts. ``advance()``: run one chunk; returns the rollouts
    finished in the chunk before it as ``(tag, sample_index, rollout)`` (the rollout: what the backend's
    ``score`` and ``record`` take). ``abort()``: drop what is queued or running, returns ``(tag, index, tokens)``
    per rollout dropped. ``idle``: nothing queued, running or undelivered. ``free``: slots neither running
    nor claimed by the queue. ``length(rollout)``: its generated tokens. ``counters()``: ``sampler_calls``,
    ``slot_utilization``.
    """
    idle: bool
    free: int

    def add(self, context, tag) -> None: ...

    def advance(self) -> list[tuple[object, int, object]]: ...

    def abort(self) -> list[tuple[object, int, int]]: ...

    def length(self, rollout) -> int: ...

    def counters(self) -> dict: ...


def collect_rollouts_events(allocator: Allocator, state: AllocatorState, backend: RolloutBackend, params, *,
                            seed: int, any_order: bool | None = None) -> StepRollouts:
    """Run one step's allocation on ``backend.stream(params, seed)`` (see the module docstring); returns
    what :func:`~.loop.collect_rollouts` returns, with the engine's counters in ``engine``. Fresh groups'
    first requests are started ahead into free slots (:mod:`.ahead`; ``backend.lookahead`` groups at most,
    0: none; ``backend.store.discard(keys)`` forgets a guess's trajectories). ``backend.harvest``
    (``sampling.harvest``) says when a chunk's harvest is read (:func:`harvest_lagged`)."""
    if not hasattr(backend, "stream"):
        raise ConfigError(f"sampling.engine = 'slots': the rollout backend {type(backend).__name__} has no "
                          "stream of decode slots; set sampling.engine=rounds")
    if any_order is None:
        any_order = getattr(allocator, "retires_in_any_order", False)
    run = allocator.start_step(state)
    longest_first = allocator.decides_at_start
    table, order, by_key = RolloutTable(), collections.deque(), {}
    opened, replay_buckets = [], {}
    backend.open_step(params)
    try:
        stream = backend.stream(params, seed, lagged=harvest_lagged(getattr(backend, "harvest", "auto"), run,
                                                                    longest_first))
        ahead = Ahead(backend, stream, getattr(backend, "lookahead", 0))

        def issue(requests: list | None = None) -> None:
            """Serve the machine's new requests (``run.issue``'s unless given): claim guesses, queue the
            rest, then top the guesses up."""
            requests = run.issue(ahead.window) if requests is None else requests
            note_requests(requests, opened, replay_buckets)
            claimed = [ahead.claim(req) for req in requests]
            started = []
            for req, ctx, guess in zip(requests, backend.contexts(requests), claimed):
                order.append(flight := guess or Flight(req, ctx is not None))
                by_key[req.group_key] = flight
                if ctx is not None and guess is None:
                    started.append((req, ctx))
            for req, ctx in _start_order(started, backend, longest_first):
                stream.add(ctx, tag=req.group_key)
            ahead.top_up(run)

        issue()
        while not run.done:
            # Where retirement order is free, requests a harvest of guesses already completed retire
            # without waiting for a chunk (elsewhere that would regroup the machine's events).
            retired = _take_retired(order, any_order) if any_order else []
            if not retired:
                _score(backend, stream, by_key, ahead, stream.advance())
                retired = _take_retired(order, any_order)
            if retired:
                issue(run.observe_and_issue(_retire(backend, table, retired), ahead.window))
            else:
                ahead.top_up(run)  # slots freed by the harvest: more guesses while the machine waits
            if not retired and stream.idle:
                raise RuntimeError("event loop: nothing in flight, yet the allocation step is not done")
        counters = {**stream.counters(), **_abort(stream, ahead)}
    finally:
        backend_counters = backend.close_step(table)
    result, new_state = run.finish(abort=True)
    if unobserved := table.unobserved_groups():
        result = dataclasses.replace(result, groups=[g for g in result.groups if g.group_key not in unobserved])
    return StepRollouts(result, new_state, table, backend_counters, engine=counters, opened=opened,
                        replay_buckets=replay_buckets)


def harvest_lagged(harvest: str, run, decides_at_start: bool) -> bool:
    """Whether the stream reads a chunk's harvest after dispatching the next chunk (``sampling.harvest``).
    auto: lagged where the machine runs apart from the decoding (``run.apart``: on the host CPU beside an
    accelerator), so that scoring and deciding overlap the next chunk, or where the step decides
    everything at its start (the verifier's work then overlaps the decoding and no decision waits for
    it); at once otherwise. A device runs its programs in dispatch order, so on a CPU-only run the
    machine's programs would wait behind the chunk in flight: lagging then delays every decision by a
    chunk and overlaps little (docs/engine.md, "Where the machine runs, and when a harvest is read")."""
    if harvest != "auto":
        return harvest == "lagged"
    return run.apart or decides_at_start


def _start_order(started: list[tuple], backend: RolloutBackend, longest_first: bool) -> list[tuple]:
    """The order in which one issue's (request, context) pairs enter the stream's queue: issue order, or
    with ``longest_first`` the longest prompts first (issue order among equals). Where every request is
    made at the step's start, the step ends when its last rollout does; starting the longest answers first
    leaves short ones to fill the rows that free up near the end, rather than one long answer decoding
    alone in a pool that has nothing left to start (the longest-processing-time-first rule). A prompt's
    length stands for its answer's: on the built-in tasks more digits mean more worked lines. On the
    default preset, GRPO: chunks a step 12.7 -> 11.3, slot utilization 0.74 -> 0.82 (docs/engine.md)."""
    if not longest_first:
        return started
    return sorted(started, key=lambda rc: -len(backend.prompt_ids(rc[0].prompt_id)))


def _take_retired(order: collections.deque, any_order: bool) -> list[Flight]:
    """Remove and return the requests that retire now: the complete ones at the head of ``order`` (issue
    order), or with ``any_order`` every complete one (in issue order among themselves)."""
    if not any_order:
        retired = []
        while order and order[0].complete:
            retired.append(order.popleft())
        return retired
    retired = [f for f in order if f.complete]
    if retired:
        waiting = [f for f in order if not f.complete]
        order.clear()
        order.extend(waiting)
    return retired


def _abort(stream: RolloutStream, ahead: Ahead) -> dict:
    """End the step's decoding: what was requested and cut short is aborted; guesses never requested
    (dropped, harvested or still running) are unused. Both kinds' tokens are wasted."""
    aborted = wasted = 0
    for tag, index, tokens in stream.abort():
        if isinstance(tag, AheadTag) and not ahead.claimed(tag, index):
            ahead.unused, ahead.wasted_tokens = ahead.unused + 1, ahead.wasted_tokens + tokens
        else:
            aborted, wasted = aborted + 1, wasted + tokens
    ahead.finish()
    return {"rollouts/aborted": aborted, "tokens/wasted": wasted + ahead.wasted_tokens,
            "rollouts/speculative": ahead.started, "rollouts/speculative_unused": ahead.unused}


def _score(backend: RolloutBackend, stream: RolloutStream, by_key: dict, ahead: Ahead,
           finished: Sequence[tuple]) -> None:
    """Score one harvest in one verifier call (its requests' rollouts as they came, in slot order); the
    rollouts of a dropped guess are counted as unused and not scored."""
    groups: dict[object, list] = {}
    for tag, index, rollout in finished:
        flight = ahead.wanted(tag, index) if isinstance(tag, AheadTag) else by_key[tag]
        if flight is None:
            ahead.unused, ahead.wasted_tokens = ahead.unused + 1, ahead.wasted_tokens + stream.length(rollout)
            continue
        groups.setdefault(tag, (flight, []))[1].append((index, rollout))
    if not groups:
        return
    flights = [f for f, _ in groups.values()]
    scores = backend.score([f.request for f in flights], [[r for _, r in rs] for _, rs in groups.values()])
    pos = 0
    for tag, (flight, rollouts) in groups.items():
        for index, rollout in rollouts:
            score = {name: column[pos] for name, column in scores.items()}
            if isinstance(tag, AheadTag):
                ahead.deliver(tag, index, rollout, score)
            else:
                flight.rollouts[index], flight.scores[index] = rollout, score
            pos += 1


def _retire(backend: RolloutBackend, table: RolloutTable, retired: Sequence[Flight]) -> list:
    """Record retired requests (each rollout in its request's order) and return the machine's results."""
    live = [f for f in retired if f.started]
    rollouts = [[f.rollouts[f.request.first_index + j] for j in range(f.request.num_rollouts)] for f in live]
    if not live:
        scores = backend.score([], [])  # the columns, empty
    else:
        names = next(iter(live[0].scores.values())).keys()
        scores = {name: np.asarray([f.scores[f.request.first_index + j][name] for f in live
                                    for j in range(f.request.num_rollouts)]) for name in names}
    results, rows = table.add([f.request for f in retired], [f.started for f in retired], scores)
    if live:
        backend.record([f.request for f in live], rollouts, table, rows)
    return results
