"""How long the math verifier's calls take, and how many time out, on generated adversarial answers.

    PYTHONPATH=. python benchmarks/verifier.py --json              # 10,000 answers, the shipped 5 s timeout
    PYTHONPATH=. python benchmarks/verifier.py -n 1500

The answers are ``tests/test_data_rewards.py``'s adversarial ones (unicode and LaTeX noise, deep nesting,
huge powers, factorial chains, over-long and harmful text) sent through the shipped math path:
extraction, the cheap checks, size refusals, math-verify in its 2-worker process pool. Targets (the
test suite checks correctness only; these bounds depend on the machine's load, so they live here):
every call the pool runs ends within its timeout plus 1 s, and fewer than 1% of the answers time out.
10,000 answers took 2-3.5 minutes on the project's idle 2-core CPU (about 9 at load 10).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

from passrate_jax.data.rewards import Rewarder
from passrate_jax.data.sources import PromptRecord
from tests.test_data_rewards import _REFERENCES, adversarial_answers


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", type=int, default=10_000, help="answers to verify")
    parser.add_argument("--timeout-s", type=float, default=5.0, help="the shipped data.verify_timeout_s")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    answers = adversarial_answers(args.n)
    records = [PromptRecord(i, f"question {i}", _REFERENCES[i % len(_REFERENCES)]) for i in range(args.n)]
    start = time.perf_counter()
    with Rewarder("math", "boxed", timeout_s=args.timeout_s, workers=2) as rewarder:
        rewarder(records, [f"\\boxed{{{a}}}" for a in answers])
        seconds = np.asarray(rewarder._pool.call_seconds)
        counts = dict(rewarder.counter.counts)
    wall = time.perf_counter() - start
    sent = seconds[~np.isnan(seconds)]
    timeouts = counts.get("timeout", 0)
    out = {"answers": args.n, "sent_to_pool": int(len(sent)), "wall_s": round(wall, 1),
           "call_s_max": round(float(sent.max()), 2), "call_s_p99": round(float(np.percentile(sent, 99)), 3),
           "timeouts": timeouts, "errors": counts.get("error", 0), "load_avg_1m": round(os.getloadavg()[0], 2),
           "target_call_s_max": args.timeout_s + 1.0, "target_timeouts_below": args.n // 100}
    out["meets_targets"] = bool(out["call_s_max"] <= args.timeout_s + 1.0 and timeouts < args.n // 100)
    print(json.dumps(out) if args.json else "\n".join(f"{k:22s} {v}" for k, v in out.items()))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
