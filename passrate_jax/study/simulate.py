"""Allocation simulator: every method side by side on a synthetic prompt population, as one pure function.

    passrate-jax simulate [--config FILE] [key=value ...] [--json] [--plot FILE.png]
    python -m passrate_jax.study.simulate [same arguments]

Each prompt i has a success rate p_i drawn from a Beta mixture (``sim.mixture_*``); the rate drifts
upward by ``sim.drift`` in logit units per step to mimic learning. Rollouts are Bernoulli. A
re-rollout from a prefix cut at ratio r of a successful trajectory succeeds with p + (1 - p) r^k, from
a failed one with p (1 - r^k), k = ``sim.ps_response_power``. Every method reads the same uniform
random numbers (rollout j of prompt i at step t uses the same draw under every method) and its
allocator starts from the same PRNG key. Each rollout has a length in tokens (:mod:`.lengths`).

The step is the allocator's own round machine (:mod:`passrate_jax.allocation.machine`) with Bernoulli
draws in place of the sampler, in each rollout mode of ``sim.engine`` (:mod:`.sim_engine`): round
mode, or the slot engine's event loop (``sampling.slots`` slots, chunks of ``sampling.chunk_tokens``),
both counting the decode slot-steps the device would spend. A simulated step is pure: the steps run
under ``jax.lax.scan``, the seeds (``sim.seeds``) under ``jax.vmap``, and every method on one setup (a
:class:`~passrate_jax.allocation.family.Family` of the policies, the method a knob): one compile per
mode. A sweep (:mod:`.sweep`) vmaps a grid of thresholds and controller gains over the method's own
setup. Overrides ``sim.<field>=value`` set :class:`SimulatorConfig`; ``allocation.*``,
``prefix_sampling.*`` and ``sampling.*`` set the baseline every method starts from.
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
from passrate_jax.allocation.composition import Knobs
from passrate_jax.allocation.table import ABANDONED, successes
from passrate_jax.configlib import ConfigError, apply_overrides, build, option, read_preset, section
from passrate_jax.sampling.config import SamplingConfig
from passrate_jax.study.lengths import KINDS, LengthModel, draw_lengths
from passrate_jax.study.sim_engine import Timing, run_step_events, run_step_rounds
from passrate_jax.study.sim_plot import plot_report
from passrate_jax.study.sim_report import format_table, format_timing, summarise, summarise_timing

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
    engine: str = option("both", doc="rollout modes simulated: rounds, slots (the slot engine, sampling.slots and "
                                     "sampling.chunk_tokens) or both (docs/engine.md, 'The simulator')")
    lengths: str = option("table", doc="answer lengths: table (the default preset's, measured), lognormal, constant")
    length_median: float = option(36.0, gt=0, doc="lognormal: median answer tokens; constant: every answer's")
    length_sigma: float = option(0.8, gt=0, doc="lognormal: log-sd (p99 / median = exp(2.326 sigma))")
    length_fail_factor: float = option(1.0, gt=0, doc="a failed answer's length is multiplied by this")
    max_tokens: int = option(0, ge=0, doc="token limit (lengths clipped to it); 0: sampling.max_new_tokens")
    max_chunks: int = option(4096, ge=1, doc="slot engine: chunks a step may run (a step stopped there is "
                                              "counted in chunk_limit_steps)")

    def validate(self) -> None:
        if not len(self.mixture_weights) == len(self.mixture_a) == len(self.mixture_b) > 0:
            raise ConfigError(f"mixture_weights = {self.mixture_weights}: needs one weight per mixture_a, mixture_b")
        if sum(self.mixture_weights) <= 0:
            raise ConfigError(f"mixture_weights = {self.mixture_weights}: must not all be 0")
        if not self.methods:
            raise ConfigError("methods = (): name at least one method")
        for name in self.methods:
            method_configs(name, AllocationConfig(), PrefixSamplingConfig())
        if self.engine not in ("rounds", "slots", "both"):
            raise ConfigError(f"sim.engine = {self.engine!r}: must be rounds, slots or both")
        if self.lengths not in KINDS:
            raise ConfigError(f"sim.lengths = {self.lengths!r}: must be one of {', '.join(KINDS)}")

    @property
    def engines(self) -> tuple[str, ...]:
        return ("rounds", "slots") if self.engine == "both" else (self.engine,)


@dataclasses.dataclass(frozen=True)
class AllocationSettings:
    """The part of a run config the simulator reads (a preset's other sections are ignored)."""
    allocation: AllocationConfig = section(AllocationConfig)
    prefix_sampling: PrefixSamplingConfig = section(PrefixSamplingConfig)
    sampling: SamplingConfig = section(SamplingConfig)


def method_configs(name: str, base: AllocationConfig, ps: PrefixSamplingConfig):
    """'sara+dps+ps' -> (AllocationConfig, PrefixSamplingConfig). The first part is uniform, ds, ds_ideal,
    sara (fill mode), sara_fixed (fixed-budget mode) or pilot_commit (or directly mopps / dps, meaning
    uniform with that selection)."""
    head, *rest = name.split("+")
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
    """Static description of the simulated world; the per-seed arrays are passed alongside. ``engine``:
    the rollout mode (rounds or slots) with its time model ``timing`` and answer ``lengths``."""
    steps: int
    drift: float
    power: float
    engine: str = "rounds"
    timing: Timing = Timing(64, 8, 4096, (64, 128, 256))
    lengths: LengthModel = LengthModel("constant", 64)


def make_world(sim: SimulatorConfig, sampling: SamplingConfig | None, engine: str = "rounds") -> World:
    """The :class:`World` of a simulator config, its rollout mode and sampling options."""
    sampling = sampling or SamplingConfig()
    timing = Timing(sampling.slots, sampling.chunk_tokens, sim.max_chunks, tuple(sampling.row_buckets),
                    narrow=sampling.narrow_slots)
    lengths = LengthModel.build(sim.lengths, sim.max_tokens or sampling.max_new_tokens, sim.length_median,
                                sim.length_sigma, sim.length_fail_factor)
    return World(sim.steps, sim.drift, sim.ps_response_power, engine, timing, lengths)


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


def _lengths(model: LengthModel, fresh, replay):
    """``lengths_of(t, rewards)``: tokens of row g's rollout j, int32 [G, N], from the step's uniform
    length draws of its prompt (fresh or replay, as the outcomes), given its outcome."""
    def lengths_of(t, rewards):
        is_replay = t.bucket >= 0
        u = jnp.where(is_replay[:, None], replay[t.prompt], fresh[t.prompt])
        return draw_lengths(model, u, rewards, jnp.where(is_replay, t.cut, 0.0)[:, None])
    return lengths_of


def _step_metrics(t, state, rates, lengths):
    """What one step did, as arrays (scan stacks them over steps)."""
    n_full = t.rewards.shape[1]
    s = successes(t)
    trained = t.rank >= 0
    held = trained[:, None] & (jnp.arange(n_full)[None, :] < t.n[:, None])
    valid = trained & (s > 0) & (s < t.n)
    full = trained & (t.n == n_full)
    abandoned = t.closed == ABANDONED  # per prompt (closed groups leave the table's rows)
    return {"spent": t.spent, "trained": t.trained, "valid": jnp.sum(valid), "overflow": t.overflow,
            "useful": jnp.sum(jnp.where(valid, t.n, 0)),
            "hist": jnp.sum(jax.nn.one_hot(s, n_full + 1) * full[:, None], axis=0),
            "abandoned": jnp.sum(abandoned),
            "abandoned_phi": jnp.sum(jnp.where(abandoned, survival(rates, n_full), 0.0)),
            "replay_successes": t.replay_successes, "replay_rollouts": t.replay_rollouts,
            "ratio": state.prefix_control.ratio, "trained_rollouts": jnp.sum(held),
            "trained_tokens": jnp.sum(jnp.where(held, lengths, 0))}


def simulation(setup, world: World):
    """``run(knobs, logit0 [P], key, state) -> per-step metrics [T, ...]``: a whole simulated run of one
    seed, pure (vmap it over seeds or knobs; jit it once per setup)."""
    n, p = setup.N, setup.num_prompts

    def run(knobs: Knobs, logit0, key, state):
        def body(state, t):
            rates = jax.nn.sigmoid(logit0 + world.drift * t)
            k_fresh, k_replay = jax.random.split(jax.random.fold_in(key, t))
            fresh, replay = jax.random.uniform(k_fresh, (p, n)), jax.random.uniform(k_replay, (p, n))
            # Lengths from their own keys: the outcomes' draws stay those of the simulator without lengths.
            k_len, k_len_replay = jax.random.split(jax.random.fold_in(jax.random.fold_in(key, t), 1))
            lengths_of = _lengths(world.lengths, jax.random.uniform(k_len, (p, n)),
                                  jax.random.uniform(k_len_replay, (p, n)))
            step = run_step_events if world.engine == "slots" else run_step_rounds
            state, table, counters = step(setup, knobs, state, _outcomes(rates, fresh, replay, world.power),
                                          lengths_of, world.timing)
            # Trained lengths are read at this step's draws: exact for rollouts generated this step; a group
            # carried from an earlier step (ideal DS's surplus, a committed pilot) gets this step's lengths.
            return state, {**_step_metrics(table, state, rates, lengths_of(table, table.rewards)), **counters}

        state, metrics = jax.lax.scan(body, state, jnp.arange(world.steps))
        return {**metrics, "evicted": jnp.sum(state.evicted_now)}
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


def _retires_in_any_order(allocator: Allocator, knobs: Knobs | None) -> bool:
    """The allocator's retirement order, or issue order (right for every setting) where the swept knobs
    change what it depends on."""
    return allocator.retires_in_any_order and (knobs is None or all(
        np.all(np.asarray(getattr(knobs, k)) == getattr(allocator.knobs, k)) for k in ("policy", "budget",
                                                                                        "selection", "ps_on")))


def prepare(name: str, sim: SimulatorConfig, alloc: AllocationConfig, ps: PrefixSamplingConfig,
            knobs: Knobs | None = None, world: World | None = None):
    """(jitted run, its arguments) for method ``name``; ``knobs`` (optional, some with leading grid
    axes) replaces the configs' thresholds and gains: a sweep. Without ``knobs`` every method runs on
    one setup (a :class:`~passrate_jax.allocation.family.Family` of the policies: one compile for
    all); a sweep runs on the method's own setup, whose table is sized for that method alone (uniform's
    grid is 40x cheaper per step than on the family's table) and which draws the same numbers. ``world``:
    the rollout mode and time model (default: round mode, sampling's defaults)."""
    cfg, pcfg = method_configs(name, alloc, ps)
    allocator = Allocator(cfg, pcfg, sim.num_prompts)
    setup = make_setup(cfg, pcfg, sim.num_prompts, family=True) if knobs is None else allocator.setup
    rank, knob_axes = (0, None) if knobs is None else grid_axes(knobs, allocator.knobs)
    world = world or make_world(sim, None)
    if world.engine == "slots":
        world = dataclasses.replace(world, timing=dataclasses.replace(world.timing, any_order=_retires_in_any_order(
            allocator, knobs)))
    run = _runner(setup, world, rank, knob_axes)
    return run, (allocator.knobs if knobs is None else knobs, *_seed_inputs(sim, setup))


def run_method(name: str, sim: SimulatorConfig, alloc: AllocationConfig, ps: PrefixSamplingConfig,
               knobs: Knobs | None = None, world: World | None = None) -> dict:
    """Per-step metrics of method ``name`` for every seed (numpy, leading axes [grid..., seeds, T]), in
    one call (:func:`~.sweep.run_grid` splits a grid over the CPU's cores)."""
    run, args = prepare(name, sim, alloc, ps, knobs, world)
    return jax.device_get(run(*args))


def simulate(sim: SimulatorConfig, alloc: AllocationConfig, ps: PrefixSamplingConfig, progress: bool = True,
             sampling: SamplingConfig | None = None) -> dict:
    """Run every method of ``sim.methods`` over ``sim.seeds`` seeds in each rollout mode of ``sim.engine``;
    returns {"config", "population", "methods": {name: metrics (means over seeds, sd as name_sd) of the
    first mode, and "modes": {mode: its time model's numbers}}, "wall_s"}."""
    start = time.perf_counter()
    bar = None
    keys = [(name, engine) for engine in sim.engines for name in sim.methods]
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=len(keys), desc="simulate", unit="run", file=sys.stderr)
    worlds = {engine: make_world(sim, sampling, engine) for engine in sim.engines}
    first, *rest = keys
    jobs = {first: prepare(first[0], sim, alloc, ps, world=worlds[first[1]])}
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        # Every method shares one runner per mode (one setup, the method a knob), so there is one compile
        # per mode; the first overlaps the host-side set-up of the other runs, then the runs go on two
        # threads (XLA compiles and runs without the GIL).
        compiling = pool.submit(lambda run, args: run.lower(*args).compile(), *jobs[first])
        jobs.update({key: prepare(key[0], sim, alloc, ps, world=worlds[key[1]]) for key in rest})
        compiled = {id(jobs[first][0]): compiling.result()}
        for run, args in jobs.values():
            if id(run) not in compiled:
                compiled[id(run)] = run.lower(*args).compile()

        def one(key):
            run, args = jobs[key]
            m = jax.device_get(compiled[id(run)](*args))
            out = summarise(m, sim, alloc.group_size, "ps" in key[0].split("+")), summarise_timing(m, sim.steps)
            if bar is not None:
                bar.update(1)
            return out
        runs = dict(zip(keys, pool.map(one, keys)))
    if bar is not None:
        bar.close()
    methods = {name: {**runs[(name, sim.engines[0])][0],
                      "modes": {engine: runs[(name, engine)][1] for engine in sim.engines}} for name in sim.methods}
    n = alloc.group_size
    p0 = np.stack([population(sim, np.random.default_rng(s)) for s in range(sim.seed, sim.seed + sim.seeds)])
    p_end = 1 / (1 + np.exp(-(np.log(p0) - np.log1p(-p0) + sim.drift * (sim.steps - 1))))
    pop = {"mean_pass_rate": round(float(p0.mean()), 4),
           "uniform_saturated_fraction": round(float(1 - survival(p0, n).mean()), 4),
           "uniform_saturated_fraction_final": round(float(1 - survival(p_end, n).mean()), 4)}
    ds = methods.get("ds", {}).get("rollouts_per_valid_group")
    for m in methods.values():
        m["vs_ds"] = round(m["rollouts_per_valid_group"] / ds, 4) if ds and m["rollouts_per_valid_group"] else None
    timing = worlds[sim.engines[-1]].timing
    return {"config": {"sim": dataclasses.asdict(sim), "num_prompts_per_step": alloc.num_prompts, "group_size": n,
                       "slots": timing.slots, "chunk_tokens": timing.chunk, "row_buckets": list(timing.row_buckets),
                       "max_tokens": worlds[sim.engines[-1]].lengths.limit},
            "population": pop, "methods": methods, "wall_s": round(time.perf_counter() - start, 2)}


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
        data = {k: v for k, v in data.items() if k in ("allocation", "prefix_sampling", "sampling")}
        cfg = build(AllocationSettings, apply_overrides(data, [o for o in args.overrides if not o.startswith("sim.")]))
        sim = build(SimulatorConfig, apply_overrides({}, sim_over), prefix="sim.")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    report = simulate(sim, cfg.allocation, cfg.prefix_sampling, progress=not args.no_progress, sampling=cfg.sampling)
    if args.plot:
        plot_report(report, args.plot)
    if args.json:
        print(json.dumps(report))
    else:
        print(format_table(report))
        print(format_timing(report))
    return 0


def main(argv=None) -> int:
    """Entry point of ``python -m passrate_jax.study.simulate``."""
    parser = argparse.ArgumentParser(prog="python -m passrate_jax.study.simulate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
