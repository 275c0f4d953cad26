"""Rollouts of text answers: the :class:`passrate_jax.rollout.loop.RolloutBackend` of prompt-and-verifier tasks.

A request becomes one sampler context (the prompt, plus the replayed prefix of a Prefix Sampling
re-rollout group); each answer is decoded and scored by the run's verifier; the trajectories (the
generated ids, by group key and rollout index) are kept for later replays and for the update batch,
whose loss mask covers the generated ids only (prompt and replayed prefix are context).

Everything here is plain Python / numpy on the host; the arrays it builds go to the jitted sampler
and update. The trajectories are JSON-serialisable so a checkpoint keeps those that later steps may
replay (the allocator names them in ``StepResult.retained_keys``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from passrate_jax.allocation import Request, TrainGroup
from passrate_jax.sampling.prefix_store import PrefixStore
from passrate_jax.sampling.sampler import Context, Sampler, bucket
from passrate_jax.sampling.slot_pool import SlotEngine, SlotPool

# Padded widths (prompt + response tokens) of the update batch: a run compiles one update per width used.
WIDTH_BUCKETS = (64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192)


def cut_prefix(response: Sequence[int], ratio: float, newline_id: int | None = None,
               granularity: str = "tokens") -> list[int]:
    """The first ``ratio`` of a response's tokens, at least 1 and at most ``len - 1`` (a prefix never
    holds the whole answer or its end token). When a line break lies within the last 10% of the cut,
    the cut snaps back to just after it, so the replayed prefix ends on a whole step (DESIGN 2.4).

    ``granularity`` "lines": the first round(ratio * L) (half up) of the response's L lines instead, at
    least 1 and at most L - 1, each line ending on its ``newline_id`` (the last line is what follows the
    last line break, if anything); a response of one line is cut by tokens."""
    n = len(response)
    if n < 2:
        return []
    if granularity == "lines" and newline_id is not None:
        ends = [j + 1 for j, tok in enumerate(response) if tok == newline_id]  # where each full line ends
        lines = len(ends) + (not ends or ends[-1] < n)
        if lines > 1:
            k = min(max(int(math.floor(ratio * lines + 0.5)), 1), lines - 1)
            return list(response[:ends[k - 1]])
    elif granularity not in ("tokens", "lines"):
        raise ValueError(f"granularity = {granularity!r}: must be 'tokens' or 'lines'")
    cut = min(max(int(math.floor(ratio * n)), 1), n - 1)
    if newline_id is not None:
        window = max(1, math.ceil(0.1 * cut))
        for j in range(cut - 1, max(cut - 1 - window, -1), -1):
            if response[j] == newline_id:
                cut = j + 1
                break
    return list(response[:cut])


def score_each(verify: Callable[[list[int], list[str]], np.ndarray], prompts: list[int],
               texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Rewards float32 [n] of ``texts`` (answers to prompt indices ``prompts``) and bool [n], True where
    the verifier raised. The answers are scored in one call (so a process-pool verifier works in
    parallel); should that call raise, each answer is scored alone, so an exception costs only the
    answer that raised it (reward 0): a verifier never stops training nor zeroes other answers."""
    n = len(texts)
    if n == 0:
        return np.zeros(0, np.float32), np.zeros(0, bool)

    def call(p, t) -> np.ndarray:
        out = np.asarray(verify(p, t), np.float32).reshape(-1)
        if out.shape != (len(t),):
            raise ValueError(f"the verifier returned {out.shape[0]} rewards for {len(t)} answers")
        return out

    try:
        return call(prompts, texts), np.zeros(n, bool)
    except Exception:  # noqa: BLE001 - find the answers that raise; the others keep their rewards
        rewards, errors = np.zeros(n, np.float32), np.zeros(n, bool)
        for i in range(n):
            try:
                rewards[i] = call(prompts[i:i + 1], texts[i:i + 1])[0]
            except Exception:  # noqa: BLE001 - reward 0 and a counted error, never a crash
                errors[i] = True
        return rewards, errors


class StepKV:
    """A backend's step-scoped prefix store (the ``open_step`` / ``close_step`` of the rollout protocol):
    every round of a step samples under one parameter state, so each distinct context is prefilled once
    per step, and its KV rows are freed when the step's rounds are over (before the update)."""
    sampler: Sampler | None
    _kv: tuple[object, PrefixStore] | None = None  # (the step's params as given, their store)

    def open_step(self, params) -> None:
        self._kv = None if self.sampler is None else (params, self.sampler.kv_store(params))

    def close_step(self) -> dict[str, int]:
        """Free the step's KV rows; its ``prefill_tokens``, ``context_tokens`` and ``unshared_prefill_tokens``
        (``PrefixStore``'s counters; empty: no step open)."""
        kv, self._kv = self._kv, None
        if kv is None:
            return {}
        kv[1].release()
        return {"prefill_tokens": kv[1].prefill_tokens, "context_tokens": kv[1].context_tokens,
                "unshared_prefill_tokens": kv[1].unshared_tokens}

    def step_store(self, params) -> PrefixStore:
        """The open step's store, whose parameters ``params`` must be; outside a step, a store for one call."""
        if self._kv is None:
            return self.sampler.kv_store(params)
        if params is not self._kv[0]:
            raise ValueError("generate within a step must sample with the parameters the step was opened with")
        return self._kv[1]


class Completion(NamedTuple):
    """One generated answer: its ids (stop token included) and whether it ended on a stop token."""
    ids: list[int]
    stopped: bool


@dataclasses.dataclass
class TextGroup:
    """One group's trajectories: the prompt index, the replayed prefix (empty for a fresh group) and,
    by rollout index within the group, each rollout's generated ids and its reward as scored (what the
    update trains on; the allocator's success bits are ``TrainGroup.rewards``). A trained group may hold
    rollouts of earlier steps (Pilot-Commit), so the scored rewards live here, with the trajectories,
    not only in a step's table."""
    prompt: int
    prefix: list[int]
    completions: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    rewards: dict[int, float] = dataclasses.field(default_factory=dict)


class TextRollouts(StepKV):
    """The text backend. ``prompt_ids(i)``: prompt i's token ids (with BOS); ``decode``: ids -> text;
    ``verify(prompt_indices, texts)``: one reward per answer; ``max_new_tokens``: an answer's budget
    (prefix included); ``newline_id``: where a Prefix Sampling cut may snap to; ``prefix_granularity``:
    tokens or lines (:func:`cut_prefix`); ``success_threshold``: a reward at or above it is a success for
    the allocator (``data.reward_threshold``)."""

    def __init__(self, sampler: Sampler, prompt_ids: Callable[[int], Sequence[int]], *,
                 decode: Callable[[list[int]], str], verify: Callable[[list[int], list[str]], np.ndarray],
                 max_new_tokens: int, pad_id: int, newline_id: int | None = None, prefix_granularity: str = "tokens",
                 success_threshold: float = 0.5, width_buckets: Sequence[int] = WIDTH_BUCKETS,
                 slots: int = 64, chunk_tokens: int = 8, lookahead: int = 0, longest_prompt: int = 1):
        self.sampler, self.prompt_ids, self.decode, self.verify = sampler, prompt_ids, decode, verify
        self.slots, self.chunk_tokens, self.lookahead, self._engine = slots, chunk_tokens, lookahead, None
        # The engine's rows hold the longest prompt and a whole budget (a replayed prefix is part of it).
        self.row_length = longest_prompt + max_new_tokens
        self._decode_steps = (0, 0)  # the sampler's decode counters when the step opened
        self.max_new_tokens, self.pad_id, self.newline_id = max_new_tokens, pad_id, newline_id
        self.prefix_granularity = prefix_granularity
        self.success_threshold, self.width_buckets = float(success_threshold), tuple(width_buckets)
        self.groups: dict[int, TextGroup] = {}

    # ------------------------------------------------------------------ a round
    def contexts(self, requests: Sequence[Request]) -> list[Context]:
        """Sampler contexts for one round of requests. A group's randomness is keyed by its group key
        and rollout index, so a row samples the same tokens whatever batch it lands in."""
        out = []
        for r in requests:
            g = self.groups.get(r.group_key)
            if g is None:
                prefix = []
                if r.prefix is not None:
                    src = self.groups[r.prefix.source_group].completions[r.prefix.source_rollout]
                    prefix = cut_prefix(src, r.prefix.cut_ratio, self.newline_id, self.prefix_granularity)
                g = self.groups[r.group_key] = TextGroup(prompt=r.prompt_id, prefix=prefix)
            out.append(Context(prompt_ids=self.prompt_ids(g.prompt), prefix_ids=g.prefix,
                               num_samples=r.num_rollouts, context_id=r.group_key,
                               first_sample_index=r.first_index,
                               max_new_tokens=max(1, self.max_new_tokens - len(g.prefix))))
        return out

    def generate(self, contexts: Sequence[Context], params, seed: int) -> list[list[Completion]]:
        if not contexts:
            return []
        out = self.sampler.generate(list(contexts), seed=seed, store=self.step_store(params))
        rows = [np.flatnonzero(out.context_index == c) for c in range(len(contexts))]
        return [[Completion(out.completion(r), bool(out.stopped[r])) for r in mine] for mine in rows]

    def score(self, requests: Sequence[Request], rollouts: Sequence[list[Completion]]) -> dict[str, np.ndarray]:
        """The round's answers decoded (replayed prefix included) and verified in one call: ``score``, the
        reward as scored (a reward plugin's float as is), and ``reward``, the allocator's success bit
        (score >= ``success_threshold``)."""
        prompts, texts = [], []
        for req, answers in zip(requests, rollouts):
            prefix = self.groups[req.group_key].prefix
            prompts += [req.prompt_id] * len(answers)
            texts += [self.decode(prefix + a.ids) for a in answers]
        scores, errors = score_each(self.verify, prompts, texts)
        return {"reward": (scores >= self.success_threshold).astype(np.int64), "score": scores,
                "verifier_error": errors,
                "truncated": np.array([not a.stopped for answers in rollouts for a in answers], bool)}

    def record(self, requests: Sequence[Request], rollouts: Sequence[list[Completion]],
               scores: dict[str, np.ndarray]) -> None:
        """Keep each answer's ids and its scored reward (the update trains on it, possibly in a later step)."""
        pos = 0
        for req, answers in zip(requests, rollouts):
            g = self.groups[req.group_key]
            for j, a in enumerate(answers):
                g.completions[req.first_index + j] = list(a.ids)
                g.rewards[req.first_index + j] = float(scores["score"][pos])
                pos += 1

    # ------------------------------------------------------------------ after the rounds
    def batch(self, groups: Sequence[TrainGroup], rows: int) -> dict[str, np.ndarray]:
        """Rows of every trained group's rollouts, right-padded to ``rows`` x a width bucket (see
        :func:`pack_rows`): loss mask on the generated ids only, rewards as scored."""
        seqs, masks, rewards, gids = [], [], [], []
        for gi, tg in enumerate(groups):
            g = self.groups[tg.group_key]
            context = list(self.prompt_ids(g.prompt)) + g.prefix
            for i, success in enumerate(tg.rewards):
                comp = g.completions[i]
                seqs.append(context + comp)
                masks.append([0] * len(context) + [1] * len(comp))
                # The scored reward, not the allocator's success bit (a checkpoint from before scores
                # were kept has only the bit).
                rewards.append(g.rewards.get(i, float(success)))
                gids.append(gi)
        return pack_rows(seqs, masks, rewards, gids, num_groups=len(groups), rows=rows,
                         width_buckets=self.width_buckets, pad_id=self.pad_id)

    def metrics(self, table) -> dict:
        """Round mode's decode slot utilization (live rows / rows, over the step's decode steps)."""
        live, rows = (a - b for a, b in zip(self._decode_counters(), self._decode_steps))
        return {"slot_utilization": live / rows} if rows else {}

    def _decode_counters(self) -> tuple[int, int]:
        return getattr(self.sampler, "decode_live_steps", 0), getattr(self.sampler, "decode_row_steps", 0)

    def open_step(self, params) -> None:
        super().open_step(params)
        self._decode_steps = self._decode_counters()

    def stream(self, params, seed: int) -> TextStream:
        """The step's decode slots (the slot engine, built on first use), over the step's prefix store."""
        if self._engine is None:
            length = max(self.sampler.store_capacity[1], bucket(self.row_length, self.sampler.cfg.context_buckets))
            self._engine = SlotEngine(self.sampler, rows=self.slots, chunk=self.chunk_tokens, length=length)
        return TextStream(self._engine.pool(self.step_store(params), seed=seed))

    def discard(self, keys) -> None:
        """Forget groups the slot engine started ahead of a request that never came (rollout/ahead.py)."""
        for k in keys:
            self.groups.pop(k, None)

    def response(self, group_key: int, index: int) -> list[int]:
        """Prefix + completion ids of one rollout: the whole response the verifier scores."""
        g = self.groups[group_key]
        return g.prefix + g.completions[index]

    def generated_tokens(self, group_key: int, index: int) -> int:
        """Tokens the policy generated in one rollout (its completion; a replayed prefix is not generated)."""
        return len(self.groups[group_key].completions[index])

    # ------------------------------------------------------------------ the checkpointed trajectories
    def retain(self, keys) -> None:
        """Free every group not in ``keys``."""
        self.groups = {k: g for k, g in self.groups.items() if k in keys}

    def to_json(self) -> dict:
        return {str(k): {"prompt": g.prompt, "prefix": g.prefix,
                         "completions": {str(i): c for i, c in g.completions.items()},
                         "rewards": {str(i): r for i, r in g.rewards.items()}} for k, g in self.groups.items()}

    def load_json(self, data: dict) -> None:
        """Inverse of :meth:`to_json`."""
        self.groups = {int(k): TextGroup(prompt=v["prompt"], prefix=list(v["prefix"]),
                                         completions={int(i): list(c) for i, c in v["completions"].items()},
                                         rewards={int(i): float(r) for i, r in v.get("rewards", {}).items()})
                       for k, v in data.items()}


class TextStream:
    """A :class:`~passrate_jax.sampling.slot_pool.SlotPool` as the event loop's ``RolloutStream``: rollouts
    are :class:`Completion` s."""

    def __init__(self, pool: SlotPool):
        self.pool = pool

    @property
    def idle(self) -> bool:
        return self.pool.idle

    def add(self, context: Context, tag) -> None:
        self.pool.add(context, tag)

    def advance(self) -> list[tuple[object, int, Completion]]:
        return [(f.tag, f.sample_index, Completion(f.ids, f.stopped)) for f in self.pool.advance()]

    @property
    def free(self) -> int:
        return self.pool.free

    def abort(self) -> list[tuple[object, int, int]]:
        return self.pool.abort()

    def length(self, rollout: Completion) -> int:
        return len(rollout.ids)

    def counters(self) -> dict:
        return {"sampler_calls": self.pool.chunks, "slot_utilization": self.pool.utilization}


def pack_rows(seqs, masks, rewards, group_ids, *, num_groups: int, rows: int, width_buckets: Sequence[int],
              pad_id: int) -> dict[str, np.ndarray]:
    """Token sequences with their loss masks, rewards and group ids as right-padded numpy arrays:
    tokens, attention_mask, loss_mask [rows, width bucket], rewards [rows], group_ids [rows] (padding
    rows get their own id and an all-zero mask, so they change no group statistic)."""
    if len(seqs) > rows:
        raise ValueError(f"{len(seqs)} rollouts to train on exceed the batch of {rows} rows")
    width = bucket(max(len(s) for s in seqs), width_buckets)
    out = {"tokens": np.full((rows, width), pad_id, np.int32), "attention_mask": np.zeros((rows, width), np.int32),
           "loss_mask": np.zeros((rows, width), np.int32), "rewards": np.zeros((rows,), np.float32),
           "group_ids": np.arange(rows, dtype=np.int32) + num_groups}
    for i, (s, m) in enumerate(zip(seqs, masks)):
        out["tokens"][i, :len(s)] = s
        out["attention_mask"][i, :len(s)] = 1
        out["loss_mask"][i, :len(s)] = m
    out["rewards"][:len(seqs)] = rewards
    out["group_ids"][:len(seqs)] = group_ids
    return out
