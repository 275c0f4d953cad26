"""Every accelerator measurement the project needs, in one run that fits a short device lease (issue 37).

    python3 benchmarks/device.py --out "$OUT"             # one GPU (or TPU): about 6 minutes, budget 420 s
    python3 benchmarks/device.py --cpu --out /tmp/device  # the same on small shapes: 1-2 minutes on 2 cores

Measurements, each in its own try block (a failure is recorded and the rest still run), in this order:

* ``matmul``: a jitted square bfloat16 matmul on random data, the measured ceiling beside the datasheet peak.
* ``sampler_<engine>``: sampler new tokens/s in the Qwen3-0.6B preset's shape (configs/qwen3_0p6b_gpu.yaml,
  random weights), 32 prompts x 8 rows, 256-token prompts, 512 new tokens, for every engine that
  ``SamplingConfig.engine`` offers: ``rounds`` (one ``Sampler.generate`` over every row) and ``slots`` (the
  slot engine a run drives, a pool of half as many slots as rows, refilled from the queue between chunks of
  8 decode steps): a fixed-length job (every row to the token limit) and a varied-length one (per-row
  budgets drawn from a lognormal, p99 / median about 6), with the decode slot utilization of the varied job.
* ``update_remat_<none|full>``: the training step of the 0.6B shape at the preset's micro-batch (4 rows of
  768 tokens), model FLOP/s and MFU against the chip's bf16 dense peak (benchmarks/update.py's count).
* ``memory_1p7b``: the 1.7B preset's peak bytes per device, launch/memory_probe.py's method (programs
  compiled, never run) on this backend: its own buffer assignment rather than XLA CPU's.

A global time budget skips a measurement whose estimate would overrun it (recorded as skipped), and a
watchdog ends the run if one is still going 45 s past the budget (recorded as failed). Results go
to ``OUT/device.json`` (rewritten after every measurement, so a killed run keeps what finished) and a
short table to ``OUT/device.txt`` and stdout. docs/performance_device.md says how to read them.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import math
import os
import platform
import sys
import threading
import time
import traceback
import typing
from collections.abc import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # benchmarks/ and launch/ import as namespace packages from the repository root

import flax  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from benchmarks import sampler as sampler_bench  # noqa: E402
from benchmarks import update as update_bench  # noqa: E402
from launch import memory_probe  # noqa: E402
from passrate_jax.rl.config import RLConfig  # noqa: E402
from passrate_jax.run.config import load_config  # noqa: E402
from passrate_jax.sampling import Context, Sampler, SamplingConfig, SlotEngine  # noqa: E402

# bfloat16 dense (no structured sparsity) peak FLOP/s per chip, keyed by a substring of jax's device_kind;
# the first match wins, so a variant's name comes before its family's. Sources: NVIDIA's H200 datasheet
# (SXM 1,979 TFLOP/s with sparsity, so 989 dense; NVL 1,671 -> 835), H100 datasheet (SXM 989, PCIe 756),
# A100 datasheet (312); Google Cloud TPU system-architecture pages (v4 275, v5e 197, v5p 459, v6e 918).
PEAK_BF16_FLOPS = (
    ("H200 NVL", 835e12), ("H200", 989e12), ("H100 PCIe", 756e12), ("H100", 989e12), ("A100", 312e12),
    ("TPU v5 lite", 197e12), ("TPU v5e", 197e12), ("TPU v5p", 459e12), ("TPU v5", 459e12),
    ("TPU v4", 275e12), ("TPU v6 lite", 918e12), ("TPU v6e", 918e12),
)
ENGINES = ("rounds", "slots")  # SamplingConfig.engine values measured, when the option exists


def peak_bf16_flops(device_kind: str) -> float | None:
    """The table's peak for ``device_kind`` (e.g. 'NVIDIA H200'), None for a chip it does not list (CPUs)."""
    return next((peak for key, peak in PEAK_BF16_FLOPS if key.lower() in device_kind.lower()), None)


@dataclasses.dataclass(frozen=True)
class Profile:
    """Shapes of one run: ``gpu`` (the presets' own) or ``cpu`` (small: a minute or two on 2 cores)."""
    name: str
    budget_s: float
    matmul_size: int
    model_overrides: tuple[str, ...]  # applied to configs/qwen3_0p6b_gpu.yaml's model (sampler and update)
    sampler_job: tuple[int, int, int, int]  # prompts, rows per prompt, prompt tokens, new tokens
    engine_slots: int  # the slot engine's pool: half the job's rows, so finished rows are refilled from the queue
    update_job: tuple[int, int, int, int]  # rows, tokens per row (prompt 1/3), micro-batches, timed steps
    memory_overrides: tuple[str, ...]  # applied to configs/qwen3_1p7b_gpu.yaml
    memory_prompt_tokens: int
    estimates_s: dict  # Entry.kind -> seconds one measurement of it is expected to take (compiles included)


# The presets' shapes: qwen3_gsm8k.yaml's 32 prompts x 8 rollouts, prompts < 256 tokens, 512 new tokens; the
# update's micro-batch of 4 rows x 768 tokens (rl.grad_accum 64 of 256 rows). Estimates: an H200, 2026-12-04.
GPU = Profile("gpu", budget_s=420.0, matmul_size=8192, model_overrides=(), sampler_job=(32, 8, 256, 512),
              engine_slots=128,
              update_job=(32, 768, 8, 3), memory_overrides=(), memory_prompt_tokens=256,
              estimates_s={"matmul": 10, "sampler": 90, "update": 30, "memory": 40})
SMALL_MODEL = ("model.vocab_size=512", "model.hidden_size=64", "model.intermediate_size=128", "model.num_layers=2",
               "model.num_heads=4", "model.num_kv_heads=2", "model.head_dim=16")
# The budget is far above the minute or two this takes, so a loaded machine does not skip what the test checks.
CPU = Profile("cpu", budget_s=600.0, matmul_size=256, model_overrides=SMALL_MODEL, sampler_job=(4, 4, 32, 32),
              engine_slots=8,
              update_job=(8, 48, 2, 2), memory_overrides=SMALL_MODEL, memory_prompt_tokens=32,
              estimates_s={"matmul": 2, "sampler": 15, "update": 15, "memory": 15})


# ---------------------------------------------------------------------------------------------- the runner
@dataclasses.dataclass(frozen=True)
class Entry:
    """One measurement: ``run()`` returns {"metrics": positive numbers, "settings": ..., "headline": str}.
    ``kind``: entries of one kind cost about the same, so a finished one's time updates the estimate."""
    name: str
    kind: str
    estimate_s: float
    run: Callable[[], dict]


def run_entries(entries: list[Entry], budget_s: float, on_record: Callable[[dict], None] = lambda r: None) -> dict:
    """Run each entry in order, each in its own try block: {name: record} with status ok, failed (the error
    and its traceback) or skipped (the elapsed time plus its estimate, or the time a finished entry of its
    kind took, would overrun ``budget_s``). ``on_record(records)`` after every change, an entry's start
    (status running) included, so a run killed mid-measurement leaves a file that names it."""
    start, records, took = time.perf_counter(), {}, {}
    for entry in entries:
        elapsed = time.perf_counter() - start
        estimate = max(entry.estimate_s, took.get(entry.kind, 0.0))
        if elapsed + estimate > budget_s:
            records[entry.name] = {"status": "skipped", "reason": f"elapsed {elapsed:.0f} s + estimate "
                                   f"{estimate:.0f} s would exceed the budget of {budget_s:.0f} s"}
            on_record(records)
            continue
        records[entry.name] = {"status": "running"}
        on_record(records)
        t = time.perf_counter()
        try:
            records[entry.name] = {"status": "ok", **entry.run()}
        except Exception as e:  # noqa: BLE001 - every failure is data for the report, never fatal
            records[entry.name] = {"status": "failed", "error": f"{type(e).__name__}: {e}"[:2000],
                                   "traceback": traceback.format_exc()[-4000:]}
        took[entry.kind] = records[entry.name]["seconds"] = round(time.perf_counter() - t, 2)
        gc.collect()  # the measurement's arrays are garbage now: free their device memory before the next
        on_record(records)
    return records


# ---------------------------------------------------------------------------------------------- measurements
def measure_matmul(n: int, peak: float | None) -> dict:
    rate = update_bench.matmul_flops_per_s(n, n, n, jnp.bfloat16, iters=10)
    metrics = {"flops_per_s": rate, **({"fraction_of_peak": rate / peak} if peak else {})}
    return {"metrics": metrics, "settings": {"shape": [n, n, n], "dtype": "bfloat16", "data": "random normal"},
            "headline": f"{rate / 1e12:.1f} TFLOP/s" + (f" ({rate / peak:.0%} of peak)" if peak else "")}


def sampler_engines() -> tuple[list[str | None], str]:
    """The ``engine`` values to build SamplingConfig with and why: None (no such option: the sampler's one
    mode, rounds) or SamplingConfig.engine's values among ENGINES."""
    if "engine" not in {f.name for f in dataclasses.fields(SamplingConfig)}:
        return [None], "SamplingConfig has no 'engine' option yet: round mode measured alone"
    allowed = typing.get_args(typing.get_type_hints(SamplingConfig).get("engine")) or ENGINES
    return [e for e in ENGINES if e in allowed], f"SamplingConfig.engine offers {list(allowed)}: each measured"


def round_utilization(lengths: np.ndarray, rows: int) -> float:
    """Live rows / slots over a round's decode steps: every step runs all ``rows`` (padded) rows until the
    longest row ends, so the slot-steps are rows x the longest length and the live ones the tokens made."""
    return float(np.sum(lengths)) / (rows * max(int(np.max(lengths)), 1))


def varied_budgets(rows: int, new_tokens: int, seed: int = 0) -> list[int]:
    """Per-row token budgets with a long tail: lognormal, median new_tokens / 6, sigma 0.8 (p99 / median
    about 6.4), clipped to [4, new_tokens]; the answer lengths of a reasoning workload, not of random text."""
    draws = np.random.default_rng(seed).lognormal(math.log(new_tokens / 6), 0.8, rows)
    return [int(x) for x in np.clip(np.round(draws), 4, new_tokens)]


def time_varied_job(sampler, prompts: list, samples: int, budgets: list[int]) -> tuple[float, np.ndarray]:
    """Best seconds of 2 calls (after a compiling one) whose rows have their own token budgets, and the
    lengths made. One context per row, from a shared store, so each prompt is still prefilled once."""
    varied = [Context(prompts[r // samples], num_samples=1, context_id=r // samples, first_sample_index=r % samples,
                      max_new_tokens=b) for r, b in enumerate(budgets)]
    results = []
    run = lambda i: results.append(sampler.generate(varied, seed=i, store=sampler.kv_store()))  # noqa: E731
    run(0)
    seconds = sampler_bench.timed(lambda i: run(i + 1), 2)
    return seconds, results[-1].lengths


def engine_pass(engine: SlotEngine, sampler, contexts: list[Context], seed: int) -> tuple[np.ndarray, float]:
    """One pass of the slot engine over ``contexts`` (queued in order, a fresh step store): the lengths of
    the rollouts it finished and the pool's own slot utilization (live rows / slots over its decode steps)."""
    pool = engine.pool(sampler.kv_store(), seed=seed)
    for c in contexts:
        pool.add(c, tag=c.context_id)
    lengths = []
    while not pool.idle:
        lengths += [len(f.ids) for f in pool.advance()]
    return np.asarray(lengths), pool.utilization


def time_engine_job(engine: SlotEngine, sampler, contexts: list[Context]) -> tuple[float, np.ndarray, float]:
    """Best seconds of 2 engine passes after a compiling one, with the last pass's lengths and utilization."""
    results = [engine_pass(engine, sampler, contexts, 0)]
    seconds = sampler_bench.timed(lambda i: results.append(engine_pass(engine, sampler, contexts, i + 1)), 2)
    return seconds, *results[-1]


def measure_sampler(model_cfg, job: tuple[int, int, int, int], engine: str | None, peak: float | None,
                    slots: int = 0, chunk: int = 8) -> dict:
    """Round mode (``engine`` None or rounds): ``Sampler.generate`` over every row at once. ``slots``: the
    slot engine (``SlotEngine``, what a run with ``sampling.engine=slots`` drives) with ``slots`` rows,
    refilled between chunks of ``chunk`` decode steps, over the same rollouts queued in order."""
    prompts_n, samples, prompt_len, new_tokens = job
    rows = prompts_n * samples
    prompts = np.random.default_rng(1).integers(3, model_cfg.vocab_size, (prompts_n, prompt_len)).tolist()
    options = {} if engine is None else {"engine": engine}
    sampler = Sampler(sampler_bench.random_model(model_cfg),
                      sampler_bench.bench_config(prompts_n, samples, prompt_len, new_tokens, **options), eos_id=None)
    fixed = [Context(p, num_samples=samples, context_id=i) for i, p in enumerate(prompts)]
    budgets = varied_budgets(rows, new_tokens)
    utilization, source = None, "not reported by this engine"
    if engine == "slots":
        slot_engine = SlotEngine(sampler, rows=slots or rows, chunk=chunk, length=prompt_len + new_tokens)
        varied = [Context(prompts[r // samples], num_samples=1, context_id=r // samples,
                          first_sample_index=r % samples, max_new_tokens=b) for r, b in enumerate(budgets)]
        fixed_s, _, _ = time_engine_job(slot_engine, sampler, fixed)
        varied_s, lengths, utilization = time_engine_job(slot_engine, sampler, varied)
        source, pool = "reported by the slot engine's pool", {"slots": slot_engine.rows, "chunk_tokens": chunk}
    else:
        sampler.generate(fixed, seed=0)  # compiles
        fixed_s = sampler_bench.timed(lambda i: sampler.generate(fixed, seed=i + 1), 2)
        varied_s, lengths = time_varied_job(sampler, prompts, samples, budgets)
        utilization, source, pool = round_utilization(lengths, rows), "computed from the lengths (round mode)", {}
    flops = sampler_bench.job_flops(model_cfg, prompts_n, rows, prompt_len, new_tokens)
    metrics = {"fixed_new_tokens_per_s": rows * new_tokens / fixed_s, "fixed_flops_per_s": flops / fixed_s,
               "varied_new_tokens_per_s": float(np.sum(lengths)) / varied_s, "fixed_seconds": fixed_s,
               "varied_seconds": varied_s, **({"fixed_mfu": flops / fixed_s / peak} if peak else {})}
    if utilization is not None:
        metrics["varied_slot_utilization"] = utilization
    settings = {"engine": engine or "rounds", "dtype": model_cfg.dtype, "param_dtype": model_cfg.param_dtype,
                "scan_layers": model_cfg.scan_layers, "rows": rows, "prompts": prompts_n, "prompt_len": prompt_len,
                "new_tokens": new_tokens, "varied_mean_budget": float(np.mean(budgets)),
                "varied_max_length": int(np.max(lengths)), "compilations": sampler.compilations,
                "utilization_source": source, **pool}
    headline = (f"{metrics['fixed_new_tokens_per_s']:,.0f} tok/s fixed, {metrics['varied_new_tokens_per_s']:,.0f} "
                f"varied" + (f", utilization {utilization:.2f}" if utilization is not None else ""))
    return {"metrics": metrics, "settings": settings, "headline": headline}


def measure_update(model_cfg, job: tuple[int, int, int, int], remat: str, peak: float | None) -> dict:
    rows, seq_len, grad_accum, iters = job
    cfg = dataclasses.replace(model_cfg, remat=remat)
    step = update_bench.measure_train_step(cfg, RLConfig(grad_accum=grad_accum), batch=rows, seq_len=seq_len,
                                           group_size=8, prompt_len=seq_len // 3, iters=iters)
    metrics = {k: step[k] for k in ("step_s", "compile_s", "step_flops", "step_flops_per_s", "step_tokens_per_s")}
    if peak:
        metrics["mfu"] = step["step_flops_per_s"] / peak
    settings = {k: step[k] for k in ("params", "batch", "seq_len", "grad_accum", "remat", "loss")}
    settings.update(dtype=cfg.dtype, param_dtype=cfg.param_dtype, micro_batch_rows=rows // grad_accum,
                    flops_count="model FLOPs (6 x matmul params + attention) per token; remat's recompute not counted")
    headline = f"step {step['step_s']:.3g} s, {step['step_flops_per_s'] / 1e12:.3g} TFLOP/s" + (
        f", MFU {metrics['mfu']:.1%}" if peak else "")
    return {"metrics": metrics, "settings": settings, "headline": headline}


def measure_memory(overrides: tuple[str, ...], prompt_tokens: int) -> dict:
    cfg = load_config(os.path.join(ROOT, "configs", "qwen3_1p7b_gpu.yaml"), ["model.pretrained=null", *overrides])
    device = jax.devices()[0]
    summary = memory_probe.probe(cfg, prompt_tokens, platform=device.platform)
    metrics = {"peak_bytes_per_device": summary["peak_bytes_per_device"],
               **{f"{k}_bytes": v for k, v in summary["program_bytes_per_device"].items()}}
    limit = (device.memory_stats() or {}).get("bytes_limit")
    if limit:
        metrics["device_bytes_limit"] = float(limit)
    settings = {k: summary[k] for k in ("parameters", "peak_program", "update_rows", "update_width", "grad_accum",
                                        "remat", "platform")}
    settings["method"] = ("launch/memory_probe.py: XLA's buffer assignment of the compiled update and prefill; "
                          "decode analytic")
    gb = summary["peak_bytes_per_device"] / 1e9
    headline = f"peak {gb:.1f} GB ({summary['peak_program']})" + (f" of {limit / 1e9:.0f} GB" if limit else "")
    return {"metrics": metrics, "settings": settings, "headline": headline}


def entries(profile: Profile, peak: float | None, engines: list[str | None]) -> list[Entry]:
    """The measurements of ``profile`` in run order (see the module docstring)."""
    est = profile.estimates_s
    model = load_config(os.path.join(ROOT, "configs", "qwen3_0p6b_gpu.yaml"),
                        ["model.pretrained=null", *profile.model_overrides]).model
    out = [Entry("matmul", "matmul", est["matmul"], lambda: measure_matmul(profile.matmul_size, peak))]
    for engine in engines:
        out.append(Entry(f"sampler_{engine or 'rounds'}", "sampler", est["sampler"],
                         lambda engine=engine: measure_sampler(model, profile.sampler_job, engine, peak,
                                                                 slots=profile.engine_slots)))
    for remat in ("none", "full"):
        out.append(Entry(f"update_remat_{remat}", "update", est["update"],
                         lambda remat=remat: measure_update(model, profile.update_job, remat, peak)))
    out.append(Entry("memory_1p7b", "memory", est["memory"],
                     lambda: measure_memory(profile.memory_overrides, profile.memory_prompt_tokens)))
    return out


# ---------------------------------------------------------------------------------------------- report
def environment(peak: float | None, peak_flag: float | None) -> dict:
    device = jax.devices()[0]
    return {"platform": device.platform, "device_kind": device.device_kind, "device_count": jax.device_count(),
            "jax": jax.__version__, "flax": flax.__version__, "optax": optax.__version__,
            "python": platform.python_version(), "cpu_count": os.cpu_count(),
            "peak_bf16_flops": peak, "peak_source": "--peak-flops" if peak_flag else
            "PEAK_BF16_FLOPS table" if peak else "none: device kind not in the table, MFU not reported"}


def table(report: dict) -> str:
    lines = [f"# benchmarks/device.py, {report['profile']} profile: {report['environment']['device_kind']}, "
             f"{report['elapsed_s']:.0f} s of a {report['budget_s']:.0f} s budget; {report['sampler_engines_note']}",
             f"{'measurement':<20} {'status':<8} {'seconds':>8}  result"]
    for name, r in report["measurements"].items():
        what = r.get("headline") or r.get("error") or r.get("reason", "")
        lines.append(f"{name:<20} {r['status']:<8} {r.get('seconds', 0):>8.1f}  {what[:160]}")
    return "\n".join(lines)


def write_json(path: str, report: dict) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(report, f, indent=1)
    os.replace(path + ".tmp", path)  # a run killed mid-write keeps the previous complete file


def finish(report: dict, out: str) -> int:
    """Write the table beside the JSON and print it; 1 if a measurement failed (all were still reported)."""
    text = table(report)
    with open(os.path.join(out, "device.txt"), "w") as f:
        f.write(text + "\n")
    print(text, flush=True)
    return 1 if any(r["status"] == "failed" for r in report["measurements"].values()) else 0


def start_watchdog(seconds: float, report: dict, save: Callable[[dict], None], out: str,
                   end: Callable[[int], None] = os._exit) -> threading.Timer:
    """A measurement can overrun its estimate (a compile, a hang): ``seconds`` after the start, mark the one
    still running as failed, write the files and ``end`` the process (at once, whatever the main thread
    is doing), before the device tool's own limit kills it with no table."""
    def overrun():
        records = dict(report["measurements"])
        for name, record in records.items():
            if record["status"] == "running":
                records[name] = {"status": "failed", "error": f"still running {seconds:.0f} s after the start "
                                 "(budget + grace): the process was ended"}
        save(records)
        end(finish(report, out))

    timer = threading.Timer(seconds, overrun)
    timer.daemon = True
    timer.start()
    return timer


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu", action="store_true", help="small shapes on the CPU backend (a minute or two)")
    p.add_argument("--out", default=os.environ.get("OUT") or "device_out", help="folder for device.json, device.txt")
    p.add_argument("--budget", type=float, default=None, help="seconds for the whole run (default: 420 GPU, 600 CPU); "
                   "a measurement still running 45 s past it ends the process")
    p.add_argument("--only", default="", help="comma-separated measurement names (default: all)")
    p.add_argument("--engine-slots", type=int, default=None, help="the slot engine's pool for sampler_slots "
                   "(default: half the job's rows, 128 on a GPU)")
    p.add_argument("--peak-flops", type=float, default=None, help="the chip's bf16 dense peak, if not in the table")
    args = p.parse_args(argv)
    started = time.perf_counter()
    if args.cpu:
        jax.config.update("jax_platforms", "cpu")  # before any backend starts: nothing above touched a device
    profile = CPU if args.cpu else GPU
    if args.engine_slots:
        profile = dataclasses.replace(profile, engine_slots=args.engine_slots)
    budget = args.budget or profile.budget_s
    peak = args.peak_flops or peak_bf16_flops(jax.devices()[0].device_kind)
    engines, note = sampler_engines()
    todo = entries(profile, peak, engines)
    unknown = set(filter(None, args.only.split(","))) - {e.name for e in todo}
    if unknown:
        p.error(f"--only {args.only}: unknown {sorted(unknown)}; choose among {[e.name for e in todo]}")
    todo = [e for e in todo if not args.only or e.name in args.only.split(",")]
    os.makedirs(args.out, exist_ok=True)
    report = {"command": " ".join(["python3 benchmarks/device.py", *(argv if argv is not None else sys.argv[1:])]),
              "profile": profile.name, "budget_s": budget, "elapsed_s": 0.0,
              "started_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "environment": environment(peak, args.peak_flops), "sampler_engines": [e or "rounds" for e in engines],
              "sampler_engines_note": note, "measurements": {}}

    def save(records):
        report.update(measurements=records, elapsed_s=round(time.perf_counter() - started, 1))
        write_json(os.path.join(args.out, "device.json"), report)

    watchdog = start_watchdog(budget + 45, report, save, args.out)
    run_entries(todo, budget - (time.perf_counter() - started), save)
    watchdog.cancel()
    return finish(report, args.out)


if __name__ == "__main__":
    sys.exit(main())
