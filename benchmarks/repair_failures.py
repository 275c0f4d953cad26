"""Where the testbed's answers go wrong: each failed answer's first broken rule, in easy and hard groups.

    PYTHONPATH=$PWD python benchmarks/repair_failures.py --run-dir RUN [--step S] [--prompts 96]
        [--group-size 8] [--seed 0] [--examples 3] [--out FILE.json] [key=value ...]

Prefix Sampling replays a failure of an easy group (6-7 of 8 right) and a success of a hard one. Whether
the replayed prefix *shifts* the re-rollout group's pass rate or *decides* it (benchmarks/ps_premise.py
measures which) depends on what went wrong: a slip a later line could still redo leaves the outcome open;
a false line nothing repairs, or a malformed one, decides it. From a run's checkpoint of the ``repair``
task (configs/testbed.yaml), this draws N answers for ``--prompts`` train prompts and counts, per group
kind (easy: at least 3/4 of N right; hard: at most 1/4; mixed: between; all right / all wrong), the
failed answers by ``passrate_jax.data.repair.fault`` (the verifier's own walk), with a few examples of
each. Prints one JSON object. About 20 seconds on a 2-core CPU once the warm start is cached.
"""

from __future__ import annotations

import argparse
import collections
import json
import time
from collections.abc import Sequence

import numpy as np

from passrate_jax.allocation.protocol import Request
from passrate_jax.cli.commands import open_run_at
from passrate_jax.data import repair
from passrate_jax.data.sources import builtin_problem
from passrate_jax.rollout.table import RolloutTable
from passrate_jax.run.backends import text_backend


def group_kind(successes: int, n: int) -> str:
    """easy (at least 3/4 of ``n`` right, not all), hard (at most 1/4, not none), mixed, all right, all wrong."""
    if successes == n:
        return "all right"
    if successes == 0:
        return "all wrong"
    return "easy" if successes >= n - n // 4 else "hard" if successes <= n // 4 else "mixed"


def tally(groups: Sequence[tuple[object, Sequence[str]]], n: int, examples: int = 3) -> dict:
    """``groups``: (problem, its N answers' texts). Per group kind: groups, answers, and the failed answers
    counted by fault (with up to ``examples`` of each, prompt and answer)."""
    out: dict[str, dict] = {}
    for problem, texts in groups:
        faults = [repair.fault(problem, t) for t in texts]
        kind = out.setdefault(group_kind(sum(f is None for f in faults), n),
                              {"groups": 0, "answers": 0, "faults": collections.Counter(), "examples": {}})
        kind["groups"] += 1
        kind["answers"] += len(texts)
        for f, text in zip(faults, texts):
            if f is not None:
                kind["faults"][f] += 1
                shown = kind["examples"].setdefault(f, [])
                if len(shown) < examples:
                    shown.append(f"{problem.prompt.strip()} | {text.replace(chr(10), ' / ')}")
    for kind in out.values():
        kind["faults"] = dict(kind["faults"].most_common())
    return out


def draw(session, params, prompts: Sequence[int], n: int, seed: int) -> list[tuple[object, list[str]]]:
    """N sampled answers (texts) to each train prompt, with its built-in problem."""
    backend = text_backend(session)
    requests = [Request(i, int(p), n, 0) for i, p in enumerate(prompts)]
    backend.open_step(params)
    try:
        answers = backend.generate(backend.contexts(requests), params, seed)
    finally:
        backend.close_step(RolloutTable())
    return [(builtin_problem(session.prompts[r.prompt_id]), [session.decode(a.ids) for a in group])
            for r, group in zip(requests, answers)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--step", type=int, default=None, help="checkpoint step; 0: the run's warm start (default: latest)")
    ap.add_argument("--prompts", type=int, default=96, help="train prompts drawn (uniformly, without replacement)")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--examples", type=int, default=3, help="examples kept per fault and group kind")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    session, step, params = open_run_at(args.run_dir, args.step, args.overrides)
    if session.cfg.data.task != "repair":
        raise SystemExit(f"data.task = {session.cfg.data.task!r}: this benchmark reads the repair task's "
                         "faults; pass a run of configs/testbed.yaml")
    pool = session.cfg.data.train_size
    prompts = np.random.default_rng(args.seed).choice(pool, size=min(args.prompts, pool), replace=False)
    kinds = tally(draw(session, params, prompts.tolist(), args.group_size, args.seed), args.group_size,
                  args.examples)
    session.close()
    text = json.dumps({"run_dir": args.run_dir, "step": step, "prompts": len(prompts),
                       "group_size": args.group_size, "seconds": round(time.perf_counter() - t0, 1),
                       "by_group_kind": kinds})
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
