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

from passrate_jax.allocation import Allocator, AllocatorState, Request
from passrate_jax.configlib import ConfigError
from passrate_jax.rollout.loop import RolloutBackend, RolloutTable, StepRollouts, note_requests


class RolloutStream(Protocol):
    """One step's decode slots as the event loop drives them.

    ``add(context, tag)``: queue a context's rollouts. ``advance()``: run one chunk; returns the rollouts
    finished in the chunk before it as ``(tag, sample_index, rollout)`` (the rollout: what the backend's
    ``score`` and ``record`` take). ``abort()``: drop what is queued or running, returns (rollouts, tokens).
    ``idle``: nothing queued, running or undelivered. ``counters()``: ``sampler_calls``, ``slot_utilization``.
    """
    idle: bool

    def add(self, context, tag) -> None: ...

    def advance(self) -> list[tuple[object, int, object]]: ...

    def abort(self) -> tuple[int, int]: ...

    def counters(self) -> dict: ...


@dataclasses.dataclass
class _Flight:
    """An issued request: its rollouts and per-rollout score rows as they come in."""
    request: Request
    started: bool  # False: the backend could not start it (not observed; retires at once)
    rollouts: dict[int, object] = dataclasses.field(default_factory=dict)   # sample index -> rollout
    scores: dict[int, dict] = dataclasses.field(default_factory=dict)       # sample index -> {column: value}

    @property
    def complete(self) -> bool:
        return not self.started or len(self.scores) == self.request.num_rollouts


def collect_rollouts_events(allocator: Allocator, state: AllocatorState, backend: RolloutBackend, params, *,
                            seed: int) -> StepRollouts:
    """Run one step's allocation on ``backend.stream(params, seed)`` (see the module docstring); returns
    what :func:`~.loop.collect_rollouts` returns, with the engine's counters in ``engine``."""
    if not hasattr(backend, "stream"):
        raise ConfigError("sampling.engine = 'slots': this rollout backend (environments) runs in round mode "
                          "only; set sampling.engine=rounds")
    run = allocator.start_step(state)
    table, order, by_key = RolloutTable(), collections.deque(), {}
    opened, replay_buckets = [], {}
    backend.open_step(params)
    try:
        stream = backend.stream(params, seed)

        def issue() -> None:
            requests = run.issue()
            note_requests(requests, opened, replay_buckets)
            for req, ctx in zip(requests, backend.contexts(requests)):
                order.append(flight := _Flight(req, ctx is not None))
                by_key[req.group_key] = flight
                if ctx is not None:
                    stream.add(ctx, tag=req.group_key)

        issue()
        while not run.done:
            _score(backend, by_key, stream.advance())
            retired = []
            while order and order[0].complete:
                retired.append(order.popleft())
            if retired:
                run.observe_some(_retire(backend, table, retired))
                issue()
            elif stream.idle:
                raise RuntimeError("event loop: nothing in flight, yet the allocation step is not done")
        aborted, wasted = stream.abort()
        counters = {**stream.counters(), "rollouts/aborted": aborted, "tokens/wasted": wasted}
    finally:
        prefill = backend.close_step()
    result, new_state = run.finish(abort=True)
    if unobserved := table.unobserved_groups():
        result = dataclasses.replace(result, groups=[g for g in result.groups if g.group_key not in unobserved])
    return StepRollouts(result, new_state, table, prefill, engine=counters, opened=opened,
                        replay_buckets=replay_buckets)


def _score(backend: RolloutBackend, by_key: dict, finished: Sequence[tuple]) -> None:
    """Score one harvest in one verifier call (its requests' rollouts as they came, in slot order)."""
    if not finished:
        return
    groups: dict[int, list] = {}
    for tag, index, rollout in finished:
        groups.setdefault(tag, []).append((index, rollout))
    keys = list(groups)
    scores = backend.score([by_key[k].request for k in keys], [[r for _, r in groups[k]] for k in keys])
    pos = 0
    for k in keys:
        flight = by_key[k]
        for index, rollout in groups[k]:
            flight.rollouts[index] = rollout
            flight.scores[index] = {name: column[pos] for name, column in scores.items()}
            pos += 1


def _retire(backend: RolloutBackend, table: RolloutTable, retired: Sequence[_Flight]) -> list:
    """Record retired requests (each rollout in its request's order) and return the machine's results."""
    live = [f for f in retired if f.started]
    rollouts = [[f.rollouts[f.request.first_index + j] for j in range(f.request.num_rollouts)] for f in live]
    if not live:
        scores = backend.score([], [])  # the columns, empty
    else:
        names = next(iter(live[0].scores.values())).keys()
        scores = {name: np.asarray([f.scores[f.request.first_index + j][name] for f in live
                                    for j in range(f.request.num_rollouts)]) for name in names}
        backend.record([f.request for f in live], rollouts, scores)
    return table.add([f.request for f in retired], [f.started for f in retired], scores)
