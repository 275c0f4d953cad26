"""The host-side allocation loop of one training step (DESIGN.md section 3), written once for every kind
of rollout.

One step is rounds of (allocator requests -> backend: contexts, generate, score, record -> allocator
observe), Prefix Sampling re-rollout rounds included, then the allocator's ``finish`` names the groups
to train on. No algorithm lives here: the allocator decides; a :class:`RolloutBackend` (text answers:
``passrate_jax.rollout.text.TextRollouts``; environment episodes: ``passrate_jax.rollout.env.EnvRollouts``)
generates, scores and keeps the trajectories; this module wires them and keeps the step's one table of
rollouts, from which the allocator's results and the step's metrics are read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from passrate_jax.allocation import Allocator, AllocatorState, Request, StepResult
from passrate_jax.allocation.prefix_control import bucket_successes
from passrate_jax.rollout.store import TrajectoryStore
from passrate_jax.rollout.table import RolloutTable


class RolloutBackend(Protocol):
    """One kind of rollout, as the round loop and the trainer drive it: what differs between the kinds.

    A step opens with ``open_step(params)`` (the rounds' ``generate`` calls share one prefix store of
    these parameters, so a context sampled in several rounds is prefilled once) and ends with
    ``close_step(table)`` (frees that KV before the update; returns the step's counters: the prefix
    store's ``prefill_tokens``, ``context_tokens`` and ``unshared_prefill_tokens``, see
    ``passrate_jax.sampling.PrefixStore``, and the backend's own, read from the step's ``table``).
    A round: ``contexts`` (where each request's rollouts start; None where a start cannot be rebuilt,
    e.g. an environment replay that fails its determinism check: the request is not observed) ->
    ``generate`` (each context's rollouts, in sample order) -> ``score`` (per-rollout columns of the step's
    :class:`~passrate_jax.rollout.table.RolloutTable`) -> ``record`` (keep the trajectories in ``store``,
    each referring to its row of the table, where its score lives). The slot engine drives a backend that
    has ``stream(params, seed)`` (text answers). Everything done with the kept trajectories (the update
    batch, what the person watching reads, checkpoints) is the store's, written once for every kind
    (:class:`~passrate_jax.rollout.store.TrajectoryStore`); the supervised warm start and held-out
    evaluation are the run's (``passrate_jax/run/warm_start.py``, ``held_out.py``).
    """
    store: TrajectoryStore
    # Prompt i's token ids; the slot engine reads their length to start the longest prompts first where a
    # step asks everything at its start (rollout/events.py).
    prompt_ids: Callable[[int], Sequence[int]]

    def open_step(self, params) -> None: ...

    def close_step(self, table: RolloutTable) -> dict: ...

    def contexts(self, requests: Sequence[Request]) -> list: ...

    def generate(self, contexts: Sequence, params, seed: int) -> list[list]: ...

    def score(self, requests: Sequence[Request], rollouts: Sequence[list]) -> dict[str, np.ndarray]: ...

    def record(self, requests: Sequence[Request], rollouts: Sequence[list], table: RolloutTable,
               rows: Sequence[np.ndarray]) -> None: ...


@dataclasses.dataclass
class StepRollouts:
    """What the rollout phase of a step produced: the allocator's result (unobserved groups left out),
    the next allocator state, the step's table of rollouts, the backend's step counters (``close_step``:
    the sampler's prefill counters; the backend's own, e.g. round mode's ``slot_utilization``) and the
    decoding's (``sampler_calls``; the slot engine's ``slot_utilization``, ``rollouts/aborted``,
    ``tokens/wasted``)."""
    result: StepResult
    state: AllocatorState
    table: RolloutTable
    backend_counters: dict = dataclasses.field(default_factory=dict)
    engine: dict = dataclasses.field(default_factory=dict)
    # The study's premise probes (passrate_jax/study/probes.py): prompts opened fresh this step, and the
    # PS bucket of each re-rollout group (by group key); both loops fill them through note_requests.
    opened: list[int] = dataclasses.field(default_factory=list)
    replay_buckets: dict[int, int] = dataclasses.field(default_factory=dict)


def note_requests(requests: Sequence[Request], opened: list[int], replay_buckets: dict[int, int]) -> None:
    """Record the premise probes' view of requests as they are issued (see :class:`StepRollouts`)."""
    opened += [r.prompt_id for r in requests if r.prefix is None and r.first_index == 0]
    replay_buckets.update((r.group_key, r.prefix.bucket) for r in requests if r.prefix is not None)


def collect_rollouts(allocator: Allocator, state: AllocatorState, backend: RolloutBackend, params, *,
                     seed: int) -> StepRollouts:
    """Run one step's allocation rounds with ``backend``. A request the backend cannot start is sent
    to the allocator as not observed (its rollouts count as spent, nothing is learned from them) and its
    group is left out of the update."""
    run = allocator.start_step(state)
    table, opened, replay_buckets = RolloutTable(), [], {}
    backend.open_step(params)
    calls = 0
    try:
        while requests := run.requests():
            note_requests(requests, opened, replay_buckets)
            contexts = backend.contexts(requests)
            observed = [c is not None for c in contexts]
            live = [r for r, seen in zip(requests, observed) if seen]
            rollouts = backend.generate([c for c in contexts if c is not None], params, seed)
            calls += any(observed)
            scores = backend.score(live, rollouts)
            results, rows = table.add(requests, observed, scores)
            backend.record(live, rollouts, table, rows)
            run.observe(results)
    finally:
        backend_counters = backend.close_step(table)
    result, new_state = run.finish()
    if unobserved := table.unobserved_groups():
        result = dataclasses.replace(result, groups=[g for g in result.groups if g.group_key not in unobserved])
    return StepRollouts(result, new_state, table, backend_counters, engine={"sampler_calls": calls}, opened=opened,
                        replay_buckets=replay_buckets)


def rollout_metrics(allocator: Allocator, rollouts: StepRollouts, backend: RolloutBackend) -> dict:
    """Per-step counters: rollouts spent, valid groups, useful rollouts, pass-rate histogram of the
    trained groups, per Prefix Sampling bucket (named by its success count) the re-rollout pass rate,
    the controller's ratio and EMA, the sampler's ``prefill_tokens`` / ``context_tokens`` and their
    ``prefill_ratio`` (1: every context's KV computed once in the step; ``unshared_prefill_tokens``:
    what prefilling every call in full would have computed), the decoding's and the backend's own
    counters. Generated-rollout counters (accuracy, truncation, verifier errors) count observed
    rollouts only."""
    r, n, table = rollouts.result, allocator.cfg.group_size, rollouts.table
    seen = table["observed"].astype(bool)
    rewards = table["reward"][seen]
    valid = [g for g in r.groups if g.valid]
    hist = np.zeros(n + 1, int)
    for g in r.groups:
        if len(g.rewards) == n:
            hist[sum(g.rewards)] += 1
    m = {
        "rollouts_step": r.rollouts_spent,
        "rounds": r.rounds,
        "groups_trained": len(r.groups),
        "valid_groups": len(valid),
        "valid_group_fraction": len(valid) / allocator.cfg.num_prompts,
        # Rollouts landing in trained valid groups; Pilot-Commit's pilots and ideal DS's surplus were
        # spent in earlier steps, so only the run's cumulative ratio is bounded by 1 (see train.py).
        "useful_rollouts": sum(len(g.rewards) for g in valid),
        "abandoned": len(r.abandoned),
        "train_accuracy": float(np.mean(rewards)) if len(rewards) else float("nan"),
        "truncated_rollouts": int(table["truncated"][seen].sum()),
        "verifier_errors": int(table["verifier_error"][seen].sum()),
        "replay_groups": sum(g.prefix is not None for g in r.groups),
        "pass_rate_hist": hist.tolist(),
        # Premise probes: which prompts were opened (selection learns from revisits), out of how many,
        # and how many prompts Pilot-Commit's eviction keeps out of the next step's pool (a scripted allocator
        # may know neither).
        "prompts_opened": [int(p) for p in rollouts.opened],
        "train_prompts": getattr(allocator, "num_prompts", None),
        "evicted_total": _evicted_total(rollouts.state),
    }
    if "prefill_tokens" in rollouts.backend_counters:
        p, c = rollouts.backend_counters["prefill_tokens"], rollouts.backend_counters["context_tokens"]
        m.update(prefill_ratio=p / c if c else float("nan"))
    if allocator.ps.enabled:
        pcs = rollouts.state.prefix_control
        ratio, ema = np.asarray(pcs.ratio), np.asarray(pcs.ema)
        for b, s in enumerate(bucket_successes(n)):
            m[f"ps/ratio/{s}"] = float(ratio[b])
            m[f"ps/ema/{s}"] = float(ema[b])
            if r.replay_rollouts[b] > 0:
                m[f"ps/pass_rate/{s}"] = float(r.replay_successes[b] / r.replay_rollouts[b])
        m.update(_replay_histograms(rollouts, n))
    return {**m, **rollouts.engine, **rollouts.backend_counters}


def _evicted_total(state) -> int:
    """Prompts out of the next step's pool by Pilot-Commit's eviction (0 for a state without eviction)."""
    return int(np.sum(np.asarray(state.evicted_now))) if hasattr(state, "evicted_until") else 0


def _replay_histograms(rollouts: StepRollouts, n: int) -> dict:
    """Per PS bucket (named by its success count), ``ps/replay_hist/<s>``: how many of the step's complete
    re-rollout groups had 0..N successes. PS assumes a replayed prefix *shifts* a group's pass rate toward
    0.5, so most such groups are mixed; a prefix that *decides* the outcome gives all-0 and all-N groups
    whose pooled pass rate can still be 0.5 (the study's premise probe reads this)."""
    table = rollouts.table
    seen = table["observed"].astype(bool)
    keys, rewards = table["group_key"], table["reward"]
    hists: dict[int, np.ndarray] = {}
    for key, b in rollouts.replay_buckets.items():
        rows = (keys == key) & seen
        if rows.sum() == n:
            hists.setdefault(b, np.zeros(n + 1, int))[int(rewards[rows].sum())] += 1
    labels = bucket_successes(n)
    return {f"ps/replay_hist/{labels[b]}": h.tolist() for b, h in sorted(hists.items())}
