"""Measure the answer lengths of a real training run and store them as the simulator's length table.

    python benchmarks/answer_lengths.py                       # configs/default.yaml, seed 0, 25 steps
    python benchmarks/answer_lengths.py --steps 10 --out /tmp/lengths.json --set sampling.max_new_tokens=64

Runs ``train`` on the preset (evaluation only at the ends, on 64 held-out prompts, which leaves the
training rollouts as they are) and records every generated answer of every step: its length in
tokens (the stop token included, as the sampler counts it) and whether the verifier scored it a
success. The output (default: ``passrate_jax/study/answer_lengths_default.json``, read by ``simulate``
as its default length distribution) holds one histogram of lengths for successes and one for failures,
so that the simulator draws each rollout's length given its outcome, with the command that produced it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from passrate_jax.run import train as train_module  # noqa: E402
from passrate_jax.run.config import load_config  # noqa: E402

DEFAULT_OUT = os.path.join(ROOT, "passrate_jax", "study", "answer_lengths_default.json")


def measure(preset: str, seed: int, steps: int, extra: list[str]) -> tuple[dict, int]:
    """{(group key, rollout index): (length, success)} of every answer the run generated; its token limit."""
    overrides = [f"steps={steps}", f"seed={seed}", f"eval_every={steps}", "eval_samples=0", "data.eval_size=64",
                 "logging.tensorboard=false", *extra]
    cfg = load_config(os.path.join(ROOT, "configs", f"{preset}.yaml"), overrides)
    seen: dict = {}
    original = train_module.rollout_metrics

    def metrics(allocator, rollouts, backend):
        for key, group in backend.store.groups.items():
            for index, ids in group.trajectories.items():
                success = group.score(index, 0) >= cfg.data.reward_threshold
                seen.setdefault((key, index), (len(ids), bool(success)))
        return original(allocator, rollouts, backend)

    train_module.rollout_metrics = metrics
    try:
        with tempfile.TemporaryDirectory() as run_dir:
            train_module.train(cfg, run_dir, progress=False, log=lambda *a: None)
    finally:
        train_module.rollout_metrics = original
    return seen, cfg.sampling.max_new_tokens


def table(seen: dict, limit: int) -> dict:
    """Histograms (counts of lengths 1 .. limit) of successful and failed answers."""
    lengths = np.asarray([v[0] for v in seen.values()])
    success = np.asarray([v[1] for v in seen.values()])
    hist = lambda x: np.bincount(x, minlength=limit + 1)[1:limit + 1].tolist()  # noqa: E731
    return {"max_new_tokens": limit, "answers": int(lengths.size), "success_rate": round(float(success.mean()), 4),
            "median": float(np.median(lengths)), "p90": float(np.percentile(lengths, 90)),
            "p99": float(np.percentile(lengths, 99)), "success_counts": hist(lengths[success]),
            "failure_counts": hist(lengths[~success])}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="default")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--out", default=DEFAULT_OUT)
    p.add_argument("--set", nargs="*", default=[], dest="overrides", metavar="KEY=VALUE")
    args = p.parse_args(argv)
    seen, limit = measure(args.preset, args.seed, args.steps, args.overrides)
    out = {"command": " ".join(["python benchmarks/answer_lengths.py", *(sys.argv[1:] if argv is None else argv)]),
           "preset": args.preset, "seed": args.seed, "steps": args.steps,
           "measured": datetime.date.today().isoformat(), **table(seen, limit)}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    print(json.dumps({k: v for k, v in out.items() if not k.endswith("_counts")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
