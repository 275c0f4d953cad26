"""Environments end to end: the sampler's turn loop (shared first-turn prefill, batch-independent
samples), a few training steps on each environment with Prefix Sampling on, exact resume, a
non-deterministic environment caught during training, and (slow) the documented longer run.

A tiny random model solves nothing, so the fast runs wrap the environment in :class:`CoinFlipEnv`:
same transitions and observations, but a reward hashed from the actions taken, so groups are mixed and
every path (PS replay through execution, masks, update, checkpoint) runs. The real rewards are tested
in test_envs.py; the slow test trains on them.
"""

import dataclasses
import hashlib
import itertools
import os
import subprocess
import sys

import numpy as np
import pytest

from passrate_jax.run.config import load_config
from passrate_jax.envs import ENVS, Episode
from passrate_jax.envs.episodes import Start, run_episodes
from passrate_jax.envs.replay import TurnCodec
from passrate_jax.rollout.env import EnvRollouts
from passrate_jax.run.metrics import read_jsonl
from passrate_jax.run.train import NONDETERMINISTIC_METRICS, train

TINY = ["model.hidden_size=32", "model.intermediate_size=64", "model.num_layers=1", "model.num_heads=2",
        "model.num_kv_heads=1", "model.max_position_embeddings=256", "warm_start.enabled=false",
        "data.source=env", "data.max_level=0", "data.train_size=64", "data.eval_size=4", "data.max_turns=3",
        "sampling.max_new_tokens=10", "sampling.row_buckets=[32]", "sampling.prefill_row_buckets=[32]",
        "sampling.context_buckets=[256]", "sampling.generation_buckets=[16]", "allocation.num_prompts=4",
        "allocation.group_size=4", "allocation.method=uniform", "prefix_sampling.enabled=true",
        "logging.tensorboard=false", "logging.progress_bar=false", "eval_every=2", "checkpoint.async_save=false"]


class CoinFlipEnv:
    """``inner``'s transitions and observations, with a reward hashed from the actions taken."""

    def __init__(self, inner):
        self.inner, self.name, self.levels, self.max_turns = inner, inner.name, inner.levels, inner.max_turns

    def sample(self, *args, **kwargs):
        return self.inner.sample(*args, **kwargs)

    def reset(self, task):
        state, observation = self.inner.reset(task)
        return (state, ""), observation

    def step(self, task, state, action):
        t = self.inner.step(task, state[0], action)
        return t._replace(state=(t.state, f"{state[1]}|{action}"))

    def reward(self, task, state):
        return float(hashlib.blake2b(f"{task.task_id}{state[1]}".encode(), digest_size=1).digest()[0] % 2)

    def state_json(self, state):
        return [self.inner.state_json(state[0]), state[1]]


class NoisyEnv(CoinFlipEnv):
    """Made non-deterministic on purpose: every observation carries a global call count."""
    calls = itertools.count()

    def step(self, task, state, action):
        t = super().step(task, state, action)
        return t._replace(observation=f"{t.observation} #{next(self.calls)}")


def _tiny_sampler():
    from passrate_jax.model import create_model
    from passrate_jax.sampling.sampler import Sampler
    from passrate_jax.text.tokenizer import CharTokenizer
    cfg = load_config(None, TINY)
    tok = CharTokenizer()
    return Sampler(create_model(cfg.model, seed=0), dataclasses.replace(cfg.sampling, max_new_tokens=10),
                   eos_id=tok.eos_id, pad_id=tok.pad_id), tok


def test_turn_loop_shares_the_first_prefill_and_samples_independently_of_the_batch():
    sampler, tok = _tiny_sampler()
    env, codec = ENVS["calculator"], TurnCodec(tok)
    tasks = [env.sample(0, "train", i) for i in range(2)]

    def starts(which):
        out = []
        for i in which:
            episode = Episode(env, tasks[i], max_turns=3)
            episode.reset()
            out.append(Start(episode, tok.encode(tasks[i].prompt, add_bos=True), 4, context_id=10 + i))
        return out

    calls = []
    real_live, real_extend = sampler.generate_live, sampler.extend_live
    sampler.generate_live = lambda contexts, **kw: calls.append(contexts) or real_live(contexts, **kw)
    sampler.extend_live = lambda live, parents, contexts, **kw: calls.append(contexts) or real_extend(
        live, parents, contexts, **kw)
    both = run_episodes(sampler, sampler.params, starts([0, 1]), codec, seed=3, turn_tokens=10, max_len=256)
    # Turn 1: one context per start, shared by its 4 rollouts (one prefill each); then one per live rollout.
    assert [(c.num_samples, c.first_sample_index) for c in calls[0]] == [(4, 0), (4, 0)]
    assert all(c.num_samples == 1 for call in calls[1:] for c in call) and len(calls) <= 3
    assert len(calls[1]) == sum(not r.ended or len(r.turns) > 1 for r in both)
    for r in both:
        assert 1 <= len(r.turns) <= 3 and r.episode.done and r.ended in ("env", "limit", "quit", "length")
        assert r.context == list(tok.encode(tasks[r.context_id - 10].prompt, add_bos=True)) + [
            i for t in r.turns[:-1] for i in t.action + t.observation]
    # Appending each observation to the live caches gives the rollouts of re-prefilling every turn's
    # whole conversation (the turn loop as it was before live rows).
    sampler.generate_live = lambda contexts, live_len, **kw: (sampler.generate(contexts, **kw), None)
    sampler.extend_live = lambda live, parents, contexts, **kw: (sampler.generate(contexts, **kw), live)
    again = run_episodes(sampler, sampler.params, starts([0, 1]), codec, seed=3, turn_tokens=10, max_len=256)
    assert [[t.action for t in r.turns] for r in again] == [[t.action for t in r.turns] for r in both]
    assert sum(len(r.turns) > 1 for r in both) >= 2  # later turns really ran from live rows
    sampler.generate_live, sampler.extend_live = real_live, real_extend
    # Each start on its own gives the same rollouts: samples depend on (seed, context id, index) only.
    alone = [r for i in (1, 0) for r in run_episodes(sampler, sampler.params, starts([i]), codec, seed=3,
                                                     turn_tokens=10, max_len=256)]
    key = lambda r: (r.context_id, r.sample_index)  # noqa: E731
    assert {key(r): [t.action for t in r.turns] for r in alone} == {key(r): [t.action for t in r.turns] for r in both}


def _replayed_starts(monkeypatch):
    """Record (prefix cut ratio, replayed turns, source turns) of every PS start the store builds."""
    seen = []
    real = EnvRollouts._start

    def start(self, request):
        s = real(self, request)
        if request.prefix is not None and s is not None:
            src = self.store.groups[request.prefix.source_group].trajectories[request.prefix.source_rollout]
            seen.append((request.prefix.cut_ratio, s.episode.turns, len(src)))
        return s
    monkeypatch.setattr(EnvRollouts, "_start", start)
    return seen


def _scored_episodes(monkeypatch):
    """Per scoring call, (reward, tokens of the generated actions, cut off) of each episode, read from
    the episodes themselves as ``EnvRollouts.score`` receives them."""
    seen = []
    real = EnvRollouts.score

    def score(self, requests, rollouts):
        seen.append([(r.reward, sum(len(t.action) for t in r.turns), r.ended in ("limit", "length"))
                     for rs in rollouts for r in rs])
        return real(self, requests, rollouts)
    monkeypatch.setattr(EnvRollouts, "score", score)
    return seen


@pytest.mark.parametrize("name", sorted(ENVS))
def test_a_few_steps_on_each_environment_with_prefix_sampling(tmp_path, monkeypatch, name):
    monkeypatch.setitem(ENVS, name, CoinFlipEnv(ENVS[name]))
    seen = _replayed_starts(monkeypatch)
    episodes = _scored_episodes(monkeypatch)
    cfg = load_config(None, TINY + [f"data.env={name}", "steps=3", "logging.samples_every=1"])
    summary = train(cfg, str(tmp_path), progress=False, log=lambda *a: None)
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3] and summary["step"] == 3
    records = records[1:]
    _assert_rewards_lengths_and_samples(records, episodes, read_jsonl(tmp_path / "samples.jsonl"))
    for r in records:
        assert r["env/replay_rejected"] == 0 and r["env/error_observations"] > 0  # a random model's actions
        assert 1 <= r["env/turns_mean"] <= 3 and "ps/ratio/1" in r
        assert np.isfinite(r["update/loss"])
        # Turns after the first append to live caches: the conversation is never prefilled again.
        assert r["prefill_tokens"] <= r["context_tokens"] < r["unshared_prefill_tokens"]
    assert sum(r["replay_groups"] for r in records) > 0
    assert any(k.startswith("ps/pass_rate/") for r in records for k in r)
    # Replays cut whole assistant turns: floor(r * T) clipped to [1, T - 1] of the source's T turns.
    # (A source that ended after one turn, e.g. by end-of-sequence, has nothing to replay: 0 turns.)
    assert all(t == (min(max(int(np.floor(ratio * src)), 1), src - 1) if src >= 2 else 0) for ratio, t, src in seen)
    assert any(1 <= t < src for _, t, src in seen)
    assert records[-1]["compilations/update"] <= 2


def _assert_rewards_lengths_and_samples(records, episodes, samples):
    """An environment run's rewards, lengths and samples, as a text run's (run/observe.py): each step's
    record against the episodes scored in it (held-out evaluation runs its episodes without the backend)."""
    calls = iter(episodes)
    for r in records:
        step = []
        while len(step) < r["answers_scored"]:
            step += next(calls)
        ep = np.array(step, float)
        assert len(ep) == r["answers_scored"]
        assert r["reward/mean"] == pytest.approx(ep[:, 0].mean()) and r["reward/std"] == pytest.approx(ep[:, 0].std())
        assert r["response/length_mean"] == pytest.approx(ep[:, 1].mean())
        assert r["response/length_max"] == ep[:, 1].max()
        assert r["response/truncated_fraction"] == pytest.approx(ep[:, 2].mean())
        assert 0 < r["response/length_max"] <= 3 * 10  # data.max_turns x sampling.max_new_tokens
    assert next(calls, None) is None
    assert {s["step"] for s in samples} == {1, 2, 3}
    assert all(set(s) == {"step", "prompt", "completion", "reward"} for s in samples)
    # A completion is the episode after its prompt: actions, each answered by the environment's observation.
    assert all(s["prompt"] and "\n" in s["completion"] and s["reward"] in (0.0, 1.0) for s in samples)


def test_env_run_resumes_exactly(tmp_path, monkeypatch):
    monkeypatch.setitem(ENVS, "files", CoinFlipEnv(ENVS["files"]))
    base = TINY + ["data.env=files", "checkpoint.every_steps=1"]
    train(load_config(None, base + ["steps=4"]), str(tmp_path / "full"), progress=False, log=lambda *a: None)
    train(load_config(None, base + ["steps=2"]), str(tmp_path / "cut"), progress=False, log=lambda *a: None)
    messages = []
    train(load_config(None, base + ["steps=4"]), str(tmp_path / "cut"), progress=False, log=messages.append)
    assert any("resuming" in m for m in messages)
    a, b = (read_jsonl(tmp_path / d / "metrics.jsonl") for d in ("full", "cut"))
    strip = lambda rs: [{k: v for k, v in r.items() if k not in NONDETERMINISTIC_METRICS} for r in rs]  # noqa: E731
    assert strip(a) == strip(b) and sum(r.get("replay_groups", 0) for r in b[3:]) > 0


def test_nondeterministic_environment_is_rejected_during_training(tmp_path, monkeypatch):
    monkeypatch.setitem(ENVS, "calculator", NoisyEnv(ENVS["calculator"]))
    accepted = _replayed_starts(monkeypatch)
    cfg = load_config(None, TINY + ["data.env=calculator", "steps=3"])
    train(cfg, str(tmp_path), progress=False, log=lambda *a: None)
    records = read_jsonl(tmp_path / "metrics.jsonl")[1:]
    assert sum(r["env/replay_rejected"] for r in records) > 0
    # No replay with a turn to compare got through (only a source too short to cut replays nothing),
    # and training went on without the rejected groups.
    assert all(turns == 0 for _, turns, _ in accepted) and records[-1]["step"] == 3
    assert all(np.isfinite(r["update/loss"]) for r in records if r["groups_trained"])


@pytest.mark.slow
# env_files is absent on purpose: its warm start does not reach competence (docs/runs.md), so RL has no signal.
@pytest.mark.parametrize("preset", ["env_calculator.yaml"])
def test_documented_longer_run(tmp_path, preset):
    """The command of docs/guide.md: warm start on expert trajectories (cached), then RL with PS on. Reports held-out
    success before and after and each PS bucket's re-rollout pass rate (first and last five steps)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    subprocess.run([sys.executable, "-m", "passrate_jax.cli.main", "train", "--config", f"configs/{preset}", "--run-dir",
                    str(tmp_path), "--no-progress"], check=True, cwd=root, timeout=3600)
    records = read_jsonl(tmp_path / "metrics.jsonl")
    before, after = records[0]["eval_accuracy"], records[-1]["eval_accuracy"]
    print(f"{preset}: held-out success {before:.3f} -> {after:.3f}")
    for key in sorted({k for r in records for k in r if k.startswith("ps/pass_rate/")}):
        rates = [r[key] for r in records if key in r]
        print(f"  {key}: first 5 steps {np.mean(rates[:5]):.3f}, last 5 steps {np.mean(rates[-5:]):.3f}")
    assert after > before
