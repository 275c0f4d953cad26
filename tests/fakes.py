"""Pieces the suite's fake rollout backends share."""

import numpy as np

from passrate_jax.rollout.table import RolloutTable


class PassThroughBackend:
    """A fake rollout backend whose step holds no device state and whose contexts are the requests
    themselves; subclasses supply ``generate``, ``score`` and ``record``."""

    def open_step(self, params):
        pass

    def close_step(self, table):
        return {}

    def contexts(self, requests):
        return list(requests)


def clean_scores(rewards) -> dict:
    """A backend's ``score`` result for ``rewards`` with nothing truncated and no verifier error."""
    rewards = np.asarray(rewards, np.int64)
    return {"reward": rewards, "truncated": np.zeros(len(rewards), bool), "verifier_error": np.zeros(len(rewards), bool)}


def score_and_record(backend, requests, rollouts, table=None) -> dict:
    """What the round loop does with one round's ``rollouts`` of observed ``requests``: score them, add
    them to ``table`` (a new one if None) and record them in the backend; returns the scores."""
    table = RolloutTable() if table is None else table
    scores = backend.score(requests, rollouts)
    _, rows = table.add(requests, [True] * len(requests), scores)
    backend.record(requests, rollouts, table, rows)
    return scores
