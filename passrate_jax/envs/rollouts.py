"""Host-side bookkeeping of multi-turn rollouts: the trajectory store (the turn-based counterpart of
``passrate_jax.rollouts.RolloutStore``), where an allocator request's rollouts start, and the padded
update batch with its loss masks.

Same allocator protocol as text tasks; only the meaning of a request's ``Prefix`` differs: the first
``floor(cut_ratio * T)`` assistant turns of the source trajectory, replayed through the environment
(``replay.py``). Loss mask 1 on the tokens of generated actions only: the prompt, every replayed turn
and every observation are context (mask 0). The store is JSON-serialisable, so a checkpoint keeps the
trajectories that later steps may replay.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from passrate_jax.allocation import Request, TrainGroup
from passrate_jax.envs.base import Environment, EnvTask
from passrate_jax.envs.episodes import Rollout, Start
from passrate_jax.envs.replay import Turn, TurnCodec, cut_turns, replay
from passrate_jax.rollouts import pack_rows


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


@dataclasses.dataclass
class EnvGroupRecord:
    """One group: the prompt index, the replayed turns (empty for a fresh group), whether its start
    could not be rebuilt faithfully (``rejected``: no rollouts were generated), and each rollout's
    generated turns and reward by rollout index within the group."""
    prompt: int
    prefix: list[Turn]
    rejected: bool = False
    turns: dict[int, list[Turn]] = dataclasses.field(default_factory=dict)
    rewards: dict[int, int] = dataclasses.field(default_factory=dict)


class EnvRolloutStore:
    """Trajectories by group key for an environment run.

    ``task(i)`` / ``prompt_ids(i)``: prompt i's task and token ids (with BOS). ``max_turns``: the
    turn limit; ``max_len``: the most tokens a context may hold. ``rejected`` counts replays rejected
    for non-determinism since the counter was last reset by the caller.
    """

    def __init__(self, env: Environment, task: Callable[[int], EnvTask], prompt_ids: Callable[[int], list[int]],
                 codec: TurnCodec, *, max_turns: int, max_len: int):
        self.env, self.task, self.prompt_ids, self.codec = env, task, prompt_ids, codec
        self.max_turns, self.max_len = max_turns, max_len
        self.groups: dict[int, EnvGroupRecord] = {}
        self.rejected = 0

    def start(self, request: Request) -> Start | None:
        """Where the request's rollouts begin, or None when the group's start state cannot be rebuilt
        (its replayed observations differ from the recorded ones: the environment is not deterministic)."""
        g = self.groups.get(request.group_key)
        if g is None:
            prefix: list[Turn] = []
            if request.prefix is not None:
                src = self.groups[request.prefix.source_group].turns[request.prefix.source_rollout]
                prefix = [Turn(list(t.action), list(t.observation), t.error)
                          for t in src[:cut_turns(len(src), request.prefix.cut_ratio)]]
            g = self.groups[request.group_key] = EnvGroupRecord(prompt=request.prompt_id, prefix=prefix)
        if not g.rejected:
            rebuilt = replay(self.env, self.task(g.prompt), g.prefix, self.codec, self.max_turns)
            if not rebuilt.rejected:
                return Start(rebuilt.episode, list(self.prompt_ids(g.prompt)) + turn_ids(g.prefix),
                             request.num_rollouts, request.group_key, request.first_index)
            g.rejected = True
            self.rejected += 1
        return None

    def record(self, request: Request, rollouts: Sequence[Rollout] | None) -> list[int]:
        """Store a request's rollouts (None: its start was rejected, nothing was generated) and return
        their rewards, binarised; a rejected request's are all 0."""
        g = self.groups[request.group_key]
        rewards = [int(r.reward >= 0.5) for r in rollouts] if rollouts is not None else [0] * request.num_rollouts
        for j, reward in enumerate(rewards):
            g.turns[request.first_index + j] = rollouts[j].turns if rollouts is not None else []
            g.rewards[request.first_index + j] = reward
        return rewards

    def retain(self, keys) -> None:
        """Free every group not in ``keys``."""
        self.groups = {k: g for k, g in self.groups.items() if k in keys}

    def to_json(self) -> dict:
        return {str(k): {"prompt": g.prompt, "prefix": [t.to_json() for t in g.prefix], "rejected": g.rejected,
                         "turns": {str(i): [t.to_json() for t in ts] for i, ts in g.turns.items()},
                         "rewards": {str(i): r for i, r in g.rewards.items()}} for k, g in self.groups.items()}

    def load_json(self, data: dict) -> None:
        self.groups = {int(k): EnvGroupRecord(
            prompt=int(v["prompt"]), prefix=[Turn.from_json(t) for t in v["prefix"]], rejected=bool(v["rejected"]),
            turns={int(i): [Turn.from_json(t) for t in ts] for i, ts in v["turns"].items()},
            rewards={int(i): int(r) for i, r in v["rewards"].items()}) for k, v in data.items()}


def env_batch_arrays(store: EnvRolloutStore, groups: Sequence[TrainGroup], *, rows: int,
                     width_buckets: Sequence[int], pad_id: int) -> dict:
    """The update batch of the trained groups (the arrays of ``passrate_jax.rollouts.batch_arrays``),
    with loss masks from :func:`trajectory_tokens`. Rejected groups must not be among ``groups``."""
    seqs, masks, rewards, gids = [], [], [], []
    for gi, tg in enumerate(groups):
        g = store.groups[tg.group_key]
        if g.rejected:
            raise ValueError(f"group {tg.group_key}: its replay was rejected, it has no trajectories to train on")
        for i in range(len(tg.rewards)):
            ids, mask = trajectory_tokens(store.prompt_ids(g.prompt), g.prefix, g.turns[i])
            seqs.append(ids)
            masks.append(mask)
            rewards.append(float(tg.rewards[i]))
            gids.append(gi)
    return pack_rows(seqs, masks, rewards, gids, num_groups=len(groups), rows=rows, width_buckets=width_buckets,
                     pad_id=pad_id)
