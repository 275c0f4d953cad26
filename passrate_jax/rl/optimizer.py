"""The Optax optimizer of the policy update, built from :class:`OptimizerConfig`.

    skip-if-non-finite( clip_by_global_norm -> AdamW(warm-up + cosine schedule) )

The schedule and the skip counter advance once per *optimizer update*, i.e. ``ppo_epochs *
minibatches`` times per training step.
"""

from __future__ import annotations

import jax
import optax

from passrate_jax.rl.config import OptimizerConfig

# optax.apply_if_finite gives up and applies a non-finite update after this many consecutive
# rejections; its counter saturates at int32 max, so this value means "never apply one".
_NEVER_APPLY = 2**31 - 1


def learning_rate_schedule(cfg: OptimizerConfig) -> optax.Schedule:
    """Learning rate per optimizer update: linear warm-up from 0 over ``warmup_steps``, then cosine
    decay to ``final_lr_fraction * learning_rate`` over ``decay_steps`` more updates (constant when 0)."""
    lr = cfg.learning_rate
    if cfg.decay_steps == 0:
        if cfg.warmup_steps == 0:
            return optax.constant_schedule(lr)
        return optax.join_schedules([optax.linear_schedule(0.0, lr, cfg.warmup_steps), optax.constant_schedule(lr)],
                                    [cfg.warmup_steps])
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=lr, warmup_steps=cfg.warmup_steps,
        decay_steps=cfg.warmup_steps + cfg.decay_steps, end_value=lr * cfg.final_lr_fraction)


def _decay_mask(params):
    # Decoupled weight decay on weight matrices only: pulling norm scales (init 1) or biases toward 0
    # would change the function rather than regularise it. Names come from the model's state paths.
    def decays(path, _):
        names = [str(getattr(k, "key", getattr(k, "name", ""))) for k in path]
        return not any("norm" in n or "bias" in n for n in names)
    return jax.tree_util.tree_map_with_path(decays, params)


def make_optimizer(cfg: OptimizerConfig) -> optax.GradientTransformation:
    """AdamW with global-norm clipping, wrapped so a non-finite gradient is never applied.

    The outer state is :class:`optax.ApplyIfFiniteState`; its ``total_notfinite`` counts skipped updates.
    """
    inner = optax.chain(
        optax.clip_by_global_norm(cfg.max_grad_norm),
        optax.adamw(learning_rate_schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                    weight_decay=cfg.weight_decay, mask=_decay_mask),
    )
    return optax.apply_if_finite(inner, max_consecutive_errors=_NEVER_APPLY)


def skipped_updates(opt_state) -> jax.Array:
    """Total number of updates rejected as non-finite so far (int32 scalar)."""
    if not isinstance(opt_state, optax.ApplyIfFiniteState):
        raise TypeError("opt_state does not come from make_optimizer (expected optax.ApplyIfFiniteState)")
    return opt_state.total_notfinite
