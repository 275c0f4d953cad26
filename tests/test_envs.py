"""Multi-turn environments: tasks, transitions, error observations, replay through execution (state
rebuilt at every turn, non-determinism rejected), assistant-turn cuts and the loss masks of the batch."""

import itertools
import json
import random
import string

import numpy as np
import pytest

from passrate_jax.allocation import Prefix, Request, TrainGroup
from passrate_jax.run.config import load_config
from passrate_jax.configlib import ConfigError
from passrate_jax.envs import ENVS, CalculatorEnv, Episode, EnvTask, Transition
from passrate_jax.envs.replay import expert_trajectory
from passrate_jax.envs.episodes import Rollout
from passrate_jax.envs.replay import Turn, TurnCodec, cut_turns, replay, trajectory_tokens, turn_ids
from passrate_jax.rollout.env import EnvRollouts
from passrate_jax.text.tokenizer import CharTokenizer
from tests.fakes import score_and_record

TOK = CharTokenizer()
CODEC = TurnCodec(TOK)


class NoisyCalculator(CalculatorEnv):
    """A calculator made non-deterministic on purpose: every observation carries a global call count,
    as an environment with a clock, a random seed or outside state would."""
    calls = itertools.count()

    def step(self, task, state, action):
        t = super().step(task, state, action)
        return t._replace(observation=f"{t.observation} #{next(self.calls)}")


def play(env, task, actions, *, truncate_at=None, max_turns=None):
    """Execute ``actions`` as a policy would have written them; returns the turns and the state after
    every turn (states[0]: after reset). ``truncate_at``: that turn's action ran out of budget (no "\\n")."""
    episode = Episode(env, task, max_turns)
    episode.reset()
    states, turns = [episode.state], []
    for t, action in enumerate(actions):
        ids = CODEC.action_ids(action)
        if t == truncate_at:
            ids = ids[:-1]
        outcome = episode.step(action)
        turns.append(Turn(ids, [] if outcome.done else CODEC.observation_ids(outcome.observation, ids), outcome.error))
        states.append(episode.state)
        if outcome.done:
            break
    return turns, states, episode


@pytest.mark.parametrize("name", sorted(ENVS))
def test_tasks_are_deterministic_split_and_solved_by_the_expert(name):
    env = ENVS[name]
    train = [env.sample(0, "train", i) for i in range(300)]
    heldout = [env.sample(0, "heldout", i) for i in range(100)]
    assert train[:20] == [env.sample(0, "train", i) for i in range(20)]
    assert not {t.prompt for t in train} & {t.prompt for t in heldout}
    assert {t.level for t in train} == set(range(1, env.levels + 1))
    assert {t.level for t in (env.sample(0, "train", i, max_level=2) for i in range(50))} == {1, 2}
    for task in train + heldout:
        assert EnvTask.from_json(json.loads(json.dumps(task.to_json()))) == task
        turns = expert_trajectory(env, task, CODEC)  # raises unless the expert solves it
        assert len(turns) == task.level + 1 and not any(t.error for t in turns)
        assert len(task.prompt) + len(turn_ids(turns)) < 160  # short enough for the character model


def test_calculator_state_changes_with_actions():
    env = ENVS["calculator"]
    task = next(t for t in (env.sample(0, "train", i, level=2) for i in range(100)))
    turns, states, episode = play(env, task, task.solution)
    assert [len(s.registers) for s in states] == [0, 1, 2, 2]
    assert states[-1].answer == task.spec[0] and episode.reward == 1.0
    _, _, wrong = play(env, task, ["add 1 1", "answer r1"])
    assert wrong.done and wrong.reward == (1.0 if task.spec[0] == 2 else 0.0)
    assert json.loads(json.dumps(env.state_json(states[2])))["registers"] == list(states[2].registers)


def test_files_edits_change_the_files_and_done_checks_them():
    env = ENVS["files"]
    task = env.sample(0, "train", 0, level=3)
    turns, states, episode = play(env, task, task.solution)
    assert len(set(states)) == len(states)  # every edit (and done) changed the state
    assert dict(states[-1].files) == dict(task.spec[1]) and episode.reward == 1.0
    _, _, early = play(env, task, ["done"])
    assert early.done and early.reward == 0.0
    obs = [TOK.decode(t.observation).strip() for t in turns[:-1]]
    assert all("=" in o or o.endswith("deleted") for o in obs)


@pytest.mark.parametrize("name", sorted(ENVS))
def test_malformed_actions_are_error_observations_and_the_episode_continues(name):
    env = ENVS[name]
    task = env.sample(0, "train", 5)
    rng = random.Random(0)
    garbage = ["", " ", "add", "add 1", "mul r9 2", "answer", "answer r7", "write", "write z abc", "append q x",
               "write a ABC", "delete e", "copy a", "done now", "add 1 2 3", "sub 1234567 1", "rm -rf /",
               "__import__('os')", "\x00", "write a " + "x" * 40] + [
        "".join(rng.choice(string.printable) for _ in range(rng.randint(0, 20))) for _ in range(300)]
    for action in garbage:
        episode = Episode(env, task, max_turns=1000)
        episode.reset()
        before = episode.state
        outcome = episode.step(action)  # never raises, whatever the text
        assert isinstance(outcome.observation, str) and "\n" not in outcome.observation
        TOK.encode(outcome.observation)  # observations never echo model text, so they always encode
        if outcome.error:
            assert outcome.observation.startswith("err: ") and episode.state == before and not outcome.done
    # An episode of nothing but errors runs to the turn limit and scores 0.
    episode = Episode(env, task)
    episode.reset()
    outcomes = [episode.step("???") for _ in range(env.max_turns)]
    assert all(o.error for o in outcomes) and outcomes[-1].done and outcomes[-1].truncated
    assert episode.errors == env.max_turns and episode.reward == 0.0
    with pytest.raises(RuntimeError):
        episode.step("???")


def test_cut_turns_bounds():
    assert cut_turns(0, 0.5) == cut_turns(1, 0.9) == 0
    for t in range(2, 12):
        for r in np.linspace(0.0, 1.0, 21):
            k = cut_turns(t, r)
            assert 1 <= k <= t - 1 and (k == int(np.floor(r * t)) or k in (1, t - 1))


def _mixed_actions(env, task):
    """The expert's actions with a malformed one and a harmless extra one spliced in."""
    sol = list(task.solution)
    extra = "add 1 1" if env.name == "calculator" else "write e q"
    return sol[:1] + ["bogus action", extra] + sol[1:-1] + ["delete e"] * (env.name == "files") + sol[-1:]


@pytest.mark.parametrize("name", sorted(ENVS))
def test_replay_rebuilds_the_state_at_every_turn(name):
    env = ENVS[name]
    for index in range(40):
        task = env.sample(0, "train", index)
        turns, states, _ = play(env, task, _mixed_actions(env, task), truncate_at=1, max_turns=20)
        assert any(t.error for t in turns) and len(turns) >= 4
        for t in range(len(turns)):
            rebuilt = replay(env, task, turns[:t], CODEC, 20)
            assert not rebuilt.rejected, (task.prompt, t, rebuilt.mismatch_turn)
            assert rebuilt.episode.state == states[t] and rebuilt.episode.turns == t
            assert env.state_json(rebuilt.episode.state) == env.state_json(states[t])


def test_nondeterministic_environment_is_detected_and_the_replay_rejected():
    env = NoisyCalculator()
    task = env.sample(0, "train", 3, level=3)
    turns, _, _ = play(env, task, task.solution)
    assert replay(env, task, turns[:0], CODEC).episode is not None  # no turn replayed: nothing to compare
    rebuilt = replay(env, task, turns[:2], CODEC)
    assert rebuilt.rejected and rebuilt.mismatch_turn == 1
    # The same recorded turns replay faithfully in the deterministic environment they came from ...
    det_turns, _, _ = play(ENVS["calculator"], task, task.solution)
    assert not replay(ENVS["calculator"], task, det_turns[:2], CODEC).rejected
    # ... and a recorded observation that was tampered with is caught too.
    det_turns[1] = Turn(det_turns[1].action, CODEC.observation_ids("r2=12345", det_turns[1].action))
    assert replay(ENVS["calculator"], task, det_turns[:2], CODEC).mismatch_turn == 2


def _store(env, tasks, width_buckets=(64, 128, 256)):
    """The environment backend without a sampler: these tests play the rollouts themselves."""
    prompts = [TOK.encode(t.prompt, add_bos=True) for t in tasks]
    return EnvRollouts(env, tasks.__getitem__, prompts.__getitem__, CODEC, None, max_turns=env.max_turns,
                       max_len=256, turn_tokens=16, pad_id=TOK.pad_id, width_buckets=width_buckets)


def _rollouts(env, task, start, action_lists):
    """Rollouts continuing ``start`` with the given actions (as if sampled)."""
    out = []
    for j, actions in enumerate(action_lists):
        episode = start.episode.fork()
        turns = []
        for a in actions:
            ids = CODEC.action_ids(a)
            o = episode.step(a)
            turns.append(Turn(ids, [] if o.done else CODEC.observation_ids(o.observation, ids), o.error))
            if o.done:
                break
        out.append(Rollout(episode, [], start.context_id, start.first_index + j, turns, "env"))
    return out


def test_prefix_cut_at_turn_boundaries_and_masks_zero_on_replayed_turns_and_observations():
    env = ENVS["calculator"]
    task = next(t for t in (env.sample(0, "train", i, level=4) for i in range(200)))
    store = _store(env, [task])
    src = Request(group_key=0, prompt_id=0, num_rollouts=2, first_index=0)
    [start] = store.contexts([src])
    assert start.context == store.prompt_ids(0) and start.episode.turns == 0
    sol = list(task.solution)
    played = [_rollouts(env, task, start, [sol, ["nonsense"] + sol])]
    assert store.score([src], played)["reward"].tolist() == [1, 1]
    score_and_record(store, [src], played)
    # Re-rollout group from rollout 1 (T = 6 turns) at ratio 0.4: floor(2.4) = 2 turns replayed.
    req = Request(group_key=1, prompt_id=0, num_rollouts=2, first_index=0,
                  prefix=Prefix(source_group=0, source_rollout=1, cut_ratio=0.4, bucket=0, success=True))
    [start] = store.contexts([req])
    assert start.episode.turns == 2 and start.episode.errors == 1
    assert start.episode.state == env.step(task, env.reset(task)[0], sol[0]).state  # rebuilt, not pasted
    replayed = store.store.groups[1].prefix
    assert [CODEC.action_text(t.action) for t in replayed] == ["nonsense", sol[0]]
    assert start.context == store.prompt_ids(0) + turn_ids(replayed)
    played = [_rollouts(env, task, start, [sol[1:], ["answer 0"]])]
    scores = store.score([req], played)
    # Episode lengths count the replayed turns: 2 replayed + the rest of the solution; 2 + 1.
    assert scores["turns"].tolist() == [2 + len(sol) - 1, 3] and scores["action_errors"].tolist() == [0, 0]
    score_and_record(store, [req], played)
    groups = [TrainGroup(0, 0, (1, 1), None, False), TrainGroup(1, 0, tuple(scores["reward"].tolist()),
                                                                req.prefix, True)]
    arrays = store.store.batch(groups, rows=8)
    for row, (g, i) in enumerate([(0, 0), (0, 1), (1, 0), (1, 1)]):
        rec = store.store.groups[g]
        ids, mask = trajectory_tokens(store.prompt_ids(0), rec.prefix, rec.trajectories[i])
        assert arrays["tokens"][row, :len(ids)].tolist() == ids
        assert arrays["loss_mask"][row, :len(ids)].tolist() == mask and arrays["loss_mask"][row, len(ids):].sum() == 0
        # Mask 1 exactly on the generated actions: the masked-in text is their text, in order.
        picked = TOK.decode([t for t, m in zip(ids, mask) if m])
        assert picked == "".join(TOK.decode(t.action) for t in rec.trajectories[i])
        # The prompt and every replayed turn (actions included) are context.
        context = len(store.prompt_ids(0)) + len(turn_ids(rec.prefix))
        assert sum(mask[:context]) == 0 and (g == 0 or context > len(store.prompt_ids(0)))
        # Every observation is 0.
        pos = context
        for t in rec.trajectories[i]:
            assert all(mask[pos:pos + len(t.action)]) and not any(mask[pos + len(t.action):pos + len(t.action)
                                                                       + len(t.observation)])
            pos += len(t.action) + len(t.observation)
    assert arrays["group_ids"][:4].tolist() == [0, 0, 1, 1] and arrays["loss_mask"][4:].sum() == 0
    # The trajectories survive a JSON round trip (they are checkpointed).
    again = _store(env, [task])
    again.store.load_json(json.loads(json.dumps(store.store.to_json())))
    assert again.store.groups == store.store.groups


def test_store_rejects_a_replay_in_a_nondeterministic_environment():
    env = NoisyCalculator()
    task = env.sample(0, "train", 1, level=3)
    store = _store(env, [task], width_buckets=(256,))
    src = Request(0, 0, 1, 0)
    score_and_record(store, [src], [_rollouts(env, task, store.contexts([src])[0], [list(task.solution)])])
    req = Request(1, 0, 3, 0, Prefix(0, 0, 0.5, 0, True))
    assert store.contexts([req]) == [None] and store.store.groups[1].rejected
    assert store.contexts([req]) == [None]  # rejected once, not replayed again
    with pytest.raises(ValueError, match="rejected"):
        store.store.batch([TrainGroup(1, 0, (0, 0, 0), req.prefix, False)], rows=4)


def test_turn_codec_handles_truncated_and_quitting_turns():
    ids = TOK.encode("add 1 2")
    assert CODEC.action_text(ids) == CODEC.action_text(ids + [CODEC.newline_id]) == "add 1 2"
    assert TOK.decode(CODEC.observation_ids("r1=3", ids)) == "\nr1=3\n"  # the line break the action lacked
    assert TOK.decode(CODEC.observation_ids("r1=3", ids + [CODEC.newline_id])) == "r1=3\n"
    assert CODEC.quits(ids + [TOK.eos_id]) and not CODEC.quits(ids)
    assert CODEC.action_text([5, 200, 6]) == TOK.decode([5, 6])  # ids beyond the vocabulary have no text


def test_env_config_validation_names_the_key():
    cfg = load_config(None, ["data.source=env", "data.env=files", "data.max_level=0", "data.train_size=16"])
    assert cfg.data.resolved_verifier == "exact"
    with pytest.raises(ConfigError, match="max_level = 9"):
        load_config(None, ["data.source=env", "data.max_level=9"])
    with pytest.raises(ConfigError, match="data.env = 'shell'"):
        load_config(None, ["data.source=env", "data.env=shell"])
    with pytest.raises(ConfigError, match="chat_template"):
        load_config(None, ["data.source=env", "data.chat_template=true"])


def test_step_is_a_pure_function_of_the_state():
    env = ENVS["calculator"]
    task = env.sample(0, "train", 0)
    state, _ = env.reset(task)
    t = env.step(task, state, "add 2 3")
    assert isinstance(t, Transition) and t.observation == "r1=5" and not t.error and not t.done
    assert env.step(task, state, "add 2 3") == t and state == env.reset(task)[0]  # nothing mutated
    assert env.step(task, t.state, "mul r1 r1").observation == "r2=25"
