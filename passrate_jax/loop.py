"""The host-side allocation loop of one training step (DESIGN.md section 3).

One step is rounds of (allocator requests -> sampler -> verifier -> allocator observe), Prefix
Sampling re-rollout rounds included, then the allocator's ``finish`` names the groups to train on.
No algorithm lives here: the allocator decides, the sampler generates, the verifier scores; this
module wires them and counts what happened.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from passrate_jax.allocation import Allocator, AllocatorState, Result, StepResult
from passrate_jax.allocation.prefix_control import bucket_successes
from passrate_jax.rollouts import RolloutStore
from passrate_jax.sampling.sampler import Sampler


@dataclasses.dataclass
class StepRollouts:
    """What the rollout phase of a step produced: the allocator's result, the next allocator state,
    and counters for the metrics (rewards of every rollout generated, sampler rows by finish reason)."""
    result: StepResult
    state: AllocatorState
    rewards: list[int]
    truncated: int
    verifier_errors: int


def collect_rollouts(allocator: Allocator, state: AllocatorState, store: RolloutStore, sampler: Sampler, params,
                     *, seed: int, max_new_tokens: int, decode: Callable[[list[int]], str],
                     verify: Callable[[list[int], list[str]], np.ndarray],
                     success_threshold: float = 0.5) -> StepRollouts:
    """Run one step's allocation rounds with the real sampler and verifier.

    ``verify(prompt_indices, response_texts)`` returns one reward per response (a round's responses are
    scored in one call, so a process-pool verifier works in parallel). Should it raise, the round's
    rewards are 0 and counted as verifier errors: a verifier never stops training. The store keeps the
    rewards as scored (advantages use them as is); the allocator sees successes, reward >= ``success_threshold``.
    """
    run = allocator.start_step(state)
    all_rewards: list[int] = []
    truncated = errors = 0
    while requests := run.requests():
        contexts = store.contexts(requests, max_new_tokens)
        out = sampler.generate(contexts, seed=seed, params=params)
        truncated += int((~out.stopped).sum())
        completions = [out.completion(row) for row in range(len(out.context_index))]
        prompts = [requests[c].prompt_id for c in out.context_index]
        texts = [decode(store.groups[requests[c].group_key].prefix + comp)
                 for c, comp in zip(out.context_index, completions)]
        try:
            scored = np.asarray(verify(prompts, texts), np.float32)
        except Exception:  # noqa: BLE001 - reward 0 and a counted error, never a crash
            scored, errors = np.zeros(len(texts), np.float32), errors + len(texts)
        rewards = (scored >= success_threshold).astype(int)
        results = []
        for c, req in enumerate(requests):
            rows = np.flatnonzero(out.context_index == c)
            store.record(req, [completions[r] for r in rows], scored[rows].tolist())
            results.append(Result(req.group_key, tuple(int(x) for x in rewards[rows])))
        all_rewards += rewards.tolist()
        run.observe(results)
    result, new_state = run.finish()
    return StepRollouts(result, new_state, all_rewards, truncated, errors)


def rollout_metrics(allocator: Allocator, rollouts: StepRollouts) -> dict:
    """Per-step counters: rollouts spent, valid groups, useful rollouts, pass-rate histogram of the
    trained groups, and per Prefix Sampling bucket (named by its success count) the re-rollout pass rate,
    the controller's ratio and EMA."""
    r, n = rollouts.result, allocator.cfg.group_size
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
        "train_accuracy": float(np.mean(rollouts.rewards)) if rollouts.rewards else float("nan"),
        "truncated_rollouts": rollouts.truncated,
        "verifier_errors": rollouts.verifier_errors,
        "replay_groups": sum(g.prefix is not None for g in r.groups),
        "pass_rate_hist": hist.tolist(),
    }
    if allocator.ps.enabled:
        pcs = rollouts.state.prefix_control
        ratio, ema = np.asarray(pcs.ratio), np.asarray(pcs.ema)
        for b, s in enumerate(bucket_successes(n)):
            m[f"ps/ratio/{s}"] = float(ratio[b])
            m[f"ps/ema/{s}"] = float(ema[b])
            if r.replay_rollouts[b] > 0:
                m[f"ps/pass_rate/{s}"] = float(r.replay_successes[b] / r.replay_rollouts[b])
    return m
