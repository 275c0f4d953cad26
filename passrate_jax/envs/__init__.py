"""Multi-turn stateful environments, and Prefix Sampling replay through execution (DESIGN.md 2.4).

- ``base.py``: the protocol (tasks, pure ``reset`` / ``step`` / ``reward``, the :class:`Episode` shell).
- ``calculator.py``, ``files.py``: the built-in environments (offline, deterministic, exact rewards).
- ``replay.py``: turn records, the assistant-turn cut, and rebuilding a prefix's state by re-execution.
- ``episodes.py``: the sampler turn loop (one sampler call per assistant turn of every live rollout).
- ``passrate_jax/rollout/env.py``, ``env_data.py``: the trajectory store, update batch, prompt source, expert warm
  start and held-out evaluation of env runs (in the rollout layer, above these environments).
- ``resolve_env``: ``data.env`` to an environment, built-in or the user's class (``passrate_jax/plugins.py``).
"""

from passrate_jax.envs.base import Environment, EnvTask, Episode, StepOutcome, Transition
from passrate_jax.envs.calculator import CalculatorEnv
from passrate_jax.envs.files import FilesEnv

# The built-in environments by the name ``data.env`` takes.
ENVS: dict[str, Environment] = {"calculator": CalculatorEnv(), "files": FilesEnv()}


def resolve_env(name: str, field: str = "data.env") -> Environment:
    """The environment ``data.env`` names: a built-in by name, or a user's class ``"path/file.py:ClassName"``
    (``passrate_jax.plugins.load_environment``: imported and checked once, the same instance every time)."""
    from passrate_jax.plugins import is_plugin_spec, load_environment

    if is_plugin_spec(name):
        return load_environment(name, field)
    if name not in ENVS:
        from passrate_jax.configlib import ConfigError
        raise ConfigError(f"{field} = {name!r}: not a built-in environment ({', '.join(ENVS)}) nor "
                          "'path/to/file.py:ClassName'")
    return ENVS[name]


__all__ = ["ENVS", "CalculatorEnv", "EnvTask", "Environment", "Episode", "FilesEnv", "StepOutcome", "Transition",
           "resolve_env"]
