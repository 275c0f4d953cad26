"""Multi-turn stateful environments, and Prefix Sampling replay through execution (DESIGN.md 2.4).

- ``base.py``: the protocol (tasks, pure ``reset`` / ``step`` / ``reward``, the :class:`Episode` shell).
- ``calculator.py``, ``files.py``: the built-in environments (offline, deterministic, exact rewards).
- ``replay.py``: turn records, the assistant-turn cut, rebuilding a prefix's state by re-execution, and
  the expert's trajectory.
- ``episodes.py``: the sampler turn loop (one sampler call per assistant turn of every live rollout).
- ``resolve_env``: ``data.env`` to an environment, built-in or the user's class (``passrate_jax/plugins.py``).

Above these environments: their prompt source (``passrate_jax/data/env_source.py``), the trajectory store
and update batch of env runs (``passrate_jax/rollout/env.py``), their expert warm start and held-out
evaluation (``passrate_jax/run/warm_start.py``, ``held_out.py``).
"""

from passrate_jax.configlib import ConfigError
from passrate_jax.envs.base import Environment, EnvTask, Episode, StepOutcome, Transition
from passrate_jax.envs.calculator import CalculatorEnv
from passrate_jax.envs.files import FilesEnv
from passrate_jax.plugins import is_plugin_spec, load_environment

# The built-in environments by the name ``data.env`` takes.
ENVS: dict[str, Environment] = {"calculator": CalculatorEnv(), "files": FilesEnv()}


def resolve_env(name: str, field: str = "data.env") -> Environment:
    """The environment ``data.env`` names: a built-in by name, or a user's class ``"path/file.py:ClassName"``
    (``passrate_jax.plugins.load_environment``: imported and checked once, the same instance every time)."""
    if is_plugin_spec(name):
        return load_environment(name, field)
    if name not in ENVS:
        raise ConfigError(f"{field} = {name!r}: not a built-in environment ({', '.join(ENVS)}) nor "
                          "'path/to/file.py:ClassName'")
    return ENVS[name]


__all__ = ["ENVS", "CalculatorEnv", "EnvTask", "Environment", "Episode", "FilesEnv", "StepOutcome", "Transition",
           "resolve_env"]
