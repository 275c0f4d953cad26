"""The one trajectory store (passrate_jax/rollout/store.py): a rollout's score lives in its step's table and
the store refers to it; batching, saving and loading are written once for both kinds; the backend
protocol keeps what differs between the kinds."""

import json

import numpy as np
import pytest

from passrate_jax.allocation import Request, TrainGroup
from passrate_jax.envs.replay import Turn
from passrate_jax.rollout.env import EnvKind, EnvRollouts
from passrate_jax.rollout.loop import RolloutBackend
from passrate_jax.rollout.store import TextKind, TrajectoryStore
from passrate_jax.rollout.table import RolloutTable
from passrate_jax.rollout.text import TextRollouts

PROMPTS = {0: [1, 10], 1: [1, 11, 12]}


def _step(store: TrajectoryStore, key: int, prompt: int, trajectories: list, scores: list[float]) -> RolloutTable:
    """One step's table holding one group's rollouts with ``scores``, recorded in ``store``."""
    table, req = RolloutTable(), Request(key, prompt, len(trajectories), 0)
    store.open(key, prompt, [])
    scored = np.asarray(scores, np.float32)
    _, rows = table.add([req], [True], {"reward": (scored >= 0.5).astype(np.int64), "score": scored})
    store.add([req], [trajectories], table, rows)
    return table


def test_the_batch_trains_on_the_scores_of_each_groups_own_step_table():
    store = TrajectoryStore(TextKind(), PROMPTS.__getitem__, pad_id=0, width_buckets=(8, 16))
    first = _step(store, 5, 0, [[7, 2], [8, 8, 2]], [0.25, 1.0])   # e.g. a pilot, trained a step later
    _step(store, 9, 1, [[6, 2], [6, 6, 2]], [0.0, 0.75])
    groups = [TrainGroup(5, 0, (0, 1), None, True), TrainGroup(9, 1, (0, 1), None, True)]
    arrays = store.batch(groups, rows=6)
    # The scores as the tables hold them, not the success bits (0, 1).
    assert arrays["rewards"].tolist() == [0.25, 1.0, 0.0, 0.75, 0.0, 0.0]
    assert arrays["tokens"][1, :5].tolist() == [1, 10, 8, 8, 2] and arrays["loss_mask"][1, :5].tolist() == [0, 0, 1, 1, 1]
    assert arrays["group_ids"].tolist()[:4] == [0, 0, 1, 1]
    # The store refers to the table's row: it keeps no copy of the score.
    first._columns["score"][0][0] = 0.5
    first._joined.clear()
    assert store.batch(groups, rows=6)["rewards"][0] == 0.5


def test_a_checkpointed_store_round_trips_and_reads_the_stores_of_earlier_versions():
    store = TrajectoryStore(TextKind(), PROMPTS.__getitem__, pad_id=0)
    _step(store, 5, 0, [[7, 2], [8, 8, 2]], [0.25, 1.0])
    again = TrajectoryStore(TextKind(), PROMPTS.__getitem__, pad_id=0)
    again.load_json(json.loads(json.dumps(store.to_json())))
    assert again.groups == store.groups and again.groups[5].scores() == {0: 0.25, 1: 1.0}
    # The text store's JSON before the one store: completions and rewards by rollout index.
    old = TrajectoryStore(TextKind(), PROMPTS.__getitem__, pad_id=0)
    old.load_json({"5": {"prompt": 0, "prefix": [], "completions": {"0": [7, 2], "1": [8, 8, 2]},
                         "rewards": {"0": 0.25, "1": 1.0}}})
    assert old.groups == store.groups
    # The environment store's: turns, rejected.
    turns = [[Turn([3, 4], [5], False)], [Turn([3], [], True)]]
    env = TrajectoryStore(EnvKind(), PROMPTS.__getitem__, pad_id=0)
    env.load_json({"2": {"prompt": 1, "prefix": [], "rejected": False, "rewards": {"0": 1.0, "1": 0.0},
                         "turns": {str(i): [t.to_json() for t in ts] for i, ts in enumerate(turns)}}})
    assert env.groups[2].trajectories == {0: turns[0], 1: turns[1]} and env.groups[2].scores() == {0: 1.0, 1: 0.0}
    assert env.response(2, 0) == [3, 4, 5] and env.generated_tokens(2, 0) == 2


def test_a_score_missing_from_an_old_checkpoint_trains_on_the_success_bit():
    store = TrajectoryStore(TextKind(), PROMPTS.__getitem__, pad_id=0, width_buckets=(8,))
    store.load_json({"5": {"prompt": 0, "prefix": [], "completions": {"0": [7, 2], "1": [8, 2]}}})
    assert store.batch([TrainGroup(5, 0, (0, 1), None, True)], rows=2)["rewards"].tolist() == [0.0, 1.0]


def test_the_backend_protocol_keeps_six_methods_and_both_backends_have_them():
    methods = sorted(n for n, v in vars(RolloutBackend).items() if callable(v) and not n.startswith("_"))
    assert methods == ["close_step", "contexts", "generate", "open_step", "record", "score"]
    for backend in (TextRollouts, EnvRollouts):
        assert all(callable(getattr(backend, m)) for m in methods), backend


@pytest.mark.parametrize("kind", [TextKind(), EnvKind()])
def test_the_store_batches_a_rejected_group_never(kind):
    store = TrajectoryStore(kind, PROMPTS.__getitem__, pad_id=0)
    store.open(3, 0, []).rejected = True
    with pytest.raises(ValueError, match="rejected"):
        store.batch([TrainGroup(3, 0, (0,), None, False)], rows=2)
