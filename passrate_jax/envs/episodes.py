"""Sampling in turns: one sampler call generates the next assistant turn of every live rollout.

Rollouts begin at a :class:`Start`: an episode (reset, or rebuilt after a replayed prefix) and its
context ids. The first turn of a start is one sampler context with ``num_samples`` continuations, so
the shared context (the prompt, or prompt + replayed prefix) is prefilled once (once per step, with the
step's prefix store) and its KV cache rows are shared by the whole group. Every rollout's cache then
stays live (``Sampler.generate_live``): from the second turn on, each rollout appends its observation
to its own cache (``Sampler.extend_live``), so a turn computes the keys and values of its new tokens
only, never the conversation again. A turn ends at "\\n" (added to the sampler's stop tokens), at
end-of-sequence (the policy ends the episode), or at the per-turn budget; the environment's
observation is then appended to the context.

Randomness: a row's sample is a function of (seed, context id, sample index) only (see the sampler).
The first turn uses the start's ``context_id`` and the rollout index, later turns a hash of
(context id, rollout index, turn), so a rollout draws the same tokens whatever batch it lands in.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from passrate_jax.envs.base import Episode, stable_hash
from passrate_jax.envs.replay import Turn, TurnCodec
from passrate_jax.sampling.config import SamplingConfig
from passrate_jax.sampling.prefix_store import PrefixStore
from passrate_jax.sampling.sampler import Context, Sampler


@dataclasses.dataclass
class Start:
    """``num_samples`` rollouts from ``episode`` (not mutated; each rollout forks it), whose context
    (prompt and replayed turns) is ``context``; rollout j has sample index ``first_index + j``."""
    episode: Episode
    context: list[int]
    num_samples: int
    context_id: int
    first_index: int = 0


@dataclasses.dataclass
class Rollout:
    """One trajectory being generated. ``ended``: why it ended, "env" (the environment's done), "limit"
    (turn limit), "quit" (end-of-sequence) or "length" (the context filled the model's positions)."""
    episode: Episode
    context: list[int]
    context_id: int
    sample_index: int
    turns: list[Turn] = dataclasses.field(default_factory=list)
    ended: str = ""
    row: int = -1  # the rollout's row among the sampler's live rows after its last turn

    @property
    def reward(self) -> float:
        return self.episode.reward


def turn_context_id(context_id: int, sample_index: int, turn: int) -> int:
    """The sampler context id of a rollout's later turn: a 31-bit hash (the sampler takes int32 ids)."""
    return stable_hash(f"turn|{context_id}|{sample_index}|{turn}") & 0x7FFFFFFF


def run_episodes(sampler: Sampler, params, starts: Sequence[Start], codec: TurnCodec, *, seed: int,
                 turn_tokens: int, max_len: int, cfg: SamplingConfig | None = None,
                 store: PrefixStore | None = None) -> list[Rollout]:
    """Generate every start's rollouts to the end of their episodes; returns them start by start, in
    sample order.

    ``turn_tokens``: generation budget of one assistant turn. ``max_len``: the most tokens a context
    may hold (the model's positions): a rollout whose context is full ends ("length", reward of its
    state). ``cfg``: sampling controls for this call (e.g. greedy for evaluation). ``store``: the step's
    prefix store (its parameter state replaces ``params``, which may then be None); without one the
    starts' contexts are prefilled for this call alone.
    """
    base = cfg or sampler.cfg
    turn_cfg = dataclasses.replace(base, stop_token_ids=tuple(dict.fromkeys((*base.stop_token_ids,
                                                                               codec.newline_id))))
    own_store = store is None
    store = sampler.kv_store(params) if own_store else store
    rollouts = [[Rollout(s.episode.fork(), list(s.context), s.context_id, s.first_index + j)
                 for j in range(s.num_samples)] for s in starts]
    live, first = None, True
    while True:
        for r in (r for rs in rollouts for r in rs if not r.episode.done and len(r.context) >= max_len):
            end_for_length(r)
        if first:
            # One context per start: its rollouts share the prefill of the common context.
            owners = [[r for r in rs if not r.episode.done] for rs in rollouts]
            contexts = [Context(s.context, num_samples=len(rs), context_id=s.context_id,
                                first_sample_index=s.first_index,
                                max_new_tokens=min(turn_tokens, max_len - len(s.context)))
                        for s, rs in zip(starts, owners) if rs]
            owners = [r for rs in owners for r in rs]
        else:
            owners = [r for rs in rollouts for r in rs if not r.episode.done]
            contexts = [Context(r.context, num_samples=1, first_sample_index=r.sample_index,
                                context_id=turn_context_id(r.context_id, r.sample_index, len(r.turns)),
                                max_new_tokens=min(turn_tokens, max_len - len(r.context))) for r in owners]
        if not contexts:
            break
        if first:
            out, live = sampler.generate_live(contexts, live_len=max_len, seed=seed, cfg=turn_cfg, store=store)
        else:
            out, live = sampler.extend_live(live, [r.row for r in owners], contexts, seed=seed, cfg=turn_cfg)
        first = False
        # Rows come back grouped by context in input order, samples in index order: owners' order.
        for row, r in enumerate(owners):
            r.row = row
            apply_turn(r, out.completion(row), codec)
    if own_store:
        store.release()
    return [r for rs in rollouts for r in rs]


def end_for_length(r: Rollout) -> None:
    """End a rollout whose context fills the model's positions: no room for another turn."""
    r.episode.finish()
    r.ended = "length"


def apply_turn(r: Rollout, action: list[int], codec: TurnCodec) -> None:
    """Execute one generated turn in the rollout's episode and extend its context."""
    turn = Turn(action, [])
    r.turns.append(turn)
    if codec.quits(action):
        r.episode.finish()
        r.ended = "quit"
        return
    outcome = r.episode.step(codec.action_text(action))
    turn.error = outcome.error
    if outcome.done:
        r.ended = "limit" if outcome.truncated else "env"
        return
    turn.observation = codec.observation_ids(outcome.observation, action)
    r.context += action + turn.observation
