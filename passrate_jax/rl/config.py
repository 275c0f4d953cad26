"""Static settings of the policy update and its optimizer."""

from __future__ import annotations

import dataclasses
from typing import Literal

from passrate_jax.configlib import option


@dataclasses.dataclass(frozen=True)
class RLConfig:
    """GRPO-family loss and PPO loop settings."""
    advantage: Literal["grpo", "dr_grpo", "rloo"] = option(
        "grpo", doc="grpo: (r - mean) / (std + eps); dr_grpo: r - mean; rloo: r - leave-one-out mean")
    advantage_eps: float = option(1e-6, gt=0, doc="added to the group reward std (grpo)")
    loss_aggregation: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"] = option(
        "token_mean", doc="DAPO token-mean, GRPO seq-mean-token-mean, Dr.GRPO seq-mean-token-sum / constant")
    loss_norm_constant: float = option(256.0, gt=0, doc="Dr.GRPO normaliser (tokens)")
    clip_low: float = option(0.2, ge=0, lt=1)
    clip_high: float = option(0.28, ge=0)
    dual_clip: float | None = option(None, gt=1, doc="dual-clip constant c > 1 for negative advantages")
    kl_coef: float = option(0.0, ge=0)
    kl_estimator: Literal["k1", "k3"] = option("k3")
    ppo_epochs: int = option(1, ge=1, doc="passes over the batch per training step")
    minibatches: int = option(1, ge=1, doc="optimizer updates per epoch (rows reshuffled each epoch)")
    grad_accum: int = option(1, ge=1, doc="micro-batches per update (memory only; same result)")
    recompute_old_logprobs: bool = option(True, doc="False: take the sampler's logprobs")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW with warm-up + cosine decay and global-norm clipping."""
    learning_rate: float = option(1e-4, gt=0)
    warmup_steps: int = option(0, ge=0, doc="linear warm-up from 0, in optimizer updates")
    decay_steps: int = option(0, ge=0, doc="cosine decay length in optimizer updates after warm-up; "
                              "0: constant after warm-up")
    final_lr_fraction: float = option(0.1, ge=0, le=1)
    weight_decay: float = option(0.0, ge=0)
    b1: float = option(0.9, ge=0, lt=1)
    b2: float = option(0.999, ge=0, lt=1)
    eps: float = option(1e-8, gt=0)
    max_grad_norm: float = option(1.0, gt=0)
