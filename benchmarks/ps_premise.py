"""Does Prefix Sampling's premise hold at a checkpoint? Replay skewed groups' prefixes and count mixed groups.

    PYTHONPATH=$PWD python benchmarks/ps_premise.py --run-dir RUN [--step S] [--prompts 256] [--group-size 8]
        [--ratios 0.1 0.3 0.5 0.7 0.9] [--out FILE.json] [key=value ...]

PS assumes that replaying a prefix of a skewed group's minority trajectory (a success for a hard group,
1-2 of 8 right; a failure for an easy one, 6-7 of 8) gives a re-rollout group whose pass rate is *shifted*
toward 0.5, so the group is mixed and carries a gradient. If the prefix instead *decides* the outcome
(every continuation repeats the source's result), re-rollout groups are all-right or all-wrong: their
pooled pass rate can still be 0.5 while almost none is mixed.

From a run's checkpoint (``--step 0``: the run's warm start), draws N rollouts for ``--prompts`` train
prompts, keeps the skewed groups (PS's buckets: successes 1..N/4 and N-N/4..N-1), and replays one minority
trajectory of each at every cut ratio (``cut_prefix``, the trainer's own cut, snapped to a line break) with
N continuations. Prints one JSON object: per bucket (its success count) and ratio, the number of re-rollout
groups, the fraction that are mixed and their mean pass rate; the fresh groups' histogram; and the answer
length spread (p90 / median tokens, which a testbed with repairs should raise to 2 or more).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from passrate_jax.allocation.prefix_control import bucket_successes
from passrate_jax.allocation.protocol import Prefix, Request
from passrate_jax.rollout.table import RolloutTable

RATIOS = (0.1, 0.3, 0.5, 0.7, 0.9)


def _run_round(backend, params, requests, seed: int) -> tuple[list[np.ndarray], list[int]]:
    """Generate, score and record one batch of requests as one step of its own; each request's rewards
    (0/1) and its answers' lengths."""
    table = RolloutTable()
    backend.open_step(params)
    try:
        rollouts = backend.generate(backend.contexts(requests), params, seed)
        results, rows = table.add(requests, [True] * len(requests), backend.score(requests, rollouts))
        backend.record(requests, rollouts, table, rows)
    finally:
        backend.close_step(table)
    return [np.asarray(r.rewards, int) for r in results], [len(a.ids) for answers in rollouts for a in answers]


def _minority(rewards: np.ndarray, n: int) -> tuple[int, bool] | None:
    """(rollout index, success) of the trajectory PS replays for a group with these rewards, or None when
    the group is not in a PS bucket (degenerate or balanced)."""
    s = int(rewards.sum())
    if s not in bucket_successes(n):
        return None
    hard = s <= n // 4
    return int(np.flatnonzero(rewards == (1 if hard else 0))[0]), hard


def ps_premise(backend, params, prompts, *, n: int, ratios=RATIOS, seed: int = 0, batch: int = 32) -> dict:
    """The probe (see the module docstring) with any :class:`passrate_jax.rollout.loop.RolloutBackend`:
    ``prompts`` are train prompt ids, ``batch`` the requests generated at once. Returns the JSON-ready
    summary."""
    key, sources, fresh_hist, lengths = 0, [], np.zeros(n + 1, int), []
    for start in range(0, len(prompts), batch):
        reqs = [Request(key + i, int(p), n, 0) for i, p in enumerate(prompts[start:start + batch])]
        key += len(reqs)
        rewards, lens = _run_round(backend, params, reqs, seed)
        lengths += lens
        for req, r in zip(reqs, rewards):
            fresh_hist[int(r.sum())] += 1
            if (pick := _minority(r, n)) is not None:
                sources.append((req, int(r.sum()), *pick))
    bucket_of = {s: b for b, s in enumerate(bucket_successes(n))}
    hists: dict[tuple[int, float], np.ndarray] = {}
    replays = [(src, s, idx, ok, ratio) for src, s, idx, ok in sources for ratio in ratios]
    for start in range(0, len(replays), batch):
        chunk = replays[start:start + batch]
        reqs = [Request(key + i, src.prompt_id, n, 0, Prefix(src.group_key, idx, ratio, bucket_of[s], ok))
                for i, (src, s, idx, ok, ratio) in enumerate(chunk)]
        key += len(reqs)
        rewards, _ = _run_round(backend, params, reqs, seed + 1)
        for (_, s, _, _, ratio), r in zip(chunk, rewards):
            hists.setdefault((s, ratio), np.zeros(n + 1, int))[int(r.sum())] += 1
    return summarise(hists, fresh_hist, lengths, n)


def summarise(hists: dict, fresh_hist: np.ndarray, lengths, n: int) -> dict:
    """Per bucket and ratio: groups, mixed fraction, mean pass rate (and the histogram); the best ratio
    per bucket by mixed fraction; the fresh groups' histogram and the answer length spread."""
    by_bucket: dict[str, dict] = {}
    for (s, ratio), h in sorted(hists.items()):
        total = int(h.sum())
        by_bucket.setdefault(str(s), {})[f"{ratio:g}"] = {
            "groups": total, "mixed": float(h[1:-1].sum() / total),
            "mean_pass_rate": float(np.dot(np.arange(n + 1), h) / (n * total)), "hist": h.tolist()}
    best = {b: max(v.values(), key=lambda x: x["mixed"])["mixed"] for b, v in by_bucket.items()}
    lengths = np.asarray(lengths, float)
    spread = float(np.percentile(lengths, 90) / np.median(lengths)) if len(lengths) else float("nan")
    return {"group_size": n, "fresh_groups": int(fresh_hist.sum()), "fresh_hist": fresh_hist.tolist(),
            "skewed_groups": {b: v[next(iter(v))]["groups"] for b, v in by_bucket.items()},
            "by_bucket": by_bucket, "best_mixed": best,
            "length_p90_over_median": spread, "length_median": float(np.median(lengths)) if len(lengths) else None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--step", type=int, default=None, help="checkpoint step; 0: the run's warm start (default: latest)")
    ap.add_argument("--prompts", type=int, default=256, help="train prompts drawn (uniformly, without replacement)")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--ratios", type=float, nargs="+", default=list(RATIOS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)

    from passrate_jax.cli.commands import open_run_at
    from passrate_jax.run.backends import text_backend

    t0 = time.perf_counter()
    session, step, params = open_run_at(args.run_dir, args.step, args.overrides)
    cfg = session.cfg
    pool = cfg.data.train_size
    prompts = np.random.default_rng(args.seed).choice(pool, size=min(args.prompts, pool), replace=False)
    out = ps_premise(text_backend(session), params, prompts.tolist(), n=args.group_size,
                     ratios=args.ratios, seed=args.seed)
    session.close()
    out = {"run_dir": args.run_dir, "step": step, "task": cfg.data.task, "prompts": len(prompts),
           "seconds": round(time.perf_counter() - t0, 1), **out}
    text = json.dumps(out)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
