"""One small policy per allocation method, behind one protocol the round machine drives.

A policy says how a round is planned (which groups are opened or continued, how many rollouts each
requests) and what is decided about the groups whose outcomes just came in. Everything else (Prefix
Sampling replays, recording outcomes, completing groups to N, the end-of-step updates) is shared and
lives in :mod:`.machine`. Policies are stateless, hashable objects (static arguments: each method
compiles once, no method name is tested inside a round); a method's queues are its own pytree,
``state.policy``, which only its hooks touch.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import struct

from passrate_jax.allocation import pilot_commit as pc
from passrate_jax.allocation.composition import UNBOUNDED, Knobs, Opening, Setup
from passrate_jax.allocation.group_queue import GroupQueue, pilot_priority, queue_expire, queue_init, queue_push
from passrate_jax.allocation.sara import ABANDON, CONFIRM, sara_rule
from passrate_jax.allocation.table import (ABANDONED, ACTIVE, BUFFERED, CONFIRMED, DROPPED, StepTable,
                                           afford, pending, successes, take_rows)


def budget_left(knobs: Knobs, t: StepTable):
    """Rollouts still free this step after what is already spent and requested, and after the N of
    each same-step re-rollout group the step may still open (``t.replay_left``, else 0)."""
    return knobs.budget - t.spent - jnp.sum(t.chunk) - t.replay_left * t.rewards.shape[1]


def toward_b(setup: Setup, t: StepTable):
    """Rows whose groups count toward the step's B, bool [G]: all but re-rollout groups placed on top."""
    return setup.placement.toward_b(t)


def trained_toward_b(setup: Setup, t: StepTable):
    """Trained groups that count toward B (int32): ``t.trained`` less re-rollout groups placed on top."""
    return setup.placement.trained_toward_b(t)


def slots(setup: Setup, t: StepTable):
    """Groups the step still lacks: B minus those trained and in progress (counting toward B), and,
    in place, minus the slots held for same-step re-rollout groups not yet opened."""
    busy = jnp.sum(pending(t) & toward_b(setup, t)).astype(jnp.int32)
    return setup.B - setup.placement.held(t) - trained_toward_b(setup, t) - busy


def _no_decision(setup, knobs, state, t, fresh, completed):
    return state, t


class NoQueue:
    """The state hooks of a policy that keeps nothing across steps (a policy with a queue overrides them)."""

    def next_request(self, setup, knobs, n, s, probes):
        """The size of the request this policy makes next for a fresh group (no replayed prefix) that has
        ``n`` rollouts with ``s`` successes after ``probes`` requests (int arrays, elementwise), 0 for none:
        what the slot engine may start ahead for sure (``machine.next_request``). By default 0: the next
        request of these policies is not a function of the group's own outcomes (GRPO and DS ask the whole
        group at once; a Pilot-Commit commit depends on the pilot's rank among others)."""
        return jnp.zeros_like(n)

    def init(self, setup):
        return ()

    def begin(self, setup, knobs, state, t):
        return state, t

    def held_prompts(self, state, num_prompts):
        return jnp.zeros((num_prompts,), bool)

    def end(self, setup, state, now):
        none = jnp.zeros((0,), jnp.int32)
        return state, (none, none, none, jnp.zeros((0,), bool))


@struct.dataclass
class DSState:
    """Dynamic sampling's state: ideal DS's valid groups beyond B, trained first next step (empty
    without ``keep_surplus``)."""
    surplus: GroupQueue


@struct.dataclass
class PilotCommitState:
    """Pilot-Commit's state: the buffer of kept pilots awaiting their commit."""
    buffer: GroupQueue


@dataclasses.dataclass(frozen=True)
class Uniform(NoQueue):
    """GRPO: B fresh prompts, N rollouts each, every group trained (saturated ones too)."""
    trains_saturated: bool = True

    def default_budget(self, cfg):
        return cfg.num_prompts * cfg.group_size

    def capacity(self, setup):
        return setup.B

    def max_rounds(self, cfg):
        return 1

    def max_open(self, setup):
        return setup.B

    def plan(self, setup, knobs, state, t):
        k = jnp.minimum(slots(setup, t), afford(budget_left(knobs, t), setup.N))
        return state, t, Opening.of(k, CONFIRMED, setup.N)

    decide = staticmethod(_no_decision)


@dataclasses.dataclass(frozen=True)
class DynamicSampling(NoQueue):
    """DAPO dynamic sampling: generation batches of gen_batch_multiple * B full groups until B are valid.
    With ``keep_surplus`` (ideal DS) valid groups beyond B wait in the surplus queue for the next step."""
    trains_saturated: bool = False

    def default_budget(self, cfg):
        return UNBOUNDED

    def capacity(self, setup):
        # At most B trained (or carried) plus one generation batch; the rest are closed each round.
        return setup.B + self.max_open(setup)

    def max_rounds(self, cfg):
        return cfg.ds.max_gen_batches

    def max_open(self, setup):
        return setup.cfg.ds.gen_batch_multiple * setup.B

    def plan(self, setup, knobs, state, t):
        # DAPO's reference code draws a full generation batch whatever is still missing (same-step
        # replays aside: no batch while the missing groups are all replays in progress).
        k = jnp.minimum(self.max_open(setup), afford(budget_left(knobs, t), setup.N))
        # Event mode: no new generation batch while the groups still in flight could complete B (in
        # round mode none is in flight when a round is planned).
        in_flight = jnp.sum(pending(t) & (t.bucket < 0)).astype(jnp.int32)
        k = jnp.where(trained_toward_b(setup, t) + in_flight >= setup.B, 0, k)
        if setup.timing.in_step:  # no batch while the missing groups are all replays in progress
            k = jnp.where(slots(setup, t) > 0, k, 0)
        return state, t, Opening.of(k, CONFIRMED, setup.N)

    def decide(self, setup, knobs, state, t, fresh, completed):
        s = successes(t)
        extra = knobs.keep_surplus & completed & (t.status == DROPPED) & (s > 0) & (s < t.n)
        zero = jnp.zeros_like(t.n)
        surplus = queue_push(state.policy.surplus, t.prompt, t.key, t.n, s, t.rewards, zero, zero, state.step,
                             extra)
        return state.replace(policy=DSState(surplus)), t

    def init(self, setup):
        return DSState(queue_init(setup.B, setup.N))

    def begin(self, setup, knobs, state, t):
        """Ideal DS: last step's surplus (complete groups, requesting nothing) is trained first."""
        q = state.policy.surplus
        k = jnp.where(knobs.keep_surplus, setup.B, 0)
        t, q, _, _ = take_rows(t, q, k, q.stamp.astype(jnp.float32), CONFIRMED, lambda n: 0 * n, carried=True)
        return state.replace(policy=DSState(q)), t

    def end(self, setup, state, now):
        surplus, _ = queue_expire(state.policy.surplus, now, 0)  # a surplus group waits one step at most
        return super().end(setup, state.replace(policy=DSState(surplus)), now)


@dataclasses.dataclass(frozen=True)
class Sara(NoQueue):
    """SARA: probe fresh prompts in rounds; confirm, abandon or continue each after every round; a
    confirmed group is completed to N. Fill mode opens prompts until B confirmed groups are complete
    (within a cap equal to DS's worst case); fixed-budget mode spends at most B * N rollouts a step.
    Either way a prompt is opened only while the budget can still complete it and every pending group."""
    trains_saturated: bool = False

    def default_budget(self, cfg):
        full = cfg.num_prompts * cfg.group_size
        if cfg.sara.mode == "fixed_budget":
            return full
        return cfg.ds.gen_batch_multiple * cfg.ds.max_gen_batches * full

    def capacity(self, setup):
        # Trained plus pending groups never exceed B (a round opens only the missing ones); one round's
        # openings on top, and abandoned probes are closed each round.
        return setup.B + self.max_open(setup)

    def max_rounds(self, cfg):
        return cfg.sara.max_rounds

    def max_open(self, setup):
        return setup.B

    def plan(self, setup, knobs, state, t):
        own = pending(t) & (t.bucket < 0)
        future = jnp.sum(jnp.where(own, setup.N - t.n - t.chunk - t.inflight, 0))
        k = jnp.minimum(slots(setup, t), afford(budget_left(knobs, t) - future, setup.N))
        return state, t, Opening.of(k, ACTIVE, jnp.clip(knobs.schedule[0], 1, setup.N))

    def decide(self, setup, knobs, state, t, fresh, completed):
        rows = fresh & (t.status == ACTIVE)
        probes = t.probes + rows
        action, _, chunk = sara_rule(t.n, successes(t), probes, t.prior_a, t.prior_b, knobs.tau_confirm,
                                     knobs.tau_abandon, knobs.schedule, setup.N)
        status = jnp.where(action == CONFIRM, CONFIRMED, jnp.where(action == ABANDON, ABANDONED, ACTIVE))
        return state, t.replace(probes=probes, status=jnp.where(rows, status, t.status),
                                chunk=jnp.where(rows, chunk, t.chunk))

    def next_request(self, setup, knobs, n, s, probes):
        """SARA's own rule on the group's outcomes (a fresh group's prior is the configured one): the rest
        when it would confirm, the next probe when it would continue, nothing when it would abandon."""
        prior_a = jnp.full(n.shape, setup.cfg.sara.prior_a, jnp.float32)
        prior_b = jnp.full(n.shape, setup.cfg.sara.prior_b, jnp.float32)
        return sara_rule(n, s, probes, prior_a, prior_b, knobs.tau_confirm, knobs.tau_abandon, knobs.schedule,
                         setup.N)[2]


@dataclasses.dataclass(frozen=True)
class PilotCommit(NoQueue):
    """Pilot-Commit: pilot fresh prompts with n_p rollouts, keep those in the pass-rate band in a buffer,
    commit the best buffered pilots (highest pilot variance first; n_c = N - n_p more rollouts).

    fill mode (the released code): each round commits into the missing slots, then pilots
    pilot_pool_ratio prompts per slot still missing, until B groups are committed (round limit).
    budgeted mode (the paper): the step spends at most its budget (default B * N). The first round is the
    pilot stage, pilot_budget_fraction of the budget (so this step's pilots are ranked together before
    any commit); later rounds commit from the buffer into the missing slots and, with what the budget
    has left, pilot further prompts only as many as it could also commit."""
    trains_saturated: bool = False

    def default_budget(self, cfg):
        return cfg.num_prompts * cfg.group_size if cfg.pilot_commit.mode == "budgeted" else UNBOUNDED

    def capacity(self, setup):
        # Trained plus committed groups never exceed B; a round's pilots on top (each is closed once decided).
        return setup.B + self.max_open(setup)

    def max_rounds(self, cfg):
        return cfg.pilot_commit.max_rounds

    def max_open(self, setup):
        pcfg = setup.cfg.pilot_commit
        fill = pcfg.pilot_pool_ratio * setup.B
        if pcfg.mode != "budgeted":
            return fill
        # The pilot stage's size at the largest budget, within the buffer's room (2 * ratio * B, allocator.py).
        stage = int(pcfg.pilot_budget_fraction * setup.max_budget) // pc.pilot_size(pcfg, setup.N)
        return min(max(fill, stage), 2 * fill)

    def plan(self, setup, knobs, state, t):
        pcfg, n = setup.cfg.pilot_commit, setup.N
        n_p = pc.pilot_size(pcfg, n)
        want, buf = slots(setup, t), state.policy.buffer
        budgeted = pcfg.mode == "budgeted"
        stage = budgeted & (t.rounds == 0)  # the pilot stage commits nothing: its pilots are ranked first
        # Event mode (the slot engine): while a pilot is in flight, nothing is committed or opened, so the
        # buffer is ranked with all the pilots requested, as in round mode. Ranking those scored so far would
        # favour short answers: a pilot retires once it and every pilot issued before it are scored, so the
        # first retired are those whose answers ended first. (Never in round mode: nothing is in flight.)
        ranking = jnp.any(t.pilot & (t.inflight > 0))
        k_commit = jnp.where(stage | ranking, 0, jnp.minimum(want, afford(budget_left(knobs, t), n - n_p)))
        t, buf, _, ok = take_rows(t, buf, k_commit, pilot_priority(buf), CONFIRMED, lambda held: n - held)
        shortfall = want - jnp.sum(ok).astype(jnp.int32)
        if budgeted:
            share = jnp.floor(pcfg.pilot_budget_fraction * knobs.budget.astype(jnp.float32)).astype(jnp.int32)
            first = jnp.minimum(share // n_p, afford(budget_left(knobs, t), n_p))
            # After the stage a pilot is opened only if the budget could also pay its commit.
            later = jnp.minimum(pcfg.pilot_pool_ratio * shortfall, afford(budget_left(knobs, t), n))
            k_pilot = jnp.where(ranking, 0, jnp.minimum(jnp.where(stage, first, later), self.max_open(setup)))
        else:
            k_pilot = jnp.where(ranking, 0, jnp.minimum(pcfg.pilot_pool_ratio * shortfall,
                                                         afford(budget_left(knobs, t), n_p)))
        return state.replace(policy=PilotCommitState(buf)), t, Opening.of(k_pilot, ACTIVE, n_p, pilot=True)

    def decide(self, setup, knobs, state, t, fresh, completed):
        rows = fresh & (t.status == ACTIVE) & t.pilot
        s = successes(t)
        verdict = pc.pilot_classify(t.n, s, setup.cfg.pilot_commit)
        keep = rows & (verdict == pc.KEEP)
        evict = rows & (verdict == pc.EVICT)
        zero = jnp.zeros_like(t.n)
        buf = queue_push(state.policy.buffer, t.prompt, t.key, t.n, s, t.rewards, zero, zero, state.step, keep)
        evicted = t.evicted.at[jnp.where(evict, t.prompt, t.evicted.shape[0])].set(True, mode="drop")
        status = jnp.where(rows, jnp.where(keep, BUFFERED, ABANDONED), t.status)
        return (state.replace(policy=PilotCommitState(buf)),
                t.replace(status=status, pilot=t.pilot & ~rows, evicted=evicted))

    def init(self, setup):
        return PilotCommitState(queue_init(2 * setup.cfg.pilot_commit.pilot_pool_ratio * setup.B, setup.N))

    def held_prompts(self, state, num_prompts):
        buf = state.policy.buffer
        return jnp.zeros((num_prompts,), bool).at[jnp.where(buf.valid, buf.prompt_id, num_prompts)].set(
            True, mode="drop")

    def end(self, setup, state, now):
        # Kept pilots are observed when committed (as one group of N) or, if never committed, when they
        # expire: a pilot is committable for exactly buffer_max_age steps after its own.
        buf, expired = queue_expire(state.policy.buffer, now + 1, setup.cfg.pilot_commit.buffer_max_age)
        return state.replace(policy=PilotCommitState(buf)), (buf.prompt_id, buf.n, buf.s, expired)
