"""Pieces the suite's fake rollout backends share."""

import numpy as np


class PassThroughBackend:
    """A fake rollout backend whose step holds no device state and whose contexts are the requests
    themselves; subclasses supply ``generate``, ``score`` and ``record``."""

    def open_step(self, params):
        pass

    def close_step(self):
        return {}

    def contexts(self, requests):
        return list(requests)


def clean_scores(rewards) -> dict:
    """A backend's ``score`` result for ``rewards`` with nothing truncated and no verifier error."""
    rewards = np.asarray(rewards, np.int64)
    return {"reward": rewards, "truncated": np.zeros(len(rewards), bool), "verifier_error": np.zeros(len(rewards), bool)}
