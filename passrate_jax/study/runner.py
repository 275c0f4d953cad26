"""``passrate-jax study``: every allocation method side by side on the built-in task, paired seeds, the
same rollout accounting, one command. The methods are in ``methods.py``, the statistics in
``stats.py`` and ``analysis.py``, the report in ``report.py``.

    passrate-jax study --quick                      # 2 seeds, short runs
    passrate-jax study                              # the full study: 5 seeds (see docs/results.md)

Each (method, seed) is an ordinary training run in ``OUT/runs/<method>/seed<k>`` built from one base
preset plus the method's overrides, so everything but the allocation is identical across methods (the
model, the cached warm start of that seed, the data, the optimizer, the evaluation). A study is
resumable: runs already finished are read back, not retrained. Wall-clock seconds are measured on this
machine as the runs go; the rollout counts do not depend on the machine.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import threading
import time

import jax

from passrate_jax.configlib import ConfigError, to_dict
from passrate_jax.run.config import load_config
from passrate_jax.run.metrics import read_jsonl
from passrate_jax.run.train import train
from passrate_jax.run.warm_start import warm_start_file
from passrate_jax.study import provenance
from passrate_jax.study.analysis import analyse, load_runs
from passrate_jax.study.methods import DEFAULT_METHODS, HEADLINE_METHODS, METHODS, NEUTRAL, PS_INVESTIGATION
from passrate_jax.study.report import write_report

DEFAULT_SEEDS = (0, 1, 2, 3, 4)
QUICK_SEEDS = (0, 1)  # two seeds: the fewest a paired interval over seeds needs
# Shorter runs for --quick: two seeds, 8 steps of 8 prompts, 3 evaluations on a smaller held-out set (26
# runs in about 10 minutes on a 2-core CPU: a smoke check of the whole pipeline, its verdicts noise).
QUICK = ("steps=8", "eval_every=4", "data.eval_size=128", "allocation.num_prompts=8", "optimizer.warmup_steps=2",
         "eval_greedy=ends")
# The full study evaluates every 5 steps (time-to-target needs resolution) on 512 held-out prompts x 4
# samples, and stops at step 30: 65 runs of the default preset as written (50 steps, 1,024 prompts)
# would take about 8 hours on a 2-core CPU. It measures sampled accuracy, so greedy answers (a fifth of an
# evaluation's cost) are only evaluated at step 0 and the last step.
FULL = ("steps=30", "eval_every=5", "data.eval_size=512", "eval_greedy=ends")


@dataclasses.dataclass(frozen=True)
class StudyPlan:
    base_config: str
    methods: tuple[str, ...]
    seeds: tuple[int, ...]
    overrides: tuple[str, ...]
    out_dir: str
    quick: bool
    headline_seeds: tuple[int, ...] = ()  # seeds run only by the methods of ``headline``
    headline: tuple[str, ...] = ()

    def jobs(self) -> list[tuple[str, int]]:
        """Every (method, seed) of the study, seed-major (a study stopped midway is paired)."""
        return [(m, s) for s in self.seeds for m in self.methods] + [
            (m, s) for s in self.headline_seeds for m in self.methods if m in self.headline]

    def run_dir(self, method: str, seed: int) -> str:
        return os.path.join(self.out_dir, "runs", method, f"seed{seed}")

    def config_overrides(self, method: str, seed: int) -> list[str]:
        return [*(QUICK if self.quick else FULL), *NEUTRAL, *METHODS[method][1], f"seed={seed}",
                "logging.progress_bar=false", "logging.tensorboard=false", *self.overrides]


def _check_known(option: str, methods) -> None:
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ConfigError(f"{option} {' '.join(unknown)}: unknown; known: {' '.join(METHODS)}")


def make_plan(base_config: str, methods, seeds, overrides, out_dir: str, quick: bool, headline_seeds=(),
              headline=HEADLINE_METHODS) -> StudyPlan:
    """Validate the request (every config is built here, before any compute)."""
    _check_known("--methods", methods)
    if "grpo" not in methods:
        raise ConfigError(f"--methods {' '.join(methods)}: the study needs grpo, the baseline that sets the target")
    if len(set(seeds)) != len(seeds) or any(s < 0 for s in seeds):
        raise ConfigError(f"--seeds {' '.join(map(str, seeds))}: need distinct non-negative seeds")
    every = [*seeds, *headline_seeds]
    if len(set(every)) != len(every) or any(s < 0 for s in headline_seeds):
        raise ConfigError(f"--headline-seeds {' '.join(map(str, headline_seeds))}: need distinct non-negative seeds "
                          f"that are not among --seeds")
    if headline_seeds and "grpo" not in headline:
        raise ConfigError(f"--headline-methods {' '.join(headline)}: need grpo, the baseline that sets each seed's "
                          "target")
    _check_known("--headline-methods", headline)
    plan = StudyPlan(base_config, tuple(methods), tuple(seeds), tuple(overrides), out_dir, quick,
                     tuple(headline_seeds), tuple(headline))
    for m, s in plan.jobs():
        load_config(base_config, plan.config_overrides(m, s))
    return plan


def _records(run_dir: str) -> list[dict]:
    """A run's metrics records (none before it starts)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    return read_jsonl(path) if os.path.exists(path) else []


def _finished(records: list[dict], steps: int) -> bool:
    return bool(records) and records[-1].get("step") == steps and "eval_accuracy" in records[-1]


def _start_key(cfg) -> str:
    """What a run's step-0 evaluation depends on: its whole config but how it allocates, logs and saves.
    Runs with equal keys start from the same cached warm start and evaluate it on the same prompts with
    the same seed, so their step-0 evaluations are equal (tests/test_study.py checks it)."""
    d = {k: v for k, v in to_dict(cfg).items() if k not in ("allocation", "prefix_sampling", "logging", "checkpoint")}
    return json.dumps(d, sort_keys=True, default=str)


def _start_metrics(records: list[dict]) -> dict | None:
    """The evaluation keys of a run's step-0 record, if it has one."""
    if not records or records[0].get("step") != 0:
        return None
    return {k: v for k, v in records[0].items() if k.startswith("eval_")} or None


def _train_run(base_config, overrides: list[str], run_dir: str, start_metrics: dict | None, xla_cache: str) -> None:
    """Train one study run (in this process, or in a worker process of a parallel study)."""
    jax.config.update("jax_compilation_cache_dir", xla_cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    provenance.record(run_dir)
    train(load_config(base_config, overrides), run_dir, progress=False, log=lambda *a: None,
          start_metrics=start_metrics)


def _next_job(pending: list, keys: dict, starts: dict, running: set, cached=lambda key: True):
    """The first pending job that can start now. A run whose start (warm start and step-0 evaluation,
    :func:`_start_key`) is not yet measured, or whose warm start is not cached (``cached(key)`` false: a
    study extended with seeds on a machine whose cache lacks them), waits while a sibling of the same
    start runs, so each seed trains its warm start and evaluates step 0 once; meanwhile free workers take
    another seed's first run. (Two runs of one seed started together each trained the seed's 800-step
    warm start, about 5 minutes of both cores, when study v4 was extended on a fresh cache.)"""
    for job in pending:
        key = keys[job]
        if (starts.get(key) is not None and cached(key)) or key not in running:
            return job
    return None


def run_study(plan: StudyPlan, *, progress: bool = True, target_fraction: float = 0.8,
              metric: str | None = None, jobs: int = 1, train: bool = True) -> dict:
    """Train every (method, seed) not yet finished (a run stopped midway resumes from its checkpoint),
    then return the analysis of all of them (:func:`passrate_jax.study.analysis.analyse`). With ``train``
    false nothing is trained: the analysis covers the finished runs, and ``analysis["not_trained"]`` lists
    the (method, seed) pairs left out (a study still running, or one given more seeds for some methods).

    ``jobs`` > 1 trains that many runs at once, each in its own process, for CPU machines with cores to
    spare (one run keeps a 2-core CPU busy much of the time: --jobs 2 there gains little). Every run is
    the same computation either way (its metrics do not depend on ``jobs``; tests/test_study.py checks
    it); on one accelerator keep 1."""
    if jobs < 1:
        raise ConfigError(f"--jobs {jobs}: must be >= 1")
    # Every run builds the same sampler and update programs: compile them once for the whole study
    # (each run, in this process or a worker, points JAX at this cache: _train_run).
    xla_cache = os.path.join(plan.out_dir, "xla_cache")
    jobs_list = plan.jobs()
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=len(jobs_list), desc="study", unit="run", dynamic_ncols=True)
    t0, starts, keys, pending, warm_files = time.perf_counter(), {}, {}, [], {}
    for method, seed in jobs_list:
        cfg = load_config(plan.base_config, plan.config_overrides(method, seed))
        keys[method, seed], records = _start_key(cfg), _records(plan.run_dir(method, seed))
        warm_files[keys[method, seed]] = warm_start_file(cfg)
        if _finished(records, cfg.steps):
            starts.setdefault(keys[method, seed], _start_metrics(records))
            if bar is not None:
                bar.update(1)
        else:
            pending.append((method, seed))

    def launch(submit, job):
        pending.remove(job)
        if bar is not None:
            bar.set_postfix(run=f"{job[0]}/seed{job[1]}", refresh=True)
        return submit(_train_run, plan.base_config, plan.config_overrides(*job), plan.run_dir(*job),
                      starts.get(keys[job]), xla_cache)

    def finished(job):
        key = keys[job]
        if starts.get(key) is None:
            starts[key] = _start_metrics(_records(plan.run_dir(*job)))
        if bar is not None:
            bar.update(1)

    not_trained = [] if train else list(pending)
    if train:
        cached = lambda key: warm_files[key] is None or os.path.exists(warm_files[key])  # noqa: E731
        _train_pending(jobs, pending, keys, starts, launch, finished, cached)
    if bar is not None:
        bar.close()
    analysis = analyse(runs := load_runs(plan, leave_out=not_trained), target_fraction=target_fraction,
                       metric=metric, prints=provenance.load_fingerprints(plan, runs))  # of exactly the runs analysed
    analysis["not_trained"] = not_trained
    analysis["study_seconds"] = time.perf_counter() - t0
    analysis["machine"] = f"{platform.platform()}, {os.cpu_count()} CPU cores, jax {jax.__version__} " \
                          f"on {jax.default_backend()}"
    return analysis


def _exit_with_parent(parent: int) -> None:
    """Worker initializer: a daemon thread ends the worker once the study process is gone. Killed with
    SIGTERM or SIGKILL (a scheduler, ``kill``), the study's workers get no signal and would train their
    run to its end, orphaned, while a resumed study trains the same run in the same directory."""
    def watch():
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)
    threading.Thread(target=watch, daemon=True).start()


def worker_pool(jobs: int):
    """``jobs`` spawned worker processes (not forked: the parent has imported JAX) that exit with the
    process that made them (:func:`_exit_with_parent`)."""
    import concurrent.futures as cf
    import multiprocessing
    return cf.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"),
                                  initializer=_exit_with_parent, initargs=(os.getpid(),))


def _train_pending(jobs: int, pending: list, keys: dict, starts: dict, launch, finished, cached) -> None:
    """Train the pending runs: one after another in this process, or in ``jobs`` worker processes
    (``cached``: :func:`_next_job`'s)."""
    if jobs == 1:
        while pending:
            job = pending[0]
            launch(lambda fn, *args: fn(*args), job)
            finished(job)
    elif pending:
        _run_parallel(jobs, pending, keys, starts, launch, finished, cached)


def _run_parallel(jobs: int, pending: list, keys: dict, starts: dict, launch, finished, cached) -> None:
    """Keep ``jobs`` worker processes busy until every pending run is trained (:func:`worker_pool`); a run
    that fails stops the study with its name."""
    import concurrent.futures as cf

    with worker_pool(jobs) as pool:
        running = {}  # future -> job
        while pending or running:
            while len(running) < jobs:
                job = _next_job(pending, keys, starts, {keys[j] for j in running.values()}, cached)
                if job is None:
                    break
                running[launch(pool.submit, job)] = job
            # Woken every few seconds too: a run waiting for a sibling's warm start starts once it is cached.
            done, _ = cf.wait(running, timeout=5, return_when=cf.FIRST_COMPLETED)
            for future in done:
                job = running.pop(future)
                try:
                    future.result()
                except BaseException as e:
                    for other in running:
                        other.cancel()
                    raise RuntimeError(f"study run {job[0]}/seed{job[1]} failed: {e!r}") from e
                finished(job)


def add_subparser(subparsers) -> None:
    p = subparsers.add_parser("study", help="every allocation method side by side (paired seeds, rollouts to "
                                            "target accuracy with intervals), written to a Markdown report")
    p.add_argument("--config", default="configs/default.yaml", help="base preset every method starts from")
    p.add_argument("--quick", action="store_true", help="2 seeds, 8 short steps (a smoke check)")
    p.add_argument("--seeds", type=int, nargs="+", default=None,
                   help=f"default: {' '.join(map(str, DEFAULT_SEEDS))} (--quick: {' '.join(map(str, QUICK_SEEDS))})")
    p.add_argument("--headline-seeds", type=int, nargs="+", default=[],
                   help="more seeds, run only by the headline methods (for narrower intervals on the main claims)")
    p.add_argument("--headline-methods", nargs="+", default=list(HEADLINE_METHODS),
                   help=f"the methods --headline-seeds runs (default: {' '.join(HEADLINE_METHODS)})")
    p.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS),
                   help=f"default: {' '.join(DEFAULT_METHODS)}; the PS investigation adds {' '.join(PS_INVESTIGATION)}")
    p.add_argument("--out", default=None, help="study directory (default: runs/study or runs/study_quick)")
    p.add_argument("--report", default=None, help="Markdown report (default: OUT/results.md)")
    p.add_argument("--target-fraction", type=float, default=0.8,
                   help="target = warm start + this fraction of GRPO's gain to its plateau (default 0.8)")
    p.add_argument("--metric", choices=("eval_sampled_accuracy", "eval_accuracy"), default=None,
                   help="held-out accuracy the study measures (default: sampled when every run records it)")
    p.add_argument("--jobs", type=int, default=1,
                   help="runs trained at once, each in its own process (default 1; for CPU machines with cores to "
                        "spare, a run keeps up to about two busy; on one GPU or TPU keep 1)")
    p.add_argument("--report-only", action="store_true",
                   help="train nothing: report the runs of OUT that have finished and list those left out")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="applied to every run")
    p.set_defaults(func=run)


def run(args) -> int:
    import shlex
    import sys

    seeds = args.seeds if args.seeds is not None else list(QUICK_SEEDS if args.quick else DEFAULT_SEEDS)
    out = args.out or os.path.join("runs", "study_quick" if args.quick else "study")
    if not 0 < args.target_fraction <= 1:
        raise ConfigError(f"--target-fraction {args.target_fraction}: must be in (0, 1]")
    plan = make_plan(args.config, args.methods, seeds, args.overrides, out, args.quick, args.headline_seeds,
                     args.headline_methods)
    analysis = run_study(plan, progress=not args.no_progress, target_fraction=args.target_fraction,
                         metric=args.metric, jobs=args.jobs, train=not args.report_only)
    report = args.report or os.path.join(out, "results.md")
    command = "passrate-jax " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    paths = write_report(plan, analysis, report, command=command)
    more = f" (+{len(plan.headline_seeds)} headline seeds)" if plan.headline_seeds else ""
    print(f"study of {len(plan.methods)} methods x {len(plan.seeds)} seeds{more} in {analysis['study_seconds']:.0f} s: "
          + ", ".join(paths))
    return 0
