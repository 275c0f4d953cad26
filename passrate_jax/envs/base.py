"""The environment protocol: tasks, pure transitions, and the stateful :class:`Episode` shell over them.

    env = ENVS["calculator"]
    task = env.sample(seed=0, split="train", index=3)       # deterministic, with an expert solution
    episode = Episode(env, task)
    observation = episode.reset()                            # the task statement: the prompt
    outcome = episode.step("add 3 4")                        # StepOutcome("r1=7", done=False, reward=0.0, ...)

An environment is a handful of pure functions over an immutable state (a NamedTuple: comparable with
``==``, hashable, and JSON-serialisable through ``state_json``): ``reset(task) -> (state, observation)``
and ``step(task, state, action) -> Transition``. Purity is what makes Prefix Sampling's replay through
execution possible: feeding the same actions to ``reset`` + ``step`` rebuilds the same state, so a
mismatch between a rebuilt observation and the recorded one proves the environment is not
deterministic (``replay.py``). An action that does not parse, or cannot execute, is an error
*observation* (``Transition.error``); environments never raise on model output and never execute it.

The reward is a function of the final state only (``reward(task, state)``), read when the episode ends:
by the environment (``done``), by the turn limit, or by the policy (end-of-sequence, context length).
It may be a float (the update uses it as is; the allocator sees success = reward >= the run's
``data.reward_threshold``). A ``reward`` that raises or returns a non-finite number costs that episode
only: reward 0, flagged (``Episode.reward_error``, counted as a verifier error), the first traceback logged.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import logging
import math
import random
import traceback
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

SPLITS = ("train", "heldout")
_ID_MASK = (1 << 63) - 1
# Bounds the rejection loop of sample_task, so a level too narrow for a split fails loudly.
_MAX_DRAWS = 20_000
log = logging.getLogger(__name__)
# Environments (by name) whose first failing reward was logged; later failures are only counted.
_REWARD_FAILURE_LOGGED: set[str] = set()


def stable_hash(text: str) -> int:
    """A 63-bit hash that is the same in every process (unlike ``hash``)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big") & _ID_MASK


def _freeze(value: Any) -> Any:
    """JSON lists back to tuples (recursively), so a task read from JSON equals the one written."""
    return tuple(_freeze(v) for v in value) if isinstance(value, (list, tuple)) else value


@dataclasses.dataclass(frozen=True)
class EnvTask:
    """One task of an environment.

    prompt: the first observation, the text the policy starts from (ends with a newline).
    spec: what ``reset`` builds the initial state and ``reward`` the check from (nested tuples of
      ints and strings; environment-specific). solution: an expert's actions, one per turn, which
      solve the task (the supervised warm start trains on them).
    """
    env: str
    task_id: int
    level: int
    prompt: str
    spec: tuple
    solution: tuple[str, ...]

    def to_json(self) -> dict:
        return {"env": self.env, "task_id": self.task_id, "level": self.level, "prompt": self.prompt,
                "spec": self.spec, "solution": list(self.solution)}

    @classmethod
    def from_json(cls, data: dict) -> EnvTask:
        return cls(data["env"], int(data["task_id"]), int(data["level"]), data["prompt"], _freeze(data["spec"]),
                   tuple(data["solution"]))


class Transition(NamedTuple):
    """What one action did: the new state, the observation text (one line, no newline), whether the
    environment ended the episode, and whether the action was malformed or could not execute."""
    state: Any
    observation: str
    done: bool
    error: bool


class Environment(Protocol):
    """What an environment provides (see the module docstring). ``levels``: difficulty levels
    1..levels; ``max_turns``: the default turn limit (assistant turns per episode)."""
    name: str
    levels: int
    max_turns: int

    def sample(self, seed: int, split: str, index: int, level: int | None = None, max_level: int = 0) -> EnvTask: ...
    def reset(self, task: EnvTask) -> tuple[Any, str]: ...
    def step(self, task: EnvTask, state: Any, action: str) -> Transition: ...
    def reward(self, task: EnvTask, state: Any) -> float: ...
    def state_json(self, state: Any) -> Any: ...


def sample_task(name: str, levels: int, draw: Callable[[random.Random, int], EnvTask | None], *, seed: int,
                split: str, index: int, level: int | None = None, max_level: int = 0,
                heldout_fraction: float = 0.1) -> EnvTask:
    """The task at ``index`` of ``split``, a pure function of the arguments; ``draw(rng, level)``
    proposes one (or None). A task is held out iff a hash of its prompt lands in ``heldout_fraction``,
    and draws of the other split are rejected, so train and held-out never share a task. With
    ``level`` None the level is drawn uniformly per index from 1..max_level (0: 1..levels)."""
    if split not in SPLITS:
        raise ValueError(f"split = {split!r}: must be one of {SPLITS}")
    rng = random.Random(stable_hash(f"{name}|{seed}|{split}|{index}"))
    if not 0 <= max_level <= levels:
        raise ValueError(f"max_level = {max_level}: {name} has levels 1..{levels} (0: all)")
    if level is None:
        level = rng.randint(1, max_level or levels)
    if not 1 <= level <= levels:
        raise ValueError(f"level = {level}: {name} has levels 1..{levels}")
    for _ in range(_MAX_DRAWS):
        task = draw(rng, level)
        if task is not None and split_of(name, task.prompt, heldout_fraction) == split:
            return task
    raise RuntimeError(f"{name} level {level} gave no {split} task in {_MAX_DRAWS} draws")


def split_of(name: str, prompt: str, heldout_fraction: float = 0.1) -> str:
    """"heldout" or "train", from the task's prompt alone (never from how it was sampled)."""
    return "heldout" if stable_hash(f"split|{name}|{prompt}") / (_ID_MASK + 1) < heldout_fraction else "train"


@dataclasses.dataclass(frozen=True)
class StepOutcome:
    """One turn as the policy sees it: the observation, whether the episode is over, its reward (the
    final state's, 0 until done), whether the action was an error, and whether the turn limit ended it."""
    observation: str
    done: bool
    reward: float
    error: bool
    truncated: bool = False


class Episode:
    """The stateful shell over a pure environment: ``reset()``, then ``step(action)`` per assistant turn
    until ``done``. It counts turns and error observations and enforces the turn limit. Cheap to
    :meth:`fork` (the state is immutable), which is how one rebuilt prefix seeds a group of rollouts."""

    def __init__(self, env: Environment, task: EnvTask, max_turns: int | None = None):
        self.env, self.task = env, task
        self.max_turns = max_turns or env.max_turns
        self.state: Any = None
        self.turns = self.errors = 0
        self.done = False
        self.reward = 0.0
        self.reward_error = False

    def reset(self) -> str:
        """Start over; returns the first observation (the task statement)."""
        self.state, observation = self.env.reset(self.task)
        self.turns = self.errors = 0
        self.done, self.reward, self.reward_error = False, 0.0, False
        return observation

    def step(self, action: str) -> StepOutcome:
        """Execute one action (the text of an assistant turn, without its newline)."""
        if self.state is None:
            raise RuntimeError("reset() the episode before step()")
        if self.done:
            raise RuntimeError(f"the episode is over (after {self.turns} turns)")
        t = self.env.step(self.task, self.state, action)
        self.state = t.state
        self.turns += 1
        self.errors += int(t.error)
        limited = not t.done and self.turns >= self.max_turns
        if t.done or limited:
            self.finish()
        return StepOutcome(t.observation, self.done, self.reward, bool(t.error), limited)

    def finish(self) -> float:
        """End the episode now (turn limit, or the policy stopped); its reward is the state's (0 with
        ``reward_error`` set when ``env.reward`` raised or gave no finite number)."""
        self.done = True
        self.reward, self.reward_error = _safe_reward(self.env, self.task, self.state)
        return self.reward

    def fork(self) -> Episode:
        """An independent copy at the same point (states are immutable, so a shallow copy suffices)."""
        return copy.copy(self)


def _safe_reward(env: Environment, task: EnvTask, state: Any) -> tuple[float, bool]:
    """(reward, failed): ``env.reward(task, state)`` as a float, or (0.0, True) when it raised or was not
    a finite number; the first failure's traceback is logged."""
    try:
        reward = float(env.reward(task, state))
        if math.isfinite(reward):
            return reward, False
        problem = f"returned {reward}"
    except Exception:  # noqa: BLE001 - a broken reward costs its episode, never the run
        problem = "raised:\n" + traceback.format_exc()
    name = str(getattr(env, "name", env))
    if name not in _REWARD_FAILURE_LOGGED:
        _REWARD_FAILURE_LOGGED.add(name)
        log.warning("environment %s: reward(task %d) %s (reward 0; further failures are only counted as "
                    "verifier_errors)", name, task.task_id, problem)
    return 0.0, True
