"""Shared test fixtures, the suite's caches and its xdist groups (docs/testing.md).

Caches: before JAX is imported, the environment gets one persistent compilation cache inside the
checkout (``.cache/jax``, git-ignored) and one warm-start cache (``.cache/passrate-jax``), unless the
caller set them. Every subprocess and notebook kernel a test starts inherits both, so a program one
test compiles is loaded, not compiled, by every later test, process and run of the suite.

Groups (``pytest -n 2 --dist loadgroup``, from pyproject.toml): the files in ``GROUP_OF_FILE`` (those
using an expensive session fixture) run on one worker per group, so the fixture is built once; every other
file is one unit. Groups are scheduled before single tests, the largest first.
"""

import dataclasses
import functools
import gc
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".cache"
# Compile times of the suite's small programs are 0.1-1 s on 2 cores; JAX's default (1 s) cached almost
# none of them. A size cap turns on JAX's file lock, so two xdist workers write the cache safely.
# Most of the suite's time is XLA compiling small programs once each; LLVM's optimisation passes are about
# half of that and buy nothing on test-sized arrays (tests/test_allocation_allocator.py: 219 s -> 120 s on a
# cold cache). Runs a user would make run optimised, as shipped (shipped_env() below).
SUITE_ENV = {"JAX_COMPILATION_CACHE_DIR": str(CACHE / "jax"),
             "JAX_DISABLE_MOST_OPTIMIZATIONS": "1",
             "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0.1",
             "JAX_COMPILATION_CACHE_MAX_SIZE": str(8 * 2**30),
             "PASSRATE_JAX_CACHE": str(CACHE / "passrate-jax")}
for _name, _value in SUITE_ENV.items():
    os.environ.setdefault(_name, _value)


def _repair_compile_cache(directory: Path) -> None:
    """Give every entry of JAX's size-capped cache its access-time file. JAX writes an entry, then that file;
    once one entry lacks it (a process killed between the two writes, as the kill tests do, or a run here
    without the size cap), every later write warns on stderr, in every process, and breaks the tests that
    check a command prints one line."""
    for entry in directory.glob("*-cache"):
        access_time = entry.with_name(entry.name.removesuffix("-cache") + "-atime")
        if not access_time.exists():
            access_time.write_bytes(time.time_ns().to_bytes(8, "little"))


if "PYTEST_XDIST_WORKER" not in os.environ:  # once, in the controller, before any worker compiles
    _repair_compile_cache(Path(os.environ["JAX_COMPILATION_CACHE_DIR"]))

import jax  # noqa: E402  after the environment above, which JAX reads at import
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from flax import nnx  # noqa: E402
from xdist.scheduler import LoadScopeScheduling  # noqa: E402

# In case a plugin imported JAX before this file set the environment.
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update("jax_persistent_cache_min_compile_time_secs",
                  float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))
jax.config.update("jax_compilation_cache_max_size", int(os.environ["JAX_COMPILATION_CACHE_MAX_SIZE"]))

# --- xdist groups ---------------------------------------------------------------------------------------
# A session fixture that is expensive to build (the shipped default run, a trained warm start) is built once
# per worker that needs it, so the files that use it go to one worker as one unit. xdist's own
# `--dist loadgroup` reads groups from node-id suffixes that pytest 9 no longer lets it write (every test
# ran alone), so the suite schedules its groups itself: by file, in GROUP_OF_FILE. A new test file that
# uses one of these fixtures joins the fixture's group here. Every other file is a unit of its own.
GROUP_OF_FILE = {"tests/test_as_shipped.py": "shipped_default",       # shipped_default_run
                 "tests/test_sharding_loop.py": "warm_start"}           # warm_start_cache
# Longest first: the units that take minutes are handed out before the rest, so the last minutes of a run
# are spent on short files on both workers rather than one worker finishing the shipped run alone. xdist's
# own reorder sorts by the number of tests, which put the shipped default (4 tests, about 6 minutes) last.
# Measured order (durations of a full run, `pytest --durations=0`); a unit not listed keeps its place.
SLOWEST_FIRST = ["shipped_default", "warm_start", "tests/test_newcomer.py", "tests/test_multihost.py",
                 "tests/test_allocation_allocator.py", "tests/test_engine_sharded.py", "tests/test_kill_resume.py",
                 "tests/test_study.py", "tests/test_engine_train.py", "tests/test_device_script.py",
                 "tests/test_notebooks.py", "tests/test_sampling_sharded.py", "tests/test_data_rewards.py",
                 "tests/test_bad_input.py", "tests/test_rl_train_step.py", "tests/test_sampling_reuse.py"]


class GroupScheduling(LoadScopeScheduling):
    """``--dist loadgroup`` with the groups of GROUP_OF_FILE."""

    def _split_scope(self, nodeid: str) -> str:
        # Every other file is a unit of its own too: its module-scoped fixtures are then built once and
        # its tests run in order, as they do in one process.
        path = nodeid.split("::", 1)[0]
        return GROUP_OF_FILE.get(path, path)

    def _assign_work_unit(self, node) -> None:
        if not getattr(self, "_slowest_moved_first", False):  # once, when the queue is complete
            for scope in reversed(SLOWEST_FIRST):
                if scope in self.workqueue:
                    self.workqueue.move_to_end(scope, last=False)
            self._slowest_moved_first = True
        super()._assign_work_unit(node)


def shipped_env(**extra) -> dict:
    """This process's environment for a command run as a user runs it: XLA's optimisations on, CPU only."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_DISABLE_MOST_OPTIMIZATIONS"}
    return {**env, "JAX_PLATFORMS": "cpu", **extra}


@pytest.fixture
def optimised():
    """XLA's optimisations on in this process for one test: its programs are then the ones a user's
    command compiles, and its numbers equal a shipped run's bit for bit."""
    jax.config.update("jax_disable_most_optimizations", False)
    jax.clear_caches()  # a program compiled unoptimised earlier in this process is not reused
    yield
    jax.config.update("jax_disable_most_optimizations", os.environ.get("JAX_DISABLE_MOST_OPTIMIZATIONS") == "1")
    jax.clear_caches()


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") == "loadgroup":
        return GroupScheduling(config, log)


# --- model: tiny Hugging Face reference checkpoints (no download) -----------------------------------

# Tiny configs covering each family's distinguishing feature: Llama 3 RoPE scaling + tied embeddings,
# Qwen2 q/k/v biases, Qwen3 q/k norms with GQA and head_dim != hidden / heads.
TINY_HF_CONFIGS = {
    "llama": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=96, hidden_size=32,
        intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=True,
        # theta and original_max_position_embeddings chosen so head_dim 8 has one unscaled, one smoothed
        # and two divided frequency bands.
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "qwen2": dict(
        architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=96, hidden_size=32,
        intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    "qwen3": dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=96, hidden_size=32,
        intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
}


def make_hf_model(kind: str, seed: int = 0):
    """A random transformers model for ``TINY_HF_CONFIGS[kind]`` with every weight perturbed (norm
    weights and biases too, which HF initialises to the trivial ones / zeros)."""
    import torch
    import transformers

    cfg = dict(TINY_HF_CONFIGS[kind])
    arch = cfg.pop("architectures")[0]
    cfg.pop("model_type")
    config_cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(config_cls(**cfg)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.1 * torch.randn_like(p))
    return model


def torch_logits(model, tokens_bt, positions_bt=None, attention_mask_bt=None) -> np.ndarray:
    """float32 numpy logits from a transformers model."""
    import torch

    kwargs = {}
    if positions_bt is not None:
        kwargs["position_ids"] = torch.as_tensor(np.asarray(positions_bt), dtype=torch.long)
    if attention_mask_bt is not None:
        kwargs["attention_mask"] = torch.as_tensor(np.asarray(attention_mask_bt), dtype=torch.long)
    with torch.no_grad():
        out = model(torch.as_tensor(np.asarray(tokens_bt), dtype=torch.long), **kwargs)
    return out.logits.float().numpy()


def saved_params(run_dir, step: int) -> list[np.ndarray]:
    """The parameter leaves of ``run_dir``'s checkpoint ``step``, which must be its latest."""
    from passrate_jax.run.checkpoint import RunCheckpointer

    ckpt = RunCheckpointer(run_dir)
    assert ckpt.latest_step() == step
    state, _ = ckpt.restore_saved(step)
    ckpt.close()
    return [np.asarray(x) for x in jax.tree.leaves(state["params"])]


@functools.partial(jax.jit, static_argnums=0)
def _jit_forward(graphdef, state, tokens, positions, mask):
    return nnx.merge(graphdef, state)(tokens, positions, mask)


def forward(model, tokens, positions=None, mask=None) -> np.ndarray:
    """Jitted model forward as numpy: one compile per (model config, shapes) instead of one per op."""
    graphdef, state = nnx.split(model)
    return np.asarray(_jit_forward(graphdef, state, tokens, positions, mask))


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """Factory: ``hf_checkpoint(kind) -> (directory, torch_model)``, saved once per session."""
    cache = {}

    def get(kind: str):
        if kind not in cache:
            model = make_hf_model(kind)
            directory = tmp_path_factory.mktemp(f"hf_{kind}")
            model.save_pretrained(directory)
            cache[kind] = (str(directory), model)
        return cache[kind]

    return get


@pytest.fixture(scope="session")
def warm_start_cache(tmp_path_factory):
    """One warm-start cache per test session: the runs that warm-start the same model the same way
    (test_sharding_loop.py's one-device and eight-device runs) train it once."""
    return tmp_path_factory.mktemp("warm_start_cache")


# --- memory maps: XLA:CPU gives each compiled kernel its own memory mappings, and JAX's caches keep every
# program the suite compiles alive. One pytest process compiles thousands of programs, enough to reach
# Linux's per-process limit (vm.max_map_count, 65530 by default), where the next compile fails inside
# XLA with a segfault or abort. A user's run compiles a handful of programs and is nowhere near it.
def _map_count() -> int | None:
    try:
        with open("/proc/self/maps", "rb") as maps:
            return sum(1 for _ in maps)
    except OSError:  # not Linux: no such limit to watch
        return None


def _map_limit() -> int:
    try:
        with open("/proc/sys/vm/max_map_count") as limit:
            return int(limit.read())
    except (OSError, ValueError):
        return 65530


_CLEAR_ABOVE_MAPS = _map_limit() // 3  # the limit is a kernel setting: read it once per session


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """After each test module, past a third of the map limit, drop JAX's caches so the programs no test
    still holds are freed (a later compile of the same program loads it from the compile cache above)."""
    yield
    count = _map_count()
    if count is not None and count > _CLEAR_ABOVE_MAPS:
        jax.clear_caches()
        gc.collect()


# --- the shipped default, as shipped ---------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ShippedRun:
    """One run of the README's first command (``configs/default.yaml`` unchanged), killed with SIGKILL
    between two checkpoints and resumed to its end. ``killed_records``: metrics.jsonl as the killed
    attempt left it; ``resume_output``: what the resumed attempt printed."""
    run_dir: Path
    killed_records: list
    resume_output: str


def steps_written(run_dir) -> list[int]:
    """The steps of ``run_dir/metrics.jsonl``'s complete lines (a running process may be mid-line)."""
    path = Path(run_dir) / "metrics.jsonl"
    lines = path.read_text().splitlines(keepends=True) if path.exists() else []
    return [json.loads(line)["step"] for line in lines if line.endswith("\n")]


SHIPPED_KILL_AFTER = (10, 12)  # SIGKILL once step 10's checkpoint is complete and step 12 is recorded


@pytest.fixture(scope="session")
def shipped_default_run(tmp_path_factory) -> ShippedRun:
    """``passrate-jax train --config configs/default.yaml`` in a subprocess, as the README runs it (its
    800-step warm start, from the suite's warm-start cache when a previous run of the suite trained it;
    25 steps; the task verifier), killed once and resumed. About 5 minutes on 2 idle cores, so its tests
    share it (xdist group ``shipped_default``)."""
    from passrate_jax.run.metrics import read_jsonl

    run_dir = tmp_path_factory.mktemp("shipped") / "default"
    cmd = [sys.executable, "-m", "passrate_jax.cli.main", "train", "--config", "configs/default.yaml",
           "--run-dir", str(run_dir), "--no-progress"]
    env = shipped_env(PYTHONPATH=str(ROOT))
    checkpoint, record = SHIPPED_KILL_AFTER
    with open(run_dir.parent / "killed.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        while proc.poll() is None and not ((run_dir / "checkpoints" / str(checkpoint)).is_dir()
                                           and record in steps_written(run_dir)):
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL, (run_dir.parent / "killed.log").read_text()[-3000:]
    killed_records = read_jsonl(run_dir / "metrics.jsonl")
    resumed = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    return ShippedRun(run_dir, killed_records, resumed.stdout + resumed.stderr)
