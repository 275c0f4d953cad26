"""Environment plugins (``data.env: "file.py:ClassName"``): the README's example environment trains with
Prefix Sampling replay through execution, its expert solves every task, and a class that misses the
protocol is refused before compute."""

import os

import numpy as np
import pytest

from passrate_jax.config import load_config
from passrate_jax.configlib import ConfigError
from passrate_jax.envs import Episode, resolve_env
from passrate_jax.envs.base import split_of
from passrate_jax.metrics import read_jsonl
from passrate_jax.train import train

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "examples", "guess_env.py") + ":GuessEnv"
TINY = ["model.hidden_size=32", "model.intermediate_size=64", "model.num_layers=1", "model.num_heads=2",
        "model.num_kv_heads=1", "model.max_position_embeddings=256", "warm_start.enabled=false",
        "data.source=env", "data.train_size=64", "data.eval_size=4", "data.max_turns=4",
        "sampling.max_new_tokens=8", "sampling.row_buckets=[32]", "sampling.prefill_row_buckets=[32]",
        "sampling.context_buckets=[256]", "sampling.generation_buckets=[16]", "allocation.num_prompts=4",
        "allocation.group_size=4", "allocation.method=uniform", "prefix_sampling.enabled=true",
        "logging.tensorboard=false", "logging.progress_bar=false", "eval_every=2", "checkpoint.async_save=false"]


def test_plugin_environment_trains_two_steps_with_prefix_sampling_replay(tmp_path):
    cfg = load_config(None, TINY + [f"data.env={EXAMPLE}", "steps=2"])
    summary = train(cfg, str(tmp_path), progress=False, log=lambda *a: None)
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2] and summary["step"] == 2
    steps = records[1:]
    assert all(r["env/replay_rejected"] == 0 for r in steps), "a deterministic plugin passes the replay check"
    assert sum(r["replay_groups"] for r in steps) > 0, "groups were replayed through execution"
    assert 0 < np.mean([r["train_accuracy"] for r in steps]) < 1
    assert all(np.isfinite(r["update/loss"]) for r in steps if r["groups_trained"])


def test_example_environment_expert_solves_every_task_within_the_turn_limit():
    env = resolve_env(EXAMPLE)
    assert env is resolve_env(EXAMPLE)  # loaded once
    for split in ("train", "heldout"):
        for i in range(40):
            task = env.sample(0, split, i)
            assert split_of(env.name, task.prompt) == split
            episode = Episode(env, task)
            episode.reset()
            outcomes = [episode.step(a) for a in task.solution]
            assert outcomes[-1].done and episode.reward == 1.0 and len(task.solution) <= env.max_turns
    assert env.step(task, (), "no digits").error and env.reward(task, ()) == 0.0


def test_a_class_missing_the_protocol_is_refused_before_compute(tmp_path):
    (tmp_path / "bad_env.py").write_text("class Half:\n    name = 'half'\n    def reset(self, task): ...\n")
    with pytest.raises(ConfigError, match=r"^data.env = .*bad_env.py:Half.*lacks sample, step, reward, state_json"):
        load_config(None, ["data.source=env", f"data.env={tmp_path}/bad_env.py:Half"])
    with pytest.raises(ConfigError, match="^data.env = 'calculater': not a built-in environment"):
        load_config(None, ["data.source=env", "data.env=calculater"])


def test_editing_a_plugin_environment_invalidates_its_cached_warm_start(tmp_path):
    from passrate_jax.envs.data import warm_start_key
    from passrate_jax.sft import cache_key
    path = tmp_path / "env.py"
    path.write_text(open(EXAMPLE.rpartition(":")[0]).read())
    cfg = load_config(None, ["data.source=env", f"data.env={path}:GuessEnv"])
    before = cache_key(cfg, warm_start_key(cfg))
    path.write_text(path.read_text().replace("max_turns = 5", "max_turns = 6"))
    assert cache_key(cfg, warm_start_key(cfg)) != before
    from passrate_jax.plugins import fingerprint
    assert fingerprint("calculator") == "calculator"  # built-in environments keep their cached warm starts
