"""A newcomer's journeys, run as a user runs them: the ``passrate-jax`` command in a subprocess, from a
directory outside the checkout (``tmp_path``), on a tiny random Qwen3 checkpoint that
examples/make_tiny_model.py writes with transformers. Each journey ends in a working run or in one
clear line: the table of bad inputs asserts exit status 2, one line on stderr naming the key or file,
and no traceback."""

import json
import os
import subprocess
import sys

import pytest

from passrate_jax.cli.main import main
from passrate_jax.run.config import dump_config, load_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Sizes that keep a run of the tiny preset to seconds of compute (the preset's own are already small).
FAST = ["steps=2", "eval_every=2", "logging.tensorboard=false", "logging.samples_every=1",
        "checkpoint.async_save=false"]
# The default preset shrunk to a toy model, for journeys that start from it.
TINY_DEFAULT = ["model.hidden_size=32", "model.intermediate_size=64", "model.num_layers=1", "model.num_heads=2",
                "model.num_kv_heads=1", "model.max_position_embeddings=128", "sampling.max_new_tokens=12",
                "sampling.store_contexts=0", "sampling.row_buckets=[32]", "sampling.prefill_row_buckets=[16]",
                "sampling.context_buckets=[32]", "sampling.generation_buckets=[16]", "allocation.num_prompts=2",
                "allocation.group_size=4", "data.verify_workers=1"] + FAST


def cli(args, cwd, env=None, timeout=600, pythonpath=REPO) -> subprocess.CompletedProcess:
    """``passrate-jax ARGS`` run in ``cwd`` with this checkout first on the path (the shared environment
    also holds an editable install of another tree)."""
    # The suite's compile cache comes with os.environ (tests/conftest.py exports it): the journeys' runs
    # compile the same tiny programs. A cache of its own here once mixed entries written without JAX's
    # LRU bookkeeping with the suite's LRU settings, and JAX's warnings about it broke the one-line checks.
    full_env = {**os.environ, "PYTHONPATH": pythonpath, "PASSRATE_JAX_DEBUG": "", **(env or {})}
    return subprocess.run([sys.executable, "-m", "passrate_jax.cli.main", *args], cwd=cwd, env=full_env,
                          capture_output=True, text=True, timeout=timeout)


def assert_one_line_error(result, *names):
    lines = [line for line in result.stderr.splitlines() if line.strip() and not line.startswith("warning:")]
    assert result.returncode == 2, (result.returncode, result.stderr[-3000:])
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert len(lines) == 1, result.stderr
    for name in names:
        assert name in lines[0], (name, lines[0])
    return lines[0]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A directory outside the checkout with tiny_qwen3/ and tiny_data/, and one finished
    two-step run of the tiny preset in runs/tiny (the journeys below read it)."""
    home = tmp_path_factory.mktemp("newcomer")
    made = subprocess.run([sys.executable, os.path.join(REPO, "examples", "make_tiny_model.py")], cwd=home,
                          capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr[-3000:]
    run = cli(["train", "--config", "tiny_own_model", "--run-dir", "runs/tiny", "--no-progress", *FAST], home)
    assert run.returncode == 0, run.stderr[-5000:]
    return home, run


def test_help_version_and_presets_by_name(tmp_path):
    top = cli(["--help"], tmp_path)
    assert top.returncode == 0 and top.stdout.count("passrate-jax train --config") >= 3
    version = cli(["--version"], tmp_path)
    assert version.returncode == 0 and version.stdout.startswith("passrate-jax 0.")
    presets = cli(["info", "--presets"], tmp_path)
    names = {line.split()[0] for line in presets.stdout.splitlines() if line and not line.startswith("(")}
    assert {"default", "qwen3_gsm8k", "sara", "tiny_own_model"} <= names
    assert all(len(line.split(maxsplit=1)) == 2 for line in presets.stdout.splitlines()), "one description each"
    # base: NAME in the user's own YAML, and --config NAME, resolve to the packaged presets from here.
    (tmp_path / "mine.yaml").write_text("base: sara\nsteps: 7\n")
    info = cli(["info", "--config", "mine.yaml", "model.num_layers=1"], tmp_path)
    assert info.returncode == 0, info.stderr[-3000:]
    assert "method: sara" in info.stdout and "steps: 7" in info.stdout


def test_bare_train_trains_the_default_preset_and_says_so(tmp_path, monkeypatch, capsys):
    """Bare ``passrate-jax train`` is ``train --config default``, announced in one line; overrides without
    --config still apply to the built-in defaults. The training itself is replaced, so only the command's
    choice of config and run directory is run."""
    from passrate_jax.cli import train as train_command

    class Started(Exception):
        pass

    def started(cfg, run_dir, **kwargs):
        raise Started(cfg, run_dir)
    monkeypatch.setattr(train_command, "train", started)
    monkeypatch.chdir(tmp_path)
    runs = {}
    for name, argv in (("bare", ["train"]), ("named", ["train", "--config", "default"]),
                       ("overrides", ["train", "data.train_size=64"])):
        with pytest.raises(Started) as run:
            main(argv)
        runs[name] = (*run.value.args, capsys.readouterr().out)
    assert runs["bare"][:2] == runs["named"][:2] == (load_config("default"), os.path.join("runs", "default"))
    assert runs["overrides"][:2] == (load_config(None, ["data.train_size=64"]), os.path.join("runs", "default"))
    assert runs["bare"][2].strip() == ("no --config: training the packaged preset 'default' "
                                       "(passrate-jax info --presets lists the others)")
    assert runs["named"][2] == runs["overrides"][2] == ""


def test_own_model_trains_and_says_where_its_files_are(tiny):
    home, run = tiny
    run_dir = home / "runs" / "tiny"
    for name in ("metrics.jsonl", "samples.jsonl", "plots", "checkpoints"):
        assert name in run.stdout and (run_dir / name).exists(), name
    assert str(run_dir / "plots" / "accuracy_vs_rollouts.png").endswith(".png")
    assert (run_dir / "plots" / "accuracy_vs_rollouts.png").exists()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    step = records[-1]
    for key in ("reward/mean", "reward/std", "response/length_mean", "response/length_max",
                "response/truncated_fraction", "verifier_errors", "verifier_timeouts", "eval_accuracy"):
        assert key in step, key
    assert 0 < step["response/length_max"] <= 8 and 0 <= step["response/truncated_fraction"] <= 1
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert {s["step"] for s in samples} == {1, 2}
    assert all(set(s) == {"step", "prompt", "completion", "reward"} for s in samples)
    assert all(s["prompt"].endswith("=") and s["reward"] in (0.0, 0.25, 1.0) for s in samples)


def test_eval_export_generate_plot_of_the_run(tiny):
    home, _ = tiny
    evaluated = cli(["eval", "--run-dir", "runs/tiny", "--num-samples", "0", "--k", "1"], home)
    assert evaluated.returncode == 0 and "greedy held-out accuracy" in evaluated.stdout, evaluated.stderr[-3000:]
    exported = cli(["export", "--run-dir", "runs/tiny", "--out", "exported"], home)
    assert exported.returncode == 0 and (home / "exported" / "model.safetensors").exists(), exported.stderr[-3000:]
    generated = cli(["generate", "--model", "exported", "--prompt", "3+4=", "--max-new-tokens", "4"], home)
    assert generated.returncode == 0 and "--- sample 0" in generated.stdout, generated.stderr[-3000:]
    assert_one_line_error(cli(["generate", "--model", "runs/tiny", "--prompt", "1"], home),
                          "--model 'runs/tiny'", "passrate-jax export --run-dir runs/tiny")
    plotted = cli(["plot", "--run-dir", "runs/tiny"], home)
    assert plotted.returncode == 0 and "accuracy_vs_rollouts.png" in plotted.stdout


def write_sums(path, count=8, answer=lambda a, b: f"{a} plus {b}\n#### {a + b}"):
    with open(path, "w") as f:
        for i in range(count):
            f.write(json.dumps({"question": f"{i % 9 + 1}+{i % 7 + 1}=", "answer": answer(i % 9 + 1, i % 7 + 1)}) + "\n")


def test_own_data_on_the_default_preset_in_one_flag(tmp_path):
    write_sums(tmp_path / "sums.jsonl")
    run = cli(["train", "--config", "default", "--no-progress", "data.source=jsonl", "data.path=sums.jsonl",
               "data.prompt_field=question", "data.reference_extract=gsm8k", *TINY_DEFAULT], tmp_path)
    assert run.returncode == 0, run.stderr[-5000:]
    warnings = [line for line in (run.stderr + run.stdout).splitlines() if line.startswith("warning:")]
    dropped = [line for line in warnings if "dropped" in line]
    assert len(dropped) == 1 and "data.max_level=6" in dropped[0] and "warm_start.misread_rate=0.85" in dropped[0]
    assert any("data.eval_path" in line for line in warnings), "no held-out file: one warning"
    records = [json.loads(line) for line in (tmp_path / "runs" / "default" / "metrics.jsonl").read_text().splitlines()]
    assert not any(k.startswith("eval_") for r in records for k in r), "no held-out prompts: no (nan) accuracy"


REWARDS = """
import zlib
def broken(prompt, response, reference, **fields):
    return 1 / 0
def moody(prompt, response, reference, **fields):
    if zlib.crc32(response.encode()) % 3 == 0:
        raise ValueError("moody")
    return 0.5
"""


def test_a_raising_reward_function_stops_the_run_with_one_line(tiny):
    home, _ = tiny
    (home / "rewards_bad.py").write_text(REWARDS)
    run = cli(["train", "--config", "tiny_own_model", "--run-dir", "runs/broken", "--no-progress",
               "data.reward_fn=rewards_bad.py:broken", *FAST], home)
    line = assert_one_line_error(run, "data.reward_fn = 'rewards_bad.py:broken'", "every answer of step 1",
                                 "ZeroDivisionError: division by zero", "rewards_bad.py:4")
    assert "16 of 16" in line
    assert not (home / "runs" / "broken").exists(), "a run stopped before its first checkpoint leaves nothing"


def test_an_occasionally_raising_reward_function_is_counted_in_the_summary(tiny):
    home, _ = tiny
    (home / "rewards_moody.py").write_text(REWARDS)
    run = cli(["train", "--config", "tiny_own_model", "--run-dir", "runs/moody", "--no-progress",
               "data.reward_fn=rewards_moody.py:moody", *FAST], home)
    assert run.returncode == 0, run.stderr[-5000:]
    steps = [json.loads(line) for line in (home / "runs/moody/metrics.jsonl").read_text().splitlines()]
    records = steps[1:]
    errors = sum(r["verifier_errors"] for r in records)
    answers = sum(r["answers_scored"] for r in records)
    assert 0 < errors < answers
    # One counter per cause, the same everywhere: training and evaluation counts add up to the running count.
    evaluating = sum(r.get("eval_verifier_errors", 0) for r in [steps[0], *records])
    assert evaluating > 0 and records[-1]["verifier/verify/error"] == errors + evaluating
    assert f"data.reward_fn = 'rewards_moody.py:moody' raised on {errors} of {answers} answers" in run.stdout


def test_a_run_that_trains_no_group_says_so(tiny):
    home, _ = tiny
    (home / "rewards_zero.py").write_text("def zero(prompt, response, reference, **fields):\n    return 0.0\n")
    run = cli(["train", "--config", "tiny_own_model", "--run-dir", "runs/zero", "--no-progress",
               "data.reward_fn=rewards_zero.py:zero", *FAST], home)
    assert run.returncode == 0, run.stderr[-5000:]
    assert "this run trained no group in 2 steps" in run.stdout


def test_bad_input_through_the_command_fails_in_one_line_and_debug_shows_the_traceback(tmp_path):
    args = ["train", "data.source=jsonl", "data.path=missing.jsonl"]
    assert_one_line_error(cli(args, tmp_path), "data.path = 'missing.jsonl': no such file")
    for debug in (cli(["--debug", *args], tmp_path), cli(args, tmp_path, env={"PASSRATE_JAX_DEBUG": "1"})):
        assert debug.returncode != 0 and "Traceback (most recent call last)" in debug.stderr
    assert not (tmp_path / "runs").exists()


def _bad_inputs(d):
    """(argv, names the line must hold) for each bad input, with the files it needs written under ``d``."""
    write_sums(d / "sums.jsonl")
    (d / "empty.jsonl").write_text("\n")
    (d / "typo.jsonl").write_text(json.dumps({"questoin": "1+1=", "answer": "#### 2"}) + "\n")
    (d / "plain.jsonl").write_text(json.dumps({"question": "1+1=", "answer": 2}) + "\n")
    (d / "malformed.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": \n')
    (d / "no_fields.py").write_text("def score(prompt, response, reference):\n    return 1.0\n")
    (d / "bad.yaml").write_text("steps: [1\n")
    (d / "base_typo.yaml").write_text("base: sarah\n")
    (d / "not_a_checkpoint").mkdir()
    (d / "run_without_checkpoint").mkdir()
    (d / "run_without_checkpoint" / "config.yaml").write_text(dump_config(load_config(None, ["model.num_layers=1", "data.train_size=8"])))
    file = ["data.source=jsonl"]
    return [
        (["train", "--config", "nope"], ["config file", "nope", "presets: "]),
        (["train", "--config", "bad.yaml"], ["bad.yaml", "not valid YAML"]),
        (["train", "--config", "base_typo.yaml"], ["base = 'sarah'", "did you mean 'sara'"]),
        (["train", "stpes=3"], ["stpes", "did you mean steps"]),
        (["train", *file], ["data.path"]),
        (["train", *file, "data.path=missing.jsonl"], ["data.path = 'missing.jsonl'", "no such file"]),
        (["train", *file, "data.path=sums.jsonl", "data.eval_path=gone.jsonl"], ["data.eval_path = 'gone.jsonl'"]),
        (["train", *file, "data.path=typo.jsonl"], ["typo.jsonl:1", "'questoin'", "data.prompt_field=questoin"]),
        (["train", *file, "data.path=sums.jsonl"], ["sums.jsonl:1", "data.prompt_field=question"]),
        (["train", *file, "data.path=empty.jsonl"], ["empty.jsonl", "no usable rows"]),
        (["train", *file, "data.path=malformed.jsonl"], ["malformed.jsonl:2", "malformed JSON"]),
        (["train", *file, "data.path=plain.jsonl", "data.prompt_field=question", "data.reference_extract=gsm8k"],
         ["plain.jsonl:1", "data.reference_extract=none"]),
        (["train", *file, "data.path=sums.jsonl", "data.max_level=3"], ["data.max_level = 3", "data.max_level=0"]),
        (["train", "model.pretrained=nowhere"], ["model.pretrained = 'nowhere'", "no such directory"]),
        (["train", "model.pretrained=not_a_checkpoint"], ["model.pretrained = 'not_a_checkpoint'", "config.json"]),
        (["train", "data.reward_fn=absent.py:score"], ["data.reward_fn", "absent.py"]),
        (["train", "data.reward_fn=no_fields.py:score"], ["data.reward_fn", "**fields"]),
        (["train", "data.source=env", "data.env=absent_env.py:Env"], ["data.env", "absent_env.py"]),
        (["eval", "--run-dir", "nowhere"], ["nowhere", "run directory"]),
        (["eval", "--run-dir", "run_without_checkpoint"], ["--run-dir", "no complete checkpoint"]),
        (["eval", "--run-dir", "run_without_checkpoint", "--k", "0,4"], ["--k 0,4", "must be >= 1"]),
        (["eval", "--run-dir", "run_without_checkpoint", "--num-samples", "-1"], ["--num-samples = -1"]),
        (["export", "--run-dir", "nowhere", "--out", "x"], ["--run-dir 'nowhere'"]),
        (["generate", "--model", "nowhere", "--prompt", "1"], ["--model 'nowhere'", "no such directory"]),
        (["generate", "--model", "run_without_checkpoint", "--prompt", "1"], ["export it first"]),
        (["generate", "--model", "not_a_checkpoint", "--prompt", "1", "--num-samples", "0"], ["--num-samples = 0"]),
        (["plot", "--run-dir", "nowhere"], ["--run-dir 'nowhere'", "no such directory"]),
    ]


def test_every_bad_input_is_one_line_with_exit_status_2(tmp_path, monkeypatch, capsys):
    """In process (the same ``main`` the command runs), so that the table stays fast; the test above runs
    one of them through a real subprocess."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PASSRATE_JAX_DEBUG", raising=False)
    cases = _bad_inputs(tmp_path)
    assert len(cases) >= 15
    for argv, names in cases:
        status = main(argv)
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.strip() and not line.startswith("warning:")]
        assert status == 2 and len(lines) == 1, (argv, status, err)
        assert "Traceback" not in err
        for name in names:
            assert name in lines[0], (argv, name, lines[0])
        assert not (tmp_path / "runs").exists(), (argv, "a failed start left a run directory behind")


def test_samples_reach_every_sink_and_a_resume_drops_those_past_its_checkpoint(tmp_path):
    from passrate_jax.run.metrics import MetricsWriter

    class Tracker:
        def __init__(self):
            self.samples = []

        def log(self, record):
            pass

        def log_samples(self, rows):
            self.samples.append(rows)

        def close(self):
            pass

    tracker = Tracker()
    writer = MetricsWriter(tmp_path, tensorboard=True, trackers=lambda d: [tracker])
    for step in (1, 2, 3):
        writer.write({"step": step, "loss": 0.5})
        writer.write_samples([{"step": step, "prompt": "1+1=", "completion": "2 | x", "reward": 1.0}])
    writer.close()
    assert [rows[0]["step"] for rows in tracker.samples] == [1, 2, 3]
    assert list((tmp_path / "tensorboard").glob("events.*")), "TensorBoard events written"
    MetricsWriter(tmp_path, tensorboard=False, truncate_after=2).close()  # a resume from step 2's checkpoint
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and rows[0]["completion"] == "2 | x"


def test_the_progress_bar_counts_reward_failures_as_the_run_goes(tmp_path):
    """The bar's ``reward_err`` is failures (errors and timeouts) over answers scored so far, shown from the
    first failing step on; a run without failures shows none."""
    from passrate_jax.run.observe import Reporter

    reporter = Reporter(load_config(None, ["logging.tensorboard=false"]), str(tmp_path), None, primary=True,
                        progress=True)
    reporter.write({"step": 0, "rollouts_total": 0})
    shown = []
    for step, errors, timeouts in ((1, 0, 0), (2, 3, 0), (3, 1, 2)):
        reporter.write({"step": step, "reward/mean": 0.5, "answers_scored": 16, "verifier_errors": errors,
                        "verifier_timeouts": timeouts})
        shown.append(reporter.bar.postfix)
    reporter.close()
    assert "reward_err" not in shown[0] and "reward=0.50" in shown[0]
    assert "reward_err=3/32" in shown[1] and "reward_err=6/48" in shown[2]
