"""Per-device memory of a preset's programs, before renting the machine: compile (never run) the update
step, the sampler's prefill and its decode loop at the preset's worst-case shapes, on fake CPU devices
laid out as the preset's mesh, and print XLA's buffer assignment per device next to the analytic sizes.

    .venv/bin/python launch/memory_probe.py --config configs/qwen3_1p7b_tpu_v5e.yaml

The model is the preset's shape with random weights (``model.pretrained`` is ignored, so no checkpoint
is needed; the preset must spell out the checkpoint's shape, as the Qwen3 presets do). Shapes:

* update: ``allocation.num_prompts * group_size`` rows x the width bucket of ``--prompt-tokens +
  sampling.max_new_tokens`` (passrate_jax.train.WIDTH_BUCKETS), split into ``rl.grad_accum`` micro-batches;
* round 0 of a step (SARA / uniform with Prefix Sampling): up to ``max_replay_share * B`` replayed groups
  of N rows whose contexts hold the prompt plus a prefix of up to ``ratio_max * max_new_tokens`` tokens,
  plus the first probes of the fresh prompts; later rounds: up to B * N rows of prompt-only contexts.

XLA's CPU buffer assignment is a cross-check, not the accelerator's (it upcasts some bfloat16
temporaries). The decode loop is not compiled: XLA CPU has no bfloat16 scatter and converts the whole
KV cache to float32 and back at every step, which TPU and GPU do not; its size is computed instead
(parameters + KV cache + float32 logits of the decode rows). Compiling the full depth of an 8B model for 16 devices takes a few minutes on
2 CPU cores; ``--layers 2`` measures two layers and extrapolates linearly in depth.
"""

from __future__ import annotations

import argparse
import math
import os
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--prompt-tokens", type=int, default=256,
                        help="longest rendered prompt, in tokens (GSM8K with the Qwen3 chat template: < 256)")
    parser.add_argument("--layers", type=int, default=0, help="measure at 1 and this many layers and "
                        "extrapolate to the model's depth (0: compile the full depth)")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value")
    args = parser.parse_args(argv)

    from passrate_jax.config import load_config
    cfg = load_config(args.config, ["model.pretrained=null", *args.overrides])
    devices = cfg.mesh.devices or 1
    # Fake devices must be requested before jax initialises its backends.
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={devices}").strip()
    import jax
    if len(jax.devices()) != devices:
        print(f"memory_probe: jax already initialised with {len(jax.devices())} devices; run in a fresh process",
              file=sys.stderr)
        return 2

    depth = cfg.model.num_layers
    depths = [depth] if not args.layers or args.layers >= depth else [1, args.layers]
    results = [measure(cfg, layers, args.prompt_tokens) for layers in depths]
    if len(results) == 1:
        at_depth = results[0]
    else:
        (l1, r1), (l2, r2) = zip(depths, results)
        at_depth = {k: r1[k] + (r2[k] - r1[k]) * (depth - l1) / (l2 - l1) for k in r1}
        print(f"# measured at {l1} and {l2} layers, extrapolated to {depth}")
    report(cfg, args.prompt_tokens, at_depth)
    return 0


def shapes(cfg, prompt_tokens: int) -> dict:
    """The worst-case program shapes of one step (see the module docstring)."""
    from passrate_jax.sampling.sampler import bucket
    from passrate_jax.train import WIDTH_BUCKETS
    s, a, ps = cfg.sampling, cfg.allocation, cfg.prefix_sampling
    row_shards = _row_shards(cfg)
    b, n = a.num_prompts, a.group_size
    g = bucket(s.max_new_tokens, s.generation_buckets)
    replays = int(ps.max_replay_share * b) if ps.enabled else 0
    first = min(a.sara.round_schedule[0], n) if a.method == "sara" else n
    rows0 = min(b * n, replays * n + (b - replays) * first)
    longest_prefix = math.floor(ps.ratio_max * s.max_new_tokens) if replays else 0
    return {
        "update_rows": b * n,
        "width": bucket(prompt_tokens + s.max_new_tokens, WIDTH_BUCKETS),
        "round0": (bucket(b, s.prefill_row_buckets, row_shards), bucket(rows0, s.row_buckets, row_shards),
                   bucket(prompt_tokens + longest_prefix, s.context_buckets), g),
        "later": (bucket(b, s.prefill_row_buckets, row_shards), bucket(b * n, s.row_buckets, row_shards),
                  bucket(prompt_tokens, s.context_buckets), g),
    }


def _mesh_sizes(cfg) -> tuple[int, int, int]:
    """(data, fsdp, tensor) with a -1 resolved against ``mesh.devices``."""
    sizes = [cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor]
    if -1 in sizes:
        sizes[sizes.index(-1)] = (cfg.mesh.devices or 1) // math.prod(x for x in sizes if x != -1)
    return tuple(sizes)


def _row_shards(cfg) -> int:
    data, fsdp, _ = _mesh_sizes(cfg)
    return data * fsdp


def measure(cfg, layers: int, prompt_tokens: int) -> dict:
    """Per-device bytes of each program at ``layers`` layers."""
    import dataclasses
    import functools

    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from passrate_jax import sharding as shd
    from passrate_jax.model.transformer import KVCache, Transformer
    from passrate_jax.rl.batch import TrainBatch
    from passrate_jax.rl.optimizer import make_optimizer
    from passrate_jax.rl.train_step import make_train_step
    from passrate_jax.sampling import core

    model_cfg = dataclasses.replace(cfg.model, num_layers=layers)
    mesh = shd.make_mesh(cfg.mesh)
    graphdef, params = nnx.split(nnx.eval_shape(lambda: Transformer(model_cfg, rngs=nnx.Rngs(0))))
    sds = jax.ShapeDtypeStruct
    sh = shapes(cfg, prompt_tokens)
    out = {}

    # The update step (arguments: parameters, optimizer state and batch; temporaries: gradients, the
    # accumulator, activations of one micro-batch).
    opt = make_optimizer(cfg.optimizer)
    fns = make_train_step(graphdef, params, cfg.rl, opt, mesh)
    opt_abs = jax.eval_shape(opt.init, params)
    rows, width = sh["update_rows"], sh["width"]
    i32 = sds((rows, width), jnp.int32)
    batch = TrainBatch(tokens=i32, positions=i32, attention_mask=i32, loss_mask=i32,
                       advantages=sds((rows,), jnp.float32), old_logprobs=sds((rows, width), jnp.float32))
    m = fns.step.lower(params, opt_abs, batch, sds((2,), jnp.uint32)).compile().memory_analysis()
    batch_bytes = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(batch)) / mesh.size
    out["state"] = m.argument_size_in_bytes - batch_bytes
    out["update"] = m.argument_size_in_bytes + m.temp_size_in_bytes

    ps = shd.param_shardings(params, mesh)
    row_axes = shd.batch_sharding(mesh, 1).spec[0]
    rows1, rows2 = NamedSharding(mesh, P(row_axes)), NamedSharding(mesh, P(row_axes, None))
    cache_sh = KVCache(*(NamedSharding(mesh, P(None, row_axes)),) * 2)
    pre_sh = core.PrefillOutput(last_logits_cv=rows2, cache=cache_sh)
    for phase in ("round0", "later"):
        c, _, t, g = sh[phase]
        prefill = jax.jit(functools.partial(core.prefill, graphdef=graphdef, model_cfg=model_cfg, cache_len=t + g),
                          in_shardings=(ps, rows2, rows1), out_shardings=pre_sh)
        m = prefill.lower(params, sds((c, t), jnp.int32), sds((c,), jnp.int32)).compile().memory_analysis()
        out[f"{phase}_prefill"] = m.argument_size_in_bytes + m.temp_size_in_bytes + m.output_size_in_bytes
    return out


def report(cfg, prompt_tokens: int, measured: dict) -> None:
    from passrate_jax.info import parameter_count
    mc = cfg.model
    n_params = parameter_count(mc)
    data, fsdp, tensor = _mesh_sizes(cfg)
    shards, row_shards = fsdp * tensor, data * fsdp
    kv_token = 2 * mc.num_layers * mc.num_kv_heads * mc.resolved_head_dim * (2 if mc.dtype == "bfloat16" else 4)
    sh = shapes(cfg, prompt_tokens)
    gb = 1e9
    print(f"# {cfg.mesh.devices or 1} device(s), mesh data={data} fsdp={fsdp} tensor={tensor}; "
          f"{n_params / 1e9:.3f}B parameters")
    print(f"analytic: parameters float32 {4 * n_params / shards / gb:.2f} GB + AdamW {8 * n_params / shards / gb:.2f} GB "
          f"per device (over fsdp x tensor = {shards}); gradients + accumulator {8 * n_params / shards / gb:.2f} GB "
          f"during the update")
    print(f"analytic: KV cache {kv_token / 1024:.0f} KiB per token; rows split over data x fsdp = {row_shards}")
    for phase in ("round0", "later"):
        c, r, t, g = sh[phase]
        print(f"analytic: {phase}: {r} decode rows + {c} prefilled contexts x {t + g} slots = "
              f"{(r + c) * (t + g) * kv_token / row_shards / gb:.2f} GB of KV cache per device; prefill float32 "
              f"logits {c * t * mc.vocab_size * 4 / row_shards / tensor / gb:.2f} GB per device")
    print(f"update: {sh['update_rows']} rows x {sh['width']} tokens in {cfg.rl.grad_accum} micro-batches of "
          f"{sh['update_rows'] // cfg.rl.grad_accum // row_shards} row(s) per device")
    print("XLA CPU buffer assignment per device (GB): "
          + ", ".join(f"{k} {v / gb:.2f}" for k, v in measured.items()))
    # The optimizer state stays resident while the sampler runs (its programs take only the parameters).
    opt_bytes, param_bytes = 8 * n_params / shards, 4 * n_params / shards
    prefill = max(measured["round0_prefill"], measured["later_prefill"]) + opt_bytes
    decode = max(param_bytes + opt_bytes + (r + c) * (t + g) * kv_token / row_shards
                 + 3 * r * mc.vocab_size * 4 / row_shards for c, r, t, g in (sh["round0"], sh["later"]))
    print(f"peak per device: update {measured['update'] / gb:.1f} GB (XLA CPU), prefill {prefill / gb:.1f} GB "
          f"(XLA CPU + optimizer state), decode {decode / gb:.1f} GB (analytic)")


if __name__ == "__main__":
    sys.exit(main())
