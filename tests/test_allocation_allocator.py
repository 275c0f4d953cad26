"""The round-by-round allocator: every composition, budgets, state round-trips, and the simulator."""

import dataclasses
import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from passrate_jax.allocation import Allocator, Result, state_from_dict, state_to_dict
from passrate_jax.allocation.config import AllocationConfig, PrefixSamplingConfig, SaraConfig
from passrate_jax.study.simulate import SimulatorConfig, format_timing, main, simulate

B, N, P = 4, 8, 48


def make(method, selection="none", ps=False, **kw):
    cfg = AllocationConfig(method=method, num_prompts=B, group_size=N, **kw)
    cfg = dataclasses.replace(cfg, selection=dataclasses.replace(cfg.selection, method=selection))
    return Allocator(cfg, PrefixSamplingConfig(enabled=ps), P)


def drive(allocator, state, steps, rates, seed=0):
    """Run steps with Bernoulli outcomes; returns (results, state, requests seen)."""
    rng = np.random.default_rng(seed)
    out, seen = [], []
    for _ in range(steps):
        run = allocator.start_step(state)
        while reqs := run.requests():
            seen += reqs
            run.observe([Result(r.group_key, tuple(int(x) for x in rng.random(r.num_rollouts) < rates[r.prompt_id]))
                         for r in reversed(reqs)])  # any order
        res, state = run.finish()
        out.append(res)
    return out, state, seen


RATES = np.random.default_rng(0).beta(0.4, 0.4, P)


@pytest.mark.parametrize("method,selection,ps", list(itertools.product(
    ["uniform", "ds", "sara", "pilot_commit"], ["none", "mopps", "dps"], [False, True])))
def test_every_composition(method, selection, ps):
    allocator = make(method, selection, ps)
    results, state, seen = drive(allocator, allocator.init(jax.random.PRNGKey(0)), 3, RATES)
    assert int(state.step) == 3 and len(results) == 3
    for res in results:
        assert len(res.groups) <= B
        assert res.rollouts_spent <= allocator.budget
        for g in res.groups:
            assert g.valid == (0 < sum(g.rewards) < len(g.rewards))
            assert len(g.rewards) == N
            if method != "uniform":
                assert g.valid  # only uniform trains saturated groups
    assert sum(r.rollouts_spent for r in results) == sum(r.num_rollouts for r in seen)
    assert any(r.prefix is not None for r in seen) == (ps and any(
        0 < sum(g.rewards) <= 2 or 6 <= sum(g.rewards) < 8 for res in results[:-1] for g in res.groups))
    for r in seen:
        if r.prefix is not None:
            assert 0 < r.prefix.cut_ratio < 1 and r.num_rollouts == N and r.first_index == 0
    # How fresh prompts are sampled, as (first rollout index, rollouts): uniform and DS in whole groups;
    # SARA in probes of its round schedule [2, 2, N - 4], a group confirmed after its first probe completed
    # to N at once; Pilot-Commit in a pilot of n_p = N / 4 and a commit of the other N - n_p.
    fresh = {(r.first_index, r.num_rollouts) for r in seen if r.prefix is None}
    expected = {"uniform": {(0, N)}, "ds": {(0, N)}, "sara": {(0, 2), (2, 2), (2, N - 2), (4, N - 4)},
                "pilot_commit": {(0, N // 4), (N // 4, N - N // 4)}}[method]
    assert fresh <= expected and (0, min(n for _, n in expected)) in fresh, fresh


def test_sara_abandons_unanimous_prompts_after_two_probes_and_respects_budget():
    allocator = make("sara", sara=SaraConfig(mode="fixed_budget"))
    (res,), _, seen = drive(allocator, allocator.init(jax.random.PRNGKey(0)), 1, np.zeros(P))
    # New prompts open only while the budget can still complete them to N, so the last N - 4
    # rollouts of the B * N budget stay unspent.
    assert res.groups == [] and B * N - N < res.rollouts_spent <= B * N
    # Every prompt gets probes of 2 then 2 and is abandoned at P_valid = 4/9 <= 0.45.
    assert all((n, s) == (4, 0) for _, n, s in res.abandoned) and len(res.abandoned) * 4 == res.rollouts_spent
    assert {r.num_rollouts for r in seen} == {2}


def test_ds_discards_surplus_and_ideal_ds_keeps_it():
    rates = np.full(P, 0.5)
    for keep in (False, True):
        cfg = AllocationConfig(method="ds", num_prompts=B, group_size=N)
        allocator = Allocator(dataclasses.replace(cfg, ds=dataclasses.replace(cfg.ds, keep_surplus=keep)),
                              PrefixSamplingConfig(), P)
        results, _, _ = drive(allocator, allocator.init(jax.random.PRNGKey(0)), 2, rates)
        assert results[0].rollouts_spent == 3 * B * N  # one generation batch of 3B prompts
        assert len(results[1].groups) == B
        assert results[1].rollouts_spent == (0 if keep else 3 * B * N)  # surplus covers the next step
        assert bool(results[0].retained_keys) == keep


def test_state_round_trips_through_a_dict_of_arrays():
    allocator = make("pilot_commit", "dps", True)
    _, state, _ = drive(allocator, allocator.init(jax.random.PRNGKey(3)), 3, RATES)
    flat = state_to_dict(state)
    assert all(isinstance(v, np.ndarray) for v in flat.values()) and "selection/counts" in flat
    again = state_from_dict({k: v.copy() for k, v in flat.items()}, allocator.init(jax.random.PRNGKey(0)))
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(x, y), state, again)
    a, _, _ = drive(allocator, state, 2, RATES, seed=9)
    b, _, _ = drive(allocator, again, 2, RATES, seed=9)
    assert [r.groups for r in a] == [r.groups for r in b]  # restored state continues identically
    with pytest.raises(ValueError):
        state_from_dict({**flat, "evicted_until": np.zeros(3, np.int32)}, state)


def test_protocol_errors():
    allocator = make("uniform")
    run = allocator.start_step(allocator.init(jax.random.PRNGKey(0)))
    reqs = run.requests()
    with pytest.raises(RuntimeError):
        run.requests()
    with pytest.raises(ValueError):
        run.observe([Result(reqs[0].group_key, (1,))])


def test_no_method_runs_out_of_table_rows():
    """Every composition on a population from hopeless to mixed, with PS replays and ideal DS's surplus,
    never needs more rows than its setup's capacity (``simulate`` raises if one does)."""
    from passrate_jax.study.simulate import run_method
    from passrate_jax.study.sweep import base_knobs
    sim = SimulatorConfig(steps=6, num_prompts=96, seeds=2, mixture_weights=(0.6, 0.2, 0.2))
    alloc, ps = AllocationConfig(num_prompts=B), PrefixSamplingConfig()
    for name in sim.methods:
        # With knobs the run is on the method's own setup (its own capacity), not the family's widest.
        m = run_method(name, sim, alloc, ps, base_knobs(name, sim, alloc, ps))
        assert m["overflow"].max() == 0 and m["trained"].sum() > 0, name


def test_simulator_smoke(tmp_path, capsys):
    sim = SimulatorConfig(steps=4, num_prompts=64, warmup=1, seeds=2,
                          methods=("ds", "sara_fixed", "uniform+ps"))
    report = simulate(sim, AllocationConfig(num_prompts=B), PrefixSamplingConfig(), progress=False)
    m = report["methods"]
    assert set(m) == set(sim.methods) and report["wall_s"] > 0
    assert m["ds"]["valid_groups_per_step"] == B and m["ds"]["vs_ds"] == 1.0
    assert m["ds"]["valid_groups_per_step_sd"] == 0
    for v in m.values():
        assert v["rollouts_per_valid_group"] >= N and 0 < v["useful_rollout_fraction"] <= 1
        assert v["valid_groups_per_step"] <= B
    assert m["sara_fixed"]["rollouts_per_step"] <= B * N
    assert "ps" in m["uniform+ps"] and len(m["uniform+ps"]["ps"]["pass_rate_per_step"]) == 4
    for v in m.values():  # both rollout modes, the same machine: round mode's numbers are the headline ones
        assert set(v["modes"]) == {"rounds", "slots"}
        assert v["modes"]["rounds"]["rollouts_per_valid_group"] == v["rollouts_per_valid_group"]
        assert all(0 < t["slot_utilization"] <= 1 and t["chunk_limit_steps"] == 0 for t in v["modes"].values())
    assert "slot-steps/trained" in format_timing(report)
    png = tmp_path / "sim.png"
    # The command line on the same population and round mode: the jitted run above serves it (no compile).
    assert main(["sim.steps=4", "sim.num_prompts=64", "sim.warmup=1", "sim.seeds=2", "sim.methods=[ds, sara_fixed]",
                 "sim.engine=rounds", "allocation.num_prompts=4", "--json", "--plot", str(png), "--no-progress"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["methods"]) == {"ds", "sara_fixed"} and png.stat().st_size > 1000 and "wall_s" in out
    assert out["methods"]["ds"]["rollouts_per_valid_group"] == m["ds"]["rollouts_per_valid_group"]
    assert main(["sim.methods=[sara+bogus]", "--no-progress"]) == 2
    assert main(["model.num_layers=3", "--no-progress"]) == 2  # the simulator reads allocation settings only


def test_simulator_runs_the_allocator_step_for_step():
    """The simulator's pure step is the host allocator's: driving the Allocator by hand with the same
    Bernoulli draws gives the same groups and rollouts."""
    from passrate_jax.study.simulate import method_configs, population, run_method
    sim = SimulatorConfig(steps=3, num_prompts=40, seeds=1, drift=0.0)
    # A selection method's pool, method none's per-step order, and PS's same-step replays on top of B.
    for name, ps in (("sara+dps+ps", PrefixSamplingConfig()), ("sara+ps", PrefixSamplingConfig()),
                     ("sara+ps", PrefixSamplingConfig(timing="same_step", placement="on_top"))):
        m = run_method(name, sim, AllocationConfig(num_prompts=B), ps)
        cfg, pcfg = method_configs(name, AllocationConfig(num_prompts=B), ps)
        allocator = Allocator(cfg, pcfg, sim.num_prompts)
        state = allocator.init(jax.random.PRNGKey(sim.seed))
        rates = population(sim, np.random.default_rng(sim.seed))
        world = jax.random.PRNGKey(10_000 + sim.seed)
        for t in range(sim.steps):
            k_fresh, k_replay = jax.random.split(jax.random.fold_in(world, t))
            fresh = np.asarray(jax.random.uniform(k_fresh, (sim.num_prompts, N)))
            replay = np.asarray(jax.random.uniform(k_replay, (sim.num_prompts, N)))
            p = np.asarray(jax.nn.sigmoid(jnp.asarray(np.log(rates) - np.log1p(-rates), jnp.float32)))
            run = allocator.start_step(state)
            while reqs := run.requests():
                results = []
                for r in reqs:
                    idx = slice(r.first_index, r.first_index + r.num_rollouts)
                    if r.prefix is None:
                        out = fresh[r.prompt_id, idx] < p[r.prompt_id]
                    else:
                        q = p[r.prompt_id]
                        g = np.float32(r.prefix.cut_ratio)
                        q = q + (1 - q) * g if r.prefix.success else q * (1 - g)
                        out = replay[r.prompt_id, idx] < q
                    results.append(Result(r.group_key, tuple(int(x) for x in out)))
                run.observe(results)
            res, state = run.finish()
            assert res.rollouts_spent == m["spent"][0, t]
            assert sum(g.valid for g in res.groups) == m["valid"][0, t]
            assert len(res.groups) == m["trained"][0, t] <= allocator.max_groups


def test_a_grid_split_over_threads_gives_each_setting_the_numbers_of_one_call():
    from passrate_jax.study.simulate import run_method
    from passrate_jax.study.sweep import base_knobs, grid_parts, run_grid, sweep_knobs
    sim = SimulatorConfig(steps=4, num_prompts=48, seeds=2)
    alloc, ps = AllocationConfig(num_prompts=B), PrefixSamplingConfig()
    knobs = sweep_knobs(base_knobs("sara", sim, alloc, ps), tau_abandon=[0.2, 0.3, 0.4, 0.5],
                        tau_confirm=[0.6, 0.7, 0.8, 0.9])
    parts = grid_parts(knobs, base_knobs("sara", sim, alloc, ps), 3)
    # The largest count <= 3 that splits 4 settings evenly; the unswept knobs stay whole.
    np.testing.assert_allclose([p.tau_abandon for p in parts], [[0.2, 0.3], [0.4, 0.5]])
    assert all(p.schedule.shape == knobs.schedule.shape for p in parts)
    split, whole = run_grid("sara", sim, alloc, ps, knobs, threads=2), run_method("sara", sim, alloc, ps, knobs)
    assert split["spent"].shape == (4, 2, 4)
    jax.tree.map(np.testing.assert_array_equal, split, jax.device_get(whole))
