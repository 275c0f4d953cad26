"""Sampler throughput: ours vs transformers generate vs no prefill sharing vs full recompute.

    python benchmarks/sampler.py --json                                   # ~34M Qwen3-shaped, CPU
    python benchmarks/sampler.py --json --layers scanned                  # the same under lax.scan
    python benchmarks/sampler.py --model-size qwen3-0.6b --dtype bfloat16  # GPU

Workload (defaults): 8 prompts x 8 continuations, 128-token prompts, exactly 128 new tokens each (no
stop ids, so every sampler produces the same number of tokens), temperature 1, random weights.
Reported rates are generated tokens per second of wall time for the whole job (prefill included),
measured after a warm-up call that compiles. FLOPs are counted from the model shape:
2 x (matmul parameters incl. the LM head) per processed token, plus 4 x layers x heads x head_dim x
(keys attended) per token for attention; processed tokens are the prefill tokens and the decode tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from passrate_jax.model import ModelConfig, Transformer, save_pretrained
from passrate_jax.sampling import Context, Sampler, SamplingConfig

SIZES = {
    # ~34M parameters: 6 layers, width 384, vocab 32000, untied embeddings (the reference shape).
    # Shallow, so unrolled by default (model.scan_layers: false): it compiles in seconds and decodes in
    # per-layer cache buffers (KVCache.decode_form), measured ~1.5x the scanned decode on a 2-core CPU.
    "small": ModelConfig(vocab_size=32000, hidden_size=384, intermediate_size=1024, num_layers=6, num_heads=6,
                         num_kv_heads=2, head_dim=64, qk_norm=True, tie_embeddings=False,
                         rope_theta=1_000_000.0, scan_layers=False),
    "qwen3-0.6b": ModelConfig(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_layers=28,
                              num_heads=16, num_kv_heads=8, head_dim=128, qk_norm=True, tie_embeddings=True,
                              rope_theta=1_000_000.0, max_position_embeddings=40960),
}


def random_model(cfg: ModelConfig, seed: int = 0) -> Transformer:
    """Random weights (std 0.02, norms 1) drawn with numpy: no init program to compile. Drawn in float32
    (no float64 temporaries): the 0.6B shape's 596M draws take seconds of a device lease, not tens."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(seed)
    state = jax.tree.map(lambda x: jnp.asarray(
        0.02 * rng.standard_normal(x.shape, np.float32) if len(x.shape) >= 2 else np.ones(x.shape, np.float32),
        x.dtype), state)
    return nnx.merge(graphdef, state)


def count_flops(cfg: ModelConfig, tokens: int, keys_per_token: float) -> float:
    """Forward FLOPs of ``tokens`` tokens each attending ``keys_per_token`` keys on average."""
    d, e, f = cfg.hidden_size, cfg.resolved_head_dim, cfg.intermediate_size
    per_layer = d * e * (2 * cfg.num_heads + 2 * cfg.num_kv_heads) + 3 * d * f
    matmul_params = cfg.num_layers * per_layer + d * cfg.vocab_size
    attention = 4 * cfg.num_layers * cfg.num_heads * e * keys_per_token
    return tokens * (2 * matmul_params + attention)


def job_flops(cfg: ModelConfig, prompts: int, rows: int, prompt_len: int, new_tokens: int) -> float:
    """FLOPs of the benchmark's job: each prompt prefilled once, then ``new_tokens`` decoded on every row
    (a decode token attends the prompt and, on average, half the generated tokens)."""
    return (count_flops(cfg, prompts * prompt_len, (prompt_len + 1) / 2)
            + count_flops(cfg, rows * new_tokens, prompt_len + new_tokens / 2))


def timed(fn, repeats: int) -> float:
    """Best wall time of ``repeats`` calls (seconds); ``fn`` must block until its result is ready."""
    best = float("inf")
    for i in range(repeats):
        start = time.perf_counter()
        fn(i)
        best = min(best, time.perf_counter() - start)
    return best


def bench_config(prompts: int, samples: int, prompt_len: int, new_tokens: int, **options) -> SamplingConfig:
    """Temperature 1 and one padding bucket per dimension sized to the workload (prefill buckets for
    shared and per-row prompts), so a sampler compiles one prefill and one decode program for it.
    ``options``: further SamplingConfig fields (benchmarks/device.py passes ``engine``)."""
    return SamplingConfig(temperature=1.0, max_new_tokens=new_tokens, row_buckets=(prompts * samples,),
                          context_buckets=(prompt_len,), prefill_row_buckets=(prompts, prompts * samples),
                          generation_buckets=(new_tokens,), **options)


def bench_ours(model, prompts, args, share: bool) -> tuple[float, Sampler]:
    cfg = bench_config(len(prompts), args.samples, args.prompt_len, args.new_tokens)
    sampler = Sampler(model, cfg, eos_id=None)
    if share:
        contexts = [Context(p, num_samples=args.samples, context_id=i) for i, p in enumerate(prompts)]
    else:  # one context per row: every continuation re-runs its prompt's prefill
        contexts = [Context(p, num_samples=1, context_id=i, first_sample_index=j)
                    for i, p in enumerate(prompts) for j in range(args.samples)]
    sampler.generate(contexts, seed=0)  # compile
    seconds = timed(lambda i: sampler.generate(contexts, seed=i + 1), args.repeats)
    return seconds, sampler


def bench_recompute(model, prompts, args) -> float:
    """Per-step time of a sampler without a KV cache (every step re-runs the whole sequence), measured at
    the job's mean sequence length ``prompt_len + new_tokens / 2`` so it equals the average step cost."""
    graphdef, params = nnx.split(model)
    rows = len(prompts) * args.samples
    width = args.prompt_len + args.new_tokens // 2

    @jax.jit
    def step(params, tokens_bt, key):
        logits = nnx.merge(graphdef, params)(tokens_bt)[:, -1]
        return jax.random.categorical(key, logits).astype(jnp.int32)

    tokens = jnp.asarray(np.random.default_rng(0).integers(3, model.cfg.vocab_size, (rows, width)), jnp.int32)
    step(params, tokens, jax.random.key(0)).block_until_ready()
    per_step = timed(lambda i: step(params, tokens, jax.random.key(i)).block_until_ready(), args.recompute_steps)
    return per_step * args.new_tokens


def bench_hf(model, prompts, args) -> float | None:
    try:
        import torch
        import transformers
    except ImportError:
        return None
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    with tempfile.TemporaryDirectory() as directory:
        save_pretrained(model, directory)
        hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).to(device).eval()
    ids = torch.tensor(np.asarray(prompts), device=device)
    kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                  num_return_sequences=args.samples, max_new_tokens=args.new_tokens,
                  min_new_tokens=args.new_tokens, pad_token_id=0)

    def run(_, new_tokens=args.new_tokens):
        with torch.no_grad():
            out = hf.generate(ids, **dict(kwargs, max_new_tokens=new_tokens, min_new_tokens=new_tokens))
        assert out.shape == (len(prompts) * args.samples, args.prompt_len + new_tokens), out.shape
        if device == "cuda":
            torch.cuda.synchronize()

    run(0, new_tokens=4)  # warm-up (allocator, kernels); PyTorch compiles nothing
    return timed(run, args.hf_repeats)


def bench_matmul(rows: int, cfg: ModelConfig, dtype) -> float:
    """FLOP/s of a jitted [rows, d] x [d, V] matmul: the decode step's largest (the LM head)."""
    a = jnp.ones((rows, cfg.hidden_size), dtype)
    b = jnp.ones((cfg.hidden_size, cfg.vocab_size), dtype)
    mm = jax.jit(lambda a, b: a @ b)
    mm(a, b).block_until_ready()
    seconds = timed(lambda _: mm(a, b).block_until_ready(), 10)
    return 2 * rows * cfg.hidden_size * cfg.vocab_size / seconds


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-size", choices=sorted(SIZES), default="small")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--layers", choices=("scanned", "unrolled"), default=None,
                   help="model.scan_layers true / false (default: the size's own, unrolled for small)")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--samples", type=int, default=8, help="continuations per prompt")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2, help="timed calls of our sampler (best is reported)")
    p.add_argument("--hf-repeats", type=int, default=1)
    p.add_argument("--recompute-steps", type=int, default=3, help="timed steps of the recompute sampler")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)

    cfg = SIZES[args.model_size]
    cfg = dataclasses.replace(cfg, dtype=args.dtype, param_dtype=args.dtype)
    if args.layers is not None:
        cfg = dataclasses.replace(cfg, scan_layers=args.layers == "scanned")
    model = random_model(cfg)
    n_params = sum(int(x.size) for x in jax.tree.leaves(nnx.state(model)))
    prompts = np.random.default_rng(1).integers(3, cfg.vocab_size, (args.prompts, args.prompt_len)).tolist()
    new_tokens = args.prompts * args.samples * args.new_tokens

    ours_s, sampler = bench_ours(model, prompts, args, share=True)
    no_share_s, no_share = bench_ours(model, prompts, args, share=False)
    recompute_s = bench_recompute(model, prompts, args)
    hf_s = None if args.skip_hf else bench_hf(model, prompts, args)
    flops = job_flops(cfg, args.prompts, args.prompts * args.samples, args.prompt_len, args.new_tokens)
    calls = 1 + args.repeats  # warm-up + timed generate calls per sampler
    out = {
        "model_size": args.model_size, "dtype": args.dtype, "params": n_params, "scan_layers": cfg.scan_layers,
        "device": str(jax.devices()[0].platform), "device_count": jax.device_count(),
        "workload": f"{args.prompts} prompts x {args.samples} continuations, {args.prompt_len}-token prompts, "
                    f"{args.new_tokens} new tokens",
        "ours_tok_s": new_tokens / ours_s,
        "hf_tok_s": None if hf_s is None else new_tokens / hf_s,
        "no_share_tok_s": new_tokens / no_share_s,
        "recompute_tok_s": new_tokens / recompute_s,
        "prefill_calls": sampler.prefill_calls // calls,
        "no_share_prefill_calls": no_share.prefill_calls // calls,
        "compilations": sampler.compilations,
        "sampler_flops_per_s": flops / ours_s,
        "matmul_flops_per_s": bench_matmul(args.prompts * args.samples, cfg, jnp.dtype(args.dtype)),
        "ours_seconds": ours_s, "hf_seconds": hf_s,
    }
    if hf_s:
        out["speedup_vs_hf"] = hf_s / ours_s
    out["speedup_vs_recompute"] = recompute_s / ours_s
    if args.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k:24s} {v:,.1f}" if isinstance(v, float) else f"{k:24s} {v}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
