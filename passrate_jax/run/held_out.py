"""A session's held-out evaluation, by the kind of its tasks: text answers scored by the run's verifier
(``evaluate.evaluate``), or whole environment episodes scored by the environment's reward. Both return
the same keys (``evaluate.summarise``): greedy accuracy overall and per level, pass@k of sampled ones.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from passrate_jax.data.env_source import task_of
from passrate_jax.envs import resolve_env
from passrate_jax.envs.base import Episode
from passrate_jax.envs.episodes import Start, run_episodes
from passrate_jax.envs.replay import TurnCodec
from passrate_jax.run.config import episode_limits
from passrate_jax.run.evaluate import EvalPrompt, evaluate, summarise



def no_heldout() -> dict:
    """The evaluation of an empty held-out set (``data.eval_size`` 0)."""
    return {"accuracy": float("nan"), "accuracy_by_level": {}}


def evaluate_session(session, params, *, seed: int = 0, num_samples: int = 0, ks=(1,), greedy: bool = True) -> dict:
    """Greedy held-out accuracy (overall and per level) of ``params``; pass@k with ``num_samples``
    (``greedy=False``: those only). Environments: success of whole episodes."""
    if session.cfg.data.source == "env":
        return evaluate_episodes(session, params, seed=seed, num_samples=num_samples, ks=ks, greedy=greedy)
    threshold = session.cfg.data.reward_threshold

    def verifier(record):
        return lambda text: float(session.score([record], [text])[0] >= threshold)
    prompts = [EvalPrompt(ids, verifier(r), int(r.metadata.get("level", 0)))
               for r, ids in zip(session.heldout, session.heldout_tokens)]
    if not prompts:
        return no_heldout()
    return evaluate(session.sampler, params, prompts, session.decode, seed=seed, num_samples=num_samples, ks=ks,
                    temperature=session.cfg.sampling.temperature, greedy=greedy)


def evaluate_episodes(session, params, *, seed: int = 0, num_samples: int = 0, ks=(1,), batch_contexts: int = 64,
                      greedy: bool = True) -> dict:
    """Held-out success of ``params`` in the session's environment: greedy episodes (overall and per
    level), plus pass@k from ``num_samples`` sampled episodes per task at the configured temperature."""
    tasks = [task_of(r) for r in session.heldout]
    if not tasks:
        return no_heldout()
    sampler_cfg = session.sampler.cfg
    correct = counts = None
    if greedy:
        correct = _episode_successes(session, params, tasks, 1, dataclasses.replace(sampler_cfg, temperature=0.0),
                                     seed, batch_contexts)
    if num_samples > 0:
        sampled = dataclasses.replace(sampler_cfg, temperature=session.cfg.sampling.temperature)
        counts = _episode_successes(session, params, tasks, num_samples, sampled, seed + 1, batch_contexts)
    return summarise(correct, [t.level for t in tasks], counts, num_samples, ks)


def _episode_successes(session, params, tasks, n: int, sampler_cfg, seed: int, batch_contexts: int) -> np.ndarray:
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
