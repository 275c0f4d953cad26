"""Allocation simulator: every method side by side on a synthetic prompt population.

    passrate-jax simulate [--config FILE] [key=value ...] [--json] [--plot FILE.png]
    python -m passrate_jax.allocation.simulate [same arguments]

Each prompt i has a success rate p_i drawn from a Beta mixture (``sim.mixture_*``); the rate drifts
upward by ``sim.drift`` in logit units per step to mimic learning. Rollouts are Bernoulli. A
re-rollout from a prefix cut at ratio r of a successful trajectory succeeds with p + (1 - p) r^k, from
a failed one with p (1 - r^k), k = ``sim.ps_response_power``. Every method reads the same uniform
random numbers (rollout j of prompt i at step t uses the same draw under every method) and its
allocator starts from the same PRNG key. Overrides ``sim.<field>=value`` set :class:`SimulatorConfig`;
all others go to the run config (``allocation.*``, ``prefix_sampling.*``) that every method starts from.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import jax
import numpy as np

from passrate_jax.allocation.allocator import Allocator, Result
from passrate_jax.allocation.config import AllocationConfig, PrefixSamplingConfig
from passrate_jax.allocation.prefix_control import bucket_successes, num_buckets
from passrate_jax.configlib import ConfigError, apply_overrides, build, option

DEFAULT_METHODS = ("uniform", "ds", "ds_ideal", "mopps", "dps", "sara", "sara+mopps", "sara+dps", "pilot_commit",
                   "pilot_commit+dps", "uniform+ps", "ds+ps", "sara+ps", "sara+dps+ps", "pilot_commit+ps",
                   "pilot_commit+dps+ps")


@dataclasses.dataclass(frozen=True)
class SimulatorConfig:
    """Synthetic population and run length (overrides: ``sim.<field>=value``)."""
    steps: int = option(200, ge=1, doc="T: training steps simulated per method")
    num_prompts: int = option(512, ge=1, doc="P: prompts in the dataset")
    mixture_weights: tuple[float, ...] = option((0.5, 0.35, 0.15), ge=0, doc="Beta mixture weights")
    mixture_a: tuple[float, ...] = option((0.2, 2.0, 2.0), gt=0, doc="Beta mixture alpha per component")
    mixture_b: tuple[float, ...] = option((2.0, 0.2, 2.0), gt=0, doc="Beta mixture beta per component")
    drift: float = option(0.005, doc="upward drift of every prompt's logit success rate per step")
    ps_response_power: float = option(1.0, gt=0, doc="k in the prefix response r^k")
    warmup: int = option(50, ge=0, doc="steps excluded from the PS pass-rate statistics")
    seed: int = option(0, ge=0)
    methods: tuple[str, ...] = option(DEFAULT_METHODS, doc="names base[+mopps|+dps][+ps]")

    def validate(self) -> None:
        if not len(self.mixture_weights) == len(self.mixture_a) == len(self.mixture_b) > 0:
            raise ConfigError(f"mixture_weights = {self.mixture_weights}: needs one weight per mixture_a, mixture_b")
        if sum(self.mixture_weights) <= 0:
            raise ConfigError(f"mixture_weights = {self.mixture_weights}: must not all be 0")
        for name in self.methods:
            method_configs(name, AllocationConfig(), PrefixSamplingConfig())


def method_configs(name: str, base: AllocationConfig, ps: PrefixSamplingConfig):
    """'sara+dps+ps' -> (AllocationConfig, PrefixSamplingConfig). The first part is uniform, ds,
    ds_ideal, sara or pilot_commit (or directly mopps / dps, meaning uniform with that selection)."""
    parts = name.split("+")
    head, rest = parts[0], parts[1:]
    if head in ("mopps", "dps"):
        head, rest = "uniform", [head] + rest
    if head not in ("uniform", "ds", "ds_ideal", "sara", "pilot_commit") or any(
            r not in ("mopps", "dps", "ps") for r in rest) or len(set(rest)) != len(rest) or (
            "mopps" in rest and "dps" in rest):
        raise ConfigError(f"methods: {name!r} is not base[+mopps|+dps][+ps] with base in uniform, ds, "
                          f"ds_ideal, sara, pilot_commit")
    selection = next((r for r in rest if r != "ps"), "none")
    cfg = dataclasses.replace(base, method="ds" if head == "ds_ideal" else head,
                              ds=dataclasses.replace(base.ds, keep_surplus=head == "ds_ideal"),
                              selection=dataclasses.replace(base.selection, method=selection))
    return cfg, dataclasses.replace(ps, enabled="ps" in rest)


def population(sim: SimulatorConfig, rng: np.random.Generator) -> np.ndarray:
    """Initial success rates p_i, float64 [P], from the Beta mixture."""
    w = np.asarray(sim.mixture_weights, float)
    comp = rng.choice(len(w), size=sim.num_prompts, p=w / w.sum())
    p = rng.beta(np.asarray(sim.mixture_a)[comp], np.asarray(sim.mixture_b)[comp])
    return np.clip(p, 1e-6, 1 - 1e-6)


def survival(p, n: int):
    """Probability that a group of n Bernoulli(p) rollouts is mixed (numpy, float64)."""
    return 1 - p**n - (1 - p) ** n


class World:
    """The population and the shared random numbers: ``rates(t)`` and ``outcomes(t, request)``."""

    def __init__(self, sim: SimulatorConfig, group_size: int):
        rng = np.random.default_rng(sim.seed)
        self.sim, self.n = sim, group_size
        self.p0 = population(sim, rng)
        self.logit0 = np.log(self.p0) - np.log1p(-self.p0)

    def rates(self, t: int) -> np.ndarray:
        return 1 / (1 + np.exp(-(self.logit0 + self.sim.drift * t)))

    def draws(self, t: int) -> tuple[np.ndarray, np.ndarray]:
        """Uniforms [P, N] for fresh rollouts and for re-rollouts of step t (same for every method)."""
        rng = np.random.default_rng([self.sim.seed, t])
        return rng.random((self.sim.num_prompts, self.n)), rng.random((self.sim.num_prompts, self.n))

    def respond(self, p: float, prefix) -> float:
        """Success rate of a continuation from a replayed prefix (monotone in the cut ratio)."""
        g = prefix.cut_ratio ** self.sim.ps_response_power
        return p + (1 - p) * g if prefix.success else p * (1 - g)


def simulate_method(name: str, world: World, alloc: AllocationConfig, ps: PrefixSamplingConfig,
                    draws: list, progress=None) -> dict:
    """Run one method for ``sim.steps`` steps; returns its metrics (JSON-serialisable)."""
    sim, n = world.sim, alloc.group_size
    cfg, pcfg = method_configs(name, alloc, ps)
    allocator = Allocator(cfg, pcfg, sim.num_prompts)
    state = allocator.init(jax.random.PRNGKey(sim.seed))
    spent = useful = valid = trained = 0
    hist = np.zeros(n + 1)
    abandoned_phi = []
    k = num_buckets(n)
    ps_rate = np.full((sim.steps, k), np.nan)
    ps_succ, ps_roll = np.zeros(k), np.zeros(k)
    ratio_trace = np.zeros((sim.steps, k))
    for t in range(sim.steps):
        rates = world.rates(t)
        fresh, replay = draws[t]
        run = allocator.start_step(state)
        while requests := run.requests():
            results = []
            for r in requests:
                idx = slice(r.first_index, r.first_index + r.num_rollouts)
                if r.prefix is None:
                    out = fresh[r.prompt_id, idx] < rates[r.prompt_id]
                else:
                    out = replay[r.prompt_id, idx] < world.respond(rates[r.prompt_id], r.prefix)
                results.append(Result(r.group_key, tuple(int(x) for x in out)))
            run.observe(results)
        result, state = run.finish()
        spent += result.rollouts_spent
        for g in result.groups:
            trained += 1
            if g.valid:
                valid += 1
                useful += len(g.rewards)
            if len(g.rewards) == n:
                hist[sum(g.rewards)] += 1
        abandoned_phi += [survival(rates[pid], n) for pid, _, _ in result.abandoned]
        with np.errstate(invalid="ignore", divide="ignore"):
            ps_rate[t] = result.replay_successes / result.replay_rollouts
        if t >= sim.warmup:
            ps_succ += result.replay_successes
            ps_roll += result.replay_rollouts
        ratio_trace[t] = np.asarray(state.prefix_control.ratio)
        if progress is not None:
            progress.update(1)
    out = {
        "rollouts_per_valid_group": spent / valid if valid else None,
        "useful_rollout_fraction": useful / spent if spent else None,
        "valid_groups_per_step": valid / sim.steps,
        "trained_groups_per_step": trained / sim.steps,
        "rollouts_per_step": spent / sim.steps,
        "abandoned_prompts": len(abandoned_phi),
        "abandoned_informative_fraction": float(np.mean(abandoned_phi)) if abandoned_phi else None,
        "pass_rate_histogram": (hist / max(hist.sum(), 1)).round(4).tolist(),
        "evicted_prompts": int(np.asarray(state.evicted).sum()),
    }
    if pcfg.enabled:
        with np.errstate(invalid="ignore", divide="ignore"):
            after = ps_succ / ps_roll
        out["ps"] = {
            "bucket_successes": bucket_successes(n),
            "rerollout_pass_rate_after_warmup": [None if np.isnan(x) else round(float(x), 4) for x in after],
            "rerollouts_after_warmup": ps_roll.astype(int).tolist(),
            "final_ratio": ratio_trace[-1].round(3).tolist(),
            "pass_rate_per_step": [[None if np.isnan(x) else round(float(x), 3) for x in row] for row in ps_rate],
        }
    return out


def simulate(sim: SimulatorConfig, alloc: AllocationConfig, ps: PrefixSamplingConfig, progress: bool = True) -> dict:
    """Run every method of ``sim.methods``; returns {"config": ..., "population": ..., "methods": {...}}."""
    world = World(sim, alloc.group_size)
    draws = [world.draws(t) for t in range(sim.steps)]
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=sim.steps * len(sim.methods), desc="simulate", unit="step", file=sys.stderr)
    methods = {}
    for name in sim.methods:
        if bar is not None:
            bar.set_postfix_str(name)
        methods[name] = simulate_method(name, world, alloc, ps, draws, bar)
    if bar is not None:
        bar.close()
    n = alloc.group_size
    p0 = world.p0
    pop = {"mean_pass_rate": round(float(p0.mean()), 4),
           "uniform_saturated_fraction": round(float(1 - survival(p0, n).mean()), 4),
           "uniform_saturated_fraction_final": round(float(1 - survival(world.rates(sim.steps - 1), n).mean()), 4)}
    ds = methods.get("ds", {}).get("rollouts_per_valid_group")
    for m in methods.values():
        m["vs_ds"] = round(m["rollouts_per_valid_group"] / ds, 4) if ds and m["rollouts_per_valid_group"] else None
    return {"config": {"sim": dataclasses.asdict(sim), "num_prompts_per_step": alloc.num_prompts,
                       "group_size": n}, "population": pop, "methods": methods}


def format_table(report: dict) -> str:
    """A plain-text table of the headline metrics, one row per method."""
    head = (f"{'method':<22}{'rollouts/valid':>15}{'x DS':>7}{'useful':>8}{'valid/step':>11}"
            f"{'abandoned inf.':>15}  PS pass rate after warm-up")
    lines = [head, "-" * len(head)]
    fmt = lambda x, f: "-" if x is None else format(x, f)  # noqa: E731
    for name, m in report["methods"].items():
        ps = m.get("ps", {}).get("rerollout_pass_rate_after_warmup")
        lines.append(f"{name:<22}{fmt(m['rollouts_per_valid_group'], '.2f'):>15}{fmt(m['vs_ds'], '.2f'):>7}"
                     f"{fmt(m['useful_rollout_fraction'], '.3f'):>8}{m['valid_groups_per_step']:>11.2f}"
                     f"{fmt(m['abandoned_informative_fraction'], '.3f'):>15}  "
                     + ("" if ps is None else " ".join(fmt(x, ".3f") for x in ps)))
    pop = report["population"]
    lines.append(f"population: mean pass rate {pop['mean_pass_rate']}, uniform groups saturated "
                 f"{pop['uniform_saturated_fraction']} at step 0, {pop['uniform_saturated_fraction_final']} at the end")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The simulator's command-line arguments."""
    parser.add_argument("--config", default=None, help="YAML run config (allocation.*, prefix_sampling.*)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides; sim.<field>=value for the simulator")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--plot", default=None, metavar="FILE.png", help="write a summary figure")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def add_subparser(subparsers) -> argparse.ArgumentParser:
    """Register ``simulate`` on an argparse subparsers object; its handler is :func:`run`."""
    parser = subparsers.add_parser("simulate", help="compare allocation methods on a synthetic population",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Run the simulator from parsed arguments; prints the table or JSON. Returns the exit code."""
    from passrate_jax.config import load_config
    sim_over = [o[len("sim."):] for o in args.overrides if o.startswith("sim.")]
    try:
        cfg = load_config(args.config, [o for o in args.overrides if not o.startswith("sim.")])
        sim = build(SimulatorConfig, apply_overrides({}, sim_over), prefix="sim.")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    report = simulate(sim, cfg.allocation, cfg.prefix_sampling, progress=not args.no_progress)
    if args.plot:
        from passrate_jax.allocation.sim_plot import plot_report
        plot_report(report, args.plot)
    if args.json:
        print(json.dumps(report))
    else:
        print(format_table(report))
    return 0


def main(argv=None) -> int:
    """Entry point of ``python -m passrate_jax.allocation.simulate``."""
    parser = argparse.ArgumentParser(prog="python -m passrate_jax.allocation.simulate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
