"""Multi-turn stateful environments, and Prefix Sampling replay through execution (DESIGN.md 2.4).

- ``base.py``: the protocol (tasks, pure ``reset`` / ``step`` / ``reward``, the :class:`Episode` shell).
- ``calculator.py``, ``files.py``: the built-in environments (offline, deterministic, exact rewards).
- ``replay.py``: turn records, the assistant-turn cut, and rebuilding a prefix's state by re-execution.
- ``episodes.py``: the sampler turn loop (one sampler call per assistant turn of every live rollout).
- ``rollouts.py`` / ``loop.py``: the trajectory store, update batch and host step loop for env runs.
- ``data.py``: the prompt source, the expert warm start and held-out evaluation of env runs.
"""

from passrate_jax.envs.base import Environment, EnvTask, Episode, StepOutcome, Transition
from passrate_jax.envs.calculator import CalculatorEnv
from passrate_jax.envs.files import FilesEnv

# The built-in environments by the name ``data.env`` takes.
ENVS: dict[str, Environment] = {"calculator": CalculatorEnv(), "files": FilesEnv()}

__all__ = ["ENVS", "CalculatorEnv", "EnvTask", "Environment", "Episode", "FilesEnv", "StepOutcome", "Transition"]
