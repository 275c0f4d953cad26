"""A study compares a seed's runs only where one arithmetic made them (passrate_jax/study/provenance.py)."""

import jax
import numpy as np
import pytest

from passrate_jax.study import provenance
from passrate_jax.study.analysis import analyse
from passrate_jax.study.report import _setup
from passrate_jax.study.runner import make_plan
from tests.test_study import _run


def test_the_fingerprint_repeats_and_changes_with_the_compiled_arithmetic(optimised):
    """The same process settings give the same fingerprint; XLA's optimisations (which reorder and fuse
    floating-point operations, as another machine's compiler may) give another."""
    on = provenance.numerics_fingerprint.__wrapped__()
    assert provenance.numerics_fingerprint.__wrapped__() == on and len(on) == 16
    jax.config.update("jax_disable_most_optimizations", True)
    jax.clear_caches()
    assert provenance.numerics_fingerprint.__wrapped__() != on


def test_each_attempt_is_recorded(tmp_path):
    run = tmp_path / "runs" / "grpo" / "seed0"
    assert provenance.fingerprints(str(run)) == frozenset()  # made before the record: no fingerprint
    first = provenance.record(str(run))
    assert first["numerics"] == provenance.numerics_fingerprint() and first["jax"] and first["cpu"]
    provenance.record(str(run))  # a resumed attempt on the same machine adds nothing new
    assert provenance.fingerprints(str(run)) == {first["numerics"]}
    with open(run / provenance.FILE, "a") as f:  # ... one on another machine does
        f.write('{"numerics": "0123456789abcdef"}\n')
    assert provenance.fingerprints(str(run)) == {first["numerics"], "0123456789abcdef"}


def _runs():
    curve = np.array([0.5, 0.6, 0.7, 0.7, 0.7])
    runs = {"grpo": {}, "ds": {}, "sara": {}}
    for s, per_step in enumerate((100, 400, 100)):
        runs["grpo"][s] = _run(curve + 0.1 * s, per_step, 4)
        runs["ds"][s] = _run(curve + 0.1 * s, 3 * per_step, 8)
        runs["sara"][s] = _run(curve + 0.1 * s, per_step, 6)
    return runs


def test_a_seed_computed_differently_is_left_out_of_its_comparisons(tmp_path):
    """DS's seed 1 ran on another machine: every comparison with DS leaves seed 1 out and says so, the
    claims read the same intervals, comparisons with GRPO keep all three seeds, and the report names
    the seed and the methods under each fingerprint. Runs with no record count as agreeing."""
    same, other = frozenset({"a" * 16}), frozenset({"b" * 16})
    prints = {m: {s: same for s in range(3)} for m in ("grpo", "ds", "sara")}
    prints["ds"][1] = other
    prints["grpo"][2] = frozenset()  # made before the record
    a = analyse(_runs(), prints=prints)
    for measure in ("rollouts_to_target", "final_accuracy", "valid_groups_per_step"):
        with_ds = a["comparisons"][("sara", "ds")][measure]
        assert (with_ds["seeds"], with_ds["unpaired_seeds"], with_ds["n"]) == ([0, 2], [1], 2)
        with_grpo = a["comparisons"][("sara", "grpo")][measure]
        assert with_grpo["seeds"] == [0, 1, 2] and with_grpo["unpaired_seeds"] == []
    claim = next(r for r in a["claims"] if r["claim"].label == "SARA: fewer rollouts than DS")
    assert claim["interval"]["seeds"] == [0, 2]
    # Without the record, seed 1 would be paired.
    assert analyse(_runs())["comparisons"][("sara", "ds")]["rollouts_to_target"]["seeds"] == [0, 1, 2]
    plan = make_plan(None, ["grpo", "ds", "sara"], [0, 1, 2], [], str(tmp_path), quick=True)
    text = "\n".join(_setup(plan, a, "passrate-jax study"))
    assert "**Pairing**: 8 of 9 runs recorded" in text
    assert f"seed 1: `{'a' * 16}` GRPO (uniform), SARA (fill); `{'b' * 16}` DS (DAPO dynamic sampling)" in text
    assert "seed 0:" not in text.split("**Pairing**")[1]


def test_a_run_resumed_on_another_machine_is_unpaired_with_every_method():
    both = frozenset({"a" * 16, "b" * 16})
    prints = {"grpo": {0: frozenset({"a" * 16}), 1: both}, "ds": {0: frozenset({"a" * 16}), 1: frozenset({"a" * 16})}}
    assert provenance.unpaired_seeds(prints, "ds", "grpo") == [1]
    lines = provenance.pairing_lines(prints, str)
    assert "seed 1:" in lines[0] and "seed 0:" not in lines[0]
    # Both runs of a seed moved between the same two machines: alike, yet neither computed one way throughout.
    prints["grpo"][2] = prints["ds"][2] = both
    assert provenance.unpaired_seeds(prints, "ds", "grpo") == [1, 2]
    assert f"seed 2: `{'a' * 16} + {'b' * 16}` grpo, ds" in provenance.pairing_lines(prints, str)[0]


@pytest.mark.parametrize("prints", [{}, {"grpo": {0: frozenset({"a" * 16})}, "ds": {0: frozenset({"a" * 16})}}])
def test_agreeing_or_missing_records_change_nothing(prints):
    assert provenance.unpaired_seeds(prints, "ds", "grpo") == []
    lines = provenance.pairing_lines(prints, str)
    assert lines == [] if not prints else "share one" in lines[0]


def test_a_study_without_records_says_nothing_checks_its_pairing():
    lines = provenance.pairing_lines({"grpo": {0: frozenset()}, "ds": {0: frozenset()}}, str)
    assert lines[0].startswith("**Pairing**: 0 of 2 runs") and "nothing here checks" in lines[0]
