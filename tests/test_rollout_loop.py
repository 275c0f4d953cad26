"""The host round loop against the rollout backend protocol, without a model: honest observations.

- A verifier that raises costs only the answer that raised (reward 0, counted), never the round.
- An environment replay that fails its determinism check is sent to the allocator as not observed
  (``Result.observed`` False), left out of the update and counted; the step's other rollouts stand.
"""

import types

import numpy as np

from passrate_jax.allocation import Allocator, Prefix, Request, StepResult, TrainGroup
from passrate_jax.allocation.config import AllocationConfig, PrefixSamplingConfig
from passrate_jax.envs.episodes import Rollout
from passrate_jax.envs.replay import Turn, TurnCodec
from passrate_jax.rollout.env import EnvRollouts
from passrate_jax.rollout.loop import collect_rollouts, rollout_metrics
from passrate_jax.rollout.text import TextRollouts, score_each
from passrate_jax.sampling.prefix_store import PrefixStore
from passrate_jax.text.tokenizer import CharTokenizer
from tests.test_envs import NoisyCalculator

EOS = 2


class StubSampler:
    """Row j of context c generates ids (group key + 10, j + 10, EOS): every answer is known in advance."""

    def kv_store(self, params):
        return PrefixStore(params)

    def generate(self, contexts, *, seed, store):
        rows = [(c, ctx.first_sample_index + j) for c, ctx in enumerate(contexts) for j in range(ctx.num_samples)]
        ids = [[contexts[c].context_id + 10, j + 10, EOS] for c, j in rows]
        return types.SimpleNamespace(context_index=np.array([c for c, _ in rows]), stopped=np.ones(len(rows), bool),
                                     completion=lambda row: ids[row])


def _answer(text: str) -> tuple[int, int]:
    group, index = text.split()[:2]
    return int(group) - 10, int(index) - 10


def verify(prompts, texts):
    """Reward 1 when group + rollout index is even; raises on rollout 2 of group 0, wherever it is."""
    if any(_answer(t) == (0, 2) for t in texts):
        raise RuntimeError("the verifier crashed on this answer")
    return np.array([float(sum(_answer(t)) % 2 == 0) for t in texts])


def test_score_each_isolates_the_answer_that_raises():
    texts = ["10 10", "10 12", "11 10", "11 11"]
    rewards, errors = score_each(verify, [0] * 4, texts)
    assert rewards.tolist() == [1.0, 0.0, 0.0, 1.0] and errors.tolist() == [False, True, False, False]
    rewards, errors = score_each(verify, [0, 0], ["10 10", "11 11"])  # no failure: one call, no error
    assert rewards.tolist() == [1.0, 1.0] and not errors.any()


def test_a_raising_answer_leaves_the_other_rewards_of_the_round_intact():
    allocator = Allocator(AllocationConfig(method="uniform", num_prompts=2, group_size=4), PrefixSamplingConfig(),
                          num_prompts=4)
    backend = TextRollouts(StubSampler(), lambda i: [1, 5 + i], decode=lambda ids: " ".join(map(str, ids)),
                           verify=verify, max_new_tokens=8, pad_id=0)
    ro = collect_rollouts(allocator, allocator.init(np.zeros(2, np.uint32)), backend, None, seed=0)
    table = ro.table
    rows = list(zip(table["group_key"].tolist(), table["index"].tolist()))
    assert sorted(rows) == [(g, i) for g in (0, 1) for i in range(4)]
    for (g, i), reward, error in zip(rows, table["reward"], table["verifier_error"]):
        assert (reward, error) == ((0, True) if (g, i) == (0, 2) else (int((g + i) % 2 == 0), False))
    # The allocator was told the same rewards: the trained groups carry them.
    assert {tg.group_key: tg.rewards for tg in ro.result.groups} == {0: (1, 0, 0, 0), 1: (0, 1, 0, 1)}
    m = rollout_metrics(allocator, ro, backend)
    assert m["verifier_errors"] == 1 and m["train_accuracy"] == 3 / 8 and m["valid_groups"] == 2


class PlayedEnvRollouts(EnvRollouts):
    """The environment backend with the expert's actions in place of a sampler."""

    def generate(self, starts, params, seed):
        out = []
        for s in starts:
            rollouts = []
            for j in range(s.num_samples):
                episode, turns = s.episode.fork(), []
                for action in self.task(0).solution[episode.turns:]:
                    ids = self.codec.action_ids(action)
                    o = episode.step(action)
                    turns.append(Turn(ids, [] if o.done else self.codec.observation_ids(o.observation, ids), o.error))
                    if o.done:
                        break
                rollouts.append(Rollout(episode, [], s.context_id, s.first_index + j, turns, "env"))
            out.append(rollouts)
        return out


class ScriptedAllocator:
    """Round 1: a fresh group of 2; round 2: a replay of its rollout 0 (2 rollouts); then an allocator that
    does not know about unobserved requests names both groups for training."""
    cfg = types.SimpleNamespace(group_size=2, num_prompts=2)
    ps = types.SimpleNamespace(enabled=False)

    def __init__(self):
        self.observed = []

    def start_step(self, state):
        rounds = [[Request(0, 0, 2, 0)], [Request(1, 0, 2, 0, Prefix(0, 0, 0.5, 0, True))]]
        me = self

        class Run:
            def requests(self):
                return rounds.pop(0) if rounds else []

            def observe(self, results):
                me.observed += results

            def finish(self):
                groups = [TrainGroup(r.group_key, 0, r.rewards, None, False) for r in me.observed]
                return StepResult(groups, 4, 2, [], frozenset({0, 1}), np.zeros(0), np.zeros(0)), state
        return Run()


def test_a_rejected_replay_is_sent_unobserved_and_never_trained():
    env, tok = NoisyCalculator(), CharTokenizer()
    task = env.sample(0, "train", 1, level=3)
    backend = PlayedEnvRollouts(env, [task].__getitem__, lambda i: tok.encode(task.prompt, add_bos=True),
                                TurnCodec(tok), None, max_turns=env.max_turns, max_len=256, turn_tokens=16,
                                pad_id=tok.pad_id)
    allocator = ScriptedAllocator()
    ro = collect_rollouts(allocator, "state", backend, None, seed=0)
    fresh, replayed = allocator.observed
    assert fresh.observed and fresh.rewards == (1, 1)  # the expert solves the task
    assert not replayed.observed and replayed.group_key == 1  # nothing generated, nothing to learn from
    assert [g.group_key for g in ro.result.groups] == [0]  # the rejected group is not trained on
    assert ro.table.unobserved_groups() == {1} and backend.store.groups[1].rejected
    m = rollout_metrics(allocator, ro, backend)
    assert m["env/replay_rejected"] == 1 and m["train_accuracy"] == 1.0 and m["rollouts_step"] == 4
    assert m["env/turns_mean"] == len(task.solution)
