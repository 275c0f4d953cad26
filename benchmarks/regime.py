"""What a regime offers RL at a checkpoint: group saturation, pass@1 / pass@8, response length.

    PYTHONPATH=$PWD python benchmarks/regime.py --run-dir RUN [--step 0] [--num-samples 8] [key=value ...]

Loads a run's config and its checkpoint ``--step`` (0 or absent checkpoint: the run's warm start),
samples ``--num-samples`` answers per held-out prompt at the training temperature and prints one JSON
object: greedy accuracy; sampled accuracy with its standard error over prompts; pass@k; the fraction of
prompts whose group of samples is all wrong, all right, or saturated (either), overall and per level;
and the mean sampled response length in tokens (stop token included) and in lines. With
``data.level_weights`` set, ``train_mixture`` gives the shares for the weighted train draws.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import numpy as np


def regime_stats(session, params, *, num_samples: int, seed: int) -> dict:
    """Statistics of ``num_samples`` sampled answers per held-out prompt of ``session`` (see module doc)."""
    from passrate_jax.run.evaluate import pass_at_k
    from passrate_jax.sampling.sampler import Context

    cfg = dataclasses.replace(session.sampler.cfg, temperature=session.cfg.sampling.temperature)
    records, prompts = session.heldout, session.heldout_tokens
    successes = np.zeros(len(prompts), int)
    tokens, lines = [], []
    per_chunk = max(1, 64 // num_samples)
    for start in range(0, len(prompts), per_chunk):
        chunk = range(start, min(start + per_chunk, len(prompts)))
        result = session.sampler.generate([Context(prompts[i], num_samples=num_samples, context_id=i)
                                           for i in chunk], seed=seed + 1, params=params, cfg=cfg)
        texts = [session.decode(result.completion(row)) for row in range(len(result.context_index))]
        rewards = session.score([records[start + c] for c in result.context_index], texts)
        for row, c in enumerate(result.context_index):
            successes[start + c] += rewards[row] > 0
        tokens += [int(n) for n in result.lengths]
        lines += [len(t.rstrip("\n").split("\n")) for t in texts]
    levels = np.array([int(r.metadata.get("level", 0)) for r in records])
    rate = successes / num_samples
    wrong, right = successes == 0, successes == num_samples

    def share(mask, sel=slice(None)):
        return round(float(np.mean(mask[sel])), 4)

    out = {"prompts": len(prompts), "num_samples": num_samples,
           "sampled_accuracy": float(rate.mean()), "sampled_accuracy_se": float(rate.std(ddof=1) / np.sqrt(len(rate))),
           **{f"pass@{k}": float(np.mean([pass_at_k(num_samples, int(c), k) for c in successes]))
              for k in (1, 4, 8) if k <= num_samples},
           "all_wrong": share(wrong), "all_right": share(right), "saturated": share(wrong | right),
           "response_tokens_mean": float(np.mean(tokens)), "response_lines_mean": float(np.mean(lines)),
           "multi_line_fraction": float(np.mean(np.array(lines) >= 3))}
    out["by_level"] = {int(lv): {"sampled_accuracy": share(rate, levels == lv), "all_wrong": share(wrong, levels == lv),
                                 "all_right": share(right, levels == lv)} for lv in np.unique(levels)}
    return out


def train_mixture(by_level: dict, levels: list[int], weights) -> dict:
    """The shares of :func:`regime_stats` for train prompts drawn with ``data.level_weights``: the
    per-level shares (measured on the uniform held-out prompts) averaged with the train draws' weights."""
    w = np.asarray(weights, float) / np.sum(weights)
    mix = {key: round(float(sum(wi * by_level[lv][key] for wi, lv in zip(w, levels))), 4)
           for key in ("sampled_accuracy", "all_wrong", "all_right")}
    mix["saturated"] = round(mix["all_wrong"] + mix["all_right"], 4)
    return {"level_weights": [float(x) for x in weights], **mix}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--step", type=int, default=None, help="checkpoint step; 0: the warm start (default: latest)")
    ap.add_argument("--num-samples", type=int, default=8)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)

    from passrate_jax.cli.commands import open_run_at

    session, step, params = open_run_at(args.run_dir, args.step, args.overrides)
    cfg = session.cfg
    greedy = session.evaluate(params, seed=cfg.seed, num_samples=0)
    stats = regime_stats(session, params, num_samples=args.num_samples, seed=cfg.seed)
    session.close()
    if cfg.data.level_weights:  # train draws weighted, held-out uniform: the shares RL's groups see
        levels = list(range(cfg.data.min_level, cfg.data.min_level + len(cfg.data.level_weights)))
        stats["train_mixture"] = train_mixture(stats["by_level"], levels, cfg.data.level_weights)
    print(json.dumps({"run_dir": args.run_dir, "step": step, "greedy_accuracy": greedy["accuracy"], **stats}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
