"""Three training steps of ``configs/default.yaml`` on 8 fake CPU devices, as (data=8) and as
(data=2, fsdp=2, tensor=2), against one device: the whole loop (sampling, the task's verifier, SARA +
adaptive Prefix Sampling, the update), not one update in isolation. Sampling runs on the slot engine,
the default (``sampling.engine``): its pool's rows are split over the data axes like round mode's.

The preset (uniform allocation as shipped) is switched to SARA + adaptive Prefix Sampling, the path with
the most host decisions (rounds, abandoned groups, prefixes), and shortened by overrides only: 3 steps,
8 prompts a step, 8 held-out prompts, a 200-step warm start on level 1 (so that some answers are right
and groups are mixed: every step trains). The model initialisation and the optimizer (Adam eps 1e-8
included) are the preset's. The warm start is computed once (its cache is keyed by model, task and
warm-start settings, not by the mesh), so the three runs start RL from the same weights.

Float results differ between layouts by reduction order, so a sampled token can flip where the
uniform draw lands within that difference of a CDF boundary. What is compared, and how:

* every rollout's generated tokens: a rollout whose tokens differ from the one-device run's is a
  *flip*; the flip rate (flipped rollouts / rollouts) must stay under ``MAX_FLIP_RATE``;
* every step up to the first one with a flip: the same rollouts requested, the same reward for every
  rollout whose tokens agree, and, on steps without any flip, the same allocation decisions (trained
  groups with their success bits and prefixes, abandoned groups, rounds) and the same metrics record:
  host-side numbers exactly, ``update/*`` within ``RTOL`` / ``ATOL``. A flip changes what later steps
  see, so steps after it are not compared; at least ``MIN_STEPS_COMPARED`` steps must be;
* the final parameters (within ``PARAM_ATOL``), when no rollout flipped.

A rollout the slot engine decoded but never scored (aborted when the step ended, an unused guess) can flip
too: its length changes only the pool's counters (``UNSCORED_LENGTH_METRICS``), never a decision, a
reward or what later steps see. The trace records every decoded rollout's length; such a flip counts
towards the flip rate, its step's records are compared without those counters, and later steps still
are. Measured on CPU (jax 0.10.2, slot engine), the (2, 2, 2) mesh: one aborted rollout one token
longer at step 2 (``tokens/wasted`` 3118 against 3117), every scored rollout and decision equal.

Measured on CPU (jax 0.10.2, in round mode, before the engine became the default), this test's 3
steps: no flip in 188 rollouts (2,364 tokens) on either mesh; losses differ by at most 3e-6 relative (2.6e-7 absolute), final parameters by 1.5e-8. The same
run for 10 steps (``steps=10 eval_every=10``, with ``python -m tests.loop_trace`` as below): no flip
in 608 rollouts (7,670 tokens) on either mesh, every host-side metric equal, ``update/loss`` within
4.2e-7 absolute, ``update/grad_norm`` within 1.9e-5 relative, parameters within 1.2e-7.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m tests.loop_trace out.json runs/trace \
        configs/default.yaml OVERRIDES... --mesh 8,1,1 --mesh 2,2,2
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from passrate_jax.run.config import load_config
from passrate_jax.run.train import NONDETERMINISTIC_METRICS
from passrate_jax.run.warm_start import warm_start_file
from tests.conftest import shipped_env

# configs/default.yaml cut down to level 1 and a 200-step warm start, so that a short run gets some answers
# right; level 1's worked answers are at most 23 characters, so the arithmetic format's shorter buffers fit
# them and keep the compiles small.
LEVEL_ONE = ["data.max_level=1", "data.level_weights=[]", "warm_start.level_weights=[]", "warm_start.steps=200",
             "warm_start.max_len=48", "sampling.max_new_tokens=40"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OVERRIDES = ["allocation.method=sara", "prefix_sampling.enabled=true", "prefix_sampling.mode=adaptive",
             "steps=3", "eval_every=3", "data.eval_size=8", "allocation.num_prompts=8", *LEVEL_ONE,
             "logging.tensorboard=false", "logging.progress_bar=false"]
MESHES = ("8,1,1", "2,2,2")  # (data, fsdp, tensor)
RTOL, ATOL = 1e-4, 1e-6  # update/* metrics (measured: 3e-6 relative, 2.6e-7 absolute)
PARAM_ATOL = 1e-6  # final parameters (measured: 1.5e-8)
MAX_FLIP_RATE = 0.01
MIN_STEPS_COMPARED = 2


def _trace(tmp_path, name, devices, overrides, meshes=()):
    """Run tests/loop_trace.py in a fresh interpreter (the fake device count is fixed when jax starts)."""
    # Optimised as a user's run is: these runs train (a 200-step warm start, 3 steps on 8 devices) more than
    # they compile, and unoptimised they took 40% longer (tests/conftest.py, SUITE_ENV).
    env = shipped_env(PYTHONPATH=ROOT, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    out = tmp_path / f"{name}.json"
    mesh_args = [a for m in meshes for a in ("--mesh", m)]
    proc = subprocess.run([sys.executable, "-m", "tests.loop_trace", str(out), str(tmp_path / name),
                           "configs/default.yaml", *overrides, *mesh_args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(out.read_text())


# The pool's counters that read the lengths of rollouts never scored (aborted, unused guesses).
UNSCORED_LENGTH_METRICS = ("slot_utilization", "tokens/wasted")
# The pool's counters of rows decoded: narrow chunks (``sampling.narrow_slots``) run only where the pool's
# rows are on one device, so one device decodes fewer rows than a mesh that splits them, the same tokens.
ROW_LAYOUT_METRICS = ("sampler_calls/narrow", "slot_steps", "slot_utilization")


def _same_record(a: dict, b: dict, where: str, skip=()) -> None:
    keys = set(a) - set(NONDETERMINISTIC_METRICS)
    assert keys == set(b) - set(NONDETERMINISTIC_METRICS), where
    for k in sorted(keys - set(skip) - set(ROW_LAYOUT_METRICS)):
        if k.startswith("update/"):
            np.testing.assert_allclose(b[k], a[k], rtol=RTOL, atol=ATOL, err_msg=f"{where} {k}")
        else:
            assert a[k] == b[k], f"{where} {k}: {a[k]} != {b[k]}"


def _unscored_flips(a: dict, b: dict) -> int:
    """Rollouts never scored (aborted, unused guesses) whose length differs between two steps whose scored
    rollouts agree: they change only the pool's counters, never a decision or what later steps see."""
    assert [d[:2] for d in a["decoded"]] == [d[:2] for d in b["decoded"]], "the pools decoded other rollouts"
    return sum(x != y for x, y in zip(a["decoded"], b["decoded"]))


def compare_runs(one: dict, other: dict, name: str) -> dict:
    """Assert what the module docstring says; returns the counts (rollouts, flips, steps compared)."""
    one_steps, other_steps = one["steps"], other["steps"]
    assert len(one_steps) == len(other_steps) == len(one["records"]) - 1, name
    _same_record(one["records"][0], other["records"][0], f"{name} step 0")  # evaluation of the warm start
    rollouts = flips = unscored_flips = compared = 0
    for t, (a, b) in enumerate(zip(one_steps, other_steps), start=1):
        assert [r[:2] for r in a["rollouts"]] == [r[:2] for r in b["rollouts"]], f"{name} step {t}: requests differ"
        same = [ra[3] == rb[3] for ra, rb in zip(a["rollouts"], b["rollouts"])]
        for ra, rb, s in zip(a["rollouts"], b["rollouts"], same):
            assert not s or ra[2] == rb[2], f"{name} step {t}: rollout {ra[:2]} same tokens, reward {ra[2]} != {rb[2]}"
        rollouts, flips = rollouts + len(same), flips + same.count(False)
        if not all(same):
            break  # later steps see other outcomes
        unscored = _unscored_flips(a, b)
        # Decoded but not in the table: unused guesses (fewer than that: the table's queued rows never decoded).
        rollouts += max(0, len(a["decoded"]) - len(a["rollouts"]))
        unscored_flips += unscored
        assert (a["groups"], a["abandoned"], a["rounds"]) == (b["groups"], b["abandoned"], b["rounds"]), \
            f"{name} step {t}: allocation decisions differ"
        _same_record(one["records"][t], other["records"][t], f"{name} step {t}",
                     skip=UNSCORED_LENGTH_METRICS if unscored else ())
        compared += 1
    assert flips + unscored_flips <= MAX_FLIP_RATE * rollouts, \
        f"{name}: {flips} + {unscored_flips} never scored of {rollouts} rollouts flipped"
    assert compared >= MIN_STEPS_COMPARED, f"{name}: a flip by step {compared + 1} leaves too little compared"
    assert sum("update/loss" in one["records"][t] for t in range(1, compared + 1)) >= MIN_STEPS_COMPARED, \
        "the compared steps must train"
    if flips == 0:  # a rollout never scored changes no parameter
        for x, y in zip(one["params"], other["params"], strict=True):
            np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=0, atol=PARAM_ATOL)
    return {"rollouts": rollouts, "flips": flips, "unscored_flips": unscored_flips, "steps_compared": compared}


@pytest.fixture(scope="module")
def one_device(tmp_path_factory, warm_start_cache):
    directory = tmp_path_factory.mktemp("one_device")
    return _trace(directory, "one", 1, OVERRIDES + [f"warm_start.cache_dir={warm_start_cache}"])["default"]


def test_one_device_run_is_the_default_preset_with_sara_and_prefix_sampling(one_device, warm_start_cache):
    """The reference run itself is ``configs/default.yaml`` switched to SARA + adaptive Prefix Sampling,
    shortened by overrides only: the task's exact verifier decided (some answers right, some wrong),
    allocation ran several rounds with replayed prefixes, every step trained a finite loss, and the
    preset's evaluations (greedy and sampled, with a standard error) were recorded. Its reserved prefix
    store serves rounds and evaluations with one prefill program per context bucket and one decode program
    per row bucket, with the slot engine's insert, chunk and narrow chunk programs (at most 5 sampler
    programs), and one update program."""
    records, steps = one_device["records"], one_device["records"][1:]
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert all(r["rollouts_step"] > 0 for r in steps)
    assert 0 < np.mean([r["train_accuracy"] for r in steps]) < 1
    trained = [r for r in steps if r["groups_trained"] > 0]
    assert trained and all(np.isfinite(r["update/loss"]) for r in trained)
    assert "ps/ratio/1" in steps[0] and any(r["rounds"] > 1 for r in steps)
    assert any(g[3] is not None for s in one_device["steps"] for g in s["groups"])  # replayed prefixes trained
    assert 0 <= records[-1]["eval_accuracy"] <= 1
    assert 0 <= records[-1]["eval_sampled_accuracy"] <= 1 and records[-1]["eval_sampled_accuracy_se"] >= 0
    assert records[-1]["compilations/sampler"] <= 5 and records[-1]["compilations/update"] == 1
    # The warm start the run trained is where a study looks for it (run/warm_start.py::warm_start_file).
    cfg = load_config(os.path.join(ROOT, "configs", "default.yaml"),
                      OVERRIDES + [f"warm_start.cache_dir={warm_start_cache}"])
    assert os.path.isfile(warm_start_file(cfg)), os.listdir(os.path.join(warm_start_cache, "warm_start"))


# (data=2, fsdp=2, tensor=2) splits the parameters and runs in the default suite; (data=8) adds a
# pure data-parallel layout whose sampling test_sampling_sharded.py already checks, so it is the slow one.
@pytest.mark.parametrize("mesh, split", [("2,2,2", ["fsdp", "tensor"]),
                                         pytest.param("8,1,1", [], marks=pytest.mark.slow)])
def test_default_preset_on_eight_devices_trains_like_one(tmp_path, warm_start_cache, one_device, mesh, split):
    eight = _trace(tmp_path, "eight", 8, OVERRIDES + [f"warm_start.cache_dir={warm_start_cache}"], [mesh])[mesh]
    # One device decodes its pool's nearly empty chunks narrow; the mesh (rows split) never does.
    assert sum(r.get("sampler_calls/narrow", 0) for r in one_device["records"]) > 0
    assert sum(r.get("sampler_calls/narrow", 0) for r in eight["records"]) == 0
    assert one_device["devices"] == 1 and eight["devices"] == 8
    assert eight["param_axes"] == split  # the parameters are split over these mesh axes
    counts = compare_runs(one_device, eight, mesh)
    print(f"mesh (data, fsdp, tensor) = ({mesh}): {counts}")


def _synthetic_run(rollouts_per_step=100):
    step = {"rollouts": [[k // 4, k % 4, k % 2, [k, 1, 2]] for k in range(rollouts_per_step)],
            "groups": [[0, 0, [0, 1, 0, 1], None]], "abandoned": [[1, 4, 0]], "rounds": 2,
            "decoded": [[str(k // 4), k % 4, 3] for k in range(rollouts_per_step)] + [["AheadTag(serial=0)", 0, 5]]}
    records = [{"step": 0, "eval_accuracy": 0.5}] + [
        {"step": t, "train_accuracy": 0.5, "update/loss": 0.1 * t, "time/step_s": t, "slot_utilization": 0.5,
         "tokens/wasted": 3}
        for t in (1, 2, 3)]
    return {"steps": [json.loads(json.dumps(step)) for _ in range(3)], "records": records, "params": [[1.0, 2.0]]}


def test_the_comparison_catches_what_it_claims_to():
    one = _synthetic_run()
    assert compare_runs(one, _synthetic_run(), "same") == {"rollouts": 303, "flips": 0, "unscored_flips": 0,
                                                           "steps_compared": 3}
    for change in (lambda r: r["steps"][1]["rollouts"][5].__setitem__(2, 0),  # a reward, same tokens
                   lambda r: r["steps"][0]["groups"][0].__setitem__(2, [1, 1, 0, 1]),  # a decision
                   lambda r: r["records"][2].__setitem__("update/loss", 0.2 + 1e-4),  # a loss
                   lambda r: r["records"][3].__setitem__("train_accuracy", 0.5 + 1e-9),  # a host number
                   lambda r: r["params"].__setitem__(0, [1.0, 2.0 + 1e-5]),  # a parameter
                   lambda r: r["steps"][1]["rollouts"][7].__setitem__(3, [9]),  # a flip too early
                   lambda r: r["records"][2].__setitem__("tokens/wasted", 7),  # a pool counter, no flip
                   lambda r: r["steps"][0]["decoded"].pop(),  # another rollout decoded
                   lambda r: [x.__setitem__(3, [0]) for x in r["steps"][2]["rollouts"][:4]]):  # 4 > 1% of 300
        other = _synthetic_run()
        change(other)
        with pytest.raises(AssertionError):
            compare_runs(one, other, "changed")
    # One flip in the last step: counted; steps 1-2 compared in full, the flipped step's decisions not.
    other = _synthetic_run()
    other["steps"][2]["rollouts"][3][3] = [0]
    other["steps"][2]["groups"] = []
    assert compare_runs(one, other, "flip") == {"rollouts": 302, "flips": 1, "unscored_flips": 0,
                                                "steps_compared": 2}
    # An unused guess one token longer at step 2: the pool's counters differ there, everything else is
    # compared, later steps too, and the parameters (nothing scored flipped).
    other = _synthetic_run()
    other["steps"][1]["decoded"][-1][2] = 6
    other["records"][2]["tokens/wasted"] = 4
    assert compare_runs(one, other, "unscored") == {"rollouts": 303, "flips": 0, "unscored_flips": 1,
                                                    "steps_compared": 3}
    other["steps"][1]["groups"] = []  # ... but not a decision
    with pytest.raises(AssertionError):
        compare_runs(one, other, "unscored and a decision")
