"""Reward plugins (``data.reward_fn``): trained with on a JSONL source, isolated per answer in the verifier
pool, and rejected before any compute when they cannot be loaded."""

import json
import os
import textwrap

import numpy as np
import pytest

from passrate_jax.run import train as train_module
from passrate_jax.cli.main import main
from passrate_jax.run.config import load_config
from passrate_jax.configlib import ConfigError
from passrate_jax.data.rewards import Rewarder
from passrate_jax.data.sources import PromptRecord
from passrate_jax.run.metrics import read_jsonl

TINY = ["model.hidden_size=32", "model.intermediate_size=64", "model.num_layers=1", "model.num_heads=2",
        "model.num_kv_heads=1", "model.max_position_embeddings=128", "warm_start.enabled=false",
        "data.eval_size=4", "sampling.max_new_tokens=12", "sampling.row_buckets=[32]",
        "sampling.prefill_row_buckets=[16]", "sampling.context_buckets=[16]", "sampling.generation_buckets=[16]",
        "allocation.num_prompts=2", "allocation.group_size=4", "logging.tensorboard=false",
        "logging.progress_bar=false", "eval_every=2", "checkpoint.async_save=false", "data.verify_workers=1"]

PLUGIN = '''
import time

def score(prompt, response, reference, **fields):
    """Quarter-point rewards from the response length; checks it is handed the row's other fields."""
    if fields["tag"] != "t" + reference:
        raise AssertionError(f"fields {fields}")
    return (len(response) % 4) / 4

def moody(prompt, response, reference, **_):
    if response == "boom":
        raise ZeroDivisionError("the plugin's own bug")
    if response == "stall":
        time.sleep(60)
    if response == "odd":
        return float("nan") if prompt == "nan" else "yes"
    return response == reference

def two_args(prompt, response):
    return 1.0
'''


@pytest.fixture
def plugin(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(textwrap.dedent(PLUGIN))
    return str(path)


def write_prompts(path, n=8):
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i), "tag": f"t{2 * i}"}) + "\n")
    return str(path)


def spy_on_rewards(monkeypatch) -> tuple[list, list]:
    """Record, while ``train`` runs, each step's rollout table as the allocator saw it and the rewards of
    every row that reached the update: (steps, trained) with steps = [(table, trained groups, metrics)]."""
    steps, trained = [], []
    real_batch, real_metrics = train_module.make_train_batch, train_module.rollout_metrics

    def batch(tokens, attention_mask, loss_mask, rewards, *args, **kwargs):
        trained.append(np.asarray(rewards)[np.asarray(loss_mask).sum(1) > 0])
        return real_batch(tokens, attention_mask, loss_mask, rewards, *args, **kwargs)

    def metrics(allocator, rollouts, backend):
        out = real_metrics(allocator, rollouts, backend)
        steps.append((rollouts.table, rollouts.result.groups, out))
        return out

    monkeypatch.setattr(train_module, "make_train_batch", batch)
    monkeypatch.setattr(train_module, "rollout_metrics", metrics)
    return steps, trained


def check_success_is_reward_at_threshold(steps, threshold: float) -> np.ndarray:
    """Every observed rollout's success bit (what the allocator, its trained groups and train_accuracy
    see) is its scored reward >= ``threshold``; returns every observed score."""
    scores = []
    for table, groups, metrics in steps:
        seen = table["observed"].astype(bool)
        score, success = table["score"][seen], table["reward"][seen]
        np.testing.assert_array_equal(success, (score >= threshold).astype(int))
        assert metrics["train_accuracy"] == pytest.approx(success.mean())
        by_row = {(g, i): s for g, i, s in zip(table["group_key"][seen], table["index"][seen], success)}
        for group in groups:  # the allocator's trained groups carry the same bits
            assert all(by_row.get((group.group_key, i), bit) == bit for i, bit in enumerate(group.rewards))
        scores.append(score)
    return np.concatenate(scores)


def test_plugin_reward_trains_two_steps_on_jsonl_with_float_rewards_as_advantages(tmp_path, plugin, monkeypatch):
    data = write_prompts(tmp_path / "train.jsonl")
    cfg = load_config(None, TINY + ["steps=2", "data.source=jsonl", f"data.path={data}", f"data.eval_path={data}",
                                    f"data.reward_fn={plugin}:score", "data.reward_threshold=0.75"])
    steps, seen = spy_on_rewards(monkeypatch)
    train_module.train(cfg, str(tmp_path / "run"), progress=False, log=lambda *a: None)
    records = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2]
    assert records[-1]["verifier/verify/error"] == 0 and records[-1]["verifier/verify/timeout"] == 0
    rewards = np.concatenate(seen)
    assert seen and set(rewards.tolist()) <= {0.0, 0.25, 0.5, 0.75}
    assert {0.25, 0.5} & set(rewards.tolist()), "fractional rewards below the threshold reach the update as they are"
    scores = check_success_is_reward_at_threshold(steps, 0.75)
    assert len(steps) == 2 and {0.5, 0.75} <= set(scores.tolist()), "both sides of the threshold were scored"


def test_a_raising_or_stalling_plugin_costs_that_answer_only(plugin, caplog):
    records = [PromptRecord(i, "q", "4") for i in range(4)]
    with Rewarder(reward_fn=f"{plugin}:moody", timeout_s=2.0, workers=1) as rewarder:
        rewards = rewarder(records, ["4", "boom", "stall", "4"])
        assert rewards.tolist() == [1.0, 0.0, 0.0, 1.0]
        counts = rewarder.metrics()
        assert counts["verify/error"] == 1 and counts["verify/timeout"] == 1
        assert rewarder(records[:2], ["boom", "4"]).tolist() == [0.0, 1.0]  # the pool carries on
        assert rewarder.metrics()["verify/error"] == 2
        odd = [PromptRecord(0, "nan", "4"), PromptRecord(1, "q", "4")]
        assert rewarder(odd, ["odd", "odd"]).tolist() == [0.0, 0.0]  # NaN and a string are not rewards
        assert rewarder.metrics()["verify/error"] == 4
    tracebacks = [r.getMessage() for r in caplog.records if "Traceback" in r.getMessage()]
    assert len(tracebacks) == 1 and "ZeroDivisionError: the plugin's own bug" in tracebacks[0]


@pytest.mark.parametrize("spec, message", [
    ("{dir}/missing.py:score", "missing.py"),
    ("{dir}/broken.py:score", "importing '{dir}/broken.py' failed: ModuleNotFoundError"),
    ("{plugin}:nothing", "defines no 'nothing'"),
    ("{plugin}:two_args", "must accept (prompt, response, reference, **fields)"),
    ("no_such_package.rewards:score", "cannot import module 'no_such_package.rewards'"),
])
def test_an_unloadable_plugin_fails_before_compute_naming_it(tmp_path, plugin, capsys, spec, message):
    spec, message = spec.format(dir=tmp_path, plugin=plugin), message.format(dir=tmp_path)
    (tmp_path / "broken.py").write_text("import no_such_module_here\n\ndef score(prompt, response, reference, **_):\n"
                                        "    return 1.0\n")
    data = write_prompts(tmp_path / "train.jsonl")
    run_dir = tmp_path / "run"
    assert main(["train", "--run-dir", str(run_dir), "data.source=jsonl", f"data.path={data}",
                 f"data.reward_fn={spec}"]) == 2
    err = capsys.readouterr().err
    assert f"data.reward_fn = {spec!r}" in err and message in err
    assert not os.path.exists(run_dir)


def test_plugin_replaces_the_verifier_and_is_not_for_environments(plugin):
    with pytest.raises(ConfigError, match="give one"):
        load_config(None, [f"data.reward_fn={plugin}:score", "data.verifier=exact"])
    with pytest.raises(ConfigError, match="not used with source env"):
        load_config(None, [f"data.reward_fn={plugin}:score", "data.source=env"])


EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples")


def test_readme_example_reward_scores_final_answers_and_format():
    from passrate_jax.plugins import load_reward_fn
    reward = load_reward_fn(os.path.join(EXAMPLES, "reward_fn.py") + ":reward")
    assert reward("2+2=", "2+2\n=> 4", "4") == 1.0
    assert reward("q", "so the answer is 1,234.", "1234") == 1.0
    assert reward("2+2=", "=> 5", "4") == 0.1
    assert reward("2+2=", "four", "4") == 0.0


def test_guide_shows_the_example_plugins_as_they_are_tested():
    """The guide's "your own task" code blocks are the example files the tests run, verbatim."""
    guide = open(os.path.join(EXAMPLES, "..", "docs", "guide.md")).read()
    for name in ("reward_fn.py", "guess_env.py"):
        source = open(os.path.join(EXAMPLES, name)).read()
        assert f"```python\n# examples/{name}\n{source}```" in guide, name


def test_a_plugin_named_by_module_runs_in_the_pool(tmp_path, monkeypatch):
    (tmp_path / "my_task_rewards.py").write_text("def graded(prompt, response, reference, **_):\n"
                                                 "    return 0.25 if response == reference else False\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # spawned workers inherit the parent's sys.path
    records = [PromptRecord(i, "q", "4") for i in range(2)]
    with Rewarder(reward_fn="my_task_rewards:graded", workers=1) as rewarder:
        assert rewarder(records, ["4", "5"]).tolist() == [0.25, 0.0]
        assert rewarder.metrics()["verify/error"] == 0
