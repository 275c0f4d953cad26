"""The sampler's host-side row types: what a call asks for (:class:`Context`), what it returns
(:class:`SampleResult`), the padding buckets (:func:`bucket`) and the update's rows (:func:`training_rows`).

Plain numpy, no jax: the allocation layer and the rollout code build and read these without compiling
anything. ``passrate_jax.sampling.sampler`` re-exports them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class Context:
    """One distinct context to continue ``num_samples`` times.

    prompt_ids: the prompt's token ids (not empty).
    prefix_ids: replayed trajectory prefix (Prefix Sampling) appended to the prompt; these tokens are
      context, not policy output, so they get loss mask 0 (see :func:`training_rows`).
    context_id: stable id seeding this context's randomness (default: its index in the call's list);
      give the same id and sample indices to reproduce a sample in another batch or after a resume.
    first_sample_index: index of the first continuation; a later round of rollouts for the same context
      (SARA, Pilot-Commit) passes the number already drawn so it gets fresh samples, not repeats.
    max_new_tokens: this context's generation budget (default: the config's max_new_tokens).
    """
    prompt_ids: Sequence[int]
    prefix_ids: Sequence[int] = ()
    num_samples: int = 1
    context_id: int | None = None
    first_sample_index: int = 0
    max_new_tokens: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "prompt_ids", tuple(int(i) for i in self.prompt_ids))
        object.__setattr__(self, "prefix_ids", tuple(int(i) for i in self.prefix_ids))
        if not self.prompt_ids:
            raise ValueError("Context.prompt_ids must not be empty")
        if self.num_samples < 0 or self.first_sample_index < 0:
            raise ValueError(f"num_samples = {self.num_samples}, first_sample_index = "
                             f"{self.first_sample_index}: must be >= 0")

    @property
    def ids(self) -> tuple[int, ...]:
        """All context token ids: prompt then replayed prefix."""
        return self.prompt_ids + self.prefix_ids

    @property
    def replayed_mask(self) -> np.ndarray:
        """bool [len(ids)]: True on replayed prefix tokens."""
        return np.arange(len(self.ids)) >= len(self.prompt_ids)


@dataclasses.dataclass(frozen=True)
class SampleResult:
    """Host-side (numpy) output, one row per continuation, rows grouped by context in input order.

    context_index [N]: position of the row's context in the ``generate`` call's list.
    sample_index [N]: continuation index within the context (``first_sample_index + j``).
    tokens [N, G] int32: generated ids, ``pad_id`` after ``lengths``; the stop token is included.
    logprobs [N, G] float32: natural-log probability of each sampled token under the distribution it
      was drawn from (temperature-scaled, top-k/top-p filtered; 0 for greedy); 0 after ``lengths``.
    policy_logprobs [N, G] float32: log-probability under the raw policy (temperature 1, unfiltered),
      what a teacher-forced forward pass of the same parameters gives; use these for RL ratios.
    lengths [N] int32: generated tokens per row. stopped [N] bool: ended on EOS / a stop id.
    loss_mask [N, G] bool: True on the row's generated tokens (the first ``lengths`` columns).
    """
    context_index: np.ndarray
    sample_index: np.ndarray
    tokens: np.ndarray
    logprobs: np.ndarray
    policy_logprobs: np.ndarray
    lengths: np.ndarray
    stopped: np.ndarray
    loss_mask: np.ndarray

    @property
    def finish_reason(self) -> list[str]:
        """Per row: "stop" (EOS or a stop id) or "length" (budget spent)."""
        return ["stop" if s else "length" for s in self.stopped]

    def completion(self, row: int) -> list[int]:
        """Generated ids of ``row`` (stop token included)."""
        return self.tokens[row, : self.lengths[row]].tolist()


def bucket(n: int, buckets: Sequence[int], multiple: int = 1) -> int:
    """Smallest bucket >= ``n`` (beyond the largest: the next multiple of the largest), rounded up to a
    multiple of ``multiple`` (the number of row shards)."""
    size = next((b for b in buckets if b >= n), None)
    if size is None:
        size = math.ceil(n / buckets[-1]) * buckets[-1]
    return math.ceil(size / multiple) * multiple


def training_rows(contexts: Sequence[Context], result: SampleResult, *, pad_id: int = 0,
                  width: int | None = None) -> dict[str, np.ndarray]:
    """Full sequences (context + completion) of every result row, right-padded, for the policy update.

    Returns numpy arrays of shape [N, W] (``W = width`` or the longest row):
      tokens: int32 ids; positions = column index.
      attention_mask: bool, True on real tokens.
      loss_mask: bool, True only on generated tokens (prompt and replayed prefix tokens are context).
      replayed_mask: bool, True on replayed prefix tokens.
      policy_logprobs: float32, the sampler's policy log-prob of each generated token at its column.
    """
    n = len(result.lengths)
    total = [len(contexts[c].ids) + int(result.lengths[i]) for i, c in enumerate(result.context_index)]
    w = width or max(total, default=0)
    if total and max(total) > w:
        raise ValueError(f"width = {w}: the longest row has {max(total)} tokens")
    out = {"tokens": np.full((n, w), pad_id, np.int32), "attention_mask": np.zeros((n, w), bool),
           "loss_mask": np.zeros((n, w), bool), "replayed_mask": np.zeros((n, w), bool),
           "policy_logprobs": np.zeros((n, w), np.float32)}
    for i, c in enumerate(result.context_index):
        ctx, m = contexts[c], int(result.lengths[i])
        k = len(ctx.ids)
        out["tokens"][i, :k], out["tokens"][i, k: k + m] = ctx.ids, result.tokens[i, :m]
        out["attention_mask"][i, : k + m] = True
        out["loss_mask"][i, k: k + m] = True
        out["replayed_mask"][i, :k] = ctx.replayed_mask
        out["policy_logprobs"][i, k: k + m] = result.policy_logprobs[i, :m]
    return out
