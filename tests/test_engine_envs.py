"""Environments on the slot engine: an episode keeps its decode row from its first turn to its end, each
later turn appended to that row's cache (``engine.extend``), and the engine's episodes are round mode's."""

import numpy as np
import pytest

from passrate_jax.envs import ENVS, Episode
from passrate_jax.envs.episodes import Start, run_episodes
from passrate_jax.envs.replay import TurnCodec
from passrate_jax.rollout.env import EnvRollouts
from passrate_jax.run.config import load_config
from passrate_jax.run.metrics import read_jsonl
from passrate_jax.run.train import NONDETERMINISTIC_METRICS, train
from tests.test_envs_train import TINY, CoinFlipEnv, _tiny_sampler

ENGINE_COUNTERS = {"sampler_calls", "slot_utilization", "rollouts/speculative", "rollouts/speculative_unused",
                   "rollouts/aborted", "tokens/wasted"}


def _starts(env, tok, tasks, samples):
    out = []
    for i, task in enumerate(tasks):
        episode = Episode(env, task, max_turns=3)
        episode.reset()
        out.append(Start(episode, tok.encode(task.prompt, add_bos=True), samples, context_id=10 + i))
    return out


def _episodes(rollouts):
    return {(r.context_id, r.sample_index): ([t.action for t in r.turns], [t.observation for t in r.turns],
                                             r.ended, r.reward) for r in rollouts}


@pytest.mark.parametrize("slots,chunk", [(4, 3), (16, 16)])
def test_engine_episodes_equal_round_modes(slots, chunk):
    """3 starts x 4 rollouts through the engine (4 slots: rollouts wait for rows, turns span chunks; 16
    slots: all at once) give round mode's episodes: the same actions, observations, ends and rewards.
    Fails if a later turn is keyed differently, if the appended ids miss the turn's last token, or if a
    row's cache is not the episode's."""
    sampler, tok = _tiny_sampler()
    env, codec = ENVS["calculator"], TurnCodec(tok)
    tasks = [env.sample(0, "train", i) for i in range(3)]
    rounds = run_episodes(sampler, sampler.params, _starts(env, tok, tasks, 4), codec, seed=3, turn_tokens=10,
                          max_len=256)
    backend = EnvRollouts(env, tasks.__getitem__, lambda i: tok.encode(tasks[i].prompt, add_bos=True), codec,
                          sampler, max_turns=3, max_len=256, turn_tokens=10, pad_id=tok.pad_id, slots=slots,
                          chunk_tokens=chunk)
    backend.open_step(sampler.params)
    stream = backend.stream(sampler.params, seed=3)
    for s in _starts(env, tok, tasks, 4):
        stream.add(s, tag=s.context_id)
    delivered = []
    while not stream.idle:
        delivered += stream.advance()
    engine = [r for _, _, r in delivered]
    assert sorted((tag, index) for tag, index, _ in delivered) == sorted((r.context_id, r.sample_index)
                                                                        for r in rounds)
    assert _episodes(engine) == _episodes(rounds)
    assert sum(len(r.turns) > 1 for r in engine) >= 3  # later turns really ran in their rows
    assert stream.pool.generated == sum(stream.length(r) for r in engine)
    assert 0 < stream.counters()["slot_utilization"] <= 1


def test_env_training_on_the_engine_equals_round_mode(tmp_path, monkeypatch):
    """Three steps of a calculator run with Prefix Sampling (replays rebuilt through the environment) on
    the engine write round mode's metrics rows, the engine's own counters and timings aside: rewards,
    losses, turns, replays, held-out accuracy, and the prefill counters (each later turn's appended ids
    counted as round mode counts them). Fails if the engine's episodes differ from round mode's."""
    monkeypatch.setitem(ENVS, "calculator", CoinFlipEnv(ENVS["calculator"]))
    rows = {}
    for engine in ("rounds", "slots"):
        cfg = load_config(None, [*TINY, "data.env=calculator", "steps=3", f"sampling.engine={engine}",
                                 "sampling.slots=8", "sampling.chunk_tokens=4"])
        train(cfg, str(tmp_path / engine), progress=False, log=lambda *a: None)
        rows[engine] = read_jsonl(tmp_path / engine / "metrics.jsonl")
    # unshared_prefill_tokens counts a context once per sampler call that samples from it: a start whose
    # rollouts enter the pool in two inserts counts twice (as for text answers on the engine).
    skip = set(NONDETERMINISTIC_METRICS) | ENGINE_COUNTERS | {"unshared_prefill_tokens"}
    assert [r["step"] for r in rows["slots"]] == [r["step"] for r in rows["rounds"]] == [0, 1, 2, 3]
    for a, b in zip(rows["rounds"], rows["slots"]):
        keys = {k for k in a if k not in skip and not k.startswith(("time/", "compil", "decode/"))}
        assert {k: a[k] for k in keys} == {k: b.get(k) for k in keys}
    assert sum(r.get("replay_groups", 0) for r in rows["slots"]) > 0
    assert all(r["sampler_calls"] > 1 for r in rows["slots"][1:])
