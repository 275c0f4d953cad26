"""One allocation step as host-side rounds. The per-prompt math it calls (validity predictor, SARA
decisions, pilot band, selection scores and updates, queues, PS controllers) is jitted and
batched over all groups of a round; this file only wires it and keeps the round bookkeeping."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from passrate_jax.allocation import pilot_commit as pc
from passrate_jax.allocation import sara as sara_lib
from passrate_jax.allocation.allocator import Allocator, AllocatorState, Prefix, Request, Result, StepResult, TrainGroup
from passrate_jax.allocation.group_queue import pilot_priority, queue_expire, queue_push, queue_take
from passrate_jax.allocation.prefix_control import num_buckets, plan_replays, prefix_control_update
from passrate_jax.allocation.selection import select_prompts, selection_prior, selection_update

# Group status within a step.
ACTIVE, CONFIRMED, TRAINED, DROPPED, ABANDONED, BUFFERED = range(6)


def _bucket(k: int) -> int:
    """Static array size for k items: next power of two (>= 8), so shapes and compiles stay few."""
    return max(8, 1 << max(k - 1, 0).bit_length())


@dataclasses.dataclass
class _Group:
    key: int
    prompt: int
    status: int
    rewards: list[int]
    new_from: int = 0          # rewards[new_from:] were generated this step
    probes: int = 0            # SARA probe rounds done
    prior: tuple[float, float] = (1.0, 1.0)
    prefix: Prefix | None = None
    pilot: bool = False        # a Pilot-Commit pilot awaiting classification
    chunk: int = 0             # rollouts the next round requests (SARA)
    stamp: int = 0             # step the group began


class StepRun:
    """Host state of one step. Call :meth:`requests` and :meth:`observe` alternately until
    :meth:`requests` returns [], then :meth:`finish`."""

    def __init__(self, allocator: Allocator, state: AllocatorState):
        self.a, self.cfg, self.ps = allocator, allocator.cfg, allocator.ps
        self.B, self.N = self.cfg.num_prompts, self.cfg.group_size
        self.state = state
        self.now = int(state.step)
        self.key, self._step_key = jax.random.split(state.key)
        self._draws = 0
        self.next_key = int(state.next_group_key)
        self.budget_left = allocator.budget
        self.spent = 0
        self.round = 0
        self.groups: dict[int, _Group] = {}
        self.trained: list[int] = []
        self.abandoned: list[tuple[int, int, int]] = []
        self.used = np.zeros(allocator.num_prompts, bool)
        self.evicted = np.asarray(state.evicted).copy()
        self.outstanding: dict[int, Request] = {}
        self._surplus: list[_Group] = []
        self.done = False
        k = num_buckets(self.N)
        self.replay_succ, self.replay_roll = np.zeros(k), np.zeros(k)
        if self.cfg.method == "ds" and self.cfg.ds.keep_surplus:
            self._take_surplus()

    # ----------------------------------------------------------------- helpers
    def _rng(self):
        self._draws += 1
        return jax.random.fold_in(self._step_key, self._draws)

    def _new_group(self, prompt: int, status: int, **kw) -> _Group:
        g = _Group(key=self.next_key, prompt=prompt, status=status, rewards=[], stamp=self.now, **kw)
        self.next_key += 1
        self.groups[g.key] = g
        self.used[prompt] = True
        return g

    def _request(self, g: _Group, count: int) -> Request:
        return Request(g.key, g.prompt, int(count), len(g.rewards), g.prefix)

    def _pending(self) -> list[_Group]:
        return [g for g in self.groups.values() if g.status in (ACTIVE, CONFIRMED)]

    def _afford(self, free: float, cost: int) -> int:
        """How many items of ``cost`` rollouts fit in ``free`` (the budget may be unbounded)."""
        return 1 << 30 if free == float("inf") else max(int(free // cost), 0)

    def _slots(self) -> int:
        return self.B - len(self.trained) - len(self._pending())

    def _open_fresh(self, k: int, **kw) -> list[_Group]:
        """Open up to ``k`` groups on prompts chosen by the selection method."""
        if k <= 0:
            return []
        buffered = np.asarray(self.state.pilot_buffer.prompt_id)[np.asarray(self.state.pilot_buffer.valid)]
        avail = ~self.evicted & ~self.used
        avail[buffered] = False
        ids, ok = select_prompts(self.state.selection, self._rng(), jnp.asarray(avail), k, _bucket(k),
                                 self.cfg.selection)
        ids = np.asarray(ids)[np.asarray(ok)]
        sel = self.cfg.selection
        pa, pb = selection_prior(self.state.selection, jnp.asarray(ids), sel, self.cfg.sara.prior_a,
                                 self.cfg.sara.prior_b)
        return [self._new_group(int(p), ACTIVE, prior=(float(x), float(y)), **kw)
                for p, x, y in zip(ids, np.asarray(pa), np.asarray(pb))]

    def _is_valid(self, g: _Group) -> bool:
        return 0 < sum(g.rewards) < len(g.rewards)

    def _complete(self, g: _Group) -> None:
        """A group reached its final size: train it, or drop it (saturated, or no slot left)."""
        keep = self._is_valid(g) or self.cfg.method == "uniform"
        if keep and len(self.trained) < self.B:
            g.status = TRAINED
            self.trained.append(g.key)
            return
        g.status = DROPPED
        if keep and self._is_valid(g) and self.cfg.method == "ds" and self.cfg.ds.keep_surplus:
            self._surplus.append(g)

    def _push(self, name: str, gs: list[_Group], tag=None, aux=None):
        """Insert groups into the state's queue ``name`` (one jitted call)."""
        q = getattr(self.state, name)
        k = _bucket(len(gs))
        pad = lambda xs: np.pad(np.asarray(xs, np.int64), (0, k - len(gs)))  # noqa: E731
        rewards = np.zeros((k, self.N), np.int8)
        for i, g in enumerate(gs):
            rewards[i, :len(g.rewards)] = g.rewards
        new = queue_push(q, pad([g.prompt for g in gs]), pad([g.key for g in gs]),
                         pad([len(g.rewards) for g in gs]), pad([sum(g.rewards) for g in gs]), rewards,
                         pad(tag if tag is not None else [0] * len(gs)), pad(aux if aux is not None else [0] * len(gs)),
                         self.now, np.arange(k) < len(gs))
        self.state = self.state.replace(**{name: new})

    def _take(self, name: str, k: int, priority) -> list[tuple]:
        q = getattr(self.state, name)
        slots, ok, new = queue_take(q, k, priority)
        self.state = self.state.replace(**{name: new})
        slots = np.asarray(slots)[np.asarray(ok)]
        fields = {f: np.asarray(getattr(q, f))[slots] for f in ("prompt_id", "group_key", "n", "rewards", "tag", "aux")}
        return [tuple(fields[f][i] for f in fields) for i in range(len(slots))]

    def _take_surplus(self) -> None:
        q = self.state.surplus
        for prompt, key, n, rewards, _, _ in self._take("surplus", self.B, q.stamp.astype(jnp.float32)):
            g = _Group(key=int(key), prompt=int(prompt), status=ACTIVE, rewards=[int(r) for r in rewards[:n]],
                       new_from=int(n), stamp=self.now - 1)
            self.groups[g.key] = g
            self.used[g.prompt] = True
            self._complete(g)

    def _replays(self) -> list[Request]:
        """Round 0 under PS: re-rollout groups from last step's skewed groups, random order."""
        if not self.ps.enabled or self.round > 0:
            return []
        k = min(int(self.ps.max_replay_share * self.B), self._afford(self.budget_left, self.N))
        q = self.state.replay_queue
        prio = jax.random.uniform(self._rng(), (q.capacity,))
        ratio = np.asarray(self.state.prefix_control.ratio)
        out = []
        for prompt, key, _, rewards, bucket, src in self._take("replay_queue", max(k, 0), prio):
            prefix = Prefix(int(key), int(src), float(ratio[bucket]), int(bucket), bool(rewards[src]))
            g = self._new_group(int(prompt), CONFIRMED, prefix=prefix)
            out.append(self._request(g, self.N))
        return out

    # ------------------------------------------------------------ the protocol
    def requests(self) -> list[Request]:
        """The next round's requests; [] when the step is over. Raises if the last round's results
        have not all been observed."""
        if self.outstanding:
            raise RuntimeError(f"observe() the {len(self.outstanding)} outstanding requests first")
        if self.done or len(self.trained) >= self.B:
            self.done = True
            return []
        reqs = self._replays()
        self.budget_left -= self.N * len(reqs)
        match self.cfg.method:
            case "uniform":
                reqs += self._plan_uniform()
            case "ds":
                reqs += self._plan_ds()
            case "sara":
                reqs += self._plan_sara()
            case "pilot_commit":
                reqs += self._plan_pilot_commit()
        self.budget_left -= sum(r.num_rollouts for r in reqs) - self.N * sum(r.prefix is not None for r in reqs)
        if not reqs:
            self.done = True
            return []
        self.round += 1
        self.outstanding = {r.group_key: r for r in reqs}
        self.spent += sum(r.num_rollouts for r in reqs)
        return reqs

    def _plan_uniform(self) -> list[Request]:
        if self.round > 0:
            return []
        k = min(self._slots(), self._afford(self.budget_left, self.N))
        return [self._request(g, self.N) for g in self._open_fresh(k)]

    def _plan_ds(self) -> list[Request]:
        if self.round >= self.cfg.ds.max_gen_batches:
            return []
        # DAPO's reference code draws a full generation batch whatever is still missing.
        k = min(self.cfg.ds.gen_batch_multiple * self.B, self._afford(self.budget_left, self.N))
        return [self._request(g, self.N) for g in self._open_fresh(k)]

    def _plan_sara(self) -> list[Request]:
        if self.round >= self.cfg.sara.max_rounds:
            return []
        own = [g for g in self._pending() if g.prefix is None]
        reqs = [self._request(g, g.chunk) for g in own]
        # Open fresh prompts only when the budget can still complete each pending group and each
        # new one to N (replays were paid in full when requested).
        cost = sum(r.num_rollouts for r in reqs)
        future = sum(self.N - len(g.rewards) for g in own) - cost
        k = min(self._slots(), self._afford(self.budget_left - cost - future, self.N))
        first = min(self.cfg.sara.round_schedule[0], self.N)
        for g in self._open_fresh(k):
            g.chunk = first
            reqs.append(self._request(g, first))
        return reqs

    def _plan_pilot_commit(self) -> list[Request]:
        pcfg = self.cfg.pilot_commit
        if self.round >= pcfg.max_rounds:
            return []
        reqs = []
        slots = self._slots()
        reserved = 0
        if slots > 0:
            for prompt, key, n, rewards, _, _ in self._take("pilot_buffer", slots,
                                                             pilot_priority(self.state.pilot_buffer)):
                g = _Group(key=int(key), prompt=int(prompt), status=CONFIRMED,
                           rewards=[int(r) for r in rewards[:n]], new_from=int(n))
                self.groups[g.key] = g
                self.used[g.prompt] = True
                reqs.append(self._request(g, self.N - n))
                reserved += self.N - n
        n_p = pc.pilot_size(pcfg, self.N)
        shortfall = slots - len(reqs)
        k = min(pcfg.pilot_pool_ratio * shortfall, self._afford(self.budget_left - reserved, n_p))
        for g in self._open_fresh(k, pilot=True):
            reqs.append(self._request(g, n_p))
        return reqs

    def observe(self, results: list[Result]) -> None:
        """Record the outcomes of every request of the last round (any order), then decide."""
        for res in results:
            req = self.outstanding.pop(res.group_key, None)
            if req is None or len(res.rewards) != req.num_rollouts:
                raise ValueError(f"result for group {res.group_key} does not match an outstanding request")
            self.groups[res.group_key].rewards.extend(int(r) for r in res.rewards)
        if self.outstanding:
            raise ValueError(f"missing results for groups {sorted(self.outstanding)}")
        pending = self._pending()
        for g in pending:  # full groups (uniform, DS, replays, commits, confirmed SARA groups)
            if len(g.rewards) >= self.N:
                self._complete(g)
        if self.cfg.method == "sara":
            self._decide_sara([g for g in pending if g.status == ACTIVE])
        if self.cfg.method == "pilot_commit":
            self._decide_pilots([g for g in pending if g.status == ACTIVE and g.pilot])
        if self._surplus:
            self._push("surplus", self._surplus)
            self._surplus = []
        for g in pending:
            if g.prefix is not None:
                b = g.prefix.bucket
                self.replay_succ[b] += sum(g.rewards)
                self.replay_roll[b] += len(g.rewards)

    def _arrays(self, gs):
        k = _bucket(len(gs))
        pad = lambda xs, dt: np.pad(np.asarray(xs, dt), (0, k - len(gs)), constant_values=1)  # noqa: E731
        return (pad([len(g.rewards) for g in gs], np.int32), pad([sum(g.rewards) for g in gs], np.int32),
                pad([g.probes for g in gs], np.int32), pad([g.prior[0] for g in gs], np.float32),
                pad([g.prior[1] for g in gs], np.float32))

    def _decide_sara(self, gs: list[_Group]) -> None:
        if not gs:
            return
        for g in gs:
            g.probes += 1
        n, s, probes, pa, pb = self._arrays(gs)
        action, _, chunk = sara_lib.sara_decide(n, s, probes, pa, pb, self.cfg.sara, self.N)
        for g, act, c in zip(gs, np.asarray(action), np.asarray(chunk)):
            g.chunk = int(c)
            if act == sara_lib.CONFIRM:
                g.status = CONFIRMED
            elif act == sara_lib.ABANDON:
                g.status = ABANDONED
                self.abandoned.append((g.prompt, len(g.rewards), sum(g.rewards)))

    def _decide_pilots(self, gs: list[_Group]) -> None:
        if not gs:
            return
        n, s, *_ = self._arrays(gs)
        verdict = np.asarray(pc.pilot_classify(n, s, self.cfg.pilot_commit))[:len(gs)]
        kept = [g for g, v in zip(gs, verdict) if v == pc.KEEP]
        for g, v in zip(gs, verdict):
            g.pilot = False
            g.status = BUFFERED if v == pc.KEEP else ABANDONED
            if v != pc.KEEP:
                self.abandoned.append((g.prompt, len(g.rewards), sum(g.rewards)))
            if v == pc.EVICT:
                self.evicted[g.prompt] = True
        if kept:
            self._push("pilot_buffer", kept)

    def finish(self) -> tuple[StepResult, AllocatorState]:
        """End the step: fold this step's outcomes into the persistent state and return the groups
        to train on with the rollouts spent."""
        if self.outstanding:
            raise RuntimeError("finish() with outstanding requests")
        sel_groups = [g for g in self.groups.values() if g.prefix is None and len(g.rewards) > g.new_from]
        if sel_groups:
            ns, ss = {}, {}
            for g in sel_groups:  # one observation per prompt and step
                new = g.rewards[g.new_from:]
                ns[g.prompt] = ns.get(g.prompt, 0) + len(new)
                ss[g.prompt] = ss.get(g.prompt, 0) + sum(new)
            k = _bucket(len(ns))
            pad = lambda xs: np.pad(np.asarray(list(xs), np.int32), (0, k - len(ns)))  # noqa: E731
            sel = selection_update(self.state.selection, pad(ns.keys()), pad(ns.values()), pad(ss.values()),
                                   np.arange(k) < len(ns), self.cfg.selection, self.N)
            self.state = self.state.replace(selection=sel)
        now = jnp.int32(self.now)
        # Replay sources live one step: unused ones from last step are dropped now.
        rq, _ = queue_expire(self.state.replay_queue, now, 0)
        pbuf, _ = queue_expire(self.state.pilot_buffer, now, self.cfg.pilot_commit.buffer_max_age)
        surplus, _ = queue_expire(self.state.surplus, now, 0)
        self.state = self.state.replace(replay_queue=rq, pilot_buffer=pbuf, surplus=surplus)
        pcs = self.state.prefix_control
        if self.ps.enabled:
            pcs = prefix_control_update(pcs, self.replay_succ, self.replay_roll, self.ps)
            self._queue_replays()
        trained = [self.groups[k] for k in self.trained]
        result = StepResult(
            groups=[TrainGroup(g.key, g.prompt, tuple(g.rewards), g.prefix, self._is_valid(g)) for g in trained],
            rollouts_spent=self.spent, rounds=self.round, abandoned=self.abandoned,
            retained_keys=frozenset(int(k) for q in (self.state.replay_queue, self.state.pilot_buffer,
                                                     self.state.surplus)
                                    for k in np.asarray(q.group_key)[np.asarray(q.valid)]),
            replay_successes=self.replay_succ.copy(), replay_rollouts=self.replay_roll.copy())
        new_state = self.state.replace(step=self.state.step + 1, key=self.key,
                                       next_group_key=jnp.int32(self.next_key),
                                       evicted=jnp.asarray(self.evicted), prefix_control=pcs)
        return result, new_state

    def _queue_replays(self) -> None:
        """Trained fresh full groups in a replay-eligible bucket become next step's replay sources."""
        gs = [g for g in (self.groups[k] for k in self.trained) if g.prefix is None and len(g.rewards) == self.N]
        if not gs:
            return
        rewards = np.zeros((_bucket(len(gs)), self.N), np.int32)
        rewards[:len(gs)] = [g.rewards for g in gs]
        eligible, buckets, src = (np.asarray(x)[:len(gs)] for x in plan_replays(self._rng(), rewards, self.ps))
        if eligible.any():
            self._push("replay_queue", [g for g, e in zip(gs, eligible) if e], tag=buckets[eligible], aux=src[eligible])
