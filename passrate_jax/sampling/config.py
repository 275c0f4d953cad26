"""Static sampler settings."""

from __future__ import annotations

import dataclasses
from typing import Literal

from passrate_jax.configlib import ConfigError, option


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """Rollout sampling controls and the padding buckets that bound the number of compiled programs.

    Every batch is padded up to a bucket in each dimension (decode rows, prefill rows, context length,
    generation length), so a whole run compiles at most one prefill and one decode program per bucket
    combination. A size above the largest bucket is rounded up to a multiple of the largest bucket.
    """
    temperature: float = option(1.0, ge=0, doc="0 means greedy")
    top_k: int = option(0, ge=0, doc="0 disables top-k")
    top_p: float = option(1.0, gt=0, le=1, doc="1 disables nucleus sampling")
    max_new_tokens: int = option(64, ge=1)
    stop_token_ids: tuple[int, ...] = option((), doc="extra stop ids besides the tokenizer's EOS")
    row_buckets: tuple[int, ...] = option((64, 128, 256), ge=1, doc="batch-row padding buckets")
    context_buckets: tuple[int, ...] = option((32, 64, 128, 256), ge=1, doc="context-length padding buckets")
    # No bucket below 16: a round that prefills a few new contexts into a store of 16 rows then reuses the
    # program that filled the store (one compile less in the default run), for a prefill that stays far
    # smaller than the decode of at least 64 rows it feeds.
    prefill_row_buckets: tuple[int, ...] = option(
        (16, 32, 64, 128, 256), ge=1, doc="padding buckets for the number of distinct contexts prefilled")
    store_contexts: int = option(
        0, ge=0, doc="contexts a step's prefix store is sized for from the start (a training run reserves them "
                     "with slots for its longest prompt plus max_new_tokens): then rounds, evaluation and "
                     "steps share one prefill program per context bucket and one decode program per row "
                     "bucket; 0: each store grows when a call needs more, compiling the programs again")
    engine: Literal["rounds", "slots"] = option(
        "slots", doc="slots: the slot engine (continuous batching): a fixed pool of decode slots kept full, "
                     "the allocation deciding per group as its rollouts finish (docs/engine.md); rounds: one "
                     "sampler call per allocation round, decoding until its longest answer ends (for comparison)")
    slots: int = option(64, ge=1, doc="slot engine: decode rows in the pool (fewer than a step's rollouts, so "
                                       "that finished rows are refilled from the queue)")
    chunk_tokens: int = option(8, ge=1, doc="slot engine: decode steps between harvests (k)")
    narrow_slots: int = option(16, ge=0, doc="slot engine: a chunk dispatched while at most this many rows are "
                                              "occupied decodes only those rows (one more program), so a pool "
                                              "draining at a step's end, or kept mostly empty by a budgeted "
                                              "method, does not pay for its empty rows; 0, or at least "
                                              "`slots`: every chunk decodes the whole pool. Used where the "
                                              "pool's rows are not split over devices")
    lookahead: int = option(32, ge=0, doc="slot engine: fresh groups whose first request may be started ahead "
                                          "into free slots, with the rest of the groups already opened, before "
                                          "the allocation asks (used only if it asks exactly that; "
                                          "docs/engine.md); 0: nothing is started ahead")
    harvest: Literal["auto", "lagged", "at_once"] = option(
        "auto", doc="slot engine: when a chunk's finished rollouts reach the host. lagged: after the next chunk "
                    "is dispatched, so the device decodes while the host scores and decides (what it decides "
                    "starts a chunk later); at_once: before it, so decisions start in the next chunk but the "
                    "device waits for the verifier and the allocation; auto: lagged where the allocation "
                    "runs apart from the decoding (on the host beside an accelerator) or decides everything "
                    "at the step's start, at_once otherwise, where its programs would wait behind the chunk "
                    "anyway (docs/engine.md)")
    generation_buckets: tuple[int, ...] = option(
        (64, 128, 256, 512, 1024, 2048), ge=1, doc="padding buckets for max new tokens (output buffer length)")

    def validate(self) -> None:
        for name in ("row_buckets", "context_buckets", "prefill_row_buckets", "generation_buckets"):
            value = getattr(self, name)
            if not value or list(value) != sorted(set(value)):
                raise ConfigError(f"{name} = {list(value)}: must be a non-empty increasing list")
