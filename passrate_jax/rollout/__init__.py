"""The rollout layer: the step's allocation loop, the text and environment backends, rollout metrics."""
