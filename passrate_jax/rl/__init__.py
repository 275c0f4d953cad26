"""The policy update: advantages, token losses, the batch record, the optimizer and the sharded step.

Modules (import them directly; this package imports nothing eagerly, because
``passrate_jax.run.config`` imports ``passrate_jax.rl.config`` and the step imports the mesh config):
``advantages``, ``losses``, ``batch``, ``optimizer``, ``train_step``, ``config``.
"""
