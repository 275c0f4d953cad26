"""A session's held-out evaluation: one evaluation (``evaluate.evaluate``: greedy accuracy overall and per
level, pass@k of sampled rollouts) over a count of successes by the kind of its tasks: text answers scored
by the run's verifier, or whole environment episodes scored by the environment's reward.
"""

from __future__ import annotations

import functools

import numpy as np

from passrate_jax.data.env_source import task_of
from passrate_jax.envs import resolve_env
from passrate_jax.envs.base import Episode
from passrate_jax.envs.episodes import Start, run_episodes
from passrate_jax.envs.replay import TurnCodec
from passrate_jax.run.config import episode_limits
from passrate_jax.run.evaluate import evaluate
from passrate_jax.sampling.sampler import Context


def no_heldout() -> dict:
    """The evaluation of an empty held-out set (``data.eval_size`` 0)."""
    return {"accuracy": float("nan"), "accuracy_by_level": {}}


def evaluate_session(session, params, *, seed: int = 0, num_samples: int = 0, ks=(1,), greedy: bool = True) -> dict:
    """Greedy held-out accuracy (overall and per level) of ``params``; pass@k with ``num_samples``
    (``greedy=False``: those only). Text answers are scored by the run's verifier, environment episodes by
    the environment's reward; one evaluation (``evaluate.evaluate``) for both."""
    if not session.heldout:
        return no_heldout()
    if session.cfg.data.source == "env":
        tasks = [task_of(r) for r in session.heldout]
        count, levels = functools.partial(_episode_successes, session, params, tasks), [t.level for t in tasks]
    else:
        count = functools.partial(_answer_successes, session, params)
        levels = [int(r.metadata.get("level", 0)) for r in session.heldout]
    return evaluate(count, levels, sampling=session.sampler.cfg, temperature=session.cfg.sampling.temperature,
                    seed=seed, num_samples=num_samples, ks=ks, greedy=greedy)


def _answer_successes(session, params, n: int, sampler_cfg, seed: int, batch_contexts: int = 64) -> np.ndarray:
    """Per held-out prompt, how many of its ``n`` answers the run's verifier scores at or above
    ``data.reward_threshold``, ``batch_contexts`` answers sampled at a time."""
    threshold, records, prompt_ids = session.cfg.data.reward_threshold, session.heldout, session.heldout_tokens
    out = np.zeros(len(records), int)
    per_chunk = max(1, batch_contexts // n)
    for lo in range(0, len(records), per_chunk):
        hi = min(lo + per_chunk, len(records))
        result = session.sampler.generate([Context(prompt_ids[i], num_samples=n, context_id=i) for i in range(lo, hi)],
                                          seed=seed, params=params, cfg=sampler_cfg)
        for row, ctx in enumerate(result.context_index):
            text = session.decode(result.completion(row))
            out[lo + ctx] += session.score([records[lo + ctx]], [text])[0] >= threshold
    return out


def _episode_successes(session, params, tasks, n: int, sampler_cfg, seed: int, batch_contexts: int = 64) -> np.ndarray:
    """Per held-out task, how many of its ``n`` episodes succeed (reward >= ``data.reward_threshold``),
    run ``batch_contexts`` episodes at a time."""
    env, codec = resolve_env(session.cfg.data.env), TurnCodec(session.tokenizer)
    max_turns, turn_tokens, max_len = episode_limits(session.cfg.data, session.cfg.sampling,
                                                     session.sampler.model_cfg.max_position_embeddings)
    out = np.zeros(len(tasks), int)
    per_chunk = max(1, batch_contexts // n)
    for lo in range(0, len(tasks), per_chunk):
        starts = []
        for i in range(lo, min(lo + per_chunk, len(tasks))):
            episode = Episode(env, tasks[i], max_turns)
            episode.reset()
            starts.append(Start(episode, list(session.heldout_tokens[i]), n, context_id=i))
        rollouts = run_episodes(session.sampler, params, starts, codec, seed=seed, turn_tokens=turn_tokens,
                                max_len=max_len, cfg=sampler_cfg)
        for j, r in enumerate(rollouts):
            out[lo + j // n] += r.reward >= session.cfg.data.reward_threshold
    return out
