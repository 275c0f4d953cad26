"""Compile time against depth: the update step and the sampler (prefill + decode) of the Qwen3-0.6B shape.

    python benchmarks/compile.py --json                       # 4, 14 and 28 layers, layers scanned
    python benchmarks/compile.py --json --unrolled --layers 4 14   # the same body unrolled, for contrast

Each program is lowered from abstract parameters and compiled (never run), so no weights are
allocated; the shapes are small (compile time depends on the program, not the batch): the update
takes 8 rows x 256 tokens in 2 micro-batches, the sampler prefills 8 contexts of 128 tokens and
decodes 64 rows for up to 128 tokens. A one-layer compile of both runs first and is discarded, so
backend start-up is not charged to the first depth. ``*_ratio`` is the deepest over the shallowest.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from passrate_jax import sharding as shd
from passrate_jax.model.transformer import KVCache, Transformer
from passrate_jax.rl.batch import TrainBatch
from passrate_jax.rl.config import OptimizerConfig, RLConfig
from passrate_jax.rl.optimizer import make_optimizer
from passrate_jax.rl.train_step import make_train_step
from passrate_jax.sampling import core
from passrate_jax.sharding import MeshConfig

# Qwen/Qwen3-0.6B config.json (the depth is the benchmark's variable).
QWEN3_0P6B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_heads=16, num_kv_heads=8,
                  head_dim=128, qk_norm=True, rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=40960,
                  tie_embeddings=True)


def _timed(lowered_fn) -> tuple[float, float]:
    """(wall, process CPU) seconds to lower and compile; the CPU time is what other processes on a
    shared machine disturb least."""
    t, c = time.perf_counter(), time.process_time()
    lowered_fn().compile()
    return time.perf_counter() - t, time.process_time() - c


def compile_update(model_cfg, mesh, rows: int = 8, width: int = 256) -> tuple[float, float]:
    graphdef, params = nnx.split(nnx.eval_shape(lambda: Transformer(model_cfg, rngs=nnx.Rngs(0))))
    opt = make_optimizer(OptimizerConfig(learning_rate=1e-5))
    fns = make_train_step(graphdef, params, RLConfig(grad_accum=2), opt, mesh)
    i32, f32 = jax.ShapeDtypeStruct((rows, width), jnp.int32), jax.ShapeDtypeStruct((rows, width), jnp.float32)
    batch = TrainBatch(tokens=i32, positions=i32, attention_mask=i32, loss_mask=i32,
                       advantages=jax.ShapeDtypeStruct((rows,), jnp.float32), old_logprobs=f32)
    opt_abs = jax.eval_shape(opt.init, params)
    return _timed(lambda: fns.compiled.lower(params, opt_abs, batch, jax.ShapeDtypeStruct((2,), jnp.uint32)))


def compile_sampler(model_cfg, mesh, contexts: int = 8, rows: int = 64, t: int = 128,
                    g: int = 128) -> tuple[float, float]:
    """(wall, CPU) seconds to compile the prefill and the decode loop with the Sampler's shardings."""
    graphdef, params = nnx.split(nnx.eval_shape(lambda: Transformer(model_cfg, rngs=nnx.Rngs(0))))
    ps, layout = shd.param_shardings(params, mesh), shd.FsdpLayout(mesh)
    row_axes = shd.batch_sharding(mesh, 1).spec[0]
    rows1, rows2, rep = NamedSharding(mesh, P(row_axes)), NamedSharding(mesh, P(row_axes, None)), shd.replicated(mesh)
    pre_sh = core.PrefillOutput(last_logits_cv=rows2, cache=KVCache(*(NamedSharding(mesh, P(None, row_axes)),) * 2))
    prefill = jax.jit(functools.partial(core.prefill, graphdef=graphdef, model_cfg=model_cfg, cache_len=t + g,
                                        layout=layout), in_shardings=(ps, rows2, rows1), out_shardings=pre_sh)
    sds = jax.ShapeDtypeStruct
    first = _timed(lambda: prefill.lower(params, sds((contexts, t), jnp.int32), sds((contexts,), jnp.int32)))
    settings = core.DecodeSettings(top_k=0, top_p=1.0, pad_id=0, gen_len=g)
    decode = jax.jit(functools.partial(core.decode, graphdef=graphdef, settings=settings, layout=layout),
                     in_shardings=(ps, pre_sh, core.RowSpec(*(rows1,) * 5), rep, rep, rep))
    prefilled = jax.eval_shape(prefill, params, sds((contexts, t), jnp.int32), sds((contexts,), jnp.int32))
    spec = core.RowSpec(*(sds((rows,), jnp.int32),) * 5)
    second = _timed(lambda: decode.lower(params, prefilled, spec, sds((), jnp.int32), sds((8,), jnp.int32),
                                                 sds((), jnp.float32)))
    return first[0] + second[0], first[1] + second[1]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 14, 28])
    parser.add_argument("--unrolled", action="store_true", help="model.scan_layers = false")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)

    base = dict(QWEN3_0P6B, scan_layers=not args.unrolled)
    from passrate_jax.model.config import ModelConfig
    mesh = shd.make_mesh(MeshConfig(data=-1))
    warm = ModelConfig(**base, num_layers=1)
    compile_update(warm, mesh), compile_sampler(warm, mesh)
    times = {"update": {}, "sampler": {}}
    for layers in args.layers:
        cfg = dataclasses.replace(warm, num_layers=layers)
        times["update"][str(layers)] = compile_update(cfg, mesh)
        times["sampler"][str(layers)] = compile_sampler(cfg, mesh)
    lo, hi = str(min(args.layers)), str(max(args.layers))
    result = {"model": "qwen3-0.6b shape", "scan_layers": not args.unrolled}
    for name, per_depth in times.items():
        wall = {k: round(v[0], 2) for k, v in per_depth.items()}
        cpu = {k: round(v[1], 2) for k, v in per_depth.items()}
        result.update({f"{name}_compile_s": wall, f"{name}_compile_cpu_s": cpu,
                       f"{name}_ratio": round(wall[hi] / wall[lo], 2), f"{name}_cpu_ratio": round(cpu[hi] / cpu[lo], 2)})
    result.update({"platform": jax.devices()[0].platform, "devices": jax.device_count(),
                   "cpu_count": os.cpu_count(), "load_avg_1m": os.getloadavg()[0]})
    print(json.dumps(result) if args.json else "\n".join(f"{k:>18}: {v}" for k, v in result.items()))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
