"""The host-side allocation loop of one training step in an environment: the multi-turn counterpart of
``passrate_jax.loop.collect_rollouts``.

Rounds of (allocator requests -> turn-by-turn rollouts in the environment -> allocator observe); the
environment's final-state reward is the verifier. A request whose start cannot be rebuilt (a Prefix
Sampling replay whose observations differ from the recorded ones) generates nothing: the allocator,
whose protocol has no "cancelled" result, is told its rollouts all failed, the group is left out of
the update, and ``env/replay_rejected`` counts it. In a deterministic environment that never happens.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from passrate_jax.allocation import Allocator, AllocatorState, Result
from passrate_jax.envs.episodes import run_episodes
from passrate_jax.envs.rollouts import EnvRolloutStore
from passrate_jax.loop import StepRollouts, rollout_metrics
from passrate_jax.sampling.sampler import Sampler


@dataclasses.dataclass
class EnvStepRollouts(StepRollouts):
    """:class:`passrate_jax.loop.StepRollouts` plus the environment's counters for the step: replays
    rejected for non-determinism, error observations (malformed or failed actions), and the length
    in assistant turns (replayed ones included) of every episode generated."""
    replay_rejected: int = 0
    error_observations: int = 0
    episode_turns: list[int] = dataclasses.field(default_factory=list)


def collect_env_rollouts(allocator: Allocator, state: AllocatorState, store: EnvRolloutStore, sampler: Sampler,
                         params, *, seed: int, max_new_tokens: int) -> EnvStepRollouts:
    """Run one step's allocation rounds in the store's environment. ``max_new_tokens``: the budget of
    one assistant turn. Rejected groups are removed from the returned result's groups."""
    run = allocator.start_step(state)
    rejected_before = store.rejected
    rewards: list[int] = []
    truncated = errors = 0
    turns: list[int] = []
    while requests := run.requests():
        starts = [store.start(r) for r in requests]
        rollouts = run_episodes(sampler, params, [s for s in starts if s is not None], store.codec, seed=seed,
                                turn_tokens=max_new_tokens, max_len=store.max_len)
        results, pos = [], 0
        for req, start in zip(requests, starts):
            mine = None
            if start is not None:
                mine, pos = rollouts[pos:pos + req.num_rollouts], pos + req.num_rollouts
                rewards += [int(r.reward >= 0.5) for r in mine]
                truncated += sum(r.ended in ("limit", "length") for r in mine)
                errors += sum(t.error for r in mine for t in r.turns)
                turns += [r.episode.turns + (r.ended == "quit") for r in mine]
            results.append(Result(req.group_key, tuple(store.record(req, mine))))
        run.observe(results)
    result, new_state = run.finish()
    result = dataclasses.replace(result, groups=[g for g in result.groups if not store.groups[g.group_key].rejected])
    return EnvStepRollouts(result, new_state, rewards, truncated, 0, store.rejected - rejected_before, errors, turns)


def env_rollout_metrics(allocator: Allocator, rollouts: EnvStepRollouts) -> dict:
    """``passrate_jax.loop.rollout_metrics`` plus ``env/replay_rejected``, ``env/error_observations``
    (this step's counts) and ``env/turns_mean`` (mean episode length in assistant turns).
    ``truncated_rollouts`` counts episodes cut off by the turn limit or the context length."""
    return {**rollout_metrics(allocator, rollouts), "env/replay_rejected": rollouts.replay_rejected,
            "env/error_observations": rollouts.error_observations,
            "env/turns_mean": float(np.mean(rollouts.episode_turns)) if rollouts.episode_turns else float("nan")}
