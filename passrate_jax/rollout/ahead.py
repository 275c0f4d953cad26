"""Rollouts started ahead of the allocation's requests, so that the slot engine's pool stays full.

SARA and Pilot-Commit keep about B groups pending, each asking 2-4 rollouts at a time: on their own
they keep a fraction of a 64-row pool busy, and a chunk costs the same however few of its rows are live.
The machine can say which fresh groups it would open next (``StepRun.lookahead``: under selection method
none the step's prompt order is fixed and a new group's key is the next unused one), so the host starts
those groups' first requests in rows that would otherwise idle. A guess is used only when the machine
makes exactly that request (same group key, prompt, first index and size; no prefix): the rollouts are
then the very ones the request would have drawn (a rollout's tokens depend on its group key and index,
never on when or where it ran), so the machine's decisions are unchanged. A guess the machine never
makes (the step ended first, or a commit or a replay took the key) is discarded: its rollouts are
counted (``rollouts/speculative_unused``, their tokens in ``tokens/wasted``), never trained.

Rules: guesses only fill slots that nothing requested is waiting for (the requested rollouts are queued
first), and guesses not yet requested never exceed what the budget has left, so a budgeted method
generates at most its budget, guesses included.
"""

from __future__ import annotations

import dataclasses
import itertools

from passrate_jax.allocation import Request


@dataclasses.dataclass
class Flight:
    """A request (issued, or a guess started ahead): its rollouts and per-rollout score rows as they come."""
    request: Request
    started: bool  # False: the backend could not start it (not observed; retires at once)
    rollouts: dict[int, object] = dataclasses.field(default_factory=dict)   # sample index -> rollout
    scores: dict[int, dict] = dataclasses.field(default_factory=dict)       # sample index -> {column: value}
    claimed: bool = True  # a guess: False until the machine makes its request

    @property
    def complete(self) -> bool:
        return not self.started or len(self.scores) == self.request.num_rollouts


@dataclasses.dataclass(frozen=True)
class AheadTag:
    """The stream tag of a guess's rollouts: a serial, so a dropped guess's late rollouts reach no flight."""
    serial: int


class Ahead:
    """One step's guesses. ``top_up`` starts new ones into free slots; ``claim`` hands the machine's
    request the guess it matches; ``flight_of`` routes a harvested rollout; ``finish`` discards the rest."""

    def __init__(self, backend, stream, window: int):
        self.backend, self.stream, self.window = backend, stream, int(window)
        self.by_key: dict[int, tuple[AheadTag, Flight]] = {}   # guesses not yet claimed, by group key
        self.by_tag: dict[AheadTag, Flight] = {}                # every live guess, claimed or not
        self._serial = itertools.count()
        self.started = self.used = self.unused = self.wasted_tokens = 0

    def top_up(self, run) -> None:
        """Start the first requests of the next fresh groups the machine would open, while slots are free
        and the budget has room for every guess not yet claimed."""
        free = self.stream.free if self.window > 0 else 0
        if free <= 0:
            return
        guesses, budget = run.lookahead(self.window)
        room = budget - sum(f.request.num_rollouts for _, f in self.by_key.values())
        for req in guesses:
            held = self.by_key.get(req.group_key)
            if held is not None and held[1].request == req:
                continue  # started already
            if req.num_rollouts > min(free, room):
                break
            if held is not None:  # the same key guessed for another prompt: the old guess is stale
                self._drop(req.group_key)
            ctx = self.backend.contexts([req])[0]
            if ctx is None:
                continue
            tag = AheadTag(next(self._serial))
            flight = Flight(req, True, claimed=False)
            self.by_key[req.group_key], self.by_tag[tag] = (tag, flight), flight
            self.stream.add(ctx, tag)
            free, room, self.started = free - req.num_rollouts, room - req.num_rollouts, self.started + req.num_rollouts

    def claim(self, req: Request) -> Flight | None:
        """The guess that is exactly ``req`` (now claimed), else None; a guess of ``req``'s key for
        anything else is dropped (call before the backend builds ``req``'s context)."""
        held = self.by_key.pop(req.group_key, None)
        if held is None:
            return None
        tag, flight = held
        if flight.request != req:
            self.by_key[req.group_key] = held
            self._drop(req.group_key)
            return None
        flight.claimed = True
        self.used += req.num_rollouts
        return flight

    def flight_of(self, tag) -> Flight | None:
        """The guess a harvested rollout belongs to (None: a dropped guess's)."""
        return self.by_tag.get(tag)

    def unclaimed(self, tag) -> bool:
        """A rollout the machine never asked for (aborted or harvested): a guess dropped or not claimed."""
        flight = self.by_tag.get(tag)
        return flight is None or not flight.claimed

    def finish(self) -> None:
        """The step is over: every guess not claimed is dropped."""
        for key in list(self.by_key):
            self._drop(key)

    def _drop(self, key: int) -> None:
        tag, flight = self.by_key.pop(key)
        del self.by_tag[tag]
        self.unused += len(flight.rollouts)
        self.wasted_tokens += sum(self.stream.length(r) for r in flight.rollouts.values())
        self.backend.discard([key])
