"""One allocation step driven by the host: the round machine (:mod:`.machine`) behind the
requests / observe / finish protocol. This file only converts between the step table and the host's
:class:`Request` / :class:`Result` / :class:`StepResult`; every decision is in the jitted machine."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from passrate_jax.allocation.group_queue import GroupQueue
from passrate_jax.allocation.machine import (begin_step, event_step, finish_step, lookahead, next_request,
                                             observe_event, observe_round, plan_and_look, plan_event, plan_round)
from passrate_jax.allocation.composition import Knobs, Setup
from passrate_jax.allocation.protocol import AllocatorState, Prefix, Request, Result, StepResult, TrainGroup
from passrate_jax.allocation.table import ABANDONED, successes

# One compile per composition (Setup is static and hashable) and per table shape.
_begin = jax.jit(begin_step, static_argnums=0)
_plan = jax.jit(plan_round, static_argnums=0)
_observe = jax.jit(observe_round, static_argnums=0)
_finish = jax.jit(finish_step, static_argnums=0)
_plan_event = jax.jit(plan_event, static_argnums=0)
_observe_event = jax.jit(observe_event, static_argnums=0)
_lookahead = jax.jit(lookahead, static_argnums=(0, 4))
_next_request = jax.jit(next_request, static_argnums=0)
_event_step = jax.jit(event_step, static_argnums=(0, 7))
_plan_and_look = jax.jit(plan_and_look, static_argnums=(0, 4))


@dataclasses.dataclass(frozen=True)
class Lookahead:
    """What the machine may request later (event mode), most likely first.

    sure: the next request of each group already opened that every outcome of its rollouts in flight
    leads to. fresh: the first requests of the next fresh groups the policy would open, in order. rests:
    the rest of each group already opened (needed only if it is completed). budget: rollouts the budget
    has left. group_size: N."""
    sure: list[Request]
    fresh: list[Request]
    rests: list[Request]
    budget: int
    group_size: int


def decision_device(state) -> jax.Device | None:
    """Where a step's machine should run: this host's first CPU device when ``state`` lives on an
    accelerator, else None (where the state is). Why: a device runs its programs in the order they were
    dispatched, so the machine's small programs, dispatched on the decoding device, would wait behind
    the decode chunk in flight and the host would decide only when that chunk is done; on the host's CPU
    they run while the accelerator decodes. A CPU-only run decodes on its CPU devices (however many it
    was started with), so none is apart from the decoding and the machine stays with the state: the same
    rule on every layout, so that one host and several decide alike."""
    return host_cpu_beside({d for leaf in jax.tree.leaves(state) if isinstance(leaf, jax.Array)
                            for d in leaf.devices()})


def host_cpu_beside(devices) -> jax.Device | None:
    """:func:`decision_device`'s rule on the state's devices: this host's first CPU device where none of
    them is a CPU device, else None."""
    if not devices or any(d.platform == "cpu" for d in devices):
        return None
    return jax.local_devices(backend="cpu")[0]


def _prefix(t, g: int) -> Prefix | None:
    """The replayed prefix of row ``g`` of a host copy of the table (None for a fresh group)."""
    if t.bucket[g] < 0:
        return None
    return Prefix(int(t.src_key[g]), int(t.src_index[g]), float(t.cut[g]), int(t.bucket[g]), bool(t.src_success[g]))


class StepRun:
    """One step. Round mode: call :meth:`requests` and :meth:`observe` alternately until :meth:`requests`
    returns [], then :meth:`finish`. Event mode (requests in flight while others are observed): call
    :meth:`issue` (new requests, possibly none) after every :meth:`observe_some`, until :attr:`done`;
    requests still outstanding then are aborted by :meth:`finish`. :meth:`observe_and_issue` is the two
    in one round trip (and the next :meth:`lookahead` comes with it).

    ``device``: where the machine runs (:func:`decision_device`; :attr:`apart`: not where the state
    lives); :meth:`finish` returns the state to where it came from, so the run's persistent state never
    moves."""

    def __init__(self, setup: Setup, knobs: Knobs, state: AllocatorState, device: jax.Device | None = None):
        self._home = None  # where the state lives, when the machine runs elsewhere
        if device is not None:
            self._home = jax.tree.map(lambda x: x.sharding if isinstance(x, jax.Array) else None, state)
            state, knobs = jax.device_put((state, knobs), device)
        self.setup, self.knobs = setup, knobs
        self.state, self.table = _begin(setup, knobs, state)
        self.outstanding: dict[int, tuple[int, Request]] = {}
        self._ahead: tuple[int, dict] | None = None  # (m, a host copy of lookahead(m)) of the current table
        self._host: tuple | None = None  # (a table, its host copy): the last one planned, as fetched

    @property
    def apart(self) -> bool:
        """The machine runs on another device than the one the state lives on."""
        return self._home is not None

    def requests(self) -> list[Request]:
        """The next round's requests; [] when the step is over. Raises if the last round's results
        have not all been observed."""
        if self.outstanding:
            raise RuntimeError(f"observe() the {len(self.outstanding)} outstanding requests first")
        if bool(self.table.done):
            return []
        self.state, self.table = _plan(self.setup, self.knobs, self.state, self.table)
        t = jax.device_get(self.table)
        rows = np.nonzero(t.chunk)[0]
        reqs = []
        for g in rows:
            req = Request(int(t.key[g]), int(t.prompt[g]), int(t.chunk[g]), int(t.n[g]), _prefix(t, g))
            self.outstanding[req.group_key] = (int(g), req)
            reqs.append(req)
        return reqs

    def observe(self, results: list[Result]) -> None:
        """Record the outcomes of every request of the last round (any order), then decide."""
        g_rows, n = self.table.capacity, self.setup.N
        rewards = np.zeros((g_rows, n), np.int8)
        observed = np.ones((g_rows,), bool)
        for res in results:
            row, req = self.outstanding.pop(res.group_key, (None, None))
            if req is None or len(res.rewards) != req.num_rollouts:
                raise ValueError(f"result for group {res.group_key} does not match an outstanding request")
            rewards[row, req.first_index:req.first_index + req.num_rollouts] = res.rewards
            observed[row] = res.observed
        if self.outstanding:
            raise ValueError(f"missing results for groups {sorted(self.outstanding)}")
        self.state, self.table = _observe(self.setup, self.knobs, self.state, self.table, rewards, observed)

    @property
    def done(self) -> bool:
        """The step needs no more requests and waits for none of those in flight (event mode)."""
        return bool(self.table.done)

    def issue(self, m: int = 0) -> list[Request]:
        """Event mode: the requests the machine makes now (none once :attr:`done`), marked in flight; with
        ``m``, :meth:`lookahead` ``(m)`` of the table after them comes in the same round trip."""
        if self.done:
            return []
        if m > 0:
            self.state, self.table, chunk, ahead = _plan_and_look(self.setup, self.knobs, self.state, self.table, m)
            return self._mark_issued(self._fetch_planned(chunk, ahead, m))
        self.state, self.table, chunk = _plan_event(self.setup, self.knobs, self.state, self.table)
        self._ahead = None
        t = jax.device_get(self.table.replace(chunk=chunk))
        self._host = (self.table, t)
        return self._mark_issued(t)

    def observe_and_issue(self, results: list[Result], m: int) -> list[Request]:
        """Event mode: :meth:`observe_some` then :meth:`issue`, and :meth:`lookahead` ``(m)`` of the table
        after it, in one program and one copy to the host (``machine.event_step``); the next
        ``lookahead(m)`` before another change is that copy."""
        rewards, observed, rows = self._event_outcomes(results)
        self.state, self.table, chunk, ahead = _event_step(self.setup, self.knobs, self.state, self.table, rewards,
                                                           observed, rows, m)
        t = self._fetch_planned(chunk, ahead, m)
        return [] if t.done else self._mark_issued(t)

    def _fetch_planned(self, chunk, ahead: dict, m: int):
        """A host copy of the table with its new requests in ``chunk``, in one copy with ``ahead`` (the
        lookahead of ``m`` computed beside them), which :meth:`lookahead` serves until the next change."""
        t, a = jax.device_get((self.table.replace(chunk=chunk), ahead))
        self._ahead, self._host = (m, a), (self.table, t)
        return t

    def _mark_issued(self, t) -> list[Request]:
        """The requests of a host copy of the table (rows with chunk > 0), marked outstanding."""
        reqs = []
        for g in np.nonzero(t.chunk)[0]:
            req = Request(int(t.key[g]), int(t.prompt[g]), int(t.chunk[g]), int(t.n[g]), _prefix(t, g))
            self.outstanding[req.group_key] = (-1, req)  # rows move as others close: found by key when observed
            reqs.append(req)
        return reqs

    def lookahead(self, m: int) -> Lookahead:
        """Event mode: requests the machine may make later (see :func:`~.machine.lookahead`), for the host
        to start ahead (a guess is used only if the machine makes that very request)."""
        if self.done:
            return Lookahead([], [], [], 0, self.setup.N)
        if self._ahead is None or self._ahead[0] != m:
            self._ahead = (m, jax.device_get(_lookahead(self.setup, self.knobs, self.state, self.table, m)))
        a = self._ahead[1]
        n, opened = self.setup.N, np.nonzero(a["ok"])[0]
        sure = [Request(int(a["key"][g]), int(a["prompt"][g]), int(a["size"][g]), int(a["first"][g]))
                for g in opened if a["size"][g] > 0]
        rests = [Request(int(a["key"][g]), int(a["prompt"][g]), n - int(a["first"][g]), int(a["first"][g]))
                 for g in opened]
        fresh = [Request(int(a["fresh_key"][j]), int(a["fresh_prompt"][j]), int(a["chunk"]), 0)
                 for j in np.nonzero(a["fresh_ok"])[0]]
        return Lookahead(sure, fresh, rests, int(a["free"]), n)

    def next_requests(self, n: list[int], s: list[int], waiting: list[int], probes: list[int],
                      width: int = 8) -> list[int]:
        """Event mode: for fresh groups guessed ahead (``n`` rollouts, ``waiting`` of them not yet scored,
        ``s`` successes, ``probes`` requests), the request the policy will surely make next if it opens
        them (0: none is sure; :func:`~.machine.next_request`). The arrays are padded to ``width`` (or to
        the groups given, if more), rounded up to a power of two and at least 8: a caller that passes
        the most groups it can ever give (its guess window) compiles one program a run, where padding
        to each call's count compiled a new one (about 0.3 s) whenever the count first crossed 8 or 16."""
        if not n:
            return []
        size = max(8, 1 << (max(len(n), width) - 1).bit_length())
        arrays = [np.asarray(list(v) + [0] * (size - len(v)), np.int32) for v in (n, s, waiting, probes)]
        return [int(x) for x in jax.device_get(_next_request(self.setup, self.knobs, *arrays))[:len(n)]]

    def observe_some(self, results: list[Result]) -> None:
        """Event mode: observe these outstanding requests (one event; the others stay in flight), then decide."""
        rewards, observed, rows = self._event_outcomes(results)
        self.state, self.table = _observe_event(self.setup, self.knobs, self.state, self.table, rewards, observed,
                                                rows)
        self._ahead = None

    def _event_outcomes(self, results: list[Result]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``observe_event``'s rewards, observed and rows of these outstanding requests (popped)."""
        g_rows, n = self.table.capacity, self.setup.N
        rewards, observed, rows = np.zeros((g_rows, n), np.int8), np.ones((g_rows,), bool), np.zeros((g_rows,), bool)
        if self._host is not None and self._host[0] is self.table:  # the copy the last plan fetched
            key, inflight = self._host[1].key, self._host[1].inflight
        else:
            key, inflight = jax.device_get((self.table.key, self.table.inflight))
        for res in results:
            _, req = self.outstanding.pop(res.group_key, (None, None))
            at = np.nonzero((key == res.group_key) & (inflight > 0))[0]
            if req is None or len(res.rewards) != req.num_rollouts or len(at) != 1:
                raise ValueError(f"result for group {res.group_key} does not match an outstanding request")
            rewards[at[0], req.first_index:req.first_index + req.num_rollouts] = res.rewards
            observed[at[0]], rows[at[0]] = res.observed, True
        return rewards, observed, rows

    def finish(self, abort: bool = False) -> tuple[StepResult, AllocatorState]:
        """End the step: fold its outcomes into the persistent state; returns the groups to train on
        and the rollouts spent. ``abort``: requests still outstanding are dropped (their rollouts stay
        spent; their groups, still pending, are not trained)."""
        if self.outstanding and not abort:
            raise RuntimeError("finish() with outstanding requests")
        self.outstanding, self._ahead, self._host = {}, None, None
        state, table = _finish(self.setup, self.knobs, self.state, self.table)
        t = jax.device_get(table)
        if t.overflow:
            raise RuntimeError(f"allocation: {int(t.overflow)} group(s) found no free row in the step table "
                               f"(capacity {t.capacity}); this is a bug in a policy's capacity")
        s = np.asarray(successes(table))
        groups = []
        for g in np.argsort(np.where(t.rank >= 0, t.rank, t.capacity))[:int(t.trained)]:
            rewards = tuple(int(r) for r in t.rewards[g, :t.n[g]])
            groups.append(TrainGroup(int(t.key[g]), int(t.prompt[g]), rewards, _prefix(t, g), bool(0 < s[g] < t.n[g])))
        abandoned = [(int(p), int(t.closed_n[p]), int(t.closed_s[p])) for p in np.nonzero(t.closed == ABANDONED)[0]]
        # Every queue of the state (the replay queue, and the policy's) holds groups later steps may request.
        queues = jax.device_get([q for q in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, GroupQueue))
                                 if isinstance(q, GroupQueue)])
        retained = frozenset(int(k) for q in queues for k in q.group_key[q.valid])
        result = StepResult(groups=groups, rollouts_spent=int(t.spent), rounds=int(t.rounds), abandoned=abandoned,
                            retained_keys=retained, replay_successes=np.asarray(t.replay_successes, float),
                            replay_rollouts=np.asarray(t.replay_rollouts, float))
        if self._home is not None:
            state = jax.device_put(state, self._home)
        return result, state
