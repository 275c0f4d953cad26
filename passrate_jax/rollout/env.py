"""Rollouts of multi-turn episodes: the :class:`passrate_jax.rollout.loop.RolloutBackend` of environment runs.

Same allocator protocol as text tasks; only the meaning of a request's ``Prefix`` differs: the first
``floor(cut_ratio * T)`` assistant turns of the source trajectory, replayed through the environment
(``replay.py``). A replay whose rebuilt observations differ from the recorded ones (the environment is
not deterministic) has no start: the loop reports the request as not observed and the group is never
trained on. The environment's final-state reward is the verifier: the update trains on it as it is (a
float too), the allocator sees success = reward >= ``data.reward_threshold``. Loss mask 1 on the tokens of
generated actions only: the prompt, every replayed turn and every observation are context (mask 0).
The trajectories live in the run's trajectory store (:mod:`.store`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from passrate_jax.allocation import Request
from passrate_jax.envs.base import Environment, EnvTask
from passrate_jax.envs.episodes import Rollout, Start, apply_turn, end_for_length, run_episodes, turn_context_id
from passrate_jax.envs.replay import Turn, TurnCodec, cut_turns, replay, trajectory_tokens, turn_ids
from passrate_jax.rollout.store import WIDTH_BUCKETS, TrajectoryStore
from passrate_jax.rollout.table import RolloutTable
from passrate_jax.rollout.text import StepKV
from passrate_jax.sampling.rows import Context, bucket
from passrate_jax.sampling.sampler import Sampler
from passrate_jax.sampling.slot_pool import Continue, Finished, SlotEngine, SlotPool


class EnvKind:
    """Environment episodes: an item is a :class:`Turn`; a trajectory's loss mask is 1 on its generated
    actions only (the prompt, replayed turns and every observation are context, mask 0)."""

    @staticmethod
    def sequence(prompt, prefix, trajectory):
        return trajectory_tokens(prompt, prefix, trajectory)

    @staticmethod
    def response(prefix, trajectory):
        """The episode after its prompt, as the policy saw it: replayed, then generated turns, each action
        followed by the environment's observation."""
        return turn_ids(list(prefix) + list(trajectory))

    @staticmethod
    def generated(trajectory):
        return sum(len(t.action) for t in trajectory)

    @staticmethod
    def item_to_json(item):
        return item.to_json()

    @staticmethod
    def item_from_json(data):
        return Turn.from_json(data)


class EnvRollouts(StepKV):
    """The environment backend. ``task(i)`` / ``prompt_ids(i)``: prompt i's task and token ids (with
    BOS). ``max_turns``: the turn limit; ``max_len``: the most tokens a context may hold;
    ``turn_tokens``: the budget of one assistant turn; ``success_threshold``: an episode whose reward is at
    or above it is a success for the allocator (``data.reward_threshold``). The trajectories (each
    episode's generated turns) are in ``store``. ``slots``, ``chunk_tokens``: the slot engine's pool and
    chunk (``sampling.engine = slots``), where an episode keeps its row from its first turn to its end."""

    def __init__(self, env: Environment, task: Callable[[int], EnvTask], prompt_ids: Callable[[int], list[int]],
                 codec: TurnCodec, sampler: Sampler | None, *, max_turns: int, max_len: int, turn_tokens: int,
                 pad_id: int, success_threshold: float = 0.5, width_buckets: Sequence[int] = WIDTH_BUCKETS,
                 slots: int = 64, chunk_tokens: int = 8, harvest: str = "auto"):
        self.env, self.task, self.prompt_ids, self.codec, self.sampler = env, task, prompt_ids, codec, sampler
        self.max_turns, self.max_len, self.turn_tokens = max_turns, max_len, turn_tokens
        self.slots, self.chunk_tokens, self.harvest, self._engine = slots, chunk_tokens, harvest, None
        self.success_threshold = float(success_threshold)
        self.store = TrajectoryStore(EnvKind(), prompt_ids, pad_id=pad_id, width_buckets=width_buckets)

    # ------------------------------------------------------------------ a round
    def contexts(self, requests: Sequence[Request]) -> list[Start | None]:
        """Where each request's rollouts begin; None when the group's start cannot be rebuilt (its replayed
        observations differ from the recorded ones: the environment is not deterministic)."""
        return [self._start(r) for r in requests]

    def _start(self, request: Request) -> Start | None:
        if request.group_key not in self.store.groups:
            prefix: list[Turn] = []
            if request.prefix is not None:
                src = self.store.groups[request.prefix.source_group].trajectories[request.prefix.source_rollout]
                prefix = [Turn(list(t.action), list(t.observation), t.error)
                          for t in src[:cut_turns(len(src), request.prefix.cut_ratio)]]
            self.store.open(request.group_key, request.prompt_id, prefix)
        g = self.store.groups[request.group_key]
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

    def stream(self, params, seed: int, lagged: bool = True) -> EnvStream:
        """The step's decode slots (the slot engine, built on first use): rows of the model's positions,
        a turn ending at a newline as in round mode."""
        if self._engine is None:
            cfg = self.sampler.cfg
            turn_cfg = dataclasses.replace(cfg, stop_token_ids=tuple(dict.fromkeys((*cfg.stop_token_ids,
                                                                                   self.codec.newline_id))))
            length = max(self.sampler.store_capacity[1], bucket(self.max_len, cfg.context_buckets))
            self._engine = SlotEngine(self.sampler, rows=self.slots, chunk=self.chunk_tokens, length=length,
                                      cfg=turn_cfg)
        return EnvStream(self._engine, self.step_store(params), seed, self.codec, max_len=self.max_len,
                         turn_tokens=self.turn_tokens, lagged=lagged)

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

    def record(self, requests: Sequence[Request], rollouts: Sequence[list[Rollout]], table: RolloutTable,
               rows: Sequence[np.ndarray]) -> None:
        """Keep each episode's turns, referring to its table row (the update trains on its reward, possibly
        in a later step)."""
        self.store.add(requests, [[r.turns for r in rs] for rs in rollouts], table, rows)

    def close_step(self, table: RolloutTable) -> dict:
        """The prefix store's counters, ``env/replay_rejected`` (groups whose replay was rejected this
        step), ``env/error_observations`` and ``env/turns_mean`` (mean episode length in assistant turns)
        of the step's episodes."""
        seen = table["observed"].astype(bool)
        turns = table["turns"][seen]
        return {**super().close_step(table), "env/replay_rejected": len(table.unobserved_groups()),
                "env/error_observations": int(table["action_errors"][seen].sum()),
                "env/turns_mean": float(np.mean(turns)) if len(turns) else float("nan")}


class EnvStream:
    """Episodes on the slot engine, as the event loop's ``RolloutStream``: a start's rollouts are queued as
    one context (its prefill shared), and each keeps its row for the whole episode. When a turn is
    harvested, the environment steps at once (``apply_turn``, as in round mode); an episode that goes on
    continues in its row (its last token and the observation appended, the next turn keyed as round
    mode keys it), one that ended is delivered as a :class:`Rollout`."""

    def __init__(self, engine: SlotEngine, store, seed: int, codec: TurnCodec, *, max_len: int, turn_tokens: int,
                 lagged: bool = True):
        self.codec, self.max_len, self.turn_tokens = codec, max_len, turn_tokens
        self.pool: SlotPool = engine.pool(store, seed=seed, on_turn=self._on_turn, lagged=lagged)
        self.rollouts: dict[tuple[object, int], Rollout] = {}
        self.ready: list[tuple[object, int]] = []  # ended before their first turn (a full context)

    @property
    def idle(self) -> bool:
        return not self.ready and self.pool.idle

    @property
    def free(self) -> int:
        return self.pool.free

    def add(self, start: Start, tag) -> None:
        keys = [(tag, start.first_index + j) for j in range(start.num_samples)]
        for key in keys:
            self.rollouts[key] = Rollout(start.episode.fork(), list(start.context), start.context_id, key[1])
        if len(start.context) >= self.max_len:  # no room for a turn: round mode ends it the same way
            for key in keys:
                end_for_length(self.rollouts[key])
            self.ready += keys
            return
        self.pool.add(Context(start.context, num_samples=start.num_samples, context_id=start.context_id,
                              first_sample_index=start.first_index,
                              max_new_tokens=min(self.turn_tokens, self.max_len - len(start.context))), tag)

    def advance(self) -> list[tuple[object, int, Rollout]]:
        keys, self.ready = self.ready, []
        keys += [(f.tag, f.sample_index) for f in self.pool.advance()]
        return [(tag, index, self.rollouts.pop((tag, index))) for tag, index in keys]

    def abort(self) -> list[tuple[object, int, int]]:
        dropped = [(tag, index, 0) for tag, index in self.ready] + self.pool.abort()
        self.ready, self.rollouts = [], {}
        return dropped

    def length(self, rollout: Rollout) -> int:
        return sum(len(t.action) for t in rollout.turns)

    def counters(self) -> dict:
        return self.pool.counters()

    def _on_turn(self, turn: Finished) -> Continue | None:
        """Step the episode with the harvested turn; what its row appends next, or None when it ended."""
        r = self.rollouts[(turn.tag, turn.sample_index)]
        apply_turn(r, turn.ids, self.codec)
        if r.episode.done:
            return None
        if len(r.context) >= self.max_len:
            end_for_length(r)
            return None
        # Counted as round mode counts a turn appended to a live row (the step's prefix-store counters).
        self.pool.store.note_context(tuple(r.context), len(turn.ids) + len(r.turns[-1].observation))
        return Continue([turn.ids[-1], *r.turns[-1].observation],
                        turn_context_id(r.context_id, r.sample_index, len(r.turns)),
                        min(self.turn_tokens, self.max_len - len(r.context)))
