"""Host records of KV reuse: a step's prefix store, the live rows of multi-turn episodes, and the
counts of prefill work against distinct context tokens.

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


class PrefixStore:
    """The KV rows of the contexts prefilled for one parameter state (see the module docstring).

    ``params``: the placed parameter state every program of this store runs with. ``shared``: contexts
    with equal ids share one stored row (a store scoped to one call prefills each context it is given).
    Rows are recycled least-recently-used first, so the store holds about as many contexts as one call
    samples from (SARA's pending groups, not every group it opened), and grows only when one call
    needs more.

    Counters over every call made with the store (live rows extended from it included):
    ``prefill_tokens``: real tokens run through a prefill or an append, i.e. keys and values computed
    other than by decoding. ``context_tokens``: the distinct context tokens sampled from: each distinct
    context (by its ids) counts the tokens it adds to the context it continues (all of them for a new
    context; an episode's next turn adds its action and observation to the previous turn's context).
    Prefilling every context in full makes ``prefill_tokens`` about the number of rounds (or turns)
    times ``context_tokens``; computing each once makes them equal (less where a decode computed a
    generated action's keys). ``unshared_tokens``: what prefilling every context of every call in full
    would have computed (the sampler without KV reuse across calls). ``prefilled``: contexts prefilled
    into the store.
    """

    def __init__(self, params, *, shared: bool = True):
        self.params = params
        self.shared = shared
        self.arrays: core.PrefillOutput | None = None   # [C, V] logits, [layers, C, T, ...] KV; None: empty
        self.slots: dict[tuple[int, ...], int] = {}      # context ids -> row (shared stores)
        self._row_ids: dict[int, tuple[int, ...]] = {}   # row -> the context it holds
        self._used: dict[int, int] = {}                  # row -> the last call that sampled from it
        self._calls = 0
        self.prefill_tokens = 0
        self.context_tokens = 0
        self.unshared_tokens = 0
        self.prefilled = 0
        self._seen: set[tuple[int, ...]] = set()

    @property
    def capacity(self) -> tuple[int, int]:
        """(contexts, slots per context) the device arrays hold; (0, 0) before the first prefill."""
        return (0, 0) if self.arrays is None else tuple(self.arrays.cache.k.shape[1:3])

    def note_context(self, ids: tuple[int, ...], added: int) -> None:
        """Count a context sampled from that adds ``added`` tokens to the one it continues (once per ids)."""
        self.unshared_tokens += len(ids)
        if ids not in self._seen:
            self._seen.add(ids)
            self.context_tokens += added

    def lookup(self, ids: tuple[int, ...]) -> int | None:
        """The row holding ``ids`` (None: not held, or an unshared store), marked used by the current call."""
        row = self.slots.get(ids) if self.shared else None
        if row is not None:
            self._used[row] = self._calls
        return row

    def begin_call(self) -> None:
        self._calls += 1

    def place(self, ids: Sequence[tuple[int, ...]], contexts: int, keep: set[int]) -> list[int]:
        """Rows for new contexts ``ids`` in a store of ``contexts`` rows: empty rows first, then the rows
        least recently used, never one in ``keep`` (those the current call samples from). A context
        evicted here is prefilled again should a later call need it (and counted again)."""
        empty = [r for r in range(contexts) if r not in self._row_ids]
        stale = sorted((self._used[r], r) for r in self._row_ids if r not in keep and r < contexts)
        rows = (empty + [r for _, r in stale])[:len(ids)]
        for x, row in zip(ids, rows):
            self.slots.pop(self._row_ids.get(row), None)
            self._row_ids[row], self._used[row] = x, self._calls
            if self.shared:
                self.slots[x] = row
        return rows

    def release(self) -> None:
        """Free the device arrays (the step is over); the counters stay readable."""
        self.arrays, self.slots, self._row_ids, self._used = None, {}, {}, {}


@dataclasses.dataclass
class LiveRows:
    """Decode caches kept from one call, one row per continuation (the call's result rows, in order).

    cache: KV [layers, R, S, ...] (R padded); slot == position.
    tokens: per row, its context ids followed by its generated ids.
    context_len: per row, the number of its context ids.
    valid: per row, the leading tokens whose keys and values the cache holds: every context token and
      every generated token but the last, which no step fed back (a row that stopped first may hold it,
      or padding after it, so it is always recomputed by the next append).
    store: the prefix store (parameter state and counters) the rows were sampled under.
    """
    cache: KVCache
    tokens: list[tuple[int, ...]]
    context_len: list[int]
    valid: list[int]
    store: PrefixStore

    @property
    def slots(self) -> int:
        """S: the most tokens a row's context and generation may reach."""
        return int(self.cache.k.shape[2])
