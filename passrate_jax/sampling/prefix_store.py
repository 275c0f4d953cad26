"""Host records of KV reuse: a step's prefix store, the live rows of multi-turn episodes, and the count
of distinct context tokens they are measured against.

A :class:`PrefixStore` belongs to one parameter state (one training step): every context prefilled
into it keeps its KV rows and last logits on device, so a later round that samples the same context
(SARA's next chunk, a Pilot-Commit commit) decodes from the stored rows without computing them again.
:class:`LiveRows` are the decode caches of one call kept alive, so the next turn of an episode appends
the observation to them instead of prefilling the conversation again. The jitted programs that fill
and read them live in :class:`passrate_jax.sampling.sampler.Sampler`; these classes hold no logic
beyond the bookkeeping.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from passrate_jax.model.transformer import KVCache
from passrate_jax.sampling import core


class ContextTrie:
    """Distinct token positions of a set of sequences: the nodes of their prefix trie. Two contexts
    that share a prefix count its tokens once, the number a perfect prefix cache would compute."""

    def __init__(self):
        self._edges: dict[tuple[int, int], int] = {}

    @property
    def size(self) -> int:
        return len(self._edges)

    def insert(self, ids: Sequence[int]) -> None:
        node = 0
        for token in ids:
            node = self._edges.setdefault((node, int(token)), len(self._edges) + 1)


class PrefixStore:
    """The KV rows of the contexts prefilled for one parameter state (see the module docstring).

    ``params``: the placed parameter state every program of this store runs with. ``shared``: contexts
    with equal ids share one stored row (a store scoped to one call prefills each context it is given).
    Counters: ``prefill_tokens`` (real tokens run through a prefill or an append: the KV computed),
    ``context_tokens`` (distinct context tokens sampled from, :class:`ContextTrie`), ``prefilled``
    (contexts prefilled into the store).
    """

    def __init__(self, params, *, shared: bool = True):
        self.params = params
        self.shared = shared
        self.arrays: core.PrefillOutput | None = None   # [C, V] logits, [layers, C, T, ...] KV; None: empty
        self.slots: dict[tuple[int, ...], int] = {}      # context ids -> row (shared stores)
        self.count = 0                                   # rows in use
        self.trie = ContextTrie()
        self.prefill_tokens = 0
        self.prefilled = 0

    @property
    def capacity(self) -> tuple[int, int]:
        """(contexts, slots per context) the device arrays hold; (0, 0) before the first prefill."""
        return (0, 0) if self.arrays is None else tuple(self.arrays.cache.k.shape[1:3])

    @property
    def context_tokens(self) -> int:
        return self.trie.size

    def lookup(self, ids: tuple[int, ...]) -> int | None:
        return self.slots.get(ids) if self.shared else None

    def release(self) -> None:
        """Free the device arrays (the step is over); the counters stay readable."""
        self.arrays, self.slots, self.count = None, {}, 0


@dataclasses.dataclass
class LiveRows:
    """Decode caches kept from one call, one row per continuation (the call's result rows, in order).

    cache: KV [layers, R, S, ...] (R padded); slot == position.
    tokens: per row, its context ids followed by its generated ids.
    valid: per row, the leading tokens whose keys and values the cache holds: every context token and
      every generated token but the last, which no step fed back (a row that stopped first may hold it,
      or padding after it, so it is always recomputed by the next append).
    store: the prefix store (parameter state and counters) the rows were sampled under.
    """
    cache: KVCache
    tokens: list[tuple[int, ...]]
    valid: list[int]
    store: PrefixStore

    @property
    def slots(self) -> int:
        """S: the most tokens a row's context and generation may reach."""
        return int(self.cache.k.shape[2])
