"""Rollouts started ahead of the allocation's requests, so that the slot engine's pool stays full.

SARA and Pilot-Commit keep about B groups pending, each asking 2-4 rollouts at a time: on their own
they keep a fraction of a 64-row pool busy, and a chunk costs the same however few of its rows are live.
The machine can say which fresh groups it would open next (``StepRun.lookahead``: under selection method
none the step's prompt order is fixed and a new group's key is the next unused one), so the host starts
those groups' first requests in rows that would otherwise idle. Most likely first: the requests the
policy will surely make next (``Lookahead.sure``, and for fresh groups already guessed
``StepRun.next_requests`` on their guessed outcomes: SARA's rule run ahead on guesses), then the fresh
groups' first requests, then the rest of every group (needed only if it is completed). A guess is used
when the machine's request is covered by guessed rollouts (same group key and prompt; no prefix): the rollouts are
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

    @property
    def complete(self) -> bool:
        return not self.started or len(self.scores) == self.request.num_rollouts


@dataclasses.dataclass(frozen=True)
class AheadTag:
    """The stream tag of a guess's rollouts: a serial, so a dropped guess's late rollouts reach no flight."""
    serial: int


class Ahead:
    """One step's guesses, each a request the machine may make (``StepRun.lookahead``). ``top_up``
    starts new ones into free slots; ``claim`` serves a request from the guesses covering it;
    ``wanted`` / ``deliver`` file a harvested rollout; ``finish`` drops the rest."""

    def __init__(self, backend, stream, window: int):
        self.backend, self.stream, self.window = backend, stream, int(window)
        self.guesses: dict[int, list[tuple[AheadTag, Flight]]] = {}  # group key -> its live guesses
        self.by_tag: dict[AheadTag, Flight] = {}
        self.owner: dict[tuple[int, int], Flight] = {}  # (group key, index) claimed -> the request's flight
        self.key_of: dict[AheadTag, int] = {}  # every guess's group key, dropped or not
        self.created: set[int] = set()  # fresh groups a guess made the backend hold (a new key each)
        self._serial = itertools.count()
        self.started = self.used = self.unused = self.wasted_tokens = 0

    def top_up(self, run) -> None:
        """Start guesses, most likely first (the module docstring), while slots are free and the budget has
        room for every guessed rollout not yet claimed."""
        free = self.stream.free if self.window > 0 else 0
        if free <= 0:
            return
        ahead = run.lookahead(self.window)
        fresh = {r.group_key for r in ahead.fresh}
        room = ahead.budget - self._unclaimed()
        n = ahead.group_size
        fresh_rests = [Request(r.group_key, r.prompt_id, n - r.num_rollouts, r.num_rollouts) for r in ahead.fresh]
        for req in ahead.sure + self._follow_ups(run, fresh, n) + ahead.fresh + ahead.rests + fresh_rests:
            req = self._not_started(req)
            if req is None or req.num_rollouts > min(free, room):
                continue
            if any(f.request.prompt_id != req.prompt_id for _, f in self.guesses.get(req.group_key, ())):
                self._drop(req.group_key)  # the key guessed for another prompt before: that guess is stale
            ctx = self.backend.contexts([req])[0]
            if ctx is None:
                continue
            if req.group_key in fresh:
                self.created.add(req.group_key)
            tag = AheadTag(next(self._serial))
            flight = self.by_tag[tag] = Flight(req, True)
            self.key_of[tag] = req.group_key
            self.guesses.setdefault(req.group_key, []).append((tag, flight))
            self.stream.add(ctx, tag)
            free, room, self.started = free - req.num_rollouts, room - req.num_rollouts, self.started + req.num_rollouts

    def _follow_ups(self, run, fresh: set[int], n_group: int) -> list[Request]:
        """For each fresh group (not opened yet) guessed ahead, the request the policy will surely make next
        on its guessed rollouts, whatever those still running bring (``StepRun.next_requests``)."""
        ready = []
        for key in sorted(fresh & self.guesses.keys()):
            flights = [f for _, f in self.guesses[key]]
            n = sum(f.request.num_rollouts for f in flights)
            if self._covers(key, flights[0].request.prompt_id, range(n)) and n < n_group:
                scored = [int(f.scores[i]["reward"]) for f in flights for i in f.scores]
                ready.append((key, flights[0].request.prompt_id, n, sum(scored), n - len(scored), len(flights)))
        sizes = run.next_requests(*([r[i] for r in ready] for i in range(2, 6)), width=self.window)
        return [Request(key, prompt, size, n) for (key, prompt, n, *_), size in zip(ready, sizes) if size > 0]

    def _not_started(self, req: Request) -> Request | None:
        """The part of ``req`` no guess holds yet (its indices from the first one not held), or None."""
        held = {i for _, f in self.guesses.get(req.group_key, ()) if f.request.prompt_id == req.prompt_id
                for i in range(f.request.first_index, f.request.first_index + f.request.num_rollouts)}
        end = req.first_index + req.num_rollouts
        start = next((i for i in range(req.first_index, end) if i not in held), end)
        if start == end or any(i in held for i in range(start, end)):
            return None  # all held, or a hole: started already
        return Request(req.group_key, req.prompt_id, end - start, start)

    def claim(self, req: Request) -> Flight | None:
        """A flight for ``req`` served by the guesses covering it (their finished rollouts copied in, the
        rest delivered as they come), else None, and then every guess of ``req``'s key is dropped (call
        before the backend builds ``req``'s context)."""
        indices = range(req.first_index, req.first_index + req.num_rollouts)
        if req.group_key not in self.guesses:
            return None
        if req.prefix is not None or not self._covers(req.group_key, req.prompt_id, indices):
            self._drop(req.group_key)
            return None
        flight = Flight(req, True)
        for _, guess in self.guesses[req.group_key]:
            for i in indices:
                if i in guess.rollouts:
                    flight.rollouts[i], flight.scores[i] = guess.rollouts[i], guess.scores[i]
        self.owner.update(((req.group_key, i), flight) for i in indices)
        self.used += req.num_rollouts
        return flight

    def wanted(self, tag: AheadTag, index: int) -> Flight | None:
        """The live guess a harvested rollout belongs to, or (a dropped guess's) None when no request
        claimed it: then it is counted unused here."""
        guess = self.by_tag.get(tag)
        if guess is None and not self.claimed(tag, index):
            return None
        return guess or self.owner[(self.key_of[tag], index)]

    def deliver(self, tag: AheadTag, index: int, rollout, score: dict) -> None:
        """File a scored rollout of guess ``tag`` (and hand it to the request that claimed it)."""
        if (guess := self.by_tag.get(tag)) is not None:
            guess.rollouts[index], guess.scores[index] = rollout, score
        if (owner := self.owner.get((self.key_of[tag], index))) is not None:
            owner.rollouts[index], owner.scores[index] = rollout, score

    def claimed(self, tag: AheadTag, index: int) -> bool:
        return (self.key_of[tag], index) in self.owner

    def finish(self) -> None:
        """The step is over: every guess is dropped (what no request claimed is counted unused)."""
        for key in list(self.guesses):
            self._drop(key)

    def _covers(self, key: int, prompt: int, indices) -> bool:
        held = {i for _, f in self.guesses.get(key, ()) if f.request.prompt_id == prompt
                for i in range(f.request.first_index, f.request.first_index + f.request.num_rollouts)}
        return all(i in held for i in indices)

    def _unclaimed(self) -> int:
        return sum(1 for key, gs in self.guesses.items() for _, f in gs
                   for i in range(f.request.first_index, f.request.first_index + f.request.num_rollouts)
                   if (key, i) not in self.owner)

    def _drop(self, key: int) -> None:
        """Forget ``key``'s guesses: their finished rollouts no request claimed are unused (their running
        ones are counted when they come in or are aborted); the backend forgets the group if a guess made it
        (never a group opened by the machine: a pilot kept from an earlier step keeps its trajectories)
        and no request claimed part of it."""
        any_claimed = False
        for tag, f in self.guesses.pop(key):
            del self.by_tag[tag]
            for i, r in f.rollouts.items():
                if (key, i) in self.owner:
                    any_claimed = True
                else:
                    self.unused, self.wasted_tokens = self.unused + 1, self.wasted_tokens + self.stream.length(r)
        if key in self.created and not any_claimed and not any(k == key for k, _ in self.owner):
            self.created.discard(key)
            self.backend.store.discard([key])
