"""Prefix Sampling (DESIGN.md 2.4): bucket assignment for any group size and the per-bucket EMA
controller of the prefix cut ratio, as a jit-compatible pytree with pure init / update.

Buckets for group size N with h = floor(N / 4): hard buckets are s = 1..h (ids 0..h-1, replay a
*successful* prefix), easy buckets are s = N-h..N-1 (ids h..2h-1, replay a *failed* prefix); s = 0
and s = N are degenerate, the rest balanced. For N = 8 that is hard {1, 2}, easy {6, 7}.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct

from passrate_jax.allocation.config import PrefixSamplingConfig

DEGENERATE, BALANCED, HARD, EASY = 0, 1, 2, 3


def num_buckets(group_size: int) -> int:
    """Number of controlled (skewed) buckets, 2 * floor(N / 4)."""
    return 2 * (group_size // 4)


def bucket_successes(group_size: int) -> list[int]:
    """Success count of each bucket id, e.g. [1, 2, 6, 7] for N = 8."""
    h = group_size // 4
    return list(range(1, h + 1)) + list(range(group_size - h, group_size))


def bucket_kind(s, group_size: int):
    """DEGENERATE, BALANCED, HARD or EASY for success counts ``s`` of full groups, int32 elementwise."""
    s = jnp.asarray(s)
    h = group_size // 4
    return jnp.where((s == 0) | (s == group_size), DEGENERATE,
                     jnp.where(s <= h, HARD, jnp.where(s >= group_size - h, EASY, BALANCED))).astype(jnp.int32)


def bucket_index(s, group_size: int):
    """Bucket id in [0, 2h) of skewed success counts, -1 for degenerate or balanced ones."""
    s = jnp.asarray(s)
    h = group_size // 4
    kind = bucket_kind(s, group_size)
    return jnp.where(kind == HARD, s - 1, jnp.where(kind == EASY, s - (group_size - h) + h, -1)).astype(jnp.int32)


def replay_eligible(s, group_size: int, cfg: PrefixSamplingConfig):
    """True where a full group with ``s`` successes gets a re-rollout group (hard always, easy unless hard_only)."""
    kind = bucket_kind(s, group_size)
    return (kind == HARD) | ((kind == EASY) & (cfg.mode != "hard_only"))


@struct.dataclass
class PrefixControlState:
    """Per-bucket controller state, K = 2 floor(N/4) buckets.

    ratio: float32 [K], prefix cut ratio r_b (fraction of the source response replayed).
    ema: float32 [K], EMA of the bucket's re-rollout pass rate (starts at the target).
    """
    ratio: jax.Array
    ema: jax.Array


def prefix_control_init(group_size: int, cfg: PrefixSamplingConfig) -> PrefixControlState:
    """Every bucket at ratio_init with its EMA at the target."""
    k = num_buckets(group_size)
    return PrefixControlState(ratio=jnp.full((k,), cfg.ratio_init, jnp.float32),
                              ema=jnp.full((k,), cfg.target, jnp.float32))


@struct.dataclass
class ControllerGains:
    """The controller's tunable numbers as arrays (float32 scalars), so a sweep can vmap over them.
    target: pass rate aimed at; deadzone: delta; step: eta; ema_decay: rho."""
    target: jax.Array
    deadzone: jax.Array
    step: jax.Array
    ema_decay: jax.Array


def controller_gains(cfg: PrefixSamplingConfig) -> ControllerGains:
    """The gains ``cfg`` sets."""
    f = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    return ControllerGains(target=f(cfg.target), deadzone=f(cfg.deadzone), step=f(cfg.step),
                           ema_decay=f(cfg.ema_decay))


@functools.partial(jax.jit, static_argnames=("cfg",))
def prefix_control_update(state: PrefixControlState, successes, rollouts, cfg: PrefixSamplingConfig,
                          gains: ControllerGains | None = None):
    """One step of every bucket's controller.

    Args:
      successes, rollouts: float [K], re-rollout successes and re-rollouts of each bucket this step;
        buckets with no re-rollouts keep their state.

    ema <- rho ema + (1 - rho) p_hat; e = ema - target; outside the deadzone |e| > delta,
    r <- clip(r - sigma eta sign(e), r_min, r_max) with sigma = +1 for hard (success-prefix) buckets,
    -1 for easy (failure-prefix) ones: a too-easy hard bucket gets a shorter head start, a too-easy
    easy bucket a longer handicap. Mode "fixed" tracks the EMA but never moves the ratio.
    ``gains`` (traced) replaces cfg's target, deadzone, step and ema_decay when given.
    """
    g = controller_gains(cfg) if gains is None else gains
    k = state.ratio.shape[0]
    seen = jnp.asarray(rollouts) > 0
    p_hat = jnp.asarray(successes, jnp.float32) / jnp.maximum(jnp.asarray(rollouts, jnp.float32), 1.0)
    ema = jnp.where(seen, g.ema_decay * state.ema + (1 - g.ema_decay) * p_hat, state.ema)
    err = ema - g.target
    sigma = jnp.where(jnp.arange(k) < k // 2, 1.0, -1.0)
    moved = jnp.clip(state.ratio - sigma * g.step * jnp.sign(err), cfg.ratio_min, cfg.ratio_max)
    adapt = seen & (jnp.abs(err) > g.deadzone) & (cfg.mode != "fixed")
    return PrefixControlState(ratio=jnp.where(adapt, moved, state.ratio), ema=ema)


@functools.partial(jax.jit, static_argnames=("cfg",))
def plan_replays(key, rewards, cfg: PrefixSamplingConfig):
    """For full groups ``rewards`` int [G, N]: (eligible bool [G], bucket int32 [G], source int32 [G]),
    the replay source being a random minority-outcome rollout (see :func:`choose_minority`)."""
    g, n = rewards.shape
    s = rewards.sum(1)
    src = choose_minority(key, rewards, jnp.full((g,), n, jnp.int32))
    return replay_eligible(s, n, cfg), bucket_index(s, n), src


@jax.jit
def choose_minority(key, rewards, lengths):
    """Index of one random minority-outcome rollout of each group (the replay source).

    rewards: int [G, Nmax] (0/1), lengths: int [G] rollouts per group. Minority = successes for a
    group with fewer successes than failures, failures otherwise. Returns int32 [G].
    """
    g, nmax = rewards.shape
    present = jnp.arange(nmax)[None, :] < lengths[:, None]
    s = jnp.sum(jnp.where(present, rewards, 0), axis=1)
    want = jnp.where(2 * s < lengths, 1, 0)[:, None]
    ok = present & (rewards == want)
    noise = jax.random.gumbel(key, (g, nmax))
    return jnp.argmax(jnp.where(ok, noise, -jnp.inf), axis=1).astype(jnp.int32)
