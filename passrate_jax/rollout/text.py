"""Rollouts of text answers: the :class:`passrate_jax.rollout.loop.RolloutBackend` of prompt-and-verifier tasks.

A request becomes one sampler context (the prompt, plus the replayed prefix of a Prefix Sampling
re-rollout group); each answer is decoded and scored by the run's verifier; the trajectories (the
generated ids, by group key and rollout index) are kept in the run's trajectory store (:mod:`.store`)
for later replays and for the update batch, whose loss mask covers the generated ids only (prompt and
replayed prefix are context).

Everything here is plain Python / numpy on the host; the arrays it builds go to the jitted sampler.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from passrate_jax.allocation import Request
from passrate_jax.rollout.store import WIDTH_BUCKETS, TextKind, TrajectoryStore
from passrate_jax.rollout.table import RolloutTable
from passrate_jax.sampling.prefix_store import PrefixStore
from passrate_jax.sampling.sampler import Context, Sampler, bucket
from passrate_jax.sampling.slot_pool import SlotEngine, SlotPool

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

    def close_step(self, table: RolloutTable) -> dict[str, int]:
        """Free the step's KV rows (``table``: the step's rollouts, for a backend's own counters); its
        ``prefill_tokens``, ``context_tokens`` and ``unshared_prefill_tokens``
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


class TextRollouts(StepKV):
    """The text backend. ``prompt_ids(i)``: prompt i's token ids (with BOS); ``decode``: ids -> text;
    ``verify(prompt_indices, texts)``: one reward per answer; ``max_new_tokens``: an answer's budget
    (prefix included); ``newline_id``: where a Prefix Sampling cut may snap to; ``prefix_granularity``:
    tokens or lines (:func:`cut_prefix`); ``success_threshold``: a reward at or above it is a success for
    the allocator (``data.reward_threshold``). The trajectories (generated ids) are in ``store``."""

    def __init__(self, sampler: Sampler, prompt_ids: Callable[[int], Sequence[int]], *,
                 decode: Callable[[list[int]], str], verify: Callable[[list[int], list[str]], np.ndarray],
                 max_new_tokens: int, pad_id: int, newline_id: int | None = None, prefix_granularity: str = "tokens",
                 success_threshold: float = 0.5, width_buckets: Sequence[int] = WIDTH_BUCKETS,
                 slots: int = 64, chunk_tokens: int = 8, lookahead: int = 0, longest_prompt: int = 1,
                 harvest: str = "auto"):
        self.sampler, self.prompt_ids, self.decode, self.verify = sampler, prompt_ids, decode, verify
        self.slots, self.chunk_tokens, self.lookahead, self._engine = slots, chunk_tokens, lookahead, None
        self.harvest = harvest
        # The engine's rows hold the longest prompt and a whole budget (a replayed prefix is part of it).
        self.row_length = longest_prompt + max_new_tokens
        self._decode_steps = (0, 0)  # the sampler's decode counters when the step opened
        self.max_new_tokens, self.newline_id, self.prefix_granularity = max_new_tokens, newline_id, prefix_granularity
        self.success_threshold = float(success_threshold)
        self.store = TrajectoryStore(TextKind(), prompt_ids, pad_id=pad_id, width_buckets=width_buckets)

    # ------------------------------------------------------------------ a round
    def contexts(self, requests: Sequence[Request]) -> list[Context]:
        """Sampler contexts for one round of requests. A group's randomness is keyed by its group key
        and rollout index, so a row samples the same tokens whatever batch it lands in."""
        out, groups = [], self.store.groups
        for r in requests:
            if r.group_key not in groups:
                prefix = []
                if r.prefix is not None:
                    src = groups[r.prefix.source_group].trajectories[r.prefix.source_rollout]
                    prefix = cut_prefix(src, r.prefix.cut_ratio, self.newline_id, self.prefix_granularity)
                self.store.open(r.group_key, r.prompt_id, prefix)
            g = groups[r.group_key]
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
            prefix = self.store.groups[req.group_key].prefix
            prompts += [req.prompt_id] * len(answers)
            texts += [self.decode(prefix + a.ids) for a in answers]
        scores, errors = score_each(self.verify, prompts, texts)
        return {"reward": (scores >= self.success_threshold).astype(np.int64), "score": scores,
                "verifier_error": errors,
                "truncated": np.array([not a.stopped for answers in rollouts for a in answers], bool)}

    def record(self, requests: Sequence[Request], rollouts: Sequence[list[Completion]], table: RolloutTable,
               rows: Sequence[np.ndarray]) -> None:
        """Keep each answer's ids, referring to its table row (the update trains on its score, possibly in
        a later step)."""
        self.store.add(requests, [[list(a.ids) for a in answers] for answers in rollouts], table, rows)

    # ------------------------------------------------------------------ the step's decoding
    def open_step(self, params) -> None:
        super().open_step(params)
        self._decode_steps = self._decode_counters()

    def close_step(self, table: RolloutTable) -> dict:
        """The prefix store's counters and round mode's decode slot utilization (live rows / rows, over
        the step's decode steps)."""
        live, rows = (a - b for a, b in zip(self._decode_counters(), self._decode_steps))
        return {**super().close_step(table), **({"slot_utilization": live / rows} if rows else {})}

    def _decode_counters(self) -> tuple[int, int]:
        return getattr(self.sampler, "decode_live_steps", 0), getattr(self.sampler, "decode_row_steps", 0)

    def stream(self, params, seed: int, lagged: bool = True) -> TextStream:
        """The step's decode slots (the slot engine, built on first use), over the step's prefix store;
        ``lagged``: see :class:`~passrate_jax.sampling.slot_pool.SlotPool`."""
        if self._engine is None:
            length = max(self.sampler.store_capacity[1], bucket(self.row_length, self.sampler.cfg.context_buckets))
            self._engine = SlotEngine(self.sampler, rows=self.slots, chunk=self.chunk_tokens, length=length)
        return TextStream(self._engine.pool(self.step_store(params), seed=seed, lagged=lagged))


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
        return self.pool.counters()
