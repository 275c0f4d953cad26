"""Per-device memory of a preset's programs, before renting the machine: compile (never run) the update
step, the sampler's prefill and its decode loop at the preset's worst-case shapes, on fake CPU devices
laid out as the preset's mesh, and print XLA's buffer assignment per device next to the analytic sizes.

    .venv/bin/python launch/memory_probe.py --config configs/qwen3_1p7b_tpu_v5e.yaml
    .venv/bin/python launch/memory_probe.py --config configs/qwen3_8b_tpu_v5p8.yaml --json

The model is the preset's shape with random weights (``model.pretrained`` is ignored, so no checkpoint
is needed; the preset must spell out the checkpoint's shape, as the Qwen3 presets do). Shapes:

* update: ``allocation.num_prompts * group_size`` rows x the width bucket of ``--prompt-tokens +
  sampling.max_new_tokens`` (passrate_jax.rollout.store.WIDTH_BUCKETS), split into ``rl.grad_accum`` micro-batches;
* round 0 of a step (SARA / uniform with Prefix Sampling): up to ``max_replay_share * B`` replayed groups
  of N rows whose contexts hold the prompt plus a prefix of up to ``ratio_max * max_new_tokens`` tokens,
  plus the first probes of the fresh prompts; later rounds: up to B * N rows of prompt-only contexts.

XLA's CPU buffer assignment is a cross-check, not the accelerator's: it upcasts some bfloat16
temporaries, and with bfloat16 weights it keeps a float32 copy of all of them (no bfloat16 dot on CPU),
which the peak subtracts (``cpu_bf16_upcast_bytes``). The decode loop is not compiled: XLA CPU has no bfloat16 scatter and converts the whole
KV cache to float32 and back at every step, which TPU and GPU do not; its size is computed instead
(parameters + KV cache + float32 logits of the decode rows). The layers run under one scan, so compiling
the full depth costs about what one layer does; ``--layers 2`` still measures at 1 and 2 layers and
extrapolates linearly in depth.
"""

from __future__ import annotations

import argparse
import json
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
    parser.add_argument("--json", action="store_true", help="print one JSON object (devices, "
                        "peak_bytes_per_device, per-program and analytic bytes)")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value")
    args = parser.parse_args(argv)

    from passrate_jax.run.config import load_config
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

    summary = probe(cfg, args.prompt_tokens, args.layers)
    if args.json:
        print(json.dumps(summary))
    else:
        depths = summary["measured_layers"]
        if len(depths) > 1:
            print(f"# measured at {depths[0]} and {depths[1]} layers, extrapolated to {cfg.model.num_layers}")
        report(summary)
    return 0


def probe(cfg, prompt_tokens: int, layers: int = 0, platform: str = "cpu") -> dict:
    """:func:`summarize` of the programs compiled (never run) for jax's current backend, ``platform``: at
    the full depth, or at 1 and ``layers`` layers extrapolated linearly to it (``layers`` > 0)."""
    depth = cfg.model.num_layers
    depths = [depth] if not layers or layers >= depth else [1, layers]
    results = [measure(cfg, n, prompt_tokens) for n in depths]
    if len(results) == 1:
        at_depth = results[0]
    else:
        (l1, r1), (l2, r2) = zip(depths, results)
        at_depth = {k: r1[k] + (r2[k] - r1[k]) * (depth - l1) / (l2 - l1) for k in r1}
    summary = summarize(cfg, prompt_tokens, at_depth, platform)
    summary["measured_layers"] = depths
    return summary


def shapes(cfg, prompt_tokens: int) -> dict:
    """The worst-case program shapes of one step (see the module docstring)."""
    from passrate_jax.sampling.sampler import bucket
    from passrate_jax.rollout.store import WIDTH_BUCKETS
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
    opt_abs = jax.eval_shape(fns.init, params)  # the adapters' state alone under LoRA
    rows, width = sh["update_rows"], sh["width"]
    i32 = sds((rows, width), jnp.int32)
    batch = TrainBatch(tokens=i32, positions=i32, attention_mask=i32, loss_mask=i32,
                       advantages=sds((rows,), jnp.float32), old_logprobs=sds((rows, width), jnp.float32))
    m = fns.compiled.lower(params, opt_abs, batch, sds((2,), jnp.uint32)).compile().memory_analysis()
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
        prefill = jax.jit(functools.partial(core.prefill, graphdef=graphdef, model_cfg=model_cfg, cache_len=t + g,
                                            layout=shd.FsdpLayout(mesh)),
                          in_shardings=(ps, rows2, rows1), out_shardings=pre_sh)
        m = prefill.lower(params, sds((c, t), jnp.int32), sds((c,), jnp.int32)).compile().memory_analysis()
        out[f"{phase}_prefill"] = m.argument_size_in_bytes + m.temp_size_in_bytes + m.output_size_in_bytes
    return out


def summarize(cfg, prompt_tokens: int, measured: dict, platform: str = "cpu") -> dict:
    """Per-device bytes: XLA's buffer assignment of each compiled program, the analytic sizes next to it,
    and the peak over the step's programs. ``platform``: the backend ``measured`` was compiled for; only
    XLA CPU's float32 copy of bfloat16 weights is taken out (benchmarks/device.py compiles for the GPU)."""
    from passrate_jax.cli.info import parameter_count
    mc = cfg.model
    n_params = parameter_count(mc)
    data, fsdp, tensor = _mesh_sizes(cfg)
    shards, row_shards = fsdp * tensor, data * fsdp
    p_item = 2 if mc.param_dtype == "bfloat16" else 4
    kv_token = 2 * mc.num_layers * mc.num_kv_heads * mc.resolved_head_dim * (2 if mc.dtype == "bfloat16" else 4)
    sh = shapes(cfg, prompt_tokens)
    # Resident for the whole run: parameters and the AdamW moments (stored in the parameter dtype).
    # Under LoRA only the float32 adapters have gradients and AdamW moments.
    n_train, t_item = (_adapter_count(mc), 4) if mc.lora.rank else (n_params, p_item)
    param_bytes, opt_bytes = p_item * n_params / shards, 2 * t_item * n_train / shards
    kv = {phase: (sh[phase][1] + sh[phase][0]) * (sh[phase][2] + sh[phase][3]) * kv_token / row_shards
          for phase in ("round0", "later")}
    # Decode is not compiled (see the module docstring): parameters, AdamW, KV cache, float32 logits.
    decode = max(param_bytes + opt_bytes + kv[ph] + 3 * sh[ph][1] * mc.vocab_size * 4 / row_shards
                 for ph in ("round0", "later"))
    # XLA CPU has no bfloat16 dot: it converts bfloat16 weights to float32 and hoists that convert out of
    # the layer scan, i.e. a float32 copy of every weight (measured: an 8-layer bf16 model's prefill
    # temporaries were 2.3x its weights, a float32 one's 0.14x). TPU and GPU multiply bfloat16 natively.
    upcast = 4 * n_params / shards if mc.param_dtype == "bfloat16" and platform == "cpu" else 0.0
    prefill = max(measured["round0_prefill"], measured["later_prefill"]) + opt_bytes - upcast
    programs = {"update": measured["update"] - upcast, "prefill": prefill, "decode": decode}
    return {
        "config": cfg.model.pretrained or "", "devices": cfg.mesh.devices or 1, "platform": platform,
        "mesh": {"data": data, "fsdp": fsdp, "tensor": tensor}, "parameters": n_params,
        "param_dtype": mc.param_dtype, "dtype": mc.dtype, "remat": mc.remat, "lora_rank": mc.lora.rank,
        "trainable_parameters": n_train,
        "update_rows": sh["update_rows"], "update_width": sh["width"], "grad_accum": cfg.rl.grad_accum,
        "micro_batch_rows_per_device": sh["update_rows"] // cfg.rl.grad_accum // row_shards,
        "analytic_bytes_per_device": {"parameters": param_bytes, "adamw": opt_bytes,
                                      "gradients": 2 * t_item * n_train / shards,
                                      "kv_cache_round0": kv["round0"], "kv_cache_later": kv["later"],
                                      "kv_bytes_per_token": kv_token},
        "xla_bytes_per_device": measured, "cpu_bf16_upcast_bytes": upcast,
        "program_bytes_per_device": programs,
        "peak_program": max(programs, key=programs.get),
        "peak_bytes_per_device": max(programs.values()),
    }


def _adapter_count(model_cfg) -> int:
    import jax
    from flax import nnx

    from passrate_jax.model.transformer import Transformer
    abstract = nnx.eval_shape(lambda: Transformer(model_cfg, rngs=nnx.Rngs(0)))
    return sum(int(x.size) for x in jax.tree.leaves(nnx.state(abstract, nnx.LoRAParam)))


def report(s: dict) -> None:
    gb = 1e9
    a, m = s["analytic_bytes_per_device"], s["mesh"]
    print(f"# {s['devices']} device(s), mesh data={m['data']} fsdp={m['fsdp']} tensor={m['tensor']}; "
          f"{s['parameters'] / 1e9:.3f}B parameters in {s['param_dtype']} ({s['trainable_parameters']:,} trained), "
          f"compute {s['dtype']}, remat {s['remat']}")
    print(f"analytic per device: parameters {a['parameters'] / gb:.2f} GB + AdamW {a['adamw'] / gb:.2f} GB resident; "
          f"gradients + accumulator {a['gradients'] / gb:.2f} GB during the update; KV cache "
          f"{a['kv_bytes_per_token'] / 1024:.0f} KiB per token: round 0 {a['kv_cache_round0'] / gb:.2f} GB, later "
          f"rounds {a['kv_cache_later'] / gb:.2f} GB")
    print(f"update: {s['update_rows']} rows x {s['update_width']} tokens in {s['grad_accum']} micro-batches of "
          f"{s['micro_batch_rows_per_device']} row(s) per device")
    print("XLA CPU buffer assignment per device (GB): "
          + ", ".join(f"{k} {v / gb:.2f}" for k, v in s["xla_bytes_per_device"].items())
          + (f"; less its float32 copy of the bfloat16 weights, {s['cpu_bf16_upcast_bytes'] / gb:.2f} GB, in the "
             "update and prefill below" if s["cpu_bf16_upcast_bytes"] else ""))
    p = s["program_bytes_per_device"]
    print(f"peak per device: update {p['update'] / gb:.1f} GB (XLA CPU), prefill {p['prefill'] / gb:.1f} GB "
          f"(XLA CPU + optimizer state), decode {p['decode'] / gb:.1f} GB (analytic); "
          f"peak {s['peak_bytes_per_device'] / gb:.1f} GB ({s['peak_program']})")


if __name__ == "__main__":
    sys.exit(main())
