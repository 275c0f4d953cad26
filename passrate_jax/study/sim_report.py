"""The simulator's report: per-seed headline numbers and their mean and sd, the time model's numbers
per rollout mode, and the plain-text tables ``passrate-jax simulate`` prints."""

from __future__ import annotations

import numpy as np

from passrate_jax.allocation.prefix_control import bucket_successes


def summarise(m: dict, sim, group_size: int, ps_on: bool) -> dict:
    """Per-seed headline numbers, then their mean and sd over seeds (``sim``: the SimulatorConfig)."""
    if m["overflow"].any():
        raise RuntimeError("simulate: groups found no free row in the step table (a policy's capacity is wrong)")
    spent, valid, useful, trained = (m[k].sum(-1).astype(float) for k in ("spent", "valid", "useful", "trained"))
    per_seed = {
        "rollouts_per_valid_group": np.where(valid > 0, spent / np.maximum(valid, 1), np.nan),
        "useful_rollout_fraction": useful / np.maximum(spent, 1),
        "valid_groups_per_step": valid / sim.steps,
        "trained_groups_per_step": trained / sim.steps,
        "rollouts_per_step": spent / sim.steps,
        "abandoned_prompts": m["abandoned"].sum(-1).astype(float),
        "abandoned_informative_fraction": np.where(m["abandoned"].sum(-1) > 0, m["abandoned_phi"].sum(-1)
                                                   / np.maximum(m["abandoned"].sum(-1), 1), np.nan),
        "evicted_prompts": m["evicted"].astype(float),
    }
    out = _mean_sd(per_seed)
    hist = m["hist"].sum((0, 1))
    out["pass_rate_histogram"] = (hist / max(hist.sum(), 1)).round(4).tolist()
    if ps_on:
        succ = m["replay_successes"][:, sim.warmup:].sum((0, 1))
        roll = m["replay_rollouts"][:, sim.warmup:].sum((0, 1))
        with np.errstate(invalid="ignore", divide="ignore"):
            after = succ / roll
            rate = m["replay_successes"][0] / m["replay_rollouts"][0]
        out["ps"] = {
            "bucket_successes": bucket_successes(group_size),
            "rerollout_pass_rate_after_warmup": [None if np.isnan(x) else round(float(x), 4) for x in after],
            "rerollouts_after_warmup": roll.astype(int).tolist(),
            "final_ratio": m["ratio"][:, -1].mean(0).round(3).tolist(),
            "pass_rate_per_step": [[None if np.isnan(x) else round(float(x), 3) for x in row] for row in rate],
        }
    return out


def format_table(report: dict) -> str:
    """A plain-text table of the headline metrics (mean +- sd over seeds), one row per method."""
    head = (f"{'method':<22}{'rollouts/valid':>16}{'x DS':>7}{'useful':>16}{'valid/step':>15}"
            f"{'abandoned inf.':>15}  PS pass rate after warm-up")
    lines = [head, "-" * len(head)]
    fmt = lambda x, f: "-" if x is None else format(x, f)  # noqa: E731
    pm = lambda m, k, f: "-" if m[k] is None else f"{m[k]:{f}} +- {m[k + '_sd']:{f}}"  # noqa: E731
    for name, m in report["methods"].items():
        ps = m.get("ps", {}).get("rerollout_pass_rate_after_warmup")
        lines.append(f"{name:<22}{pm(m, 'rollouts_per_valid_group', '.2f'):>16}{fmt(m['vs_ds'], '.2f'):>7}"
                     f"{pm(m, 'useful_rollout_fraction', '.3f'):>16}{pm(m, 'valid_groups_per_step', '.2f'):>15}"
                     f"{fmt(m['abandoned_informative_fraction'], '.3f'):>15}  "
                     + ("" if ps is None else " ".join(fmt(x, ".3f") for x in ps)))
    pop, sim = report["population"], report["config"]["sim"]
    lines.append(f"population: mean pass rate {pop['mean_pass_rate']}, uniform groups saturated "
                 f"{pop['uniform_saturated_fraction']} at step 0, {pop['uniform_saturated_fraction_final']} at the end")
    lines.append(f"{sim['seeds']} seeds, {sim['steps']} steps, {sim['num_prompts']} prompts; wall {report['wall_s']} s")
    return "\n".join(lines)




def _mean_sd(per_seed: dict) -> dict:
    """{name: mean over the seeds where it is defined, name_sd: their sd} of per-seed arrays."""
    out = {}
    for k, v in per_seed.items():
        ok = ~np.isnan(v)
        out[k] = float(v[ok].mean()) if ok.any() else None
        out[k + "_sd"] = float(v[ok].std(ddof=1)) if ok.sum() > 1 else (0.0 if ok.any() else None)
    return out


def summarise_timing(m: dict, steps: int) -> dict:
    """One rollout mode's time model, per seed then mean and sd: rollouts per valid group, decode
    slot-steps (rows x decode steps) per trained rollout and per valid group, slot utilization (live
    rows / rows over the decode steps), sampler calls (round mode) or chunks (engine) per step, rollouts
    aborted and their tokens per step, mean tokens of a trained answer; and the steps (summed over seeds)
    that hit the engine's chunk limit or stalled (both should be 0)."""
    total = lambda k: m[k].sum(-1).astype(float)  # noqa: E731
    spent, valid, trained, slot_steps = total("spent"), total("valid"), total("trained_rollouts"), total("slot_steps")
    per_seed = {
        "rollouts_per_valid_group": np.where(valid > 0, spent / np.maximum(valid, 1), np.nan),
        "slot_steps_per_trained_rollout": np.where(trained > 0, slot_steps / np.maximum(trained, 1), np.nan),
        "slot_steps_per_valid_group": np.where(valid > 0, slot_steps / np.maximum(valid, 1), np.nan),
        "slot_utilization": np.where(slot_steps > 0, total("live_steps") / np.maximum(slot_steps, 1), np.nan),
        "calls_per_step": total("chunks") / steps,
        "aborted_per_step": total("aborted") / steps,
        "wasted_tokens_per_step": total("wasted") / steps,
        "trained_length": np.where(trained > 0, total("trained_tokens") / np.maximum(trained, 1), np.nan),
    }
    return {**_mean_sd(per_seed), "chunk_limit_steps": int(m["limit_hit"].sum()), "stuck_steps": int(m["stuck"].sum()),
            "overflow_steps": int(m["overflow"].sum())}


def format_timing(report: dict) -> str:
    """A plain-text table of each mode's time model, one row per method (means over seeds)."""
    modes = list(next(iter(report["methods"].values()))["modes"])
    cfg = report["config"]
    cols = ("rollouts_per_valid_group", "slot_steps_per_trained_rollout", "slot_utilization", "calls_per_step",
            "aborted_per_step", "trained_length")
    names = ("rollouts/valid", "slot-steps/trained", "utilization", "calls/step", "aborted/step", "trained len")
    head = f"{'method':<22}{'mode':<8}" + "".join(f"{n:>20}" for n in names)
    lines = [f"time model: {cfg['slots']} slots, chunks of {cfg['chunk_tokens']} tokens (slot engine); rows padded "
             f"to {cfg['row_buckets']} (rounds); token limit {cfg['max_tokens']}; lengths {cfg['sim']['lengths']}",
             head, "-" * len(head)]
    for name, m in report["methods"].items():
        for mode in modes:
            t = m["modes"][mode]
            lines.append(f"{name:<22}{mode:<8}" + "".join(
                f"{'-' if t[c] is None else format(t[c], '.3f'):>20}" for c in cols))
    hits = {k: sum(m["modes"][mode][k] for m in report["methods"].values() for mode in modes)
            for k in ("chunk_limit_steps", "stuck_steps", "overflow_steps")}
    if any(hits.values()):
        lines.append(f"WARNING: steps cut short: {hits} (raise sim.max_chunks)")
    return "\n".join(lines)
