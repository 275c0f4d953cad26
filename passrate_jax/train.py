"""``passrate-jax train``: the main job. Builds every stage from the config, then runs steps of
(allocation rounds -> update), with evaluation, metrics, progress bar and Orbax checkpoints.

A run directory holds ``config.yaml``, ``metrics.jsonl``, TensorBoard events and ``checkpoints/``.
``train`` on a directory that has a checkpoint resumes from it (and says so): parameters, optimizer,
allocator / selection / controller states, the kept trajectories, and the step; every random draw of
a step is a pure function of (seed, step, group, rollout index), so a resumed run repeats an
uninterrupted one bit for bit on CPU.
"""

from __future__ import annotations

import os
import signal
import time

import jax
import jax.numpy as jnp
import yaml
from etils import epath

from passrate_jax import distributed
from passrate_jax.allocation import Allocator, state_from_dict, state_to_dict
from passrate_jax.checkpoint import RunCheckpointer
from passrate_jax.config import Config, dump_config
from passrate_jax.configlib import ConfigError, to_dict
from passrate_jax.envs import data as env_data
from passrate_jax.envs.loop import collect_env_rollouts, env_rollout_metrics
from passrate_jax.envs.rollouts import env_batch_arrays
from passrate_jax.loop import collect_rollouts, rollout_metrics
from passrate_jax.metrics import MetricsWriter, flatten
from passrate_jax.rl.batch import make_train_batch
from passrate_jax.rl.optimizer import make_optimizer
from passrate_jax.rl.train_step import make_train_step, policy_logprobs
from passrate_jax.rollouts import RolloutStore, batch_arrays
from passrate_jax.sampling.sampler import bucket
from passrate_jax.session import Session

WIDTH_BUCKETS = (64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192)
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
RESUMABLE_CHANGES = ("steps", "eval_every", "eval_samples", "checkpoint", "logging", "distributed")


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
            if saved.get(k) != now.get(k) and k.split(".")[0] not in RESUMABLE_CHANGES
            and not (k not in saved and now.get(k) == defaults.get(k))]


def eval_metrics(session: Session, params, cfg: Config) -> dict:
    """Held-out metrics of ``params``: greedy accuracy overall and per level, and with ``cfg.eval_samples``
    the mean accuracy of that many sampled answers per prompt (overall and per level)."""
    ev = session.evaluate(params, seed=cfg.seed, num_samples=cfg.eval_samples)
    out = {}
    for name, key in (("eval_accuracy", "accuracy"), ("eval_sampled_accuracy", "sampled_accuracy")):
        if key in ev:
            out[name] = ev[key]
            out.update({f"{name}/level_{k}": v for k, v in ev[f"{key}_by_level"].items()})
    if "sampled_accuracy_se" in ev:  # so a rise can be read against its noise from metrics.jsonl alone
        out["eval_sampled_accuracy_se"] = ev["sampled_accuracy_se"]
    return out


def train(cfg: Config, run_dir: str, *, progress: bool = True, log=print) -> dict:
    """Train (or resume) a run in ``run_dir``; returns a summary with the last metrics record.

    Multi-process (``cfg.distributed``): every process calls this with the same config and run directory
    (a shared file system or a gs:// path); see passrate_jax/distributed.py for how hosts stay in step."""
    distributed.initialize(cfg.distributed)  # before any other JAX call
    primary = distributed.is_primary()
    if not primary:
        log = _quiet
    epath.Path(run_dir).mkdir(parents=True, exist_ok=True)  # local, or gs:// seen by every host
    ckpt = RunCheckpointer(run_dir, keep=cfg.checkpoint.keep, async_save=cfg.checkpoint.async_save)
    resume_from = ckpt.latest_step()
    if resume_from is not None:
        conflicts = resume_conflicts(cfg, run_dir)
        if conflicts:
            ckpt.close()
            raise ConfigError(f"{run_dir} holds a run with another config; resuming it may change only "
                              f"{', '.join(RESUMABLE_CHANGES)}. Differences: " + "; ".join(conflicts)
                              + ". Use another --run-dir, or the saved config.yaml.")
    session = Session.create(cfg, log=log)
    if (note := cfg.lr_schedule_note()) is not None:
        log(f"warning: {note}")
    alloc_cfg = cfg.allocation
    rows_unit = alloc_cfg.num_prompts * alloc_cfg.group_size
    shards = session.mesh.shape["data"] * session.mesh.shape["fsdp"] * cfg.rl.minibatches * cfg.rl.grad_accum
    if rows_unit % shards:
        raise ConfigError(f"allocation.num_prompts * group_size = {rows_unit}: must be divisible by mesh data * "
                          f"fsdp * rl.minibatches * rl.grad_accum = {shards}")
    allocator = Allocator(alloc_cfg, cfg.prefix_sampling, num_prompts=len(session.prompts))
    env_run = cfg.data.source == "env"  # a multi-turn environment: its own store, rollout loop and batch builder
    store = env_data.make_store(session) if env_run else RolloutStore(session.prompt_ids, session.newline_id)
    alloc_state = allocator.init(jax.random.key_data(jax.random.key(cfg.seed)))
    optimizer = make_optimizer(cfg.optimizer)
    fns = make_train_step(session.graphdef, session.params, cfg.rl, optimizer, session.mesh)
    start, rollouts_total, useful_total = 0, 0, 0
    if resume_from is None:
        session.warm_start(progress=progress and primary)
    if primary:
        (epath.Path(run_dir) / "config.yaml").write_text(dump_config(cfg))  # a resume may extend steps
    params = jax.device_put(session.params, fns.param_shardings)
    opt_state = fns.init(params)
    # The KL term's frozen reference policy: the parameters training starts from (after the warm start).
    use_kl = cfg.rl.kl_coef > 0
    ref_params = jax.tree.map(jnp.copy, params) if use_kl else None
    ref_logprobs = jax.jit(lambda p, b: policy_logprobs(session.graphdef, p, b.tokens, b.positions,
                                                        b.attention_mask)[0]) if use_kl else None

    def checkpoint_state():
        state = {"params": params, "opt_state": opt_state, "allocator": state_to_dict(alloc_state)}
        return {**state, "ref_params": ref_params} if use_kl else state

    if resume_from is not None:
        state, meta = ckpt.restore(resume_from, checkpoint_state())
        params, opt_state = state["params"], state["opt_state"]
        ref_params = state.get("ref_params")
        alloc_state = state_from_dict(state["allocator"], alloc_state)
        store.load_json(meta["store"])
        start, rollouts_total, useful_total = int(meta["step"]), int(meta["rollouts_total"]), int(meta["useful_total"])
        log(f"resuming {run_dir} from the checkpoint of step {start}")
    writer = MetricsWriter(run_dir, tensorboard=cfg.logging.tensorboard, truncate_after=start, enabled=primary)
    if resume_from is None:
        # Step 0: the starting point (after the warm start) that training is measured against.
        writer.write({"step": 0, "rollouts_total": 0, **eval_metrics(session, params, cfg)})

    def save(step):
        ckpt.save(step, checkpoint_state(), {"step": step, "rollouts_total": rollouts_total,
                                             "useful_total": useful_total, "store": store.to_json()})

    bar = None
    if progress and cfg.logging.progress_bar and primary:
        from tqdm import tqdm
        bar = tqdm(total=cfg.steps, initial=start, desc="train", unit="step", dynamic_ncols=True)
    record: dict = {}
    t_run = time.perf_counter()
    with _StopRequest() as stop:
        step = start
        for step in range(start + 1, cfg.steps + 1):
            t0 = time.perf_counter()
            if env_run:
                ro = collect_env_rollouts(allocator, alloc_state, store, session.sampler, params,
                                          seed=_step_seed(cfg.seed, step), max_new_tokens=cfg.sampling.max_new_tokens)
            else:
                ro = collect_rollouts(allocator, alloc_state, store, session.sampler, params,
                                      seed=_step_seed(cfg.seed, step), max_new_tokens=cfg.sampling.max_new_tokens,
                                      decode=session.decode, verify=session.verify)
            t1 = time.perf_counter()
            record = {"step": step, **(env_rollout_metrics if env_run else rollout_metrics)(allocator, ro)}
            rollouts_total += ro.result.rollouts_spent
            useful_total += record["useful_rollouts"]
            record["rollouts_total"] = rollouts_total
            # Useful-rollout fraction of the run so far: rollouts in trained valid groups / all spent.
            record["useful_rollout_fraction"] = useful_total / max(rollouts_total, 1)
            groups = ro.result.groups
            if groups:
                rows = bucket(sum(len(g.rewards) for g in groups), [rows_unit * k for k in (1, 2, 4, 8)])
                arrays = (env_batch_arrays if env_run else batch_arrays)(
                    store, groups, rows=rows, width_buckets=WIDTH_BUCKETS, pad_id=session.tokenizer.pad_id)
                batch = make_train_batch(arrays["tokens"], arrays["attention_mask"], arrays["loss_mask"],
                                         arrays["rewards"], arrays["group_ids"], estimator=cfg.rl.advantage,
                                         eps=cfg.rl.advantage_eps)
                batch = jax.device_put(batch, fns.batch_sharding)
                if use_kl:
                    batch = batch.replace(ref_logprobs=ref_logprobs(ref_params, batch))
                params, opt_state, update = fns.step(params, opt_state, batch,
                                                     jax.random.fold_in(jax.random.key(cfg.seed), step))
                record.update({f"update/{k}": v for k, v in distributed.to_host(update).items()})
                if record["update/skipped_steps"] > 0:
                    log(f"step {step}: update skipped (non-finite loss or gradient); "
                        f"{int(record['update/total_skipped_steps'])} skipped so far")
            distributed.check_same_on_every_host(f"step {step}'s rollouts and decisions", ro.rewards,
                                                 [(g.group_key, g.rewards) for g in groups])
            alloc_state = ro.state
            store.retain(ro.result.retained_keys)
            t2 = time.perf_counter()
            if step % cfg.eval_every == 0 or step == cfg.steps:
                record.update(eval_metrics(session, params, cfg))
            record.update({"time/rollout_s": t1 - t0, "time/update_s": t2 - t1,
                           "time/step_s": time.perf_counter() - t0, "time/total_s": time.perf_counter() - t_run,
                           "compilations/sampler": session.sampler.compilations,
                           "compilations/update": _compiled_programs(fns.step)})
            record.update(session.data_metrics())
            writer.write(record)
            if step % cfg.checkpoint.every_steps == 0 or step == cfg.steps:
                save(step)
            if bar is not None:
                bar.update(1)
                bar.set_postfix({k: f"{record[v]:.2f}" for k, v in (
                    ("acc", "train_accuracy"), ("valid", "valid_group_fraction"),
                    ("useful", "useful_rollout_fraction"), ("eval", "eval_accuracy"),
                    ("eval_sampled", "eval_sampled_accuracy")) if v in record
                    and record[v] == record[v]}, refresh=False)
            if stop.requested:
                if step % cfg.checkpoint.every_steps:
                    save(step)
                log(f"interrupted: checkpoint of step {step} saved in {run_dir}; run train again to resume")
                break
    if bar is not None:
        bar.close()
    ckpt.close()
    writer.close()
    session.close()
    return {"step": step, "last": record, "run_dir": run_dir, "params": params}


def add_subparser(subparsers) -> None:
    from passrate_jax.cli import add_config_arguments
    p = subparsers.add_parser("train", help="train (or resume) a run")
    add_config_arguments(p)
    p.add_argument("--run-dir", default=None, help="default: runs/<config name>")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=run)


def run(args) -> int:
    from passrate_jax.config import load_config
    cfg = load_config(args.config, args.overrides)
    name = os.path.splitext(os.path.basename(args.config))[0] if args.config else "default"
    run_dir = args.run_dir or os.path.join("runs", name)
    summary = train(cfg, run_dir, progress=not args.no_progress)
    last = summary["last"]
    if last and distributed.is_primary():
        shown = {k: last[k] for k in ("step", "rollouts_total", "train_accuracy", "valid_group_fraction",
                                      "useful_rollout_fraction", "eval_accuracy", "eval_sampled_accuracy")
                 if k in last}
        print(f"run {run_dir}: " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                               for k, v in shown.items()))
    return 0
