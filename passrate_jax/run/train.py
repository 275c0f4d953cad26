"""``passrate-jax train``: the main job. Builds every stage from the config, then runs steps of
(allocation rounds -> update), with evaluation, metrics, progress bar and Orbax checkpoints.

A run directory holds ``config.yaml``, ``metrics.jsonl``, TensorBoard events and ``checkpoints/``.
``train`` on a directory that has a checkpoint resumes from it (and says so): parameters, optimizer,
allocator / selection / controller states, the kept trajectories, and the step; every random draw of
a step is a pure function of (seed, step, group, rollout index), so a resumed run repeats an
uninterrupted one bit for bit on CPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import yaml
from etils import epath

from passrate_jax import distributed
from passrate_jax.allocation import Allocator, AllocatorState, state_from_dict, state_to_dict
from passrate_jax.run.checkpoint import RunCheckpointer, check_run_dir
from passrate_jax.run.config import Config, check_inputs, dump_config
from passrate_jax.configlib import ConfigError, to_dict
from passrate_jax.rollout.events import collect_rollouts_events
from passrate_jax.rollout.loop import collect_rollouts, rollout_metrics
from passrate_jax.run.metrics import flatten, write_text_atomic
from passrate_jax.run.observe import (Reporter, RewardErrors, check_step_scored, groups_with_signal, rollout_stats,
                                      sample_rows)
from passrate_jax.model.lora import has_adapters, reference_params
from passrate_jax.rl.batch import make_train_batch
from passrate_jax.rl.optimizer import make_optimizer
from passrate_jax.rl.train_step import make_train_step, policy_logprobs
from passrate_jax.sampling.sampler import bucket
from passrate_jax.run.session import Session

# Wall-clock and compile counters differ between a resumed and an uninterrupted run by nature.
NONDETERMINISTIC_METRICS = ("time/step_s", "time/rollout_s", "time/update_s", "time/eval_s", "time/total_s",
                            "compilations/sampler", "compilations/update")


def _compiled_programs(jitted) -> int:
    """Programs a jitted function has compiled. jax exposes this only as the private ``_cache_size``;
    -1 when a jax version lacks it (the metric is informational, training must not depend on it)."""
    size = getattr(jitted, "_cache_size", None)
    return int(size()) if callable(size) else -1


def _quiet(*args, **kwargs) -> None:
    """The log of every host but the first: one voice per run."""


def _step_seed(seed: int, step: int) -> int:
    return (seed * 1_000_003 + step * 7_919 + 1) % (2 ** 31)


class _StopRequest:
    """First Ctrl-C: finish the current step, checkpoint, exit cleanly. Second: stop at once."""

    def __init__(self):
        self.requested = False
        self._previous = None

    def __enter__(self):
        def handler(signum, frame):
            if self.requested:
                raise KeyboardInterrupt
            self.requested = True
        try:
            self._previous = signal.signal(signal.SIGINT, handler)
        except ValueError:  # not the main thread: no Ctrl-C handling
            self._previous = None
        return self

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


# Top-level config sections a resumed run may change: they do not alter what was computed so far.
# Sections or keys a resume may change. How rollouts are decoded (the engine and its pool) is among them: both
# engines run the same method, so a run saved in round mode (the default before 2026-12-04) resumes.
RESUMABLE_CHANGES = ("steps", "eval_every", "eval_samples", "eval_greedy", "checkpoint", "logging", "distributed",
                     "sampling.engine", "sampling.slots", "sampling.chunk_tokens", "sampling.lookahead",
                     "sampling.harvest")


def resume_conflicts(cfg: Config, run_dir: str) -> list[str]:
    """Keys whose value differs from the run directory's ``config.yaml`` and that a resume may not change,
    as ``"key: saved -> now"`` lines (empty when there is no saved config)."""
    path = epath.Path(run_dir) / "config.yaml"
    if not path.exists():
        return []
    saved = dict(flatten(yaml.safe_load(path.read_text()) or {}, sep="."))
    now = dict(flatten(to_dict(cfg), sep="."))
    # A key added to the config after the run was saved is no conflict while it holds its default.
    defaults = dict(flatten(to_dict(Config()), sep="."))
    return [f"{k}: {saved.get(k)!r} -> {now.get(k)!r}" for k in sorted(set(saved) | set(now))
            if saved.get(k) != now.get(k) and not any(k == c or k.startswith(c + ".") for c in RESUMABLE_CHANGES)
            and not (k not in saved and now.get(k) == defaults.get(k))]


def eval_metrics(session: Session, params, cfg: Config, step: int) -> dict:
    """Held-out metrics of ``params`` (after ``step``): greedy accuracy overall and per level (as
    ``cfg.eval_greedy`` says), and with ``cfg.eval_samples`` the mean accuracy of that many sampled answers
    per prompt (overall and per level). Nothing without held-out prompts (a file source without
    ``data.eval_path``): no ``nan`` accuracy."""
    if not session.heldout:
        return {}
    greedy = cfg.eval_greedy == "every" or cfg.eval_samples == 0 or step in (0, cfg.steps)
    ev = session.evaluate(params, seed=cfg.seed, num_samples=cfg.eval_samples, greedy=greedy)
    out = {}
    for name, key in (("eval_accuracy", "accuracy"), ("eval_sampled_accuracy", "sampled_accuracy")):
        if key in ev:
            out[name] = ev[key]
            out.update({f"{name}/level_{k}": v for k, v in ev[f"{key}_by_level"].items()})
    if "sampled_accuracy_se" in ev:  # so a rise can be read against its noise from metrics.jsonl alone
        out["eval_sampled_accuracy_se"] = ev["sampled_accuracy_se"]
    return out


@dataclasses.dataclass(frozen=True)
class RunState:
    """What a step advances and a checkpoint keeps (besides the backend's trajectories): the step done,
    parameters, optimizer and allocator states, the KL reference (``rl.kl_coef`` > 0), and the run's
    rollouts spent and useful so far."""
    step: int
    params: Any
    opt_state: Any
    alloc_state: AllocatorState
    ref_params: Any = None
    rollouts_total: int = 0
    useful_total: int = 0

    def arrays(self) -> dict:
        out = {"params": self.params, "opt_state": self.opt_state, "allocator": state_to_dict(self.alloc_state)}
        # A LoRA run's reference is its base weights with adapters off: derived, so not saved twice.
        if self.ref_params is None or has_adapters(self.params):
            return out
        return {**out, "ref_params": self.ref_params}


class Updater:
    """The update stage: the trained groups' padded batch (built by the rollout backend), the frozen
    reference's log-probs when ``rl.kl_coef`` > 0, and one jitted, sharded optimizer step."""

    def __init__(self, cfg: Config, session: Session):
        alloc = cfg.allocation
        # The most groups a step trains: B, plus the replay slots when PS places its re-rollout groups on
        # top. Every batch is padded to a multiple of it, so a run compiles one update program.
        extra = cfg.prefix_sampling.extra_groups(alloc.num_prompts)
        self.rows_unit = (alloc.num_prompts + extra) * alloc.group_size
        shards = session.mesh.shape["data"] * session.mesh.shape["fsdp"] * cfg.rl.minibatches * cfg.rl.grad_accum
        if self.rows_unit % shards:
            what = "allocation.num_prompts * group_size" if not extra else (
                f"(allocation.num_prompts + {extra} replay slots on top) * group_size")
            raise ConfigError(f"{what} = {self.rows_unit}: must be divisible by mesh "
                              f"data * fsdp * rl.minibatches * rl.grad_accum = {shards}")
        self.cfg, self.backend = cfg, session.backend
        optimizer = make_optimizer(cfg.optimizer)
        self.fns = make_train_step(session.graphdef, session.params, cfg.rl, optimizer, session.mesh)
        self.use_kl = cfg.rl.kl_coef > 0
        self.ref_logprobs = jax.jit(lambda p, b: policy_logprobs(session.graphdef, p, b.tokens, b.positions,
                                                                 b.attention_mask)[0]) if self.use_kl else None

    def start(self, params, alloc_state: AllocatorState) -> RunState:
        """Step 0: ``params`` laid out on the mesh, a fresh optimizer, and (for the KL term) a frozen copy
        of the parameters training starts from (after the warm start)."""
        params = jax.device_put(params, self.fns.param_shardings)
        ref_params = self._reference(params) if self.use_kl else None
        return RunState(0, params, self.fns.init(params), alloc_state, ref_params)

    @staticmethod
    def _reference(params):
        # With LoRA the reference is the base model with its adapters off, sharing the base weights (the
        # update never donates them); without, a copy, since the update donates the parameters it reads.
        return reference_params(params) if has_adapters(params) else jax.tree.map(jnp.copy, params)

    def __call__(self, state: RunState, groups, step: int):
        """(params, opt_state, host metrics) after one update on ``groups``."""
        rows = bucket(sum(len(g.rewards) for g in groups), [self.rows_unit * k for k in (1, 2, 4, 8)])
        arrays = self.backend.store.batch(groups, rows=rows)
        batch = make_train_batch(arrays["tokens"], arrays["attention_mask"], arrays["loss_mask"], arrays["rewards"],
                                 arrays["group_ids"], estimator=self.cfg.rl.advantage, eps=self.cfg.rl.advantage_eps)
        batch = jax.device_put(batch, self.fns.batch_sharding)
        if self.use_kl:
            batch = batch.replace(ref_logprobs=self.ref_logprobs(state.ref_params, batch))
        params, opt_state, update = self.fns.step(state.params, state.opt_state, batch,
                                                  jax.random.fold_in(jax.random.key(self.cfg.seed), step))
        return params, opt_state, distributed.to_host(update)


class Checkpoints:
    """The run's Orbax checkpoints: a :class:`RunState` and the backend's trajectories (JSON)."""

    def __init__(self, cfg: Config, run_dir: str):
        self.run_dir = run_dir
        self.ckpt = RunCheckpointer(run_dir, keep=cfg.checkpoint.keep, async_save=cfg.checkpoint.async_save)
        self.resume_from = self.ckpt.latest_step()
        if self.resume_from is not None and (conflicts := resume_conflicts(cfg, run_dir)):
            self.ckpt.close()
            raise ConfigError(f"{run_dir} holds a run with another config; resuming it may change only "
                              f"{', '.join(RESUMABLE_CHANGES)}. Differences: " + "; ".join(conflicts)
                              + ". Use another --run-dir, or the saved config.yaml.")

    def save(self, state: RunState, backend) -> None:
        self.ckpt.save(state.step, state.arrays(), {"step": state.step, "rollouts_total": state.rollouts_total,
                                                    "useful_total": state.useful_total, "store": backend.store.to_json()})

    def restore(self, like: RunState, backend) -> RunState:
        """The latest checkpoint, into the structure and shardings of ``like``; loads the trajectories.
        Raises :class:`ConfigError` if the checkpoint keeps the allocator state in another layout."""
        check_allocator_layout(self.ckpt.saved_structure(self.resume_from), like.alloc_state,
                               f"{self.run_dir} (checkpoint of step {self.resume_from})")
        arrays, meta = self.ckpt.restore(self.resume_from, like.arrays())
        backend.store.load_json(meta["store"])
        ref = arrays.get("ref_params")
        if like.ref_params is not None and ref is None:
            ref = reference_params(arrays["params"])
        return RunState(int(meta["step"]), arrays["params"], arrays["opt_state"],
                        state_from_dict(arrays["allocator"], like.alloc_state), ref,
                        int(meta["rollouts_total"]), int(meta["useful_total"]))

    def close(self) -> None:
        self.ckpt.close()


def check_allocator_layout(saved: Any, state: AllocatorState, where: str) -> None:
    """Raise :class:`ConfigError` (one line) unless the allocator arrays of a checkpoint (``saved``: its
    state tree as saved) are those of ``state``: a version that keeps the allocator state in another
    layout (e.g. before each policy owned its queues) saved it, and it cannot be resumed."""
    saved_keys, keys = set(saved.get("allocator", {})), set(state_to_dict(state))
    if saved_keys != keys:
        differ = sorted(saved_keys ^ keys)
        raise ConfigError(f"{where} keeps the allocator state in another layout, saved by another version "
                          f"({len(differ)} arrays differ, e.g. {differ[0]}); it cannot be resumed: use another --run-dir")


@dataclasses.dataclass(frozen=True)
class Stages:
    """A run's stages, built once from the config."""
    cfg: Config
    session: Session
    allocator: Allocator
    updater: Updater
    log: Callable
    errors: RewardErrors


def train(cfg: Config, run_dir: str, *, progress: bool = True, log=print,
          start_metrics: dict | None = None) -> dict:
    """Train (or resume) a run in ``run_dir``; returns a summary with the last metrics record.

    ``start_metrics``: the step-0 evaluation when it is already known (the study's runs of one seed start
    from the same warm start and evaluate it on the same prompts with the same seed: one measures it for all).

    Multi-process (``cfg.distributed``): every process calls this with the same config and run directory
    (a shared file system or a gs:// path); see passrate_jax/distributed.py for how hosts stay in step."""
    distributed.initialize(cfg.distributed)  # before any other JAX call
    primary = distributed.is_primary()
    log = log if primary else _quiet
    check_inputs(cfg)  # a missing checkpoint or prompt file fails here, before the run directory exists
    created = _first_missing(run_dir) if primary and "://" not in run_dir else None
    try:
        check_run_dir(run_dir)  # an unwritable directory fails here, not at the first checkpoint
        epath.Path(run_dir).mkdir(parents=True, exist_ok=True)  # local, or gs:// seen by every host
        with contextlib.ExitStack() as closing:
            return _train(cfg, run_dir, closing, progress=progress, log=log, primary=primary,
                          start_metrics=start_metrics)
    except BaseException:
        if created and not _has_checkpoint(run_dir):  # a failed start leaves no run directory behind
            shutil.rmtree(created, ignore_errors=True)
        raise


def _first_missing(run_dir: str) -> str | None:
    """The outermost directory of ``run_dir`` that does not exist yet (what a failed start removes), or None."""
    path, missing = os.path.abspath(run_dir), None
    while not os.path.exists(path):
        missing, path = path, os.path.dirname(path)
    return missing


def _has_checkpoint(run_dir: str) -> bool:
    path = os.path.join(run_dir, "checkpoints")
    return os.path.isdir(path) and any(name.isdigit() for name in os.listdir(path))


def _train(cfg: Config, run_dir: str, closing: contextlib.ExitStack, *, progress: bool, log, primary: bool,
           start_metrics: dict | None) -> dict:
    """The body of :func:`train`; ``closing`` closes what it opened (checkpointer, session, reporter), also on error."""
    ckpt = Checkpoints(cfg, run_dir)
    closing.callback(ckpt.close)
    stages = build_stages(cfg, log)
    session = stages.session
    closing.callback(session.close)
    if not session.heldout:
        log("warning: no held-out prompts (data.eval_path, data.eval_split or data.eval_size is empty), so no "
            "held-out accuracy is measured; set data.eval_path=FILE to evaluate")
    if ckpt.resume_from is None:
        session.warm_start(progress=progress and primary)
    if primary:
        write_text_atomic(epath.Path(run_dir) / "config.yaml", dump_config(cfg))  # a resume may extend steps
    alloc_state = stages.allocator.init(jax.random.key_data(jax.random.key(cfg.seed)))
    state = stages.updater.start(session.params, alloc_state)
    check_run_dir(run_dir, state.arrays())  # room for one checkpoint, before any training compute
    if ckpt.resume_from is not None:
        state = ckpt.restore(state, session.backend)
        log(f"resuming {run_dir} from the checkpoint of step {state.step}")
    reporter = Reporter(cfg, run_dir, None if ckpt.resume_from is None else state.step, primary=primary, progress=progress)
    closing.callback(reporter.close)
    if ckpt.resume_from is None:  # step 0: the starting point that training is measured against
        start = start_metrics if start_metrics is not None else _evaluate(stages, state.params, 0)
        reporter.write({"step": 0, "rollouts_total": 0, **start})
    record, t_run = {}, time.perf_counter()
    with _StopRequest() as stop:
        for step in range(state.step + 1, cfg.steps + 1):
            state, record = train_step(stages, state, step)
            record["time/total_s"] = time.perf_counter() - t_run
            if (warning := stages.errors.first_warning(record, cfg.data)) is not None:
                log(warning)
            reporter.write(record)
            if step % cfg.checkpoint.every_steps == 0 or step == cfg.steps or stop.requested:
                ckpt.save(state, session.backend)
            if stop.requested:
                log(f"interrupted: checkpoint of step {step} saved in {run_dir}; run train again to resume")
                break
    return {"step": state.step, "last": record, "run_dir": run_dir, "params": state.params,
            "notes": reporter.totals.notes(cfg.data), "checkpoint": ckpt.ckpt.path}


def build_stages(cfg: Config, log) -> Stages:
    """The session (data, model, sampler, rollout backend), the allocator and the update stage."""
    session = Session.create(cfg, log=log)
    if (note := cfg.lr_schedule_note()) is not None:
        log(f"warning: {note}")
    updater = Updater(cfg, session)
    return Stages(cfg, session, Allocator(cfg.allocation, cfg.prefix_sampling, num_prompts=len(session.prompts)),
                  updater, log, RewardErrors(session.rewarder.counter))


def _evaluate(s: Stages, params, step: int) -> dict:
    """:func:`eval_metrics` with the reward failures of the evaluation (``eval_verifier_errors``, ...)."""
    s.errors.mark()
    metrics = eval_metrics(s.session, params, s.cfg, step)
    return {**metrics, **s.errors.since_mark("eval_")} if metrics else {}


def train_step(s: Stages, state: RunState, step: int) -> tuple[RunState, dict]:
    """One step: allocation rounds, one update on the trained groups, evaluation when due. Returns the
    new state and the step's metrics record."""
    cfg, backend, t0 = s.cfg, s.session.backend, time.perf_counter()
    s.errors.mark()
    collect = collect_rollouts_events if cfg.sampling.engine == "slots" else collect_rollouts
    ro = collect(s.allocator, state.alloc_state, backend, state.params, seed=_step_seed(cfg.seed, step))
    t1 = time.perf_counter()
    record = {"step": step, **rollout_metrics(s.allocator, ro, backend)}
    # Reward errors by cause (replacing rollout_metrics' table-only count), rewards and lengths as scored.
    record.update(s.errors.step(ro.table), **rollout_stats(backend.store, ro.table),
                  groups_with_signal=groups_with_signal(backend.store, ro.result.groups))
    check_step_scored(record, s.errors, cfg.data)
    if cfg.logging.samples_every and step % cfg.logging.samples_every == 0:
        record["samples"] = sample_rows(s.session, ro.table, step, cfg.logging.samples_count)
    rollouts_total = state.rollouts_total + ro.result.rollouts_spent
    useful_total = state.useful_total + record["useful_rollouts"]
    # Useful-rollout fraction of the run so far: rollouts in trained valid groups / all spent.
    record.update(rollouts_total=rollouts_total, useful_rollout_fraction=useful_total / max(rollouts_total, 1))
    params, opt_state, groups = state.params, state.opt_state, ro.result.groups
    if groups:
        params, opt_state, update = s.updater(state, groups, step)
        record.update({f"update/{k}": v for k, v in update.items()})
        if record["update/skipped_steps"] > 0:
            s.log(f"step {step}: update skipped (non-finite loss or gradient); "
                  f"{int(record['update/total_skipped_steps'])} skipped so far")
    distributed.check_same_on_every_host(f"step {step}'s rollouts and decisions", ro.table["reward"].tolist(),
                                         [(g.group_key, g.rewards) for g in groups])
    backend.store.retain(ro.result.retained_keys)
    t2 = time.perf_counter()
    if step % cfg.eval_every == 0 or step == cfg.steps:
        record.update(_evaluate(s, params, step))
    record.update({"time/rollout_s": t1 - t0, "time/update_s": t2 - t1, "time/step_s": time.perf_counter() - t0,
                   "compilations/sampler": s.session.sampler.compilations,
                   "compilations/update": _compiled_programs(s.updater.fns.compiled), **s.session.data_metrics()})
    return RunState(step, params, opt_state, ro.state, state.ref_params, rollouts_total, useful_total), record
