"""Rollouts of multi-turn episodes: the :class:`passrate_jax.rollout.loop.RolloutBackend` of environment runs.

Same allocator protocol as text tasks; only the meaning of a request's ``Prefix`` differs: the first
``floor(cut_ratio * T)`` assistant turns of the source trajectory, replayed through the environment
(``replay.py``). A replay whose rebuilt observations differ from the recorded ones (the environment is
not deterministic) has no start: the loop reports the request as not observed and the group is never
trained on. The environment's final-state reward is the verifier: the update trains on it as it is (a
float too), the allocator sees success = reward >= ``data.reward_threshold``. Loss mask 1 on the tokens of
generated actions only: the prompt, every replayed turn and every observation are context (mask 0).
The trajectories are JSON-serialisable, so a checkpoint keeps those that later steps may replay.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from passrate_jax.allocation import Request, TrainGroup
from passrate_jax.envs.base import Environment, EnvTask
from passrate_jax.envs.episodes import Rollout, Start, run_episodes
from passrate_jax.envs.replay import Turn, TurnCodec, cut_turns, replay, trajectory_tokens, turn_ids
from passrate_jax.rollout.text import WIDTH_BUCKETS, StepKV, pack_rows
from passrate_jax.sampling.sampler import Sampler


@dataclasses.dataclass
class EnvGroup:
    """One group: the prompt index, the replayed turns (empty for a fresh group), whether its start
    could not be rebuilt faithfully (``rejected``: no rollouts were generated), and each rollout's
    generated turns and final-state reward by rollout index within the group (a trained group may hold
    episodes of earlier steps, so the rewards the update trains on live with the trajectories)."""
    prompt: int
    prefix: list[Turn]
    rejected: bool = False
    turns: dict[int, list[Turn]] = dataclasses.field(default_factory=dict)
    rewards: dict[int, float] = dataclasses.field(default_factory=dict)


class EnvRollouts(StepKV):
    """The environment backend. ``task(i)`` / ``prompt_ids(i)``: prompt i's task and token ids (with
    BOS). ``max_turns``: the turn limit; ``max_len``: the most tokens a context may hold;
    ``turn_tokens``: the budget of one assistant turn; ``success_threshold``: an episode whose reward is at
    or above it is a success for the allocator (``data.reward_threshold``)."""

    def __init__(self, env: Environment, task: Callable[[int], EnvTask], prompt_ids: Callable[[int], list[int]],
                 codec: TurnCodec, sampler: Sampler | None, *, max_turns: int, max_len: int, turn_tokens: int,
                 pad_id: int, success_threshold: float = 0.5, width_buckets: Sequence[int] = WIDTH_BUCKETS):
        self.env, self.task, self.prompt_ids, self.codec, self.sampler = env, task, prompt_ids, codec, sampler
        self.max_turns, self.max_len, self.turn_tokens, self.pad_id = max_turns, max_len, turn_tokens, pad_id
        self.success_threshold = float(success_threshold)
        self.width_buckets = tuple(width_buckets)
        self.groups: dict[int, EnvGroup] = {}

    # ------------------------------------------------------------------ a round
    def contexts(self, requests: Sequence[Request]) -> list[Start | None]:
        """Where each request's rollouts begin; None when the group's start cannot be rebuilt (its replayed
        observations differ from the recorded ones: the environment is not deterministic)."""
        return [self._start(r) for r in requests]

    def _start(self, request: Request) -> Start | None:
        g = self.groups.get(request.group_key)
        if g is None:
            prefix: list[Turn] = []
            if request.prefix is not None:
                src = self.groups[request.prefix.source_group].turns[request.prefix.source_rollout]
                prefix = [Turn(list(t.action), list(t.observation), t.error)
                          for t in src[:cut_turns(len(src), request.prefix.cut_ratio)]]
            g = self.groups[request.group_key] = EnvGroup(prompt=request.prompt_id, prefix=prefix)
        if not g.rejected:
            rebuilt = replay(self.env, self.task(g.prompt), g.prefix, self.codec, self.max_turns)
            if not rebuilt.rejected:
                return Start(rebuilt.episode, list(self.prompt_ids(g.prompt)) + turn_ids(g.prefix),
                             request.num_rollouts, request.group_key, request.first_index)
            g.rejected = True
        return None

    def generate(self, starts: Sequence[Start], params, seed: int) -> list[list[Rollout]]:
        """Every start's episodes, turn by turn (``passrate_jax.envs.episodes.run_episodes``): the starts
        from the step's prefix store, every later turn appended to its episode's live cache."""
        flat = run_episodes(self.sampler, params, starts, self.codec, seed=seed, turn_tokens=self.turn_tokens,
                            max_len=self.max_len, store=self.step_store(params))
        bounds = np.cumsum([0] + [s.num_samples for s in starts])
        return [flat[lo:hi] for lo, hi in zip(bounds[:-1], bounds[1:])]

    def score(self, requests: Sequence[Request], rollouts: Sequence[list[Rollout]]) -> dict[str, np.ndarray]:
        """The environment's final-state rewards: ``score`` as they are, ``reward`` the allocator's success
        bit (score >= ``success_threshold``); ``verifier_error`` where ``reward(task, state)`` raised or
        was not a finite number (reward 0). Also episodes cut off by the turn limit or the context length
        (``truncated``), each episode's length in assistant turns (replayed ones and a final
        end-of-sequence included) and its error observations (malformed or failed actions)."""
        flat = [r for rs in rollouts for r in rs]
        scores = np.array([r.reward for r in flat], np.float32)
        return {"reward": (scores >= self.success_threshold).astype(np.int64), "score": scores,
                "truncated": np.array([r.ended in ("limit", "length") for r in flat], bool),
                "verifier_error": np.array([r.episode.reward_error for r in flat], bool),
                "turns": np.array([r.episode.turns + (r.ended == "quit") for r in flat], np.int64),
                "action_errors": np.array([sum(t.error for t in r.turns) for r in flat], np.int64)}

    def record(self, requests: Sequence[Request], rollouts: Sequence[list[Rollout]],
               scores: dict[str, np.ndarray] | None = None) -> None:
        """Keep each episode's turns and its reward (the update trains on it, possibly in a later step)."""
        for req, rs in zip(requests, rollouts):
            g = self.groups[req.group_key]
            for j, r in enumerate(rs):
                g.turns[req.first_index + j] = r.turns
                g.rewards[req.first_index + j] = float(r.reward)

    # ------------------------------------------------------------------ after the rounds
    def batch(self, groups: Sequence[TrainGroup], rows: int) -> dict[str, np.ndarray]:
        """The update batch of the trained groups (the arrays of ``passrate_jax.rollout.text.pack_rows``),
        with loss masks from :func:`trajectory_tokens`. Rejected groups must not be among ``groups``."""
        seqs, masks, rewards, gids = [], [], [], []
        for gi, tg in enumerate(groups):
            g = self.groups[tg.group_key]
            if g.rejected:
                raise ValueError(f"group {tg.group_key}: its replay was rejected, it has no trajectories to train on")
            for i, success in enumerate(tg.rewards):
                ids, mask = trajectory_tokens(self.prompt_ids(g.prompt), g.prefix, g.turns[i])
                seqs.append(ids)
                masks.append(mask)
                # The episode's reward, not the allocator's success bit (a checkpoint from before rewards
                # were kept has only the bit).
                rewards.append(g.rewards.get(i, float(success)))
                gids.append(gi)
        return pack_rows(seqs, masks, rewards, gids, num_groups=len(groups), rows=rows,
                         width_buckets=self.width_buckets, pad_id=self.pad_id)

    def metrics(self, table) -> dict:
        """``env/replay_rejected`` (groups whose replay was rejected this step), ``env/error_observations``
        and ``env/turns_mean`` (mean episode length in assistant turns) of the step's episodes."""
        seen = table["observed"].astype(bool)
        turns = table["turns"][seen]
        return {"env/replay_rejected": len(table.unobserved_groups()),
                "env/error_observations": int(table["action_errors"][seen].sum()),
                "env/turns_mean": float(np.mean(turns)) if len(turns) else float("nan")}

    def response(self, group_key: int, index: int) -> list[int]:
        """One episode after its prompt, as the policy saw it: the replayed turns, then the generated ones,
        each action followed by the environment's observation."""
        g = self.groups[group_key]
        return turn_ids(g.prefix + g.turns[index])

    def generated_tokens(self, group_key: int, index: int) -> int:
        """Tokens the policy generated in one episode: its actions (replayed turns and observations are
        not generated)."""
        return sum(len(t.action) for t in self.groups[group_key].turns[index])

    # ------------------------------------------------------------------ the checkpointed trajectories
    def retain(self, keys) -> None:
        """Free every group not in ``keys``."""
        self.groups = {k: g for k, g in self.groups.items() if k in keys}

    def to_json(self) -> dict:
        return {str(k): {"prompt": g.prompt, "prefix": [t.to_json() for t in g.prefix], "rejected": g.rejected,
                         "turns": {str(i): [t.to_json() for t in ts] for i, ts in g.turns.items()},
                         "rewards": {str(i): r for i, r in g.rewards.items()}}
                for k, g in self.groups.items()}

    def load_json(self, data: dict) -> None:
        """Inverse of :meth:`to_json`."""
        self.groups = {int(k): EnvGroup(
            prompt=int(v["prompt"]), prefix=[Turn.from_json(t) for t in v["prefix"]], rejected=bool(v["rejected"]),
            turns={int(i): [Turn.from_json(t) for t in ts] for i, ts in v["turns"].items()},
            rewards={int(i): float(r) for i, r in v.get("rewards", {}).items()}) for k, v in data.items()}
