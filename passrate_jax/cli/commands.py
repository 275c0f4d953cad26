"""``passrate-jax eval`` and ``passrate-jax sft``: evaluate a run's latest checkpoint on the held-out
prompts or on any prompt file (``--data``), and run (or load from its cache) the supervised warm start
on its own."""

from __future__ import annotations

import json
import os

from passrate_jax.configlib import ConfigError, add_config_arguments


def load_run_params(run_dir: str, session, step: int | None = None):
    """The parameters of checkpoint ``step`` (default: the latest) of ``run_dir``, in the session's
    model structure and shardings."""
    import jax

    from passrate_jax.run.checkpoint import load_params
    params = session.params
    step = load_params(run_dir, params, step)
    return step, jax.device_put(params, session.sampler.param_shardings)


def open_run_at(run_dir: str, step: int | None = None, overrides=()):
    """``(session, step, params)`` of ``run_dir`` (its config.yaml with ``overrides``, quiet) at checkpoint
    ``step``: the latest by default; 0 is the run's warm start, trained (or loaded from its cache) here."""
    from passrate_jax.run.config import load_config
    from passrate_jax.run.session import Session
    session = Session.create(load_config(os.path.join(run_dir, "config.yaml"), list(overrides)), log=lambda *a: None)
    if step == 0:
        session.warm_start(progress=False)
        return session, 0, session.params
    step, params = load_run_params(run_dir, session, step)
    return session, step, params


def add_subparsers(subparsers) -> None:
    p = subparsers.add_parser("eval", help="held-out accuracy and pass@k of a run's latest checkpoint, or on --data")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--data", default=None, metavar="FILE.jsonl|FILE.parquet|tfds:NAME",
                   help="evaluate on every row of this prompt file or TFDS dataset instead of the run's held-out "
                        "split, with the run's formatting and verifier; override its fields and verifier with "
                        "data.prompt_field=..., data.answer_field=..., data.reference_extract=..., "
                        "data.verifier=... or data.reward_fn=...")
    p.add_argument("--split", default="test", help="TFDS split of --data tfds:NAME (default test)")
    p.add_argument("--limit", type=int, default=0, help="with --data: the first N rows only (0: all)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    p.add_argument("--num-samples", type=int, default=8, help="samples per prompt for pass@k (0: greedy only)")
    p.add_argument("--k", type=lambda t: [int(x) for x in t.split(",")], default=[1, 4, 8],
                   help="comma-separated k values of pass@k (default 1,4,8)")
    p.add_argument("--vs-warm-start", action="store_true",
                   help="also evaluate the run's starting point (its cached warm start) on the same prompts and "
                        "report the paired differences: prompts fixed / broken with the exact McNemar p-value, "
                        "and the sampled-accuracy difference with its standard error")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="e.g. data.eval_size=512")
    p.set_defaults(func=run_eval)

    p = subparsers.add_parser("sft", help="run the supervised warm start (or load it from the cache)")
    add_config_arguments(p)
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run_sft)


def run_eval(args) -> int:
    from passrate_jax.run.config import load_config
    from passrate_jax.run.metrics import is_remote
    if args.num_samples < 0:
        raise ConfigError(f"--num-samples = {args.num_samples}: must be >= 0 (0: greedy answers only)")
    if any(k < 1 for k in args.k):
        raise ConfigError(f"--k {','.join(map(str, args.k))}: each k must be >= 1 (pass@k: at least one of k "
                          "sampled answers right), e.g. --k 1,4,8")
    if is_remote(args.run_dir):
        raise ConfigError(f"--run-dir {args.run_dir!r}: eval reads a local run directory; copy it first "
                          "(gcloud storage cp -r URL runs/)")
    path = os.path.join(args.run_dir, "config.yaml")
    if not os.path.exists(path):
        raise ConfigError(f"{path} does not exist: is {args.run_dir!r} a run directory?")
    cfg = load_config(path, data_overrides(args.data, args.split, args.limit) + list(args.overrides))
    from passrate_jax.run.session import Session
    session = Session.create(cfg, log=lambda *a: None)
    if not session.heldout:
        session.close()
        raise ConfigError(f"--run-dir {args.run_dir!r}: its config has no held-out prompts (data.eval_path is "
                          "empty); evaluate on a file with --data FILE.jsonl")
    step, params = load_run_params(args.run_dir, session, args.step)
    result = session.evaluate(params, seed=cfg.seed, num_samples=args.num_samples, ks=args.k)
    start = None
    if args.vs_warm_start:
        from passrate_jax.run.evaluate import paired_difference
        if session.warm_start(progress=False) is None:
            raise ConfigError(f"--vs-warm-start: {path} trains without a warm start (warm_start.enabled / steps / "
                              "data.source)")
        start = session.evaluate(session.params, seed=cfg.seed, num_samples=args.num_samples, ks=args.k)
        start["difference"] = paired_difference(start, result)
    session.close()
    result = {"step": step, "heldout_prompts": len(session.heldout), **result}
    for r in (result, start):
        if r is not None:
            r.pop("per_prompt")
    if start is not None:
        result["warm_start"] = start
    if args.json:
        print(json.dumps(result))
        return 0
    where = args.data or "held-out"
    print(f"{args.run_dir} step {step}: greedy {where} accuracy {result['accuracy']:.4f} +- "
          f"{result['accuracy_se']:.4f} on {result['heldout_prompts']} prompts (+- one standard error over prompts)")
    _print_eval(result, args, cfg)
    if start is not None:
        diff = start.pop("difference")
        print(f"warm start (step 0): greedy held-out accuracy {start['accuracy']:.4f}")
        _print_eval(start, args, cfg)
        print(f"step {step} - warm start: greedy {diff['accuracy']:+.4f} ({diff['fixed']} prompts fixed, "
              f"{diff['broken']} broken; exact McNemar p = {diff['mcnemar_p']:.2g})")
        if "sampled_accuracy" in diff:
            print(f"  sampled {diff['sampled_accuracy']:+.4f} +- {diff['sampled_accuracy_se']:.4f} (one standard "
                  "error over prompts)")
    return 0


def data_overrides(data: str | None, split: str = "test", limit: int = 0) -> list[str]:
    """Config overrides that make ``data`` (a .jsonl / .parquet file or ``tfds:NAME``) both the prompt pool
    and the held-out set, all of it (or its first ``limit`` rows): a session then evaluates on it with the
    run's formatting and verifier (the run's procedural-only data.level / max_level / train_size reset to
    0). [] when ``data`` is None."""
    if data is None:
        return []
    if limit < 0:
        raise ConfigError(f"--limit {limit}: must be >= 0")
    # The settings that only shape procedural problems go back to 0: a file is taken as it is (and the
    # config check refuses them with a file source).
    size = [f"data.eval_size={limit or 2 ** 62}", "data.level=0", "data.max_level=0", "data.train_size=0"]
    if data.startswith("tfds:"):
        return ["data.source=tfds", f"data.tfds_name={data[5:]}", f"data.train_split={split}",
                f"data.eval_split={split}"] + size
    if not os.path.isfile(data):
        raise ConfigError(f"--data {data!r}: no such file")
    kind = "parquet" if data.endswith(".parquet") else "jsonl"
    return [f"data.source={kind}", f"data.path={data}", f"data.eval_path={data}"] + size


def _print_eval(result: dict, args, cfg) -> None:
    levels = result["accuracy_by_level"]
    if any(int(level) != 0 for level in levels):  # a file without levels has them all at 0: nothing to break down
        for level, acc in levels.items():
            print(f"  level {level}: {acc:.4f}")
    if "sampled_accuracy" in result:
        print(f"  mean@{args.num_samples} {result['sampled_accuracy']:.4f} +- {result['sampled_accuracy_se']:.4f} "
              f"({args.num_samples} answers per prompt at temperature {cfg.sampling.temperature:g})")
    for k in args.k:
        if f"pass@{k}" in result:
            print(f"  pass@{k}: {result[f'pass@{k}']:.4f} +- {result[f'pass@{k}_se']:.4f}")


def run_sft(args) -> int:
    from passrate_jax.run.config import load_config
    cfg = load_config(args.config, args.overrides)
    from passrate_jax.run.session import Session
    session = Session.create(cfg)
    summary = session.warm_start(progress=not args.no_progress)
    if summary is None:
        print("warm start disabled by the config (warm_start.enabled / steps / data.source)")
    else:
        ev = session.evaluate(session.params, seed=cfg.seed)
        print(f"greedy held-out accuracy after the warm start: {ev['accuracy']:.4f}; by level: "
              + ", ".join(f"{k}: {v:.2f}" for k, v in ev["accuracy_by_level"].items()))
    session.close()
    return 0
