"""``passrate-jax study``: its statistics on synthetic runs with known answers (censoring, pairing,
intervals, verdicts), and a small end-to-end study on the tiny model (the real one is docs/results.md)."""

import math
import os

import numpy as np
import pytest

from passrate_jax.run.config import load_config
from passrate_jax.configlib import ConfigError
from passrate_jax.run.metrics import read_jsonl
from passrate_jax.study.runner import make_plan, run_study
from passrate_jax.study.analysis import analyse
from passrate_jax.study.methods import (CLAIMS, DEFAULT_METHODS, HEADLINE_METHODS, METHODS, NEUTRAL,
                                        PS_INVESTIGATION)
from passrate_jax.study.report import AXES, DISCUSSION_MARKER, figure, fmt_interval, gain_band, write_report
from passrate_jax.study.stats import (factor_interval, first_reach, km_median, log_factor_bounds, mean_over,
                                      paired_interval)
from scipy import stats as sps
from tests.test_train_e2e import TINY, fake_verifier  # noqa: F401 - fixture

# The preset of each method's composition (configs/); the study must run the same thing.
PRESETS = {"grpo": "uniform", "ds": "ds", "ds_ideal": "ds_ideal", "mopps": "mopps", "dps": "dps", "sara": "sara",
           "sara_fixed": "sara_fixed", "sara_dps": "sara_dps", "pilot_commit": "pilot_commit",
           "pilot_commit_fill": "pilot_commit_fill",
           "ps_adaptive": "ps", "ps_fixed": "ps_fixed", "ps_hard_only": "ps_hard_only", "ps_sara_dps": "ps_sara_dps",
           "ps_same_step": "ps_same_step", "ps_on_top": "ps_on_top", "ps_lines": "ps_lines",
           "ps_first_line": "ps_first_line"}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("method", list(METHODS))
def test_study_methods_match_their_presets(method):
    base = os.path.join(ROOT, "configs", "default.yaml")
    ours = load_config(base, [*NEUTRAL, *METHODS[method][1]])
    preset = load_config(os.path.join(ROOT, "configs", f"{PRESETS[method]}.yaml"))
    assert ours.allocation == preset.allocation and ours.prefix_sampling == preset.prefix_sampling


def test_claims_name_known_methods_and_measures():
    for c in CLAIMS:
        assert c.method in METHODS and c.baseline in METHODS and c.kind in ("factor", "above", "match")
        # --headline-seeds gives every run a claim reads its extra seeds, so every verdict pairs them all
        assert {c.method, c.baseline, c.premise_run} <= set(HEADLINE_METHODS), c.label


def test_bad_study_requests_fail_before_compute(tmp_path):
    with pytest.raises(ConfigError, match="--methods sarah: unknown"):
        make_plan(None, ["grpo", "sarah"], [0], [], str(tmp_path), quick=True)
    with pytest.raises(ConfigError, match="needs grpo"):
        make_plan(None, ["sara"], [0], [], str(tmp_path), quick=True)
    with pytest.raises(ConfigError, match="allocation.num_prompt"):
        make_plan(None, ["grpo"], [0], ["allocation.num_prompt=3"], str(tmp_path), quick=True)
    with pytest.raises(ConfigError, match="--headline-seeds 1 0: need distinct non-negative seeds that are not"):
        make_plan(None, ["grpo"], [0], [], str(tmp_path), quick=True, headline_seeds=[1, 0])
    with pytest.raises(ConfigError, match="--headline-methods ds: need grpo"):
        make_plan(None, ["grpo", "ds"], [0], [], str(tmp_path), quick=True, headline_seeds=[1], headline=["ds"])


def test_study_command_defaults_and_errors(tmp_path, capsys):
    from passrate_jax.cli.main import build_parser, main
    from passrate_jax.study.runner import DEFAULT_SEEDS, QUICK_SEEDS
    assert len(DEFAULT_SEEDS) >= 5 and len(QUICK_SEEDS) >= 2  # paired intervals need seeds
    args = build_parser().parse_args(["study", "--quick"])
    assert args.methods == list(DEFAULT_METHODS) and args.seeds is None
    assert len(DEFAULT_METHODS) == 14 and not set(PS_INVESTIGATION) & set(DEFAULT_METHODS)
    assert set(DEFAULT_METHODS) | set(PS_INVESTIGATION) == set(METHODS)
    plan = make_plan(None, ["grpo", *PS_INVESTIGATION], [0], [], str(tmp_path / "plan"), quick=True)
    assert plan.methods == ("grpo", *PS_INVESTIGATION)
    assert main(["study", "--out", str(tmp_path), "--methods", "grpo", "sarah"]) == 2
    assert main(["study", "--out", str(tmp_path), "--target-fraction", "1.5"]) == 2
    err = capsys.readouterr().err
    assert "--methods sarah: unknown" in err and "--target-fraction 1.5" in err
    assert not any(tmp_path.iterdir()), "nothing is trained or written before the request is validated"


# --- statistics with known answers -------------------------------------------------------------------

def test_kaplan_meier_median_keeps_censored_runs():
    # Two runs reach the target (1000, 2000), three never do (censored at 3000): S(1000) = 4/5,
    # S(2000) = 4/5 * 3/4 = 0.6 > 0.5, so the median is only known to exceed 3000. Dropping the
    # censored runs would say 1500.
    assert km_median([1000, 2000, 3000, 3000, 3000], [True, True, False, False, False]) == (3000.0, False)
    # 500 reached, 2000 censored, 4000 reached: S(500) = 2/3, S(4000) = 0 -> median 4000 (not 2250).
    assert km_median([500, 2000, 4000], [True, False, True]) == (4000.0, True)
    # No censoring: the smallest time with S <= 0.5 (the lower median).
    assert km_median([3, 1, 2, 4], [True] * 4) == (2.0, True)


def test_first_reach_ignores_the_starting_point_and_censors_a_miss():
    assert first_reach([0, 100, 200, 300], [0.7, 0.5, 0.66, 0.9], 0.66) == (200.0, True)
    assert first_reach([0, 100, 200], [0.9, 0.5, 0.6], 0.66) == (200.0, False)


T1 = sps.t.ppf(0.975, 1)  # the t quantile of a 95% interval over two seeds (12.7)


def test_factors_are_paired_per_seed():
    # Seed 0: 1000 vs 500 (2x); seed 1: 4000 vs 4000 (1x). Per seed, paired: geometric mean sqrt(2).
    # Unpaired, mean over mean: 2500 / 2250 = 1.11.
    lo, hi = log_factor_bounds([1000, 4000], [True, True], [500, 4000], [True, True])
    iv = factor_interval(lo, hi)
    assert iv["estimate_lo"] == pytest.approx(math.sqrt(2)) == iv["estimate_hi"]
    # The t-interval of the mean log factor: log 2 / 2 +- t(1) * sd / sqrt(2), sd = log 2 / sqrt(2).
    half = T1 * math.log(2) / 2
    assert (iv["ci_lo"], iv["ci_hi"]) == pytest.approx((math.sqrt(2) * math.exp(-half), math.sqrt(2) * math.exp(half)))
    # Every seed 2x, at very different scales: the paired interval is exactly [2, 2]; an unpaired
    # comparison of the two columns would not be.
    lo, hi = log_factor_bounds([1000, 4000, 2000], [True] * 3, [500, 2000, 1000], [True] * 3)
    iv = factor_interval(lo, hi)
    assert (iv["estimate_lo"], iv["ci_lo"], iv["ci_hi"]) == pytest.approx((2.0, 2.0, 2.0))


def test_a_censored_seed_bounds_its_factor_on_one_side():
    # Seed 1's method run missed the target after 2000 rollouts: its factor is < 1000 / 2000, unbounded below.
    lo, hi = log_factor_bounds([1000, 1000], [True, True], [500, 2000], [True, False])
    assert lo[0] == hi[0] == pytest.approx(math.log(2)) and lo[1] == -np.inf and hi[1] == pytest.approx(math.log(0.5))
    iv = factor_interval(lo, hi)
    assert iv["estimate_lo"] == 0.0 and iv["estimate_hi"] == pytest.approx(1.0)
    # The lower end is unbounded (seed 1 could be any slower); the upper end is the upper bounds' interval.
    assert iv["ci_lo"] == 0.0 and iv["ci_hi"] == pytest.approx(2.0 ** T1)
    # The baseline missed (censored at 3000), the method reached at 1000: the factor is > 3.
    lo, hi = log_factor_bounds([3000], [False], [1000], [True])
    assert lo[0] == pytest.approx(math.log(3)) and hi[0] == np.inf
    # Both missed: nothing is known.
    lo, hi = log_factor_bounds([3000], [False], [1000], [False])
    assert (lo[0], hi[0]) == (-np.inf, np.inf)


def test_difference_interval_and_formatting():
    iv = paired_interval([0.01, 0.03], [0.01, 0.03])
    half = T1 * 0.01  # sd = 0.01 * sqrt 2, divided by sqrt 2
    assert iv["estimate_lo"] == pytest.approx(0.02) and (iv["ci_lo"], iv["ci_hi"]) == pytest.approx((0.02 - half, 0.02 + half))
    shown = {"estimate_lo": 0.02, "estimate_hi": 0.02, "ci_lo": 0.01, "ci_hi": 0.03, "n": 2, "censored_seeds": 0}
    assert fmt_interval(shown, 3) == "0.020 [0.010, 0.030]"
    censored = {"estimate_lo": 0.0, "estimate_hi": 1.0, "ci_lo": 0.0, "ci_hi": 2.0, "n": 2, "censored_seeds": 1}
    assert fmt_interval(censored) == "0.00–1.00 [0.00, 2.00] (1 censored)"


def test_mean_accuracy_over_rollouts():
    # 0..100: linear 0.5 -> 0.7 (mean 0.6), 100..150: 0.7: (60 + 35) / 150.
    assert mean_over([0, 100, 200], [0.5, 0.7, 0.7], 150) == pytest.approx(95 / 150)


def _run(accuracy, rollouts_per_step, valid_per_step, steps=20, every=5):
    """Synthetic metrics.jsonl records: an evaluation every ``every`` steps with the given accuracies."""
    records = [{"step": 0, "rollouts_total": 0, "eval_sampled_accuracy": accuracy[0], "eval_accuracy": 0.0}]
    for t in range(1, steps + 1):
        r = {"step": t, "rollouts_total": rollouts_per_step * t, "valid_groups": valid_per_step,
             "useful_rollout_fraction": 0.5, "time/step_s": 2.0}
        if t % every == 0:
            r.update(eval_sampled_accuracy=accuracy[t // every], eval_accuracy=0.0)
        records.append(r)
    return records


def test_analysis_of_synthetic_runs_with_known_answers():
    grpo_curve = np.array([0.5, 0.6, 0.7, 0.7, 0.7])
    runs = {"grpo": {}, "ds": {}, "sara": {}}
    for s, per_step in enumerate((100, 400, 100)):
        off = 0.1 * s  # each seed its own warm start, so its own target
        runs["grpo"][s] = _run(grpo_curve + off, per_step, 4)
        runs["ds"][s] = _run(grpo_curve + off, 3 * per_step, 8)
    runs["sara"][0] = _run([0.5, 0.7, 0.7, 0.7, 0.7], 100, 6)  # target 0.66 at step 5: 500 rollouts
    runs["sara"][1] = _run(grpo_curve + 0.1, 400, 6)             # target 0.76 at step 10: 4000
    runs["sara"][2] = _run([0.7, 0.75, 0.8, 0.8, 0.8], 100, 6)   # target 0.86 never: censored at 2000
    a = analyse(runs)
    assert a["metric"] == "eval_sampled_accuracy"
    assert [a["targets"][s] for s in range(3)] == pytest.approx([0.66, 0.76, 0.86])
    sara = a["methods"]["sara"]["rollouts_to_target"]
    assert sara["per_seed"] == [(500.0, True), (4000.0, True), (2000.0, False)]
    assert (sara["median"], sara["median_reached"], sara["reached"]) == (4000.0, True, 2)
    # Against DS (3000, 12000, 3000 to target): per-seed factors 6, 3 and (censored) < 1.5.
    iv = a["comparisons"][("sara", "ds")]["rollouts_to_target"]
    assert iv["estimate_lo"] == 0.0 and iv["estimate_hi"] == pytest.approx(3.0) and iv["censored_seeds"] == 1
    t2, logs = sps.t.ppf(0.975, 2), np.log([6.0, 3.0, 1.5])
    assert iv["ci_lo"] == 0.0 and iv["ci_hi"] == pytest.approx(np.exp(logs.mean() + t2 * logs.std(ddof=1) / np.sqrt(3)))
    # GRPO against DS: exactly 3x fewer rollouts in every seed; the same steps.
    c = a["comparisons"][("grpo", "ds")]
    assert (c["rollouts_to_target"]["ci_lo"], c["rollouts_to_target"]["ci_hi"]) == pytest.approx((3.0, 3.0))
    assert c["steps_to_target"]["estimate_lo"] == pytest.approx(1.0)
    assert a["per_seed"]["sara"][0]["seconds_to_target"] == (10.0, True)  # 5 steps of 2 s
    # GRPO's peak (0.7, 0.8, 0.9 by seed): SARA reaches it at step 5 and 10, never on seed 2 (censored
    # at its 40 s); GRPO at step 10 every seed, so SARA's seconds factors are 2, 1 and at most 0.5.
    assert [a["per_seed"]["sara"][s]["seconds_to_peak"] for s in range(3)] == [(10.0, True), (20.0, True),
                                                                               (40.0, False)]
    iv = a["comparisons"][("sara", "grpo")]["seconds_to_peak"]
    assert (iv["estimate_lo"], iv["censored_seeds"]) == (0.0, 1)
    assert iv["estimate_hi"] == pytest.approx(np.exp(np.log([2.0, 1.0, 0.5]).mean()))
    # Target-free measures: valid groups 6 vs 4 per step; rollouts per valid group 100/6 vs 100/4.
    c = a["comparisons"][("sara", "grpo")]
    assert c["valid_groups_per_step"]["estimate_lo"] == pytest.approx(1.5)
    assert c["rollouts_per_valid_group"]["estimate_lo"] == pytest.approx(1.5)
    assert c["final_accuracy"]["estimate_lo"] == pytest.approx(np.mean([0.0, 0.0, 0.8 - 0.9]))
    # H = the fewest rollouts a method of the seed spent (GRPO's and SARA's 2000 in seed 0).
    assert a["horizons"][0] == 2000.0
    claim = next(r for r in a["claims"] if r["claim"].label == "SARA: fewer rollouts than DS")
    assert claim["verdict"] == "inconclusive"  # [0, 9.4] covers both 1 and 1.28
    assert a["no_gain_seeds"] == []
    # Greedy accuracy when asked for (here flat at 0: GRPO gains nothing, which the analysis flags).
    greedy = analyse(runs, metric="eval_accuracy")
    assert greedy["metric"] == "eval_accuracy" and greedy["no_gain_seeds"] == [0, 1, 2]
    # ... and leaves those seeds out of every to-target comparison (the others keep them).
    assert greedy["comparisons"][("sara", "ds")]["rollouts_to_target"]["n"] == 0
    assert greedy["comparisons"][("sara", "ds")]["final_accuracy"]["n"] == 3
    assert all(r["verdict"] == "inconclusive" for r in greedy["claims"] if r["claim"].measure.endswith("_target"))


def test_plateau_of_a_short_run_leaves_out_the_warm_start():
    # Three evaluations (steps 0, 4, 8, as --quick runs): the plateau is the mean of steps 4 and 8 only.
    runs = {"grpo": {0: _run([0.2, 0.5, 0.7], 100, 4, steps=8, every=4)}}
    a = analyse(runs)
    assert a["plateaus"][0] == pytest.approx(0.6) and a["targets"][0] == pytest.approx(0.2 + 0.8 * 0.4)


def _curve(rollouts, seconds, accuracy):
    return {"curve": {k: np.asarray(v, float) for k, v in
                      dict(rollouts=rollouts, seconds=seconds, accuracy=accuracy).items()}}


def test_the_figure_plots_each_method_against_rollouts_and_seconds():
    # Two seeds whose curves differ in rollouts and in seconds: a band on the wrong axis, or a seed
    # extrapolated past the shorter run, gives other numbers.
    fast = [_curve([0, 100, 200], [0, 10, 20], [0.2, 0.4, 0.5]), _curve([0, 100, 300], [0, 30, 40], [0.3, 0.3, 0.7])]
    x, mu, sd = gain_band([c["curve"] for c in fast], "seconds", points=3)
    np.testing.assert_allclose(x, [0, 10, 20])  # up to the smaller total, 20 s
    np.testing.assert_allclose(mu, [0.0, (0.2 + 0.0) / 2, (0.3 + 0.0) / 2])  # seed 1 gains nothing before 30 s
    np.testing.assert_allclose(sd, [0.0, np.std([0.2, 0.0], ddof=1), np.std([0.3, 0.0], ddof=1)])
    x, mu, _ = gain_band([c["curve"] for c in fast], "rollouts", points=3)
    np.testing.assert_allclose(x, [0, 100, 200])
    np.testing.assert_allclose(mu, [0.0, 0.1, (0.3 + 0.2) / 2])
    slow = [_curve([0, 100, 200], [0, 50, 90], [0.2, 0.3, 0.4]), _curve([0, 100, 200], [0, 60, 120], [0.2, 0.3, 0.5])]
    # PS adaptive ran seed 1 only (a study whose headline methods had more seeds): its reference is GRPO's seed 1.
    analysis = {"per_seed": {"grpo": dict(enumerate(slow)), "sara": dict(enumerate(fast)), "ps_adaptive": {1: fast[1]}},
                "targets": {0: 0.5, 1: 0.5}, "metric": "eval_sampled_accuracy"}
    fig = figure(analysis)
    panels = [ax for ax in fig.axes if ax.get_title()]
    assert [(ax.get_title(), ax.get_xlabel()) for ax in panels] == [
        (t, AXES[a]) for t in ("GRPO (uniform)", "SARA (fill)", "PS adaptive (seeds 1)") for a in AXES]
    sara_seconds = panels[3]  # SARA's own curve, with GRPO's as the reference
    np.testing.assert_allclose(sara_seconds.lines[-1].get_xdata()[-1], 20)
    np.testing.assert_allclose(sara_seconds.lines[0].get_xdata()[-1], 90)  # GRPO over seeds 0 and 1
    np.testing.assert_allclose(panels[5].lines[0].get_xdata()[-1], 120)  # GRPO over seed 1 alone
    import matplotlib.pyplot as plt
    plt.close(fig)


def test_small_study_end_to_end(tmp_path, fake_verifier, monkeypatch):  # noqa: F811
    tiny = [t for t in TINY if not t.startswith("eval_every")] + ["allocation.num_prompts=4", "steps=4",
                                                                  "eval_every=2", "data.eval_size=4"]
    plan = make_plan(None, ["grpo", "ds", "ps_sara_dps"], [0, 1], tiny, str(tmp_path / "study"), quick=True)
    import passrate_jax.run.train as train_module
    start_evaluations = []
    evaluate = train_module.eval_metrics
    monkeypatch.setattr(train_module, "eval_metrics", lambda session, params, cfg, step: (
        start_evaluations.append(cfg.seed) if step == 0 else None, evaluate(session, params, cfg, step))[1])
    analysis = run_study(plan, progress=False)
    # One step-0 evaluation per seed, reused by the seed's other methods; it is what each would measure.
    assert start_evaluations == [0, 1]
    firsts = {m: read_jsonl(plan.run_dir(m, 0) + "/metrics.jsonl")[0] for m in plan.methods}
    assert firsts["grpo"] == firsts["ds"] == firsts["ps_sara_dps"]
    alone = load_config(None, plan.config_overrides("ps_sara_dps", 0) + ["steps=0"])
    train_module.train(alone, str(tmp_path / "alone"), progress=False, log=lambda *a: None)
    assert read_jsonl(tmp_path / "alone" / "metrics.jsonl")[0] == firsts["ps_sara_dps"]
    assert set(analysis["methods"]) == {"grpo", "ds", "ps_sara_dps"} and analysis["metric"] == "eval_accuracy"
    for m in analysis["methods"].values():
        assert m["seeds"] == [0, 1] and m["rollouts_total"]["n"] == 2 and m["rollouts_total"]["mean"] > 0
    assert analysis["methods"]["ps_sara_dps"]["ps_pass_rate"], "PS runs report re-rollout pass rates per bucket"
    # Premise probes from the runs' own metrics: every run opened prompts out of its train pool; the PS run
    # logged a histogram per bucket of complete re-rollout groups (N + 1 counts).
    for m in plan.methods:
        probes = analysis["per_seed"][m][0]["probes"]
        assert probes["openings"] > 0 and 0 < probes["visits_per_prompt"] and probes["rollouts_per_step"] > 0
    ps_probe = analysis["per_seed"]["ps_sara_dps"][0]["probes"]
    assert all(len(x["hist"]) == 5 for x in ps_probe["ps_buckets"].values())
    assert ("ps_sara_dps", "grpo") in analysis["comparisons"] and ("grpo", "ds") in analysis["comparisons"]
    report = tmp_path / "results.md"
    report.write_text(f"old\n{DISCUSSION_MARKER}\nmy notes\n")
    paths = write_report(plan, analysis, str(report), command="passrate-jax study --quick")
    text = report.read_text()
    assert "| GRPO (uniform) | " in text and "| PS + SARA + DPS | " in text and "passrate-jax study --quick" in text
    assert "## Premise probes, per method and seed" in text and "Holm" in text
    assert "| seconds to target (KM median) |" in text and "| seconds to target × | rollouts to GRPO's peak × |" in text
    # A study of some methods says which in its title, not "every allocation method".
    assert text.startswith("# Efficiency study: GRPO (uniform); DS (DAPO dynamic sampling); PS + SARA + DPS on")
    assert "Pilot-Commit" not in text.split("## Premise probes")[0].split("## The source")[1]  # only claims with runs
    assert "22% fewer rollouts than DS" not in text  # SARA was not run
    assert text.endswith("my notes\n") and "old" not in text
    assert all(os.path.getsize(p) > 0 for p in paths)
    # A second invocation reuses the finished runs instead of training them again.
    metrics = tmp_path / "study" / "runs" / "grpo" / "seed0" / "metrics.jsonl"
    before = metrics.stat().st_mtime_ns
    run_study(plan, progress=False)
    assert metrics.stat().st_mtime_ns == before
    # --report-only with a seed whose GRPO run stopped midway and whose DS run never started: nothing is
    # trained, both are left out (a partial run's evaluations are not the run's) and listed.
    wider = make_plan(None, plan.methods, [0, 1], tiny, str(tmp_path / "study"), quick=True, headline_seeds=[2],
                      headline=("grpo", "ds"))
    assert wider.jobs() == [*plan.jobs(), ("grpo", 2), ("ds", 2)]  # headline seeds: headline methods only
    os.makedirs(wider.run_dir("grpo", 2))
    with open(os.path.join(wider.run_dir("grpo", 2), "metrics.jsonl"), "w") as f:
        f.writelines(open(metrics).readlines()[:3])
    partial = run_study(wider, progress=False, train=False)
    assert partial["not_trained"] == [("grpo", 2), ("ds", 2)] and not os.path.exists(wider.run_dir("ds", 2))
    assert partial["methods"]["ds"]["seeds"] == [0, 1] and sorted(partial["targets"]) == [0, 1]
    write_report(wider, partial, str(report), command="passrate-jax study --report-only")
    assert "**Headline seeds**: GRPO (uniform), DS (DAPO dynamic sampling) also ran seed(s) 2" in report.read_text()
    assert "**Runs left out** (written with `--report-only`; these had not finished): GRPO (uniform) seed(s) 2; " \
           "DS (DAPO dynamic sampling) seed(s) 2." in report.read_text()


def test_study_workers_exit_when_the_study_process_is_killed(tmp_path):
    # A study process that holds a worker busy (a 60 s sleep standing for a run) is killed with SIGKILL;
    # its worker must exit too, not train on as an orphan (it did, before the watchdog: 60 s).
    import signal
    import subprocess
    import sys
    import time
    script = ("import os, sys, time\nfrom passrate_jax.study.runner import worker_pool\n"
              "pool = worker_pool(1)\nprint(pool.submit(os.getpid).result(), flush=True)\n"
              "pool.submit(time.sleep, 60)\ntime.sleep(60)\n")
    study = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    worker = int(study.stdout.readline())
    os.kill(study.pid, signal.SIGKILL)
    study.wait()

    def alive(pid):
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().split(") ")[1][0] != "Z"  # a zombie has exited
        except FileNotFoundError:
            return False
    deadline = time.monotonic() + 20
    while alive(worker) and time.monotonic() < deadline:
        time.sleep(0.2)
    if alive(worker):
        os.kill(worker, signal.SIGKILL)
        pytest.fail(f"worker {worker} outlived its study process by 20 s")


def test_a_seed_whose_warm_start_is_not_cached_trains_it_once():
    """``_next_job``: a run waits while a sibling of the same start (seed) runs if that start's step-0
    evaluation is unknown, or if its warm start is not cached yet (a study extended with seeds on a machine
    whose cache lacks them: the step-0 evaluations come from the finished runs, the warm starts do not),
    so two workers never train one seed's warm start twice; the free worker takes another seed's run."""
    from passrate_jax.study.runner import _next_job
    pending = [("dps", 3), ("sara_dps", 3), ("dps", 4)]
    keys = {("dps", 3): "k3", ("sara_dps", 3): "k3", ("dps", 4): "k4"}
    starts = {"k3": {"eval_accuracy": 0.5}, "k4": {"eval_accuracy": 0.4}}
    rest = pending[1:]
    assert _next_job(pending, keys, starts, set(), cached=lambda key: False) == ("dps", 3)
    assert _next_job(rest, keys, starts, {"k3"}, cached=lambda key: False) == ("dps", 4)
    assert _next_job(rest, keys, starts, {"k3"}, cached=lambda key: key == "k3") == ("sara_dps", 3)
    assert _next_job(rest, keys, {"k4": starts["k4"]}, {"k3"}) == ("dps", 4)  # k3's start still unmeasured
    assert _next_job(rest[:1], keys, starts, {"k3"}, cached=lambda key: False) is None


def test_every_claims_table_row_has_the_headers_columns():
    """A quoted claim's ``|`` (``|SARA - DPS|``) is escaped in its cell: unescaped, it ended the cell, and
    the row's later columns (measured, premise, p-values, verdict) shifted one to the right."""
    import re
    from passrate_jax.study.report import _claims_table
    interval = {"n": 3, "estimate_lo": 1.0, "estimate_hi": 1.0, "ci_lo": 0.5, "ci_hi": 2.0, "kind": "factor"}
    rows = [{"claim": c, "interval": interval, "premise": {"met": None, "text": "–"}, "p_adjusted": (1.0, 1.0),
             "verdict": "inconclusive"} for c in CLAIMS]
    table = [line for line in _claims_table({"claims": rows}) if line.startswith("|")]
    cells = [len(re.findall(r"(?<!\\)\|", line)) for line in table]
    assert any("|" in c.quote for c in CLAIMS) and len(table) == len(CLAIMS) + 2
    assert set(cells) == {cells[0]}, [(c, line[:60]) for c, line in zip(cells, table) if c != cells[0]]
