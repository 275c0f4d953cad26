"""The sharded GRPO update: one explicit ``jax.jit`` per training step.

    fns = make_train_step(graphdef, params, rl_cfg, make_optimizer(opt_cfg), mesh)
    opt_state = fns.init(params)
    params, opt_state, metrics = fns.step(params, opt_state, batch, rng)

Inside one step (all in one jitted function of ``(params, opt_state, batch, rng)``):
  1. old log-probabilities are recomputed with the current params (default), or taken from the
     sampler (``recompute_old_logprobs = False``);
  2. ``ppo_epochs`` x ``minibatches`` optimizer updates (nested ``lax.scan``); each epoch reshuffles
     the rows when there is more than one minibatch;
  3. each update accumulates gradients over ``grad_accum`` micro-batches (``lax.scan``); micro-batch
     losses use the minibatch's token / sequence totals, so they add up to the minibatch loss;
  4. an update whose loss or gradient is not finite is rejected by ``optax.apply_if_finite``
     (params and optimizer state unchanged) and counted.

``params`` and ``opt_state`` are donated (with LoRA adapters: the adapters and ``opt_state`` only, so
the frozen base weights survive the step); in/out shardings come from the mesh and the parameters'
logical axes (:mod:`passrate_jax.sharding`).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from passrate_jax import sharding
from passrate_jax.model.lora import TRAINABLE_WITH_LORA, has_adapters
from passrate_jax.rl.batch import TrainBatch, split_rows
from passrate_jax.rl.config import RLConfig
from passrate_jax.rl.losses import grpo_loss, token_logprobs
from passrate_jax.rl.optimizer import skipped_updates

METRIC_NAMES = ("loss", "clip_frac_low", "clip_frac_high", "kl", "entropy", "grad_norm", "tokens",
                "skipped_steps", "total_skipped_steps", "updates")


class UpdateFns(NamedTuple):
    """The jitted functions of the update and the shardings they were built with.

    init: ``params -> opt_state`` placed on ``opt_shardings`` (of the LoRA adapters alone when the
      parameters hold adapters: then only they train).
    step: ``(params, opt_state, batch, rng) -> (params, opt_state, metrics)``; params and opt_state
      are donated; ``metrics`` is a dict of float32 scalars named by :data:`METRIC_NAMES`. With LoRA
      adapters only the adapters and opt_state are donated and the frozen base weights come back as the
      very same arrays, so a KL reference sharing them (``model.reference_params``) stays valid.
    compiled: the one jitted program behind ``step`` (for ``.lower`` and compile counts); with LoRA it
      returns the new adapters instead of the whole parameter state.

    Place the first params with ``jax.device_put(params, fns.param_shardings)`` (step outputs already
    are): an array without a mesh in its type traces differently and would cost a second compile.
    """
    init: Callable
    step: Callable
    compiled: Any
    param_shardings: Any
    opt_shardings: Any
    batch_sharding: NamedSharding


def unsplit_rows(x: jax.Array) -> jax.Array:
    """Inverse of :func:`passrate_jax.rl.batch.split_rows`: [parts, B // parts, ...] -> [B, ...]."""
    parts, rows = x.shape[:2]
    return jnp.swapaxes(x, 0, 1).reshape((parts * rows,) + x.shape[2:])


def policy_logprobs(graphdef: nnx.GraphDef, params, tokens_bt, positions_bt, attention_mask_bt, layout=None):
    """Per-token log-probabilities and entropies (nats, float32 [B, T], aligned with the tokens;
    column 0 is 0) of the model ``nnx.merge(graphdef, params)``. Pure; jit it or call it inside jit.
    ``layout``: the model's sharding constraints (e.g. :class:`passrate_jax.sharding.FsdpLayout`)."""
    model = nnx.merge(graphdef, params)
    logits_btv = model(tokens_bt, positions_bt, attention_mask_bt, layout=layout)
    return token_logprobs(logits_btv, tokens_bt)


def opt_state_shardings(optimizer: optax.GradientTransformation, params, param_shardings, mesh: Mesh):
    """Shardings for ``optimizer.init(params)``: parameter-shaped moments follow the parameters,
    everything else (counts, flags) is replicated."""
    abstract = jax.eval_shape(optimizer.init, params)
    rep = sharding.replicated(mesh)
    return optax.tree_map_params(optimizer, lambda _, s: s, abstract, param_shardings,
                                 transform_non_params=lambda _: rep)


def _count_tokens_and_rows(mask_bt):
    m = mask_bt.astype(bool)
    return jnp.maximum(m.sum(), 1).astype(jnp.float32), jnp.maximum(m.any(-1).sum(), 1).astype(jnp.float32)


class _Trainable(NamedTuple):
    """Which part of the parameters trains: all of them, or with LoRA adapters the adapters alone (the
    optimizer sees and keeps state for them only; the base weights pass through the step unchanged)."""
    lora: bool

    def split(self, p):
        """(trainable, frozen); frozen is None without adapters."""
        return nnx.split_state(p, TRAINABLE_WITH_LORA, ...) if self.lora else (p, None)

    def join(self, trainable, frozen):
        return nnx.merge_state(trainable, frozen) if self.lora else trainable


def make_train_step(graphdef: nnx.GraphDef, params, cfg: RLConfig, optimizer: optax.GradientTransformation,
                    mesh: Mesh) -> UpdateFns:
    """Build the jitted, sharded update for the model ``graphdef`` (from ``nnx.split(model)``).

    Args:
      graphdef: static model structure; ``params`` is the matching ``nnx.State`` (concrete or
        abstract; only shapes and logical-axis metadata are read here).
      cfg: loss and PPO-loop settings (static).
      optimizer: from :func:`passrate_jax.rl.optimizer.make_optimizer` (its skip counter is read).
      mesh: ("data", "fsdp", "tensor") mesh. The batch rows must split evenly into
        ``minibatches * grad_accum`` micro-batches, each divisible by ``data * fsdp``.
    """
    p_shard = sharding.param_shardings(params, mesh)
    trainable = _Trainable(has_adapters(params))
    t_shard = trainable.split(p_shard)[0]
    o_shard = opt_state_shardings(optimizer, trainable.split(params)[0], t_shard, mesh)
    b_shard = sharding.batch_sharding(mesh, 1)  # a prefix spec: dim 0 split, other dims replicated
    layout = sharding.FsdpLayout(mesh)  # weights gathered per layer, activations split by rows

    def constrain_split(tree):
        # [parts, rows, ...]: keep every part spread over all data-parallel devices.
        return jax.lax.with_sharding_constraint(tree, NamedSharding(mesh, PartitionSpec(None, ("data", "fsdp"))))

    # On-policy single update: old = current params, so the ratio is exactly 1 in value and
    # stop_gradient(logp) from the training forward replaces a separate recompute forward.
    reuse_forward = cfg.recompute_old_logprobs and cfg.ppo_epochs * cfg.minibatches == 1

    def loss_fn(t, frozen, micro: TrainBatch, num_tokens, num_rows):
        logp, entropy = policy_logprobs(graphdef, trainable.join(t, frozen), micro.tokens, micro.positions,
                                        micro.attention_mask, layout)
        old = jax.lax.stop_gradient(logp) if reuse_forward else micro.old_logprobs
        return grpo_loss(cfg, logp, old, micro.advantages, micro.loss_mask, ref_logp_bt=micro.ref_logprobs,
                         entropy_bt=entropy, num_tokens=num_tokens, num_sequences=num_rows)

    update = _minibatch_update(cfg, jax.value_and_grad(loss_fn, has_aux=True), optimizer, t_shard, constrain_split)

    def epoch(carry, key, batch: TrainBatch, frozen):
        if cfg.minibatches > 1:
            perm = jax.random.permutation(key, batch.tokens.shape[0])
            batch = jax.lax.with_sharding_constraint(jax.tree.map(lambda x: x[perm], batch), b_shard)
        minibatches = constrain_split(jax.tree.map(lambda x: split_rows(x, cfg.minibatches), batch))
        return jax.lax.scan(lambda c, mb: update(c, mb, frozen), carry, minibatches)

    def step(p, o, batch: TrainBatch, rng):
        skipped_before = skipped_updates(o)
        if cfg.recompute_old_logprobs and not reuse_forward:
            # Same micro-batch size as training, so peak memory stays that of one micro-batch.
            parts = cfg.minibatches * cfg.grad_accum
            fields = constrain_split(jax.tree.map(lambda x: split_rows(x, parts),
                                                  (batch.tokens, batch.positions, batch.attention_mask)))
            old = jax.lax.map(lambda f: policy_logprobs(graphdef, p, *f, layout)[0], fields)
            batch = batch.replace(old_logprobs=jax.lax.stop_gradient(unsplit_rows(old)))
        keys = jax.random.split(rng, cfg.ppo_epochs)
        t, frozen = trainable.split(p)
        (t, o), per_update = jax.lax.scan(lambda c, k: epoch(c, k, batch, frozen), (t, o), keys)
        return t, o, _step_metrics(cfg, per_update, batch.loss_mask, skipped_before, skipped_updates(o))

    return _compile_update(step, optimizer, trainable, p_shard, o_shard, b_shard, sharding.replicated(mesh))


def _minibatch_update(cfg: RLConfig, grad_fn, optimizer: optax.GradientTransformation, t_shard, constrain_split):
    """One optimizer update of a minibatch, ``(trainable, opt_state), minibatch, frozen -> (new carry,
    stats)``: gradients accumulated over ``grad_accum`` micro-batches, vetoed when not finite."""
    def update(carry, minibatch: TrainBatch, frozen):
        t, o = carry
        num_tokens, num_rows = _count_tokens_and_rows(minibatch.loss_mask)
        micros = constrain_split(jax.tree.map(lambda x: split_rows(x, cfg.grad_accum), minibatch))

        def accumulate(acc, micro):
            (loss, stats), grads = grad_fn(t, frozen, micro, num_tokens, num_rows)
            return jax.tree.map(jnp.add, acc, (loss, stats, grads)), None

        zero_stats = {k: jnp.zeros((), jnp.float32) for k in ("tokens", "clip_low", "clip_high", "kl", "entropy")}
        zero_grads = jax.lax.with_sharding_constraint(jax.tree.map(jnp.zeros_like, t), t_shard)
        (loss, stats, grads), _ = jax.lax.scan(accumulate, (jnp.zeros((), jnp.float32), zero_stats, zero_grads),
                                               micros)
        # apply_if_finite inspects the gradient only; a non-finite loss must veto the update too.
        grads = jax.tree.map(lambda g: jnp.where(jnp.isfinite(loss), g, jnp.nan), grads)
        grad_norm = optax.tree.norm(grads)
        updates, o = optimizer.update(grads, o, t)
        t = optax.apply_updates(t, updates)
        return (t, o), dict(stats, loss=loss, grad_norm=grad_norm, applied=o.last_finite)

    return update


def _step_metrics(cfg: RLConfig, per_update: dict, loss_mask, skipped_before, total_skipped) -> dict:
    """The step's metrics (:data:`METRIC_NAMES`) over the updates that were applied; NaN when every
    update was skipped."""
    applied = per_update["applied"]
    n_applied = applied.sum()
    total = lambda x: jnp.where(applied, x, 0.0).sum()
    per_token = jnp.where(n_applied > 0, jnp.maximum(total(per_update["tokens"]), 1.0), jnp.nan)
    return {
        "loss": total(per_update["loss"]) / n_applied,
        "clip_frac_low": total(per_update["clip_low"]) / per_token,
        "clip_frac_high": total(per_update["clip_high"]) / per_token,
        "kl": total(per_update["kl"]) / per_token,
        "entropy": total(per_update["entropy"]) / per_token,
        "grad_norm": total(per_update["grad_norm"]) / n_applied,
        "tokens": loss_mask.astype(bool).sum().astype(jnp.float32),
        "skipped_steps": (total_skipped - skipped_before).astype(jnp.float32),
        "total_skipped_steps": total_skipped.astype(jnp.float32),
        "updates": jnp.asarray(cfg.ppo_epochs * cfg.minibatches, jnp.float32),
    }


def _compile_update(step, optimizer, trainable: _Trainable, p_shard, o_shard, b_shard, rep) -> UpdateFns:
    """Jit ``step`` and the optimizer's init with their shardings and donations."""
    t_shard = trainable.split(p_shard)[0]
    # Returning the frozen base from the jitted program would copy it (jit does not forward an input
    # buffer to an output), and donating it would delete the arrays a KL reference shares: with LoRA
    # the program returns the adapters alone and the base is joined back outside, untouched.
    step_jit = jax.jit(step, in_shardings=(p_shard, o_shard, b_shard, rep),
                       out_shardings=(t_shard, o_shard, rep), donate_argnums=(1,) if trainable.lora else (0, 1))

    def step_fn(p, o, batch: TrainBatch, rng):
        t, o, metrics = step_jit(p, o, batch, rng)
        return trainable.join(t, trainable.split(p)[1]), o, metrics

    init_jit = jax.jit(lambda p: optimizer.init(trainable.split(p)[0]), in_shardings=(p_shard,), out_shardings=o_shard)
    return UpdateFns(init=init_jit, step=step_fn if trainable.lora else step_jit, compiled=step_jit,
                     param_shardings=p_shard, opt_shardings=o_shard, batch_sharding=b_shard)
