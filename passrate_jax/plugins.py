"""User code the config names: a reward function or an environment class, found by ``"where:name"``.

    fn = load_reward_fn("my_rewards.py:score")             # a file (relative to the working directory)
    fn = load_reward_fn("my_package.rewards:score")        # or an importable module
    env = load_environment("my_env.py:MazeEnv")            # a class, instantiated with no arguments

Both are resolved and checked when the config is validated, so a missing file, a name the file does
not define or a wrong signature fails before any compute with a message naming the spec. A reward
function is called as ``fn(prompt, response, reference, **fields)`` in the verifier's worker
processes (:func:`call_reward`), never in the training process: it can hang or crash only its worker.
The model's response reaches it as a string; nothing here executes model output.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

from passrate_jax.configlib import ConfigError


def is_plugin_spec(spec: str) -> bool:
    """Whether ``spec`` names user code (``where:name``) rather than a built-in by name."""
    return ":" in spec


def _split(spec: str, field: str) -> tuple[str, str]:
    where, _, name = spec.rpartition(":")
    if not where or not name.isidentifier():
        raise ConfigError(f"{field} = {spec!r}: expected 'path/to/file.py:name' or 'package.module:name'")
    return where, name


def _module(where: str, field: str, spec: str):
    """The module at file path ``where`` (a ``.py`` file) or of dotted name ``where``."""
    if where.endswith(".py"):
        path = os.path.abspath(where)
        if not os.path.isfile(path):
            raise ConfigError(f"{field} = {spec!r}: file {path!r} does not exist")
        # A name unique to the file, so two plugin files called rewards.py do not collide in sys.modules.
        name = "passrate_plugin_" + hashlib.blake2b(path.encode(), digest_size=6).hexdigest()
        if name in sys.modules:
            return sys.modules[name]
        module_spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module  # dataclasses and pickling look the module up while it executes
        try:
            module_spec.loader.exec_module(module)
        except Exception as e:
            del sys.modules[name]
            raise ConfigError(f"{field} = {spec!r}: importing {path!r} failed: {type(e).__name__}: {e}") from e
        return module
    try:
        return importlib.import_module(where)
    except Exception as e:
        raise ConfigError(f"{field} = {spec!r}: cannot import module {where!r}: {type(e).__name__}: {e}") from e


def fingerprint(spec: str) -> str:
    """``spec`` plus, for a plugin file, a hash of its content: what caches keyed by the config (the warm
    start's) must include, so that editing the file invalidates them. A built-in name is returned as is."""
    where = spec.rpartition(":")[0]
    if not (is_plugin_spec(spec) and where.endswith(".py") and os.path.isfile(where)):
        return spec
    with open(where, "rb") as f:
        return f"{spec}#{hashlib.sha256(f.read()).hexdigest()[:16]}"


def load_object(spec: str, field: str = "plugin") -> Any:
    """The object ``name`` of the file or module ``where`` in ``spec = "where:name"``; ConfigError
    naming ``field`` and the spec when it cannot be imported or does not define ``name``. A file is
    executed once per process (later calls find its module in ``sys.modules``)."""
    where, name = _split(spec, field)
    module = _module(where, field, spec)
    if not hasattr(module, name):
        raise ConfigError(f"{field} = {spec!r}: {where!r} defines no {name!r}")
    return getattr(module, name)


def check_reward_signature(fn: Any, spec: str, field: str = "data.reward_fn") -> None:
    """ConfigError unless ``fn`` can be called as ``fn(prompt, response, reference, **fields)``."""
    if not callable(fn):
        raise ConfigError(f"{field} = {spec!r}: {type(fn).__name__} is not callable")
    try:
        signature = inspect.signature(fn)
        signature.bind("prompt", "response", "reference")
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{field} = {spec!r}: must accept (prompt, response, reference, **fields): {e}") from None
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values()):
        raise ConfigError(f"{field} = {spec!r}: signature {signature} has no **fields; add **_ to ignore the "
                          "row's other fields")


def load_reward_fn(spec: str, field: str = "data.reward_fn") -> Callable[..., Any]:
    """The reward function ``spec`` names, checked (see :func:`check_reward_signature`)."""
    fn = load_object(spec, field)
    check_reward_signature(fn, spec, field)
    return fn


def call_reward(spec: str, prompt: str, response: str, reference: str, fields: Mapping[str, Any]) -> Any:
    """Run reward function ``spec`` on one answer; what the verifier pool's workers call (it must be
    importable by name, the plugin itself need not be). The worker loads the plugin once and keeps it."""
    return load_object(spec, "data.reward_fn")(prompt, response, reference, **fields)


def preload_reward(spec: str) -> None:
    """Import the plugin in a worker before its first call, so the import is not charged to an answer's timeout."""
    load_object(spec, "data.reward_fn")


_ENV_METHODS = ("sample", "reset", "step", "reward", "state_json")
_ENV_ATTRIBUTES = ("name", "levels", "max_turns")


# One instance per environment spec and process: the config check, the prompt source and the rollout
# store all see the same object.
_ENVIRONMENTS: dict[str, Any] = {}


def load_environment(spec: str, field: str = "data.env") -> Any:
    """An instance of the environment class ``spec`` names (the same object every time), checked against
    the protocol of ``passrate_jax.envs.base.Environment``."""
    if spec not in _ENVIRONMENTS:
        _ENVIRONMENTS[spec] = _environment(spec, field)
    return _ENVIRONMENTS[spec]


def _environment(spec: str, field: str) -> Any:
    cls = load_object(spec, field)
    if not inspect.isclass(cls):
        raise ConfigError(f"{field} = {spec!r}: expected a class, got {type(cls).__name__}")
    try:
        env = cls()
    except Exception as e:
        raise ConfigError(f"{field} = {spec!r}: {cls.__name__}() failed: {type(e).__name__}: {e}") from e
    missing = [m for m in _ENV_METHODS if not callable(getattr(env, m, None))]
    missing += [a for a in _ENV_ATTRIBUTES if not hasattr(env, a)]
    if missing:
        raise ConfigError(f"{field} = {spec!r}: {cls.__name__} lacks {', '.join(missing)} of the environment "
                          "protocol (passrate_jax/envs/base.py)")
    if not isinstance(env.levels, int) or env.levels < 1 or not isinstance(env.max_turns, int) or env.max_turns < 1:
        raise ConfigError(f"{field} = {spec!r}: levels = {env.levels!r} and max_turns = {env.max_turns!r} must be "
                          "integers >= 1")
    return env
