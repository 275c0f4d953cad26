"""The sampler's host shell: contexts in, padded static-shape batches to the jitted core, results out.

    sampler = Sampler(model, SamplingConfig(temperature=1.0), eos_id=tok.eos_id, mesh=mesh)
    result = sampler.generate([Context(prompt_ids=ids, num_samples=8, context_id=17)], seed=step)
    result.tokens[i, :result.lengths[i]]   # row i's completion

Each call prefills every distinct context once, then decodes all continuations in one batch. Batches are
padded to the buckets of :class:`SamplingConfig`, so a run compiles a handful of programs; the counters
``compilations``, ``prefill_calls`` (contexts prefilled) and ``prefill_batches`` report what happened.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from passrate_jax import sharding as shd
from passrate_jax.distributed import to_host
from passrate_jax.model.transformer import KVCache
from passrate_jax.sampling import core
from passrate_jax.sampling.config import SamplingConfig


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


class Sampler:
    """Jitted, sharded rollout sampler for one model architecture (see the module docstring).

    Args:
      model: the policy (its parameters are the default for ``generate``).
      cfg: sampling controls and padding buckets.
      eos_id: end-of-sequence id (None: only ``cfg.stop_token_ids`` stop a row).
      pad_id: id written after a row finished and used to pad contexts.
      mesh: device mesh; decode rows are split over the data-parallel axes, parameters follow
        ``sharding.param_shardings``. Default: every device on the data axis.
    """

    def __init__(self, model: nnx.Module, cfg: SamplingConfig, *, eos_id: int | None, pad_id: int = 0,
                 mesh: Mesh | None = None):
        self.cfg = cfg
        self.mesh = mesh if mesh is not None else shd.make_mesh(shd.MeshConfig())
        self.model_cfg = model.cfg
        self.graphdef, params = nnx.split(model)
        self.param_shardings = shd.param_shardings(params, self.mesh)
        self.layout = shd.FsdpLayout(self.mesh)
        self.params = jax.device_put(params, self.param_shardings)
        self.eos_id, self.pad_id = eos_id, int(pad_id)
        row_axes = shd.batch_sharding(self.mesh, 1).spec[0]
        row_axes = () if row_axes is None else (row_axes,) if isinstance(row_axes, str) else tuple(row_axes)
        self.row_shards = math.prod(self.mesh.shape[a] for a in row_axes)
        rows1 = NamedSharding(self.mesh, P(row_axes))
        rows2 = NamedSharding(self.mesh, P(row_axes, None))
        cache = KVCache(*(NamedSharding(self.mesh, P(None, row_axes)),) * 2)  # rows are dim 1 of k, v
        self._rows1, self._rows2 = rows1, rows2
        replicated = NamedSharding(self.mesh, P())
        self.compilations = 0
        self.prefill_calls = 0    # distinct contexts prefilled
        self.prefill_batches = 0  # prefill program executions
        prefilled = core.PrefillOutput(last_logits_cv=rows2, cache=cache)
        rowspec = core.RowSpec(*(rows1,) * 5)
        state = core.SamplingState(
            step=replicated, last_token_r=rows1, position_r=rows1, done_r=rows1, stopped_r=rows1,
            length_r=rows1, tokens_rg=rows2, logprobs_rg=rows2, policy_logprobs_rg=rows2, keys_r=rows1,
            budget_r=rows1, cache=None)
        self._prefill = jax.jit(self._prefill_impl, static_argnums=(3,),
                                in_shardings=(self.param_shardings, rows2, rows1), out_shardings=prefilled)
        self._decode = jax.jit(self._decode_impl, static_argnums=(5,),
                               in_shardings=(self.param_shardings, prefilled, rowspec, replicated, replicated),
                               out_shardings=state)

    def _prefill_impl(self, params, tokens_ct, length_c, cache_len):
        self.compilations += 1  # runs once per trace, i.e. once per compiled program
        return core.prefill(params, tokens_ct, length_c, graphdef=self.graphdef, model_cfg=self.model_cfg,
                            cache_len=cache_len, layout=self.layout)

    def _decode_impl(self, params, prefilled, rows, seed, stop_ids, settings):
        self.compilations += 1
        final = core.decode(params, prefilled, rows, seed, stop_ids, graphdef=self.graphdef, settings=settings,
                            layout=self.layout)
        return final.replace(cache=None)  # the cache dies inside the program instead of being returned

    def generate(self, contexts: Sequence[Context], *, seed: int = 0, params: nnx.State | None = None,
                 cfg: SamplingConfig | None = None) -> SampleResult:
        """Sample ``ctx.num_samples`` continuations of every context.

        Args:
          contexts: distinct contexts; each is prefilled once and its cache shared by its continuations.
          seed: int in [0, 2**31); with each row's (context_id, sample_index) it fixes the row's sample.
          params: parameter state to sample from (default: the model's at construction); placed with
            ``param_shardings`` (a no-op when already there).
          cfg: override of the sampling controls for this call (buckets included).
        """
        cfg = cfg or self.cfg
        if not contexts:
            raise ValueError("generate needs at least one context")
        params = self.params if params is None else jax.device_put(params, self.param_shardings)
        lengths = [len(c.ids) for c in contexts]
        budgets = [c.max_new_tokens or cfg.max_new_tokens for c in contexts]
        n_ctx, n_rows = len(contexts), sum(c.num_samples for c in contexts)
        t = bucket(max(lengths), cfg.context_buckets)
        g = bucket(max(budgets), cfg.generation_buckets)
        c_pad = bucket(n_ctx, cfg.prefill_row_buckets, self.row_shards)
        r_pad = bucket(max(n_rows, 1), cfg.row_buckets, self.row_shards)

        tokens = np.full((c_pad, t), self.pad_id, np.int32)
        for i, c in enumerate(contexts):
            tokens[i, : lengths[i]] = c.ids
        length_c = np.zeros(c_pad, np.int32)
        length_c[:n_ctx] = lengths
        ctx_index = np.repeat(np.arange(n_ctx), [c.num_samples for c in contexts]).astype(np.int32)
        sample_index = np.concatenate(
            [np.arange(c.num_samples) + c.first_sample_index for c in contexts]).astype(np.int32)
        ids = [i if c.context_id is None else c.context_id for i, c in enumerate(contexts)]

        def rows_of(per_row):
            out = np.zeros(r_pad, np.int32)  # padding rows: context 0, budget 0 (done before step 0)
            out[:n_rows] = per_row
            return out

        def per_context(values):
            return rows_of(np.asarray(values, np.int32)[ctx_index])

        rows = core.RowSpec(
            context_row_r=per_context(np.arange(n_ctx)), context_id_r=per_context(ids),
            sample_index_r=rows_of(sample_index), context_len_r=per_context(lengths),
            budget_r=per_context(budgets))
        rows = jax.device_put(rows, core.RowSpec(*(self._rows1,) * 5))
        prefilled = self._prefill(params, jax.device_put(tokens, self._rows2),
                                  jax.device_put(length_c, self._rows1), t + g)
        self.prefill_calls += n_ctx
        self.prefill_batches += 1
        stop = list(dict.fromkeys(i for i in (self.eos_id, *cfg.stop_token_ids) if i is not None))
        stop_ids = np.full(bucket(len(stop), (8,)), -1, np.int32)  # -1 never matches a token
        stop_ids[: len(stop)] = stop
        settings = core.DecodeSettings(temperature=float(cfg.temperature), top_k=int(cfg.top_k),
                                       top_p=float(cfg.top_p), pad_id=self.pad_id, gen_len=g)
        replicated = NamedSharding(self.mesh, P())
        final = self._decode(params, prefilled, rows, jax.device_put(np.int32(seed), replicated),
                             jax.device_put(stop_ids, replicated), settings)
        # to_host gathers rows living on other hosts' devices: every host gets every completion.
        out = to_host((final.tokens_rg, final.logprobs_rg, final.policy_logprobs_rg, final.length_r,
                       final.stopped_r))
        tok, lp, plp, length, stopped = (np.asarray(x)[:n_rows] for x in out)
        return SampleResult(
            context_index=ctx_index, sample_index=sample_index, tokens=tok, logprobs=lp, policy_logprobs=plp,
            lengths=length, stopped=stopped, loss_mask=np.arange(g)[None, :] < length[:, None])


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
