"""Throughput of the full GRPO training step (forward + backward + optimizer) vs a plain matmul.

    python benchmarks/update.py --json                                   # ~22M-param Qwen3 shape, CPU
    python benchmarks/update.py --json --model-size qwen3-0.6b --dtype bfloat16 --peak-flops 989e12

FLOPs are counted from the model shape (PaLM convention): per token, 6 x (parameters in matmuls,
including the tied LM head) + 12 x layers x heads x head_dim x seq_len for attention (the model
computes the full score matrix). The old-logprob recompute forward is added when the config runs
one (not in the default one-update config, which reuses the training forward).

In the same process, a jitted matmul of the step's largest GEMM shape (tokens per micro-batch x
hidden x vocab, the LM head) and a square 2048^3 one are timed in the same dtype, before and after
the step; ``ratio`` is step FLOP/s over the *best* of those, so it is never flattered by a badly
shaped or unluckily timed reference. ``load_avg_1m`` records how busy the machine was.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from passrate_jax.run.config import MeshConfig
from passrate_jax.model.config import ModelConfig
from passrate_jax.model.transformer import Transformer
from passrate_jax.rl.batch import make_train_batch
from passrate_jax.rl.config import OptimizerConfig, RLConfig
from passrate_jax.rl.optimizer import make_optimizer
from passrate_jax.rl.train_step import make_train_step
from passrate_jax.sharding import make_mesh

MODELS = {
    # Qwen3 layout (GQA, q/k RMSNorm, SwiGLU, tied embeddings) at ~22M parameters for a CPU run.
    "small": ModelConfig(vocab_size=32000, hidden_size=384, intermediate_size=1024, num_layers=6, num_heads=6,
                         num_kv_heads=2, head_dim=64, qk_norm=True, rope_theta=1e6, tie_embeddings=True),
    # Qwen/Qwen3-0.6B config.json.
    "qwen3-0.6b": ModelConfig(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_layers=28,
                              num_heads=16, num_kv_heads=8, head_dim=128, qk_norm=True, rope_theta=1e6,
                              rms_norm_eps=1e-6, max_position_embeddings=40960, tie_embeddings=True),
}


def matmul_params(cfg: ModelConfig) -> int:
    """Parameters that take part in matmuls, per token: attention + MLP projections + the LM head."""
    d, e = cfg.hidden_size, cfg.resolved_head_dim
    attn = d * e * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
    mlp = 3 * d * cfg.intermediate_size
    return cfg.num_layers * (attn + mlp) + d * cfg.vocab_size


def step_flops(cfg: ModelConfig, rl: RLConfig, batch: int, seq_len: int) -> float:
    """Model FLOPs of one training step (all B x T positions go through the model)."""
    tokens = batch * seq_len
    fwd_per_token = 2 * matmul_params(cfg) + 4 * cfg.num_layers * cfg.num_heads * cfg.resolved_head_dim * seq_len
    updates = rl.ppo_epochs * rl.minibatches
    recompute = rl.recompute_old_logprobs and updates > 1
    return tokens * fwd_per_token * (3 * rl.ppo_epochs + (1 if recompute else 0))


def time_fn(fn, *args, iters: int) -> float:
    """Median seconds per call of an already compiled function (outputs blocked on)."""
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def matmul_flops_per_s(m: int, k: int, n: int, dtype, iters: int) -> float:
    """FLOP/s of a jitted [m, k] x [k, n] matmul (float32 accumulation)."""
    a = jax.random.normal(jax.random.key(1), (m, k), dtype)
    b = jax.random.normal(jax.random.key(2), (k, n), dtype)
    f = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32))
    jax.block_until_ready(f(a, b))
    return 2.0 * m * k * n / time_fn(f, a, b, iters=iters)


def make_batch(cfg: ModelConfig, batch: int, seq_len: int, group: int, prompt_len: int, seed: int = 0):
    """Random rollouts: ``prompt_len`` prompt tokens (mask 0), the rest generated, binary rewards."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(3, cfg.vocab_size, (batch, seq_len))
    attention = np.ones((batch, seq_len), np.int32)
    loss_mask = attention.copy()
    loss_mask[:, :prompt_len] = 0
    rewards = rng.integers(0, 2, batch).astype(np.float32)
    return make_train_batch(tokens, attention, loss_mask, rewards, np.arange(batch) // group)


def measure_train_step(model_cfg: ModelConfig, rl: RLConfig, *, batch: int, seq_len: int, group_size: int,
                       prompt_len: int, iters: int) -> dict:
    """Compile the training step for ``batch`` random rollouts of ``seq_len`` tokens on every device
    (data axis), run one warm-up step, and time ``iters`` steps (median). Returns the shapes, the
    compile and step seconds, the step's model FLOPs (:func:`step_flops`) and its rates."""
    mesh = make_mesh(MeshConfig(data=-1))
    graphdef, params = nnx.split(nnx.jit(lambda: Transformer(model_cfg, rngs=nnx.Rngs(0)))())
    n_params = sum(x.size for x in jax.tree.leaves(params))
    fns = make_train_step(graphdef, params, rl, make_optimizer(OptimizerConfig(learning_rate=1e-5)), mesh)
    params = jax.device_put(params, fns.param_shardings)
    opt_state = fns.init(params)
    rollouts = jax.device_put(make_batch(model_cfg, batch, seq_len, group_size, prompt_len), fns.batch_sharding)

    t = time.perf_counter()
    step = fns.compiled.lower(params, opt_state, rollouts, jax.random.key(0)).compile()
    compile_s = time.perf_counter() - t
    params, opt_state, metrics = step(params, opt_state, rollouts, jax.random.key(0))  # warm-up
    jax.block_until_ready(metrics)
    times = []
    for i in range(iters):
        t = time.perf_counter()
        params, opt_state, metrics = step(params, opt_state, rollouts, jax.random.key(i + 1))
        jax.block_until_ready((params, metrics))
        times.append(time.perf_counter() - t)
    step_s = float(np.median(times))
    flops = step_flops(model_cfg, rl, batch, seq_len)
    return {
        "params": int(n_params), "matmul_params": matmul_params(model_cfg), "batch": batch, "seq_len": seq_len,
        "grad_accum": rl.grad_accum, "ppo_epochs": rl.ppo_epochs, "minibatches": rl.minibatches,
        "remat": model_cfg.remat, "devices": jax.device_count(), "platform": jax.devices()[0].platform,
        "cpu_count": os.cpu_count(), "compile_s": round(compile_s, 2), "step_s": step_s, "step_flops": flops,
        "step_tokens_per_s": batch * seq_len / step_s, "step_flops_per_s": flops / step_s,
        "loss": float(metrics["loss"]), "skipped_steps": float(metrics["skipped_steps"]),
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-size", choices=sorted(MODELS), default="small")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="compute dtype (parameters and optimizer state stay float32)")
    parser.add_argument("--batch", type=int, default=64, help="sequences per step")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=64, help="leading tokens with loss mask 0")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--grad-accum", type=int, default=4, help="micro-batches per update (bounds memory)")
    parser.add_argument("--ppo-epochs", type=int, default=1)
    parser.add_argument("--minibatches", type=int, default=1)
    parser.add_argument("--iters", type=int, default=3, help="timed steps (median reported)")
    parser.add_argument("--peak-flops", type=float, default=None,
                        help="the chip's peak FLOP/s in --dtype (e.g. 989e12 for H100/H200 bf16 dense)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)

    model_cfg = dataclasses.replace(MODELS[args.model_size], dtype=args.dtype)
    rl = RLConfig(grad_accum=args.grad_accum, ppo_epochs=args.ppo_epochs, minibatches=args.minibatches)
    dtype = jnp.dtype(args.dtype)
    lm_head_shape = (args.batch * args.seq_len // (rl.minibatches * rl.grad_accum), model_cfg.hidden_size,
                     model_cfg.vocab_size)
    lm_head_before = matmul_flops_per_s(*lm_head_shape, dtype, iters=5)
    square_before = matmul_flops_per_s(2048, 2048, 2048, dtype, iters=9)
    step = measure_train_step(model_cfg, rl, batch=args.batch, seq_len=args.seq_len, group_size=args.group_size,
                              prompt_len=args.prompt_len, iters=args.iters)
    # The reference matmuls run before and after the timed steps and the best is kept, so a burst of
    # load from other processes during one of the windows cannot flatter the ratio.
    lm_head = max(lm_head_before, matmul_flops_per_s(*lm_head_shape, dtype, iters=5))
    square = max(square_before, matmul_flops_per_s(2048, 2048, 2048, dtype, iters=9))
    result = {
        "model_size": args.model_size, "dtype": args.dtype, **step,
        "matmul_lm_head_flops_per_s": lm_head, "matmul_square_flops_per_s": square,
        "matmul_flops_per_s": max(lm_head, square), "ratio": step["step_flops_per_s"] / max(lm_head, square),
        "load_avg_1m": os.getloadavg()[0],
    }
    if args.peak_flops:
        result["peak_flops"] = args.peak_flops
        result["mfu"] = step["step_flops_per_s"] / args.peak_flops
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k:>28}: {v:.4g}" if isinstance(v, float) else f"{k:>28}: {v}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
