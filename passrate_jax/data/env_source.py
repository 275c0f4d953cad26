"""An environment's tasks as a prompt source, so the rest of the trainer (allocator, selection, the
session's prompt encoding) treats them like any other prompts.

A task travels in a :class:`PromptRecord`: the prompt is its first observation and the metadata hold
the whole task (``metadata["task"]``, JSON). Here in ``data/`` (above ``envs/``, which imports nothing of
``data/``) so that ``configured.make_source`` can build every kind of source without reaching up.
"""

from __future__ import annotations

from passrate_jax.data.sources import PromptRecord, PromptSource
from passrate_jax.envs import resolve_env
from passrate_jax.envs.base import EnvTask


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
