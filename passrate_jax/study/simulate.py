"""Allocation simulator: every method side by side on a synthetic prompt population, as one pure function.

    passrate-jax simulate [--config FILE] [key=value ...] [--json] [--plot FILE.png]
    python -m passrate_jax.study.simulate [same arguments]

Each prompt i has a success rate p_i drawn from a Beta mixture (``sim.mixture_*``); the rate drifts
upward by ``sim.drift`` in logit units per step to mimic learning. Rollouts are Bernoulli. A
re-rollout from a prefix cut at ratio r of a successful trajectory succeeds with p + (1 - p) r^k, from
a failed one with p (1 - r^k), k = ``sim.ps_response_power``. Every method reads the same uniform
random numbers (rollout j of prompt i at step t uses the same draw under every method) and its
allocator starts from the same PRNG key.

The step is the allocator's own round machine (:func:`passrate_jax.allocation.machine.run_step`) with
Bernoulli draws in place of the sampler, so a simulated step is pure: the steps run under
``jax.lax.scan``, the seeds (``sim.seeds``) under ``jax.vmap``, and every method on one setup (a
:class:`~passrate_jax.allocation.family.Family` of the policies, the method a knob): one compile in
all. A sweep (:mod:`.sweep`) vmaps a grid of thresholds and controller gains over the method's own setup. Overrides
``sim.<field>=value`` set :class:`SimulatorConfig`; ``allocation.*`` and ``prefix_sampling.*`` set the
baseline every method starts from.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import functools
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from passrate_jax.allocation.allocator import Allocator, init_state, make_setup
from passrate_jax.allocation.config import AllocationConfig, PrefixSamplingConfig
from passrate_jax.allocation.machine import run_step
from passrate_jax.allocation.policies import Knobs
from passrate_jax.allocation.prefix_control import bucket_successes
from passrate_jax.allocation.table import ABANDONED, successes
from passrate_jax.configlib import ConfigError, apply_overrides, build, option, read_preset, section
from passrate_jax.study.sim_plot import plot_report

BASES = ("uniform", "ds", "ds_ideal", "sara", "sara_fixed", "pilot_commit")
DEFAULT_METHODS = ("uniform", "ds", "ds_ideal", "mopps", "dps", "sara", "sara+mopps", "sara+dps", "sara_fixed",
                   "sara_fixed+mopps", "sara_fixed+dps", "pilot_commit", "pilot_commit+dps", "uniform+ps", "ds+ps",
                   "sara+ps", "sara+dps+ps", "sara_fixed+ps", "sara_fixed+dps+ps", "pilot_commit+ps",
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
    seed: int = option(0, ge=0, doc="first seed")
    seeds: int = option(5, ge=1, doc="seeds seed .. seed + seeds - 1, run side by side (vmapped)")
    methods: tuple[str, ...] = option(DEFAULT_METHODS, doc="names base[+mopps|+dps][+ps]")

    def validate(self) -> None:
        if not len(self.mixture_weights) == len(self.mixture_a) == len(self.mixture_b) > 0:
            raise ConfigError(f"mixture_weights = {self.mixture_weights}: needs one weight per mixture_a, mixture_b")
        if sum(self.mixture_weights) <= 0:
            raise ConfigError(f"mixture_weights = {self.mixture_weights}: must not all be 0")
        if not self.methods:
            raise ConfigError("methods = (): name at least one method")
        for name in self.methods:
            method_configs(name, AllocationConfig(), PrefixSamplingConfig())


@dataclasses.dataclass(frozen=True)
class AllocationSettings:
    """The part of a run config the simulator reads (a preset's other sections are ignored)."""
    allocation: AllocationConfig = section(AllocationConfig)
    prefix_sampling: PrefixSamplingConfig = section(PrefixSamplingConfig)


def method_configs(name: str, base: AllocationConfig, ps: PrefixSamplingConfig):
    """'sara+dps+ps' -> (AllocationConfig, PrefixSamplingConfig). The first part is uniform, ds, ds_ideal,
    sara (fill mode), sara_fixed (fixed-budget mode) or pilot_commit (or directly mopps / dps, meaning
    uniform with that selection)."""
    parts = name.split("+")
    head, rest = parts[0], parts[1:]
    if head in ("mopps", "dps"):
        head, rest = "uniform", [head] + rest
    if head not in BASES or any(r not in ("mopps", "dps", "ps") for r in rest) or len(set(rest)) != len(rest) or (
            "mopps" in rest and "dps" in rest):
        raise ConfigError(f"methods: {name!r} is not base[+mopps|+dps][+ps] with base in {', '.join(BASES)}")
    selection = next((r for r in rest if r != "ps"), "none")
    method = {"ds_ideal": "ds", "sara_fixed": "sara"}.get(head, head)
    sara = base.sara
    if head.startswith("sara"):
        sara = dataclasses.replace(sara, mode="fixed_budget" if head == "sara_fixed" else "fill")
    cfg = dataclasses.replace(base, method=method, sara=sara,
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
    """Probability that a group of n Bernoulli(p) rollouts is mixed (numpy or jax)."""
    return 1 - p**n - (1 - p) ** n


@dataclasses.dataclass(frozen=True)
class World:
    """Static description of the simulated world; the per-seed arrays are passed alongside."""
    steps: int
    drift: float
    power: float


def _outcomes(rates, fresh, replay, power):
    """The Bernoulli sampler: rollout j of row g succeeds when its shared uniform draw is below the
    row's success rate (the prefix response for a re-rollout group)."""
    def outcomes(state, t):
        p = rates[t.prompt]
        g = t.cut ** power
        p_replay = jnp.where(t.src_success, p + (1 - p) * g, p * (1 - g))
        is_replay = t.bucket >= 0
        rate = jnp.where(is_replay, p_replay, p)
        u = jnp.where(is_replay[:, None], replay[t.prompt], fresh[t.prompt])
        return (u < rate[:, None]).astype(jnp.int8), jnp.ones(t.prompt.shape, bool)
    return outcomes


def _step_metrics(t, state, rates):
    """What one step did, as arrays (scan stacks them over steps)."""
    n_full = t.rewards.shape[1]
    s = successes(t)
    trained = t.rank >= 0
    valid = trained & (s > 0) & (s < t.n)
    full = trained & (t.n == n_full)
    abandoned = t.closed == ABANDONED  # per prompt (closed groups leave the table's rows)
    return {"spent": t.spent, "trained": t.trained, "valid": jnp.sum(valid), "overflow": t.overflow,
            "useful": jnp.sum(jnp.where(valid, t.n, 0)),
            "hist": jnp.sum(jax.nn.one_hot(s, n_full + 1) * full[:, None], axis=0),
            "abandoned": jnp.sum(abandoned),
            "abandoned_phi": jnp.sum(jnp.where(abandoned, survival(rates, n_full), 0.0)),
            "replay_successes": t.replay_successes, "replay_rollouts": t.replay_rollouts,
            "ratio": state.prefix_control.ratio}


def simulation(setup, world: World):
    """``run(knobs, logit0 [P], key, state) -> per-step metrics [T, ...]``: a whole simulated run of one
    seed, pure (vmap it over seeds or knobs; jit it once per setup)."""
    n, p = setup.N, setup.num_prompts

    def run(knobs: Knobs, logit0, key, state):
        def body(state, t):
            rates = jax.nn.sigmoid(logit0 + world.drift * t)
            k_fresh, k_replay = jax.random.split(jax.random.fold_in(key, t))
            fresh, replay = jax.random.uniform(k_fresh, (p, n)), jax.random.uniform(k_replay, (p, n))
            state, table = run_step(setup, knobs, state, _outcomes(rates, fresh, replay, world.power))
            return state, _step_metrics(table, state, rates)

        state, metrics = jax.lax.scan(body, state, jnp.arange(world.steps))
        return {**metrics, "evicted": jnp.sum(state.evicted)}
    return run


def _seed_inputs(sim: SimulatorConfig, setup):
    """Per-seed arrays stacked on a leading axis: initial logits, world keys, allocator states."""
    seeds = range(sim.seed, sim.seed + sim.seeds)
    p0 = np.stack([population(sim, np.random.default_rng(s)) for s in seeds])
    logit0 = jnp.asarray(np.log(p0) - np.log1p(-p0), jnp.float32)
    keys = jnp.stack([jax.random.PRNGKey(10_000 + s) for s in seeds])
    states = jax.tree.map(lambda *xs: jnp.stack(xs), *[init_state(setup, jax.random.PRNGKey(s)) for s in seeds])
    return logit0, keys, states


@functools.lru_cache(maxsize=None)
def _runner(setup, world: World, grid_axes: int, knob_axes: Knobs | None):
    """The jitted run over seeds (and ``grid_axes`` leading axes of the knobs whose ``knob_axes`` leaf
    is 0; the others stay unbatched, so a switch on them stays a branch). One per setup and grid
    layout, so runs that differ only in their knobs share it, and its compile."""
    run = jax.vmap(simulation(setup, world), in_axes=(None, 0, 0, 0))
    for _ in range(grid_axes):
        run = jax.vmap(run, in_axes=(knob_axes, None, None, None))
    return jax.jit(run)


def grid_axes(knobs: Knobs, base: Knobs) -> tuple[int, Knobs]:
    """(grid rank, per-knob in_axes: 0 for the knobs that carry the grid's leading axes, else None)."""
    extra = jax.tree.map(lambda k, b: jnp.ndim(k) - jnp.ndim(b), knobs, base)
    rank = max(jax.tree.leaves(extra))
    if any(e not in (0, rank) for e in jax.tree.leaves(extra)):
        raise ValueError("knobs: every swept knob needs the same leading grid axes (see sweep_knobs)")
    return rank, jax.tree.map(lambda e: 0 if e else None, extra)


def prepare(name: str, sim: SimulatorConfig, alloc: AllocationConfig, ps: PrefixSamplingConfig,
            knobs: Knobs | None = None):
    """(jitted run, its arguments) for method ``name``; ``knobs`` (optional, some with leading grid
    axes) replaces the configs' thresholds and gains: a sweep. Without ``knobs`` every method runs on
    one setup (a :class:`~passrate_jax.allocation.family.Family` of the policies: one compile for
    all); a sweep runs on the method's own setup, whose table is sized for that method alone (uniform's
    grid is 40x cheaper per step than on the family's table) and which draws the same numbers."""
    cfg, pcfg = method_configs(name, alloc, ps)
    allocator = Allocator(cfg, pcfg, sim.num_prompts)
    setup = make_setup(cfg, pcfg, sim.num_prompts, family=True) if knobs is None else allocator.setup
    rank, knob_axes = (0, None) if knobs is None else grid_axes(knobs, allocator.knobs)
    run = _runner(setup, World(sim.steps, sim.drift, sim.ps_response_power), rank, knob_axes)
    return run, (allocator.knobs if knobs is None else knobs, *_seed_inputs(sim, setup))


def run_method(name: str, sim: SimulatorConfig, alloc: AllocationConfig, ps: PrefixSamplingConfig,
               knobs: Knobs | None = None) -> dict:
    """Per-step metrics of method ``name`` for every seed (numpy, leading axes [grid..., seeds, T]), in
    one call (:func:`~.sweep.run_grid` splits a grid over the CPU's cores)."""
    run, args = prepare(name, sim, alloc, ps, knobs)
    return jax.device_get(run(*args))


def summarise(m: dict, sim: SimulatorConfig, group_size: int, ps_on: bool) -> dict:
    """Per-seed headline numbers, then their mean and sd over seeds."""
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
    out = {}
    for k, v in per_seed.items():
        ok = ~np.isnan(v)
        out[k] = float(v[ok].mean()) if ok.any() else None
        out[k + "_sd"] = float(v[ok].std(ddof=1)) if ok.sum() > 1 else (0.0 if ok.any() else None)
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


def simulate(sim: SimulatorConfig, alloc: AllocationConfig, ps: PrefixSamplingConfig, progress: bool = True) -> dict:
    """Run every method of ``sim.methods`` over ``sim.seeds`` seeds; returns {"config", "population",
    "methods": {name: metrics (means over seeds, sd as name_sd)}, "wall_s"}."""
    start = time.perf_counter()
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=len(sim.methods), desc="simulate", unit="method", file=sys.stderr)
    first, *rest = sim.methods
    jobs = {first: prepare(first, sim, alloc, ps)}
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        # Every method shares one runner (one setup, the method a knob), so there is one compile; it
        # overlaps the host-side set-up of the other methods, then the runs go on two threads (XLA
        # compiles and runs without the GIL).
        compiling = pool.submit(lambda run, args: run.lower(*args).compile(), *jobs[first])
        jobs.update({name: prepare(name, sim, alloc, ps) for name in rest})
        compiled = {id(jobs[first][0]): compiling.result()}
        for run, args in jobs.values():
            if id(run) not in compiled:
                compiled[id(run)] = run.lower(*args).compile()

        def one(name):
            run, args = jobs[name]
            out = summarise(jax.device_get(compiled[id(run)](*args)), sim, alloc.group_size, "ps" in name.split("+"))
            if bar is not None:
                bar.update(1)
            return out
        methods = dict(zip(sim.methods, pool.map(one, sim.methods)))
    if bar is not None:
        bar.close()
    n = alloc.group_size
    p0 = np.stack([population(sim, np.random.default_rng(s)) for s in range(sim.seed, sim.seed + sim.seeds)])
    p_end = 1 / (1 + np.exp(-(np.log(p0) - np.log1p(-p0) + sim.drift * (sim.steps - 1))))
    pop = {"mean_pass_rate": round(float(p0.mean()), 4),
           "uniform_saturated_fraction": round(float(1 - survival(p0, n).mean()), 4),
           "uniform_saturated_fraction_final": round(float(1 - survival(p_end, n).mean()), 4)}
    ds = methods.get("ds", {}).get("rollouts_per_valid_group")
    for m in methods.values():
        m["vs_ds"] = round(m["rollouts_per_valid_group"] / ds, 4) if ds and m["rollouts_per_valid_group"] else None
    return {"config": {"sim": dataclasses.asdict(sim), "num_prompts_per_step": alloc.num_prompts, "group_size": n},
            "population": pop, "methods": methods, "wall_s": round(time.perf_counter() - start, 2)}


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
    sim_over = [o[len("sim."):] for o in args.overrides if o.startswith("sim.")]
    try:
        data = read_preset(args.config) if args.config else {}
        data = {k: v for k, v in data.items() if k in ("allocation", "prefix_sampling")}
        cfg = build(AllocationSettings, apply_overrides(data, [o for o in args.overrides if not o.startswith("sim.")]))
        sim = build(SimulatorConfig, apply_overrides({}, sim_over), prefix="sim.")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    report = simulate(sim, cfg.allocation, cfg.prefix_sampling, progress=not args.no_progress)
    if args.plot:
        plot_report(report, args.plot)
    if args.json:
        print(json.dumps(report))
    else:
        print(format_table(report))
    return 0


def main(argv=None) -> int:
    """Entry point of ``python -m passrate_jax.study.simulate``."""
    parser = argparse.ArgumentParser(prog="python -m passrate_jax.study.simulate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
