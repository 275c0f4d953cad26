"""What an environment run needs around the loop: its prompt source, the supervised warm start on expert
trajectories and held-out evaluation by greedy episodes.

A task travels in a :class:`PromptRecord`: the prompt is its first observation and the metadata hold
the whole task (``metadata["task"]``, JSON), so the rest of the trainer (allocator, selection, the
session's prompt encoding) treats an environment's tasks like any other prompts.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from passrate_jax.data.sources import PromptRecord, PromptSource
from passrate_jax.envs import resolve_env
from passrate_jax.envs.base import Environment, EnvTask, Episode
from passrate_jax.envs.episodes import Start, run_episodes
from passrate_jax.envs.replay import Turn, TurnCodec, trajectory_tokens


def task_record(task: EnvTask) -> PromptRecord:
    return PromptRecord(task.task_id, task.prompt, "", {"env": task.env, "level": task.level, "task": task.to_json(),
                                                        "solution": "\n".join(task.solution)})


def task_of(record: PromptRecord) -> EnvTask:
    return EnvTask.from_json(record.metadata["task"])


def env_source(name: str, *, seed: int = 0, level: int | None = None, train_size: int = 0, shuffle: bool = True,
               default_heldout: int = 256, max_level: int = 0) -> PromptSource:
    """Environment ``name``'s tasks as a prompt source: like the built-in tasks, an endless train stream
    or with ``train_size`` > 0 a fixed pool; held-out: the first K tasks of the held-out split."""
    def get(i: int) -> PromptRecord:
        return task_record(resolve_env(name).sample(seed, "train", i, level, max_level))

    def heldout(k: int) -> list[PromptRecord]:
        return [task_record(resolve_env(name).sample(seed, "heldout", i, level, max_level)) for i in range(k)]

    return PromptSource(f"env:{name}", get, train_size or None, heldout, seed=seed, shuffle=shuffle,
                        default_heldout=default_heldout)


def expert_trajectory(env: Environment, task: EnvTask, codec: TurnCodec, max_turns: int | None = None,
                      success_threshold: float = 0.5) -> list[Turn]:
    """The expert's turns, observations from executing them in ``env`` (so they are exactly what the
    policy will see). ValueError when the expert does not solve the task (reward >= ``success_threshold``)
    within the turn limit."""
    episode = Episode(env, task, max_turns)
    episode.reset()
    turns = []
    for action in task.solution:
        ids = codec.action_ids(action)
        outcome = episode.step(action)
        turns.append(Turn(ids, [] if outcome.done else codec.observation_ids(outcome.observation, ids),
                          outcome.error))
        if outcome.done:
            break
    if not (episode.done and episode.reward >= success_threshold):
        raise ValueError(f"{env.name} task {task.prompt!r}: the expert solution does not solve it in "
                         f"{episode.max_turns} turns")
    return turns


def expert_batch(env: Environment, cfg, step: int, tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """Warm-start batch ``step``: expert trajectories of train tasks, a pure function of (data seed, step);
    loss mask 1 on the expert's actions only, as in RL."""
    from passrate_jax.data.formatting import PromptFormat
    from passrate_jax.run.sft import pack_example

    ws, data, codec, fmt = cfg.warm_start, cfg.data, TurnCodec(tokenizer), PromptFormat.from_config(cfg.data)
    rows = []
    for i in range(ws.batch_size):
        task = env.sample(data.seed, "train", step * ws.batch_size + i, data.level or None, data.max_level)
        ids, mask = trajectory_tokens(fmt.encode(task.prompt, tokenizer), [],
                                      expert_trajectory(env, task, codec, data.max_turns or None,
                                                        data.reward_threshold))
        rows.append(pack_example(ids, mask, ws.max_len, tokenizer.pad_id, task.prompt))
    return np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows])


def warm_start(session, progress: bool = True) -> dict:
    """The session's supervised warm start on its environment's expert trajectories (cached)."""
    from passrate_jax.run.sft import run_warm_start

    env = resolve_env(session.cfg.data.env)
    return run_warm_start(session.cfg, session.model, session.tokenizer, progress=progress, log=session.log,
                          batches=lambda step: expert_batch(env, session.cfg, step, session.tokenizer),
                          key=warm_start_key(session.cfg))


def warm_start_key(cfg) -> dict:
    """What besides the model and warm-start settings determines an environment's expert batches: the
    cache key's ``extra`` (``passrate_jax.run.sft.cache_key``). A plugin environment enters by its file
    content, so editing its code re-runs the warm start; a built-in one by its name."""
    from passrate_jax.plugins import fingerprint

    data = cfg.data
    return dict(env=fingerprint(data.env), level=data.level, max_turns=data.max_turns, template=data.template,
                data_seed=data.seed)


def limits(session) -> tuple[int, int, int]:
    """(turn limit, tokens per turn, context length limit) of a session."""
    env = resolve_env(session.cfg.data.env)
    return (session.cfg.data.max_turns or env.max_turns, session.cfg.sampling.max_new_tokens,
            session.sampler.model_cfg.max_position_embeddings)


def evaluate(session, params, *, seed: int = 0, num_samples: int = 0, ks=(1,), batch_contexts: int = 64,
             greedy: bool = True) -> dict:
    """Held-out success of ``params``: greedy episodes (overall and per level), plus pass@k from
    ``num_samples`` sampled episodes per task at the configured temperature. Same keys as
    ``passrate_jax.run.evaluate.evaluate``."""
    from passrate_jax.run.evaluate import summarise

    env, codec = resolve_env(session.cfg.data.env), TurnCodec(session.tokenizer)
    threshold = session.cfg.data.reward_threshold
    max_turns, turn_tokens, max_len = limits(session)
    tasks = [task_of(r) for r in session.heldout]
    if not tasks:
        return {"accuracy": float("nan"), "accuracy_by_level": {}}

    def successes(n: int, cfg, seed_: int) -> np.ndarray:
        out = np.zeros(len(tasks), int)
        per_chunk = max(1, batch_contexts // n)
        for lo in range(0, len(tasks), per_chunk):
            starts = []
            for i in range(lo, min(lo + per_chunk, len(tasks))):
                episode = Episode(env, tasks[i], max_turns)
                episode.reset()
                starts.append(Start(episode, list(session.heldout_tokens[i]), n, context_id=i))
            rollouts = run_episodes(session.sampler, params, starts, codec, seed=seed_, turn_tokens=turn_tokens,
                                    max_len=max_len, cfg=cfg)
            for j, r in enumerate(rollouts):
                out[lo + j // n] += r.reward >= threshold
        return out

    correct = successes(1, dataclasses.replace(session.sampler.cfg, temperature=0.0), seed) if greedy else None
    counts = None
    if num_samples > 0:
        counts = successes(num_samples, dataclasses.replace(session.sampler.cfg,
                                                            temperature=session.cfg.sampling.temperature), seed + 1)
    return summarise(correct, [t.level for t in tasks], counts, num_samples, ks)
