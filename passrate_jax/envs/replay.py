"""Turn records, the assistant-turn cut of Prefix Sampling, replay through execution, and the expert's
trajectory (the supervised warm start of environment runs, ``passrate_jax/run/warm_start.py``).

A trajectory in an environment is the prompt (the first observation) followed by turns; a turn is the
assistant's generated ids (its action, ending in the turn-end token "\\n") and the ids of the
observation the environment answered with (context for the next turn, loss mask 0). Prefix Sampling
replays the first k of a source trajectory's T turns, k = floor(r * T) clipped to [1, T - 1]; the
state after them is not pasted as text but rebuilt by feeding the recorded actions through the
environment's own parser and executor. When a rebuilt observation differs from the recorded one the
environment is not deterministic and the state would be wrong: the replay is rejected (and counted by
the caller) instead of trained on.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from passrate_jax.envs.base import Environment, EnvTask, Episode


@dataclasses.dataclass
class Turn:
    """One assistant turn: ``action`` ids as generated (turn-end or end-of-sequence token included;
    loss mask 1), ``observation`` ids the environment appended after it (mask 0; empty after the last
    turn), and whether the action was an error."""
    action: list[int]
    observation: list[int]
    error: bool = False

    def to_json(self) -> list:
        return [self.action, self.observation, int(self.error)]

    @classmethod
    def from_json(cls, data: Sequence) -> Turn:
        return cls([int(i) for i in data[0]], [int(i) for i in data[1]], bool(data[2]))


class TurnCodec:
    """Between token ids and the texts an environment reads and writes.

    The turn-end token is "\\n" (it must be a single token). A generated action is the text of its ids
    without the turn-end / end-of-sequence token; an action that ran out of budget before its "\\n"
    gets the line break at the start of the observation, so observations always start on a new line.
    """

    def __init__(self, tokenizer):
        ids = tokenizer.encode("\n")
        if len(ids) != 1:
            raise ValueError(f"multi-turn environments end a turn at '\\n', which this tokenizer encodes as {ids}")
        self.tokenizer = tokenizer
        self.newline_id = ids[0]
        self.eos_id = tokenizer.eos_id

    def quits(self, action_ids: Sequence[int]) -> bool:
        """The policy ended the episode itself (end-of-sequence instead of an action)."""
        return bool(action_ids) and action_ids[-1] == self.eos_id

    def action_text(self, action_ids: Sequence[int]) -> str:
        ids = list(action_ids)
        if ids and ids[-1] in (self.newline_id, self.eos_id):
            ids = ids[:-1]
        # Ids beyond the tokenizer (a padded embedding) have no text; they make the action malformed.
        return self.tokenizer.decode([i for i in ids if 0 <= i < self.tokenizer.vocab_size])

    def action_ids(self, text: str) -> list[int]:
        """An expert action as the policy would write it, turn-end token included."""
        return self.tokenizer.encode(text) + [self.newline_id]

    def observation_ids(self, text: str, action_ids: Sequence[int]) -> list[int]:
        lead = "" if action_ids and action_ids[-1] == self.newline_id else "\n"
        return self.tokenizer.encode(lead + text + "\n")


def turn_ids(turns: Sequence[Turn]) -> list[int]:
    """The context ids of ``turns``: each action followed by its observation."""
    return [i for t in turns for i in t.action + t.observation]


def trajectory_tokens(prompt_ids: Sequence[int], prefix: Sequence[Turn],
                      turns: Sequence[Turn]) -> tuple[list[int], list[int]]:
    """A trajectory's token ids and loss mask: 1 exactly on the generated actions' tokens; the prompt,
    the replayed turns (actions included) and all observations are 0."""
    ids = list(prompt_ids) + turn_ids(prefix)
    mask = [0] * len(ids)
    for t in turns:
        ids += t.action + t.observation
        mask += [1] * len(t.action) + [0] * len(t.observation)
    return ids, mask


def cut_turns(num_turns: int, ratio: float) -> int:
    """Turns of a T-turn source trajectory that a replay keeps: floor(ratio * T), at least 1 and at most
    T - 1 (a prefix never holds the final action); 0 when T < 2 (nothing can be replayed)."""
    if num_turns < 2:
        return 0
    return min(max(int(math.floor(ratio * num_turns)), 1), num_turns - 1)


@dataclasses.dataclass
class Replay:
    """The outcome of a replay: the rebuilt episode (positioned after the replayed turns; None when
    rejected) and the first turn whose rebuilt observation differed (0: the first observation)."""
    episode: Episode | None
    mismatch_turn: int | None = None

    @property
    def rejected(self) -> bool:
        return self.episode is None


def replay(env: Environment, task: EnvTask, turns: Sequence[Turn], codec: TurnCodec,
           max_turns: int | None = None) -> Replay:
    """Rebuild the state after ``turns`` by executing their actions from ``reset``; every rebuilt
    observation (and error flag) must equal the recorded one, and no replayed turn may end the episode."""
    episode = Episode(env, task, max_turns)
    if episode.reset() + "\n" != task.prompt:
        return Replay(None, 0)
    for t, turn in enumerate(turns, 1):
        if codec.quits(turn.action):
            return Replay(None, t)
        outcome = episode.step(codec.action_text(turn.action))
        if (outcome.done or outcome.error != turn.error
                or codec.observation_ids(outcome.observation, turn.action) != turn.observation):
            return Replay(None, t)
    return Replay(episode)


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
