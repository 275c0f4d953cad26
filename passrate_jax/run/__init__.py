"""A run: the config tree, the session, training, the warm start, evaluation, checkpoints, metrics, trackers."""
