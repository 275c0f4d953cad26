"""Predictive prompt selection (DESIGN.md 2.1): MoPPS (decayed Beta, Thompson sampling toward 0.5)
and DPS (3-state hidden Markov model with decayed Dirichlet transition counts).

One pytree holds both per-prompt models, indexed by prompt id, so a checkpoint saves it as arrays
and SARA can read a Beta prior from it under either method:

    state = selection_init(num_prompts, cfg)
    ids, ok = select_prompts(state, key, available, k, cfg)      # before sampling
    state = selection_update(state, ids, n, s, mask, cfg, N)     # after the step's outcomes
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct

from passrate_jax.allocation.beta_binomial import validity_probability
from passrate_jax.allocation.config import SelectionConfig

ALL_WRONG, MIXED, ALL_CORRECT = 0, 1, 2


@struct.dataclass
class SelectionState:
    """Per-prompt predictive models; P = number of prompts in the dataset.

    alpha, beta: float32 [P], decayed Beta posterior of the success rate (MoPPS form).
    counts: float32 [P, 3, 3], Dirichlet transition counts from state i (row) to state j (column)
      over (all-wrong, mixed, all-correct).
    last: float32 [P, 3], belief over the prompt's state at the last step: the observed state if it was
      observed then, else the belief propagated one transition per step since (uniform if never seen).
    """
    alpha: jax.Array
    beta: jax.Array
    counts: jax.Array
    last: jax.Array


def selection_init(num_prompts: int, cfg: SelectionConfig) -> SelectionState:
    """Prior models for ``num_prompts`` unseen prompts."""
    return SelectionState(
        alpha=jnp.full((num_prompts,), cfg.mopps_alpha0, jnp.float32),
        beta=jnp.full((num_prompts,), cfg.mopps_beta0, jnp.float32),
        counts=jnp.full((num_prompts, 3, 3), cfg.dps_alpha0, jnp.float32),
        last=jnp.full((num_prompts, 3), 1.0 / 3.0, jnp.float32))


def observed_state(n, s, group_size, prior_a, prior_b):
    """Belief over (all-wrong, mixed, all-correct) for a full group, given n of its N rollouts.

    A full group is observed exactly (one-hot). A partial unanimous group (SARA abandoned it, or a
    pilot) is split by the validity predictor under the prompt's Beta prior (ours): all failures ->
    (1 - P_valid, P_valid, 0). Returns float32 [..., 3].
    """
    p_valid = validity_probability(n, s, group_size, prior_a, prior_b, max_run=group_size)
    fail = (s == 0) & (n > 0)
    succ = (s == n) & (n > 0)
    mixed = ~fail & ~succ
    return jnp.stack([jnp.where(fail, 1 - p_valid, 0.0),
                      jnp.where(mixed, 1.0, p_valid),
                      jnp.where(succ, 1 - p_valid, 0.0)], axis=-1).astype(jnp.float32)


@functools.partial(jax.jit, static_argnames=("cfg", "group_size"))
def selection_update(state: SelectionState, prompt_ids, n, s, mask, cfg: SelectionConfig,
                     group_size: int) -> SelectionState:
    """One step of both models: fold this step's outcomes of ``prompt_ids`` (int [K], unique where
    ``mask``) in, and move every other prompt's DPS model on by one step. Call it once per step.

    MoPPS (observed prompts only): alpha <- lam alpha + (1-lam) alpha0 + s; beta <- lam beta +
    (1-lam) beta0 + (n - s).
    DPS, as in the released code (maoyixiu/DPS, recipe/dps/task_sampler.py), for every prompt with
    T = counts row-normalised (T[i, j] = P(next state j | state i)):
      observed with state belief q: counts <- lam counts + (1-lam) alpha0 + W, W[i, j] proportional to
        last[i] T[i, j] q[j] and summing to 1 (the posterior over the transition just seen); last <- q.
      unobserved: counts <- lam counts + (1-lam) alpha0; last <- last T (the belief moves one step).
    Entries with ``mask`` False (padding) or n = 0 count as unobserved.
    """
    n = jnp.asarray(n, jnp.int32)
    s = jnp.asarray(s, jnp.int32)
    mask = jnp.asarray(mask) & (n > 0)
    # Out-of-range ids are dropped by the scatter, which masks the padding without a branch.
    ids = jnp.where(mask, prompt_ids, state.alpha.shape[0])
    a, b = state.alpha[prompt_ids], state.beta[prompt_ids]
    lam = cfg.mopps_lambda
    new_a = lam * a + (1 - lam) * cfg.mopps_alpha0 + s
    new_b = lam * b + (1 - lam) * cfg.mopps_beta0 + (n - s)
    trans = _row_normalised(state.counts)
    decayed = cfg.dps_lambda * state.counts + (1 - cfg.dps_lambda) * cfg.dps_alpha0
    propagated = _sum3(state.last[:, :, None] * trans, axis=1)
    q = observed_state(n, s, group_size, a, b)
    joint = state.last[prompt_ids][:, :, None] * trans[prompt_ids] * q[:, None, :]
    soft = joint / jnp.maximum(_sum3(_sum3(joint, axis=2, keepdims=True), axis=1, keepdims=True), 1e-30)
    return SelectionState(alpha=state.alpha.at[ids].set(new_a, mode="drop"),
                          beta=state.beta.at[ids].set(new_b, mode="drop"),
                          counts=decayed.at[ids].add(soft, mode="drop"),
                          last=propagated.at[ids].set(q, mode="drop"))


def _sum3(x, axis: int, keepdims: bool = False):
    """Sum over an axis of length 3 as two adds (XLA's CPU reduction over a trailing axis of 3, for
    every prompt of every vmapped lane, was most of a simulated step's end)."""
    parts = [jax.lax.index_in_dim(x, i, axis, keepdims=keepdims) for i in range(3)]
    return parts[0] + parts[1] + parts[2]


def _row_normalised(counts):
    """Transition matrices from counts [..., 3, 3]: each row divided by its sum."""
    return counts / _sum3(counts, axis=-1, keepdims=True)


def dps_mixed_probability(state: SelectionState, prompt_ids):
    """DPS prediction: P(next group of the prompt is mixed) = sum_i last_i T_i,mixed, T = row-normalised counts."""
    trans = _row_normalised(state.counts[prompt_ids])
    return _sum3(state.last[prompt_ids] * trans[:, :, MIXED], axis=1)


METHODS = ("none", "mopps", "dps")  # index = the traced method id of the *_by_id functions


def selection_scores(state: SelectionState, prompt_ids, key, cfg: SelectionConfig):
    """Preference score of each candidate (higher is chosen first), float32 [K].

    none: a uniform random number (random order); mopps: -|gamma - 0.5| with gamma ~ Beta(alpha, beta)
    (Thompson sample); dps: the predicted probability of the mixed state.
    """
    if cfg.method not in METHODS:
        raise ValueError(f"unknown selection method {cfg.method!r}")
    return scores_by_id(state, prompt_ids, key, METHODS.index(cfg.method))


def thompson_draws(state: SelectionState, key, method):
    """MoPPS's Thompson sample gamma ~ Beta(alpha, beta) of every prompt, float32 [P]; zeros unless
    ``method`` (an index into :data:`METHODS`, may be traced) is mopps. The posterior changes only
    between steps, so a multi-round step draws once and every round's selection reads the same
    sample (a Beta draw per candidate per round was most of a round's cost)."""
    def draw():
        return jax.random.beta(key, state.alpha, state.beta).astype(jnp.float32)

    def zeros():
        return jnp.zeros_like(state.alpha)
    if isinstance(method, int):
        return draw() if method == METHODS.index("mopps") else zeros()
    return jax.lax.cond(method == METHODS.index("mopps"), draw, zeros)


def scores_by_id(state: SelectionState, prompt_ids, key, method, thompson=None):
    """:func:`selection_scores` with the method as an index into :data:`METHODS` (may be traced).
    ``thompson``: this step's :func:`thompson_draws` (float32 [P]); None: draw for these candidates."""
    def none():
        return jax.random.uniform(key, prompt_ids.shape)

    def mopps():
        if thompson is not None:
            return -jnp.abs(thompson[prompt_ids] - 0.5)
        gamma = jax.random.beta(key, state.alpha[prompt_ids], state.beta[prompt_ids])
        return -jnp.abs(gamma - 0.5)

    def dps():
        return dps_mixed_probability(state, prompt_ids).astype(jnp.float32)
    if isinstance(method, int):
        return (none, mopps, dps)[method]()
    return jax.lax.switch(method, (none, mopps, dps))


@functools.partial(jax.jit, static_argnames=("k_max", "cfg"))
def select_prompts(state: SelectionState, key, available, k, k_max: int, cfg: SelectionConfig):
    """Choose ``k`` prompts to roll out among those with ``available`` True (bool [P]).

    Draws a uniform random candidate pool of ``pool_ratio * k`` available prompts (``k`` when the
    method is none) and keeps the ``k`` best by :func:`selection_scores`. ``k`` may be traced;
    ``k_max`` >= k is the static output size (bucket it to limit recompiles). Returns (ids int32
    [k_max], ok bool [k_max]) best first; ok is False beyond k or where too few prompts were available.
    """
    return select_by_id(state, key, available, k, k_max, cfg, METHODS.index(cfg.method))


def select_by_id(state: SelectionState, key, available, k, k_max: int, cfg: SelectionConfig, method,
                 thompson=None):
    """:func:`select_prompts` with the method as an index into :data:`METHODS` (may be traced; then
    the pool is sized for ``cfg.pool_ratio`` and used only in part by method none). ``thompson``: see
    :func:`scores_by_id`."""
    num = available.shape[0]
    static_none = isinstance(method, int) and method == 0
    pool = min((1 if static_none else cfg.pool_ratio) * k_max, num)
    ratio = jnp.where(method == 0, 1, cfg.pool_ratio)
    k_pool, k_score = jax.random.split(key)
    # Gumbel top-k is sampling without replacement among the available prompts.
    gumbel = jax.random.gumbel(k_pool, (num,))
    pool_val, pool_ids = jax.lax.top_k(jnp.where(available, gumbel, -jnp.inf), pool)
    pool_ok = jnp.isfinite(pool_val) & (jnp.arange(pool) < ratio * k)
    score = jnp.where(pool_ok, scores_by_id(state, pool_ids, k_score, method, thompson), -jnp.inf)
    kk = min(k_max, pool)
    val, idx = jax.lax.top_k(score, kk)
    ids, ok = pool_ids[idx].astype(jnp.int32), jnp.isfinite(val) & (jnp.arange(kk) < k)
    if kk < k_max:
        ids = jnp.concatenate([ids, jnp.zeros((k_max - kk,), jnp.int32)])
        ok = jnp.concatenate([ok, jnp.zeros((k_max - kk,), bool)])
    return ids, ok


@functools.partial(jax.jit, static_argnames=("cfg", "prior_a", "prior_b"))
def selection_prior(state: SelectionState, prompt_ids, cfg: SelectionConfig, prior_a: float, prior_b: float):
    """Beta prior SARA uses for ``prompt_ids``: the selection state's decayed Beta when a selection
    method is on (the "SARA+DPS" composition), else the fixed (prior_a, prior_b)."""
    return prior_by_id(state, prompt_ids, METHODS.index(cfg.method), prior_a, prior_b)


def prior_by_id(state: SelectionState, prompt_ids, method, prior_a, prior_b):
    """:func:`selection_prior` with the method as an index into :data:`METHODS` (may be traced)."""
    on = method != 0
    return (jnp.where(on, state.alpha[prompt_ids], jnp.float32(prior_a)),
            jnp.where(on, state.beta[prompt_ids], jnp.float32(prior_b)))
