"""Environment plugins (``data.env: "file.py:ClassName"``): the example environment of docs/guide.md trains with
Prefix Sampling replay through execution, its expert solves every task, and a class that misses the
protocol is refused before compute."""

import logging
import os

import numpy as np
import pytest

from passrate_jax.run.config import load_config
from passrate_jax.configlib import ConfigError
from passrate_jax.envs import Episode, resolve_env
from passrate_jax.envs.base import split_of
from passrate_jax.run.metrics import read_jsonl
from passrate_jax.run.train import train
from tests.fakes import score_and_record
from test_plugins import check_success_is_reward_at_threshold, spy_on_rewards

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


@pytest.mark.parametrize("spec, message", [
    ("{dir}/nope.py:GuessEnv", "file '{dir}/nope.py' does not exist"),
    ("{dir}/raises.py:GuessEnv", "importing '{dir}/raises.py' failed: RuntimeError: no GPU here"),
    ("{example}:Guess", "defines no 'Guess'"),
])
def test_an_unloadable_environment_fails_before_compute_naming_it(tmp_path, capsys, spec, message):
    from passrate_jax.cli.main import main
    (tmp_path / "raises.py").write_text("raise RuntimeError('no GPU here')\n")
    spec = spec.format(dir=tmp_path, example=EXAMPLE.rpartition(":")[0])
    assert main(["train", "--run-dir", str(tmp_path / "run"), "data.source=env", f"data.env={spec}"]) == 2
    err = capsys.readouterr().err
    assert f"data.env = {spec!r}" in err and message.format(dir=tmp_path) in err
    assert not (tmp_path / "run").exists()


def test_a_class_missing_the_protocol_is_refused_before_compute(tmp_path):
    (tmp_path / "bad_env.py").write_text("class Half:\n    name = 'half'\n    def reset(self, task): ...\n")
    with pytest.raises(ConfigError, match=r"^data.env = .*bad_env.py:Half.*lacks sample, step, reward, state_json"):
        load_config(None, ["data.source=env", f"data.env={tmp_path}/bad_env.py:Half"])
    with pytest.raises(ConfigError, match="^data.env = 'calculater': not a built-in environment"):
        load_config(None, ["data.source=env", "data.env=calculater"])


def test_editing_a_plugin_environment_invalidates_its_cached_warm_start(tmp_path):
    from passrate_jax.run.warm_start import warm_start_key
    from passrate_jax.run.sft import cache_key
    path = tmp_path / "env.py"
    path.write_text(open(EXAMPLE.rpartition(":")[0]).read())
    cfg = load_config(None, ["data.source=env", f"data.env={path}:GuessEnv"])
    before = cache_key(cfg, warm_start_key(cfg))
    path.write_text(path.read_text().replace("max_turns = 5", "max_turns = 6"))
    assert cache_key(cfg, warm_start_key(cfg)) != before
    from passrate_jax.plugins import fingerprint
    assert fingerprint("calculator") == "calculator"  # built-in environments keep their cached warm starts


# The guide's example environment with graded rewards: 1 for the number, 0.25 for any guess, 0.125 for none; and one
# that is not deterministic (its answers carry a counter), and one whose reward raises.
VARIANTS = """

import itertools

class GradedGuess(GuessEnv):
    name = "graded_guess"

    def reward(self, task, state):
        return 1.0 if state and state[-1] == task.spec[0] else 0.25 if state else 0.125


class ForgetfulGuess(GuessEnv):
    name = "forgetful_guess"
    calls = itertools.count()

    def step(self, task, state, action):
        t = super().step(task, state, action)
        return t._replace(observation=f"{t.observation} ({next(self.calls)})")


class BrokenGuess(GuessEnv):
    name = "broken_guess"

    def reward(self, task, state):
        if len(state) == 1:
            raise KeyError("the plugin's own bug")
        return float("nan") if len(state) == 2 else super().reward(task, state)
"""


@pytest.fixture
def variants(tmp_path):
    path = tmp_path / "guess_variants.py"
    path.write_text(open(EXAMPLE.rpartition(":")[0]).read() + VARIANTS)
    return str(path)


def test_graded_plugin_environment_trains_on_float_rewards_with_success_at_the_threshold(tmp_path, variants,
                                                                                         monkeypatch):
    cfg = load_config(None, TINY + [f"data.env={variants}:GradedGuess", "steps=2", "data.reward_threshold=0.2"])
    steps, trained = spy_on_rewards(monkeypatch)
    train(cfg, str(tmp_path / "run"), progress=False, log=lambda *a: None)
    scores = check_success_is_reward_at_threshold(steps, 0.2)
    assert {0.125, 0.25} <= set(scores.tolist()), "episodes on both sides of the threshold"
    rewards = set(np.concatenate(trained).tolist())
    assert 0.125 in rewards and rewards <= {0.125, 0.25, 1.0}, "the update trains on the rewards as they are"
    records = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert "eval_accuracy" in records[-1] and all(r["verifier_errors"] == 0 for r in records[1:])


def _store(env, task):
    from passrate_jax.envs.replay import TurnCodec
    from passrate_jax.rollout.env import EnvRollouts
    from passrate_jax.text.tokenizer import CharTokenizer
    tok = CharTokenizer()
    return EnvRollouts(env, [task].__getitem__, lambda i: tok.encode(task.prompt, add_bos=True), TurnCodec(tok),
                       None, max_turns=env.max_turns, max_len=256, turn_tokens=16, pad_id=tok.pad_id,
                       success_threshold=0.5, width_buckets=(256,))


def _played(store, request, action_lists):
    """Rollouts of ``request`` that play the given actions (as if sampled)."""
    from passrate_jax.envs.episodes import Rollout
    from passrate_jax.envs.replay import Turn
    [start] = store.contexts([request])
    out = []
    for j, actions in enumerate(action_lists):
        episode, turns = start.episode.fork(), []
        for a in actions:
            ids = store.codec.action_ids(a)
            o = episode.step(a)
            turns.append(Turn(ids, [] if o.done else store.codec.observation_ids(o.observation, ids), o.error))
            if o.done:
                break
        if not episode.done:
            episode.finish()
        out.append(Rollout(episode, [], start.context_id, start.first_index + j, turns, "env"))
    return [out]


def test_a_plugin_environment_that_is_not_deterministic_has_its_replays_rejected(variants):
    from passrate_jax.allocation import Prefix, Request
    for name, rejected in (("GuessEnv", False), ("ForgetfulGuess", True)):
        env = resolve_env(f"{variants}:{name}")
        task = env.sample(0, "train", 0, level=2)
        store = _store(env, task)
        source = Request(0, 0, 1, 0)
        score_and_record(store, [source], _played(store, source, [task.solution]))
        replay_request = Request(1, 0, 2, 0, Prefix(0, 0, 0.9, 0, True))
        assert (store.contexts([replay_request]) == [None]) is rejected, name
        assert store.store.groups[1].rejected is rejected and len(store.store.groups[1].prefix) >= 1


def test_a_raising_or_non_finite_environment_reward_costs_that_episode_only(variants, caplog):
    from passrate_jax.allocation import Request
    env = resolve_env(f"{variants}:BrokenGuess")
    task = next(t for t in (env.sample(0, "train", i, level=2) for i in range(50)) if len(t.solution) >= 3)
    store = _store(env, task)
    request = Request(0, 0, 4, 0)
    with caplog.at_level(logging.WARNING):
        played = _played(store, request, [task.solution, task.solution[:1], task.solution[:2], task.solution[:1]])
        scores = store.score([request], played)
    assert scores["score"].tolist() == [1.0, 0.0, 0.0, 0.0] and scores["reward"].tolist() == [1, 0, 0, 0]
    assert scores["verifier_error"].tolist() == [False, True, True, True]
    messages = [r.getMessage() for r in caplog.records if "broken_guess" in r.getMessage()]
    assert len(messages) == 1 and "KeyError: \"the plugin's own bug\"" in messages[0]
