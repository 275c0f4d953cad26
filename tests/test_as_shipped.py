"""The README's commands as a user runs them, on the shipped default preset unchanged.

One run of ``passrate-jax train --config configs/default.yaml`` (the ``shipped_default_run`` fixture in
tests/conftest.py: the full 800-step warm start, 25 GRPO steps, the worked-arithmetic task's exact
verifier), killed with SIGKILL between two checkpoints and resumed, serves three tests: the README's
headline claim, the exact resume of a warm-started run, and ``passrate-jax eval --run-dir`` on it; its
cached warm start serves a fourth, the default preset trained by a non-editable install in a fresh
virtual environment. (``passrate-jax study`` as a user runs it: tests/test_study_command.py.)
"""

import json
import os
import shutil
import site
import subprocess
import sys

import pytest

from passrate_jax.cli.main import main
from passrate_jax.run.config import load_config
from passrate_jax.run.metrics import read_jsonl
from passrate_jax.run.sft import cache_path
from tests.conftest import SHIPPED_KILL_AFTER, shipped_env
from tests.test_train_e2e import _comparable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _evaluations(run_dir):
    return [r for r in read_jsonl(run_dir / "metrics.jsonl") if "eval_sampled_accuracy" in r]


def test_default_preset_as_shipped_learns(shipped_default_run):
    """The README's claim for its first command: held-out sampled accuracy rises by at least 10 points in
    the 25 steps, each measured on 1,024 prompts x 4 samples with a standard error under 1.5 points; the
    whole run compiles at most 4 sampler programs and 2 update programs."""
    cfg = load_config(shipped_default_run.run_dir / "config.yaml")
    assert cfg == load_config("configs/default.yaml")  # the preset as shipped, nothing overridden
    assert (cfg.data.task, cfg.data.resolved_verifier, cfg.steps, cfg.warm_start.steps) == ("worked", "task", 25, 800)
    first, last = _evaluations(shipped_default_run.run_dir)
    assert (first["step"], last["step"]) == (0, 25)
    assert all(r["eval_sampled_accuracy_se"] < 0.015 for r in (first, last))
    assert last["eval_sampled_accuracy"] - first["eval_sampled_accuracy"] >= 0.10, (first, last)
    # As shipped: GRPO, one round of B prompts x N rollouts a step, no prefixes.
    steps = read_jsonl(shipped_default_run.run_dir / "metrics.jsonl")[1:]
    assert all(r["rounds"] == 1 and r["rollouts_step"] == 16 * 8 for r in steps)
    assert not any(k.startswith("ps/") for k in steps[0])
    # Its reserved prefix store: one prefill program per context bucket it meets, the engine's insert, chunk
    # and narrow chunk programs, evaluation's decode program; the update compiles once per answer-length
    # bucket the run meets. Issue 37's bound: 6 programs in all.
    assert last["compilations/sampler"] <= 5 and last["compilations/sampler"] + last["compilations/update"] <= 6


def test_warm_started_run_killed_with_sigkill_resumes_exactly(shipped_default_run):
    """The killed attempt had checkpointed step 10 and recorded steps 11 and 12; the resumed attempt
    restarts from step 10's checkpoint (the warm start is not redone: the checkpoint holds the trained
    parameters), records every step once, and repeats steps 11 and 12 exactly as the killed attempt
    computed them (timings and compile counts aside)."""
    checkpoint, recorded = SHIPPED_KILL_AFTER
    killed = {r["step"]: r for r in shipped_default_run.killed_records}
    assert checkpoint in killed and recorded in killed and max(killed) < 25
    assert f"from the checkpoint of step {checkpoint}" in shipped_default_run.resume_output
    final = read_jsonl(shipped_default_run.run_dir / "metrics.jsonl")
    assert [r["step"] for r in final] == list(range(26))
    again = {r["step"]: r for r in final}
    assert _comparable([killed[s] for s in range(recorded + 1)]) == _comparable([again[s] for s in range(recorded + 1)])


def test_eval_run_dir_reproduces_the_runs_evaluations(shipped_default_run, capsys, optimised):
    """``passrate-jax eval --run-dir DIR --vs-warm-start --num-samples 4`` (the README's paired measurement)
    with the task verifier: the checkpoint's greedy and sampled accuracy are the run's step-25 evaluation,
    the cached warm start's are its step-0 evaluation, and the paired sampled difference is the claim."""
    first, last = _evaluations(shipped_default_run.run_dir)
    capsys.readouterr()
    assert main(["eval", "--run-dir", str(shipped_default_run.run_dir), "--vs-warm-start", "--num-samples", "4",
                 "--k", "1,4", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    start = result["warm_start"]
    assert result["step"] == 25 and result["heldout_prompts"] == 1024
    for measured, record in ((result, last), (start, first)):
        assert measured["accuracy"] == record["eval_accuracy"]
        assert measured["sampled_accuracy"] == measured["pass@1"] == record["eval_sampled_accuracy"]
        assert measured["sampled_accuracy_se"] == record["eval_sampled_accuracy_se"]
        assert measured["pass@1"] <= measured["pass@4"] <= 1
    diff = start["difference"]
    assert diff["sampled_accuracy"] == pytest.approx(last["eval_sampled_accuracy"] - first["eval_sampled_accuracy"])
    assert diff["sampled_accuracy"] >= 0.10 and 0 < diff["sampled_accuracy_se"] < 0.015


def fresh_venv_with_the_project(root) -> str:
    """A virtual environment made with ``python -m venv`` under ``root``, holding the project installed from
    a copy of the checkout by its own ``python -m pip install`` (not editable; no network: no build isolation,
    no index, no dependencies). It sees this environment's site-packages (the dependencies, and pip itself)
    through a path line in a ``.pth`` file: such a line adds the directory but runs none of its own ``.pth``
    files, so this environment's editable install of the checkout stays invisible. Returns its bin/ directory."""
    source, venv = root / "source", root / "venv"
    # A copy of what the build reads, so that setuptools' build/ and egg-info land there, not in the checkout.
    shutil.copytree(os.path.join(ROOT, "passrate_jax"), source / "passrate_jax",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copyfile(os.path.join(ROOT, name), source / name)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    bin_dir = venv / "bin"
    purelib = subprocess.run([bin_dir / "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True, env=_outside()).stdout.strip()
    ours = [p for p in dict.fromkeys(site.getsitepackages() + [site.getusersitepackages()]) if os.path.isdir(p)]
    with open(os.path.join(purelib, "test_environment.pth"), "w") as pth:
        pth.write("\n".join(ours) + "\n")
    installed = subprocess.run([bin_dir / "python", "-m", "pip", "--disable-pip-version-check", "--no-input", "-q",
                                "install", "--no-deps", "--no-build-isolation", "--no-index", "--ignore-installed",
                                str(source)], capture_output=True, text=True, timeout=300, cwd=root, env=_outside())
    assert installed.returncode == 0, installed.stderr[-3000:]
    return str(bin_dir)


def _outside(**extra) -> dict:
    """This process's environment (the suite's caches included) without the checkout on PYTHONPATH."""
    env = {k: v for k, v in shipped_env().items() if k not in ("PYTHONPATH", "PASSRATE_JAX_DEBUG")}
    return {**env, **extra}


def test_a_fresh_venv_with_a_non_editable_install_trains_the_default_preset(shipped_default_run, tmp_path):
    """The issue's sentence: a fresh virtual environment with a non-editable install trains ``--config default
    steps=2`` from an empty directory: its presets come from the installed package, and its 800-step warm
    start from the cache the shipped run filled (the cache key does not depend on where the package lives).
    The held-out set is cut to 64 prompts (``data.eval_size=64``): training is the preset's, unchanged, and
    the preset's two evaluations of 1,024 prompts x 5 answers would cost four times the rest of the test."""
    bin_dir, empty = fresh_venv_with_the_project(tmp_path), tmp_path / "empty"
    empty.mkdir()
    where = subprocess.run([os.path.join(bin_dir, "python"), "-c", "import passrate_jax.run.config as c, passrate_jax."
                            "run.sft as s; print(c.__file__); print(s.cache_path(c.load_config('default')))"],
                           cwd=empty, env=_outside(), capture_output=True, text=True)
    assert where.returncode == 0, where.stderr[-3000:]
    module, warm_start = where.stdout.split()
    assert module.startswith(str(tmp_path / "venv")) and "site-packages" in module, where.stderr[-3000:]
    assert warm_start == cache_path(load_config("configs/default.yaml")) and os.path.isfile(warm_start)
    run = subprocess.run([os.path.join(bin_dir, "passrate-jax"), "train", "--config", "default", "steps=2",
                          "data.eval_size=64", "--no-progress"], cwd=empty, env=_outside(), capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert f"warm start: loaded cached weights from {warm_start}" in run.stdout
    records = read_jsonl(empty / "runs" / "default" / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2] and records[-1]["rollouts_total"] == 2 * 16 * 8
    assert all(0 <= r["eval_accuracy"] <= 1 for r in (records[0], records[-1]))
