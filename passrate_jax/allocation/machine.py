"""The round machine: one allocation step as pure functions of (allocator state, step table).

    state, t = begin_step(setup, knobs, state)
    while not t.done:
        state, t = plan_round(setup, knobs, state, t)       # rows with chunk > 0 are the requests
        rewards, observed = <generate and score them>       # the host's sampler, or the simulator's draws
        state, t = observe_round(setup, knobs, state, t, rewards, observed)
    state, t = finish_step(setup, knobs, state, t)           # rows with rank >= 0 are trained, in rank order

Event mode (the slot engine) runs the same machine with rollouts still in flight: ``plan_event`` plans
and marks the requests in flight; ``observe_event`` observes the rows whose requests have all come in
(one group event, or several taken together) and decides, while other rows are still being generated
(``event_step``: both, and the guesses' ``lookahead``, in one program; ``plan_and_look`` without the
observation, for a step's first requests).
A round is then one event: ``wave`` / ``event_wave`` count rounds as the depth of the decisions that led
to a request, so ``max_rounds`` bounds the same thing in both modes; and the step is ``done`` only once
no request is in flight that could still be trained (``waiting``). With every request of a round
observed in one event, event mode is round mode exactly.

``setup`` (static) names the composition and its policy; ``knobs`` (arrays) holds the thresholds and
gains a sweep varies. The machine owns what every method shares: Prefix Sampling's re-rollout groups
(:mod:`.replay`: round 0 of the next step, or later rounds of the same step), recording outcomes,
completing groups to N, and the end-of-step updates of the selection models, the replay queue and PS
controllers. The method's own choices, and its own state across steps (ideal DS's surplus,
Pilot-Commit's buffer: ``state.policy``), are its policy's (:mod:`.policies`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from passrate_jax.allocation.group_queue import queue_expire, queue_init
from passrate_jax.allocation.composition import Knobs, Setup
from passrate_jax.allocation.policies import budget_left, toward_b, trained_toward_b
from passrate_jax.allocation.prefix_control import prefix_control_update
from passrate_jax.allocation.selection import selection_update
from passrate_jax.allocation.table import (ABANDONED, CONFIRMED, DROPPED, REJECTED, TRAINED, StepTable, close_rows,
                                           draw_thompson, observed, open_fresh, pending, shuffle_available, successes,
                                           table_init)

# Fresh groups guessed ahead: at most this many times the step's estimate of those it still needs
# (:func:`fresh_needed`; None: the whole window). Guesses never change a decision; 2 leaves room for a
# run of abandoned prompts.
FRESH_MARGIN: float | None = 2.0


def begin_step(setup: Setup, knobs: Knobs, state):
    """A fresh table for the step; ideal DS's surplus from the last step is trained first, then Prefix
    Sampling's re-rollout groups are opened (requested in the first round), or, same-step, granted."""
    rng, step_rng = jax.random.split(state.key)
    state = state.replace(key=rng)
    t = table_init(setup.capacity, setup.N, setup.num_buckets, state.next_group_key, state.evicted_now, step_rng)
    t = draw_thompson(t, state.selection, knobs.selection)
    state, t = setup.policy.begin(setup, knobs, state, t)  # ideal DS: last step's surplus, carried
    t = _complete(setup, knobs, t, pending(t) & t.carried)
    state, t = setup.timing.begin(setup, knobs, state, t)
    return state, shuffle_available(close_rows(t), setup.policy.held_prompts(state, setup.num_prompts))


def plan_round(setup: Setup, knobs: Knobs, state, t: StepTable):
    """Plan the next round: the policy's requests (PS re-rollout groups, opened by
    :func:`begin_step`, go in the first; same-step ones are opened here). Sets ``done`` when there is
    nothing to request (B groups trained, round limit, budget, no prompts left)."""
    go = ~t.done & (t.event_wave < knobs.max_rounds)
    state, t, replays = setup.timing.open_round(setup, knobs, state, t, go)  # rows requested whatever ``go``
    go = go & (trained_toward_b(setup, t) < setup.B)
    planned_state, planned, op = setup.policy.plan(setup, knobs, state, t)
    # The prompts are chosen here, once for every policy (the selection is the costly part to compile).
    held = setup.policy.held_prompts(planned_state, setup.num_prompts)
    planned = open_fresh(planned, state.selection, held, setup.cfg, knobs.selection, op.k, setup.max_open, op.status,
                         op.chunk, pilot=op.pilot)
    # Within a step a policy changes only its own state, the replay queue and the table; selecting just those keeps the
    # (large, per-prompt) selection models out of every round's copies. Without ``go`` the step ends
    # here, so the table's per-prompt fields (which nothing after the last round reads as planned) are
    # not selected either: only the rows, counters and key. Same-step replays may go on without ``go``:
    # then every part is (``timing.in_step``).
    queues = lambda st: (st.policy, st.replay_queue)  # noqa: E731
    parts = lambda tb: {"rows": tb.rows, "counters": tb.counters, "rng": tb.rng,  # noqa: E731
                        **({"prompts": tb.prompts} if setup.timing.in_step else {})}
    (policy, replay), kept = jax.tree.map(lambda a, b: jnp.where(go, a, b),
                                          (queues(planned_state), parts(planned)), (queues(state), parts(t)))
    t = planned.replace(**kept)
    state = state.replace(policy=policy, replay_queue=replay)
    chunk = jnp.where((go | replays) & pending(t), t.chunk, 0)
    asked = jnp.sum(chunk).astype(jnp.int32)
    wave = t.event_wave + 1
    return state, t.replace(chunk=chunk, spent=t.spent + asked, wave=jnp.where(chunk > 0, wave, t.wave),
                            rounds=jnp.where(asked > 0, jnp.maximum(t.rounds, wave), t.rounds),
                            done=t.done | ((asked == 0) & ~jnp.any(waiting(setup, t))))


def waiting(setup: Setup, t: StepTable):
    """Rows in flight the step must wait for, bool [G] (none in round mode): every one while the step
    lacks B trained groups, else only re-rollout groups placed on top of B (the rest would be dropped)."""
    return (t.inflight > 0) & (~toward_b(setup, t) | (trained_toward_b(setup, t) < setup.B))


def plan_event(setup: Setup, knobs: Knobs, state, t: StepTable):
    """:func:`plan_round` with other requests possibly in flight, the new ones then marked in flight (so
    later plans do not request those rows again). Returns (state, table, chunk int32 [G]: the new requests)."""
    state, t = plan_round(setup, knobs, state, t)
    return state, t.replace(inflight=t.inflight + t.chunk, chunk=jnp.zeros_like(t.chunk)), t.chunk


def lookahead(setup: Setup, knobs: Knobs, state, t: StepTable, m: int):
    """What the slot engine may start ahead of the requests (guesses: the host uses one only when the
    machine makes exactly that request). Returns a dict of arrays:

    - the rest of each group already opened (``key``, ``prompt``, ``first``: the first index not yet
      requested, ``ok``): pending fresh rows of the table, then the pilot buffer (a commit continues a
      pilot under its key), rows [G + C];
    - the next ``m`` (static) fresh groups the policy would open (``fresh_prompt``, ``fresh_key``,
      ``fresh_ok``, [m]; ``chunk``: a fresh group's first request): the step's prompt order is fixed and a
      new group takes the next unused key. Predicted only under selection method none (MoPPS / DPS
      choose among a pool sized by how many a round opens), and, where the step ends on B groups rather
      than on its budget, only up to ``FRESH_MARGIN`` times the fresh groups it still needs
      (:func:`fresh_needed`);
    - ``free``: rollouts the budget has left.
    """
    _, _, op = setup.policy.plan(setup, knobs, state, t)
    at = t.cursor + jnp.arange(m)
    # A step whose budget is B x N or less (SARA fixed, Pilot-Commit budgeted) ends on its budget, not on
    # B groups: there the budget's room bounds the guesses. Fill modes' budgets are a safety cap above it.
    fills = knobs.budget > setup.B * setup.N
    wanted = jnp.arange(m) < (m if FRESH_MARGIN is None else
                              jnp.where(fills, FRESH_MARGIN * fresh_needed(setup, t), m))
    # Only Pilot-Commit's policy holds a pilot buffer (a commit continues a pilot under its key).
    buf = getattr(state.policy, "buffer", None)
    buf = queue_init(0, setup.N) if buf is None else buf
    waiting = t.inflight + t.chunk
    first = t.n + waiting
    size = next_request(setup, knobs, first, successes(t), waiting, t.probes + (waiting > 0))
    return {"key": jnp.concatenate([t.key, buf.group_key]), "prompt": jnp.concatenate([t.prompt, buf.prompt_id]),
            "first": jnp.concatenate([first, buf.n]), "size": jnp.concatenate([size, setup.N - buf.n]),
            "ok": jnp.concatenate([pending(t) & (t.bucket < 0) & (first < setup.N), buf.valid & (buf.n < setup.N)])
            & ~t.done,
            "fresh_prompt": t.order[jnp.minimum(at, t.order.shape[0] - 1)],
            "fresh_key": t.key_base + t.opened + jnp.arange(m, dtype=jnp.int32),
            "fresh_ok": (at < t.num_available) & (knobs.selection == 0) & ~t.done & wanted,
            "chunk": op.chunk, "free": budget_left(knobs, t)}


def fresh_needed(setup: Setup, t: StepTable):
    """About how many more fresh groups the step opens before B groups are trained (float32): B less the
    groups sure to be (trained, or confirmed on mixed outcomes), less the other pending groups times the
    step's rate of success so far (sure groups over those and the groups abandoned or dropped,
    Laplace-smoothed), over that rate. Guessing far past it decoded groups the step never opened: on
    SARA fill, about a third of the rollouts it decoded (docs/engine.md, *Fresh guesses as many as the
    step needs*). Used where the step ends on B groups, not on its budget (:func:`lookahead`)."""
    toward = pending(t) & toward_b(setup, t)
    s = successes(t)
    mixed = (t.status == CONFIRMED) & (s > 0) & (s < t.n)  # SARA's and a kept pilot's; DS's wait for theirs
    sure = trained_toward_b(setup, t) + jnp.sum(toward & mixed)
    unsure = jnp.sum(toward & ~mixed)
    failed = jnp.sum((t.closed == ABANDONED) | (t.closed == DROPPED))
    rate = (sure + 1.0) / (sure + failed + 2.0)
    return jnp.maximum(setup.B - sure - unsure * rate, 0.0) / rate


def next_request(setup: Setup, knobs: Knobs, n, s, waiting, probes):
    """The request the policy will surely make next for groups whose ``n`` rollouts include ``waiting``
    not yet scored, with ``s`` successes among the scored, after ``probes`` requests (int32 [K] each):
    the smallest of the policy's next requests over every outcome of the waiting rollouts, or 0 when some
    outcome makes none (a SARA probe that may end in abandoning). The slot engine starts it ahead
    (``rollout/ahead.py``): a guess that every outcome needs is used whenever its group is."""
    sizes = jax.vmap(lambda j: setup.policy.next_request(setup, knobs, n, s + j, probes))(
        jnp.arange(setup.N + 1, dtype=jnp.int32))
    sizes = jnp.where(jnp.arange(setup.N + 1)[:, None] <= waiting[None, :], sizes, setup.N)
    return jnp.where(jnp.all(sizes > 0, axis=0), jnp.min(sizes, axis=0), 0).astype(jnp.int32)


def observe_event(setup: Setup, knobs: Knobs, state, t: StepTable, rewards, observed, rows):
    """Observe the in-flight requests of ``rows`` (bool [G]) with :func:`observe_round`'s ``rewards`` and
    ``observed``; rows still in flight are left as they are."""
    t = t.replace(chunk=jnp.where(rows, t.inflight, 0), inflight=jnp.where(rows, 0, t.inflight))
    return observe_round(setup, knobs, state, t, rewards, observed)


def event_step(setup: Setup, knobs: Knobs, state, t: StepTable, rewards, observed, rows, m: int):
    """One group event as one program: :func:`observe_event`, then :func:`plan_and_look`. The same
    functions the host would call one by one, so the same decisions; the host makes one round trip an
    event instead of three. Returns (state, table, chunk, lookahead)."""
    state, t = observe_event(setup, knobs, state, t, rewards, observed, rows)
    return plan_and_look(setup, knobs, state, t, m)


def plan_and_look(setup: Setup, knobs: Knobs, state, t: StepTable, m: int):
    """:func:`plan_event` unless the step is done (then no request: chunk all 0), then the
    :func:`lookahead` of ``m`` (static) fresh groups from the planned table, as one program. Returns
    (state, table, chunk, lookahead)."""
    state, t, chunk = jax.lax.cond(t.done, lambda s, u: (s, u, jnp.zeros_like(u.chunk)),
                                   lambda s, u: plan_event(setup, knobs, s, u), state, t)
    return state, t, chunk, lookahead(setup, knobs, state, t, m)


def observe_round(setup: Setup, knobs: Knobs, state, t: StepTable, rewards, observed):
    """Record the round's outcomes and decide.

    rewards: int [G, N], the outcome of rollout j of row g at [g, j] (only the requested positions
    n .. n + chunk - 1 are read). observed: bool [G]; False marks a row whose outcomes are not an
    observation (an environment replay that failed its determinism check): its rollouts stay spent,
    the row is REJECTED, and nothing (policy, selection, controllers, training) learns from it.
    """
    asked = t.chunk > 0
    t = t.replace(event_wave=jnp.max(jnp.where(asked, t.wave, 0)).astype(jnp.int32))
    pos = jnp.arange(setup.N)[None, :]
    new = (pos >= t.n[:, None]) & (pos < (t.n + t.chunk)[:, None])
    rejected = asked & ~observed
    fresh = asked & ~rejected
    got = jnp.sum(jnp.where(new, rewards, 0), axis=1)
    is_replay = fresh & (t.bucket >= 0)
    drop = setup.num_buckets
    t = t.replace(rewards=jnp.where(new, rewards, t.rewards).astype(jnp.int8), n=t.n + t.chunk,
                  chunk=jnp.zeros_like(t.chunk), status=jnp.where(rejected, REJECTED, t.status),
                  replay_successes=t.replay_successes.at[jnp.where(is_replay, t.bucket, drop)].add(
                      got.astype(jnp.float32), mode="drop"),
                  replay_rollouts=t.replay_rollouts.at[jnp.where(is_replay, t.bucket, drop)].add(
                      jnp.sum(new, axis=1).astype(jnp.float32), mode="drop"))
    completed = fresh & pending(t) & (t.n >= setup.N)
    t = _complete(setup, knobs, t, completed)
    state, t = setup.timing.observed(setup, knobs, state, t, completed)  # same step: sources as they come in
    state, t = setup.policy.decide(setup, knobs, state, t, fresh & ~completed, completed)
    return state, close_rows(t)


def _complete(setup: Setup, knobs: Knobs, t: StepTable, rows):
    """Rows that reached N rollouts: trained (in row order) while fewer than B are, if valid or the
    method trains saturated groups; dropped otherwise. Re-rollout groups placed on top of B do not
    count toward it; in place, the slots held for same-step replays are not the fresh groups' to take."""
    s = successes(t)
    keep = rows & (((s > 0) & (s < t.n)) | knobs.train_saturated)
    counted = keep & toward_b(setup, t)
    room = setup.B - setup.placement.held(t)
    train = keep & (~counted | (trained_toward_b(setup, t) + jnp.cumsum(counted) - 1 < room))
    rank = t.trained + jnp.cumsum(train) - 1
    status = jnp.where(train, TRAINED, jnp.where(rows, DROPPED, t.status))
    return t.replace(status=status, rank=jnp.where(train, rank, t.rank),
                     trained=t.trained + jnp.sum(train).astype(jnp.int32))


def finish_step(setup: Setup, knobs: Knobs, state, t: StepTable):
    """Fold the step into the persistent state: one selection observation per observed prompt (a
    committed pilot's full N outcomes as one), expiry of the queues, the PS controllers, next step's
    replay sources. Returns (state, table)."""
    now = state.step
    s = successes(t)
    state, (left_ids, left_n, left_s, left_seen) = setup.policy.end(setup, state, now)  # e.g. expired pilots
    # The live rows (trained, or unfinished when the step stopped), the closed groups, what left the policy's queues.
    seen = observed(t)
    prompts = jnp.arange(t.closed.shape[0], dtype=jnp.int32)

    def update():
        return selection_update(state.selection, jnp.concatenate([t.prompt, prompts, left_ids]),
                                jnp.concatenate([t.n, t.closed_n, left_n]), jnp.concatenate([s, t.closed_s, left_s]),
                                jnp.concatenate([seen, t.closed_seen, left_seen]), setup.cfg.selection, setup.N)
    # The models are read only by a selection method (and by SARA's prior under one): without one
    # they stay at their priors, and a simulated step skips their cost.
    selection = jax.lax.cond(knobs.selection == 0, lambda: state.selection, update)
    replay_queue, _ = queue_expire(state.replay_queue, now, 0)
    control = prefix_control_update(state.prefix_control, t.replay_successes, t.replay_rollouts, setup.ps,
                                    knobs.gains)
    control = jax.tree.map(lambda new, old: jnp.where(knobs.ps_on, new, old), control, state.prefix_control)
    state, t = setup.timing.end(setup, knobs, state.replace(replay_queue=replay_queue), t)  # next step's sources
    replay_queue = state.replay_queue
    state = state.replace(step=now + 1, next_group_key=t.key_base + t.opened,
                          evicted_until=_evicted_until(setup, state, t.evicted),
                          selection=selection, replay_queue=replay_queue, prefix_control=control)
    return state, t


def _evicted_until(setup: Setup, state, evicted):
    """The state's ``evicted_until`` after a step whose table ends with ``evicted`` (bool [P]): a prompt
    evicted this step returns ``evict_steps`` steps after the next (0: never, the released code's rule)."""
    steps = setup.cfg.pilot_commit.evict_steps
    until = state.step + 1 + steps if steps else jnp.iinfo(jnp.int32).max
    return jnp.where(evicted & ~state.evicted_now, until, state.evicted_until).astype(jnp.int32)


def step_carry(state):
    """What a step's rounds change in the allocator state (the policy's queue and the replay queue): only
    these are loop-carried; the rest (selection models, controllers) is a loop constant."""
    return state.policy, state.replay_queue


def with_step_carry(state, carry):
    """``state`` with the loop-carried parts of :func:`step_carry` replaced by ``carry``."""
    return state.replace(policy=carry[0], replay_queue=carry[1])


def run_step(setup: Setup, knobs: Knobs, state, outcomes):
    """A whole step with ``outcomes(state, t) -> (rewards int [G, N], observed bool [G])`` standing in
    for the sampler and verifier (pure when ``outcomes`` is): the simulator's step."""
    state, t = begin_step(setup, knobs, state)

    def body(carry):
        queues, t = carry
        st, t = plan_round(setup, knobs, with_step_carry(state, queues), t)
        rewards, observed = outcomes(st, t)
        st, t = observe_round(setup, knobs, st, t, rewards, observed)
        return step_carry(st), t

    queues, t = jax.lax.while_loop(lambda c: ~c[1].done, body, (step_carry(state), t))
    return finish_step(setup, knobs, with_step_carry(state, queues), t)


