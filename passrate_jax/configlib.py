"""Typed, frozen config dataclasses: declaration helpers, YAML loading, dotted overrides, validation.

Every config section is a frozen dataclass whose fields are declared with :func:`option`, which
records the allowed range or choices in the field metadata. :func:`build` turns a nested dict (from
YAML and ``key.sub=value`` overrides) into the dataclass tree and validates every field *before any
compute*, raising :class:`ConfigError` with the dotted key, the bad value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
from typing import Any, Literal

import yaml


class UserError(Exception):
    """Something the user can fix: a config key, a file, a command's input. Its message is one line naming
    the key or file, the value and the fix; the command line prints it and exits with status 2, without a
    traceback (``--debug`` or ``PASSRATE_JAX_DEBUG=1`` shows one). Bugs stay other exceptions."""


class ConfigError(UserError, ValueError):
    """A config key, type or value is invalid. The message names the dotted key and the value."""


class UserFileError(UserError, FileNotFoundError):
    """A file or directory the user named is missing or is not what it should be (a FileNotFoundError too,
    so callers that catch that keep working)."""


def option(default: Any = dataclasses.MISSING, *, ge=None, gt=None, le=None, lt=None,
           choices=None, doc: str = "", default_factory: Any = dataclasses.MISSING):
    """Declare a config field with its documentation and allowed range or choices."""
    meta = {"ge": ge, "gt": gt, "le": le, "lt": lt, "choices": choices, "doc": doc}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def section(default_cls):
    """A nested config section field defaulting to ``default_cls()``."""
    return dataclasses.field(default_factory=default_cls, metadata={"doc": default_cls.__doc__ or ""})


def _type_name(tp) -> str:
    if typing.get_origin(tp) is Literal:
        return "one of " + "|".join(str(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is not None:
        return str(tp).replace("typing.", "")
    return getattr(tp, "__name__", None) or str(tp)


def _coerce(key: str, value: Any, tp) -> Any:
    """Check ``value`` against the annotation ``tp``; return it converted (lists -> tuples, int -> float)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(key, value, arg)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(f"{key} = {value!r}: expected {_type_name(tp)}")
    if origin is Literal:
        if value not in args:
            near = difflib.get_close_matches(str(value), [str(a) for a in args], n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ConfigError(f"{key} = {value!r}: must be one of {list(args)}{hint}")
        return value
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key} = {value!r}: expected a list")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(f"{key}[{i}]", v, args[0]) for i, v in enumerate(value))
        if len(args) != len(value):
            raise ConfigError(f"{key} = {value!r}: expected a list of {len(args)} items")
        return tuple(_coerce(f"{key}[{i}]", v, a) for i, (v, a) in enumerate(zip(value, args)))
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{key} = {value!r}: expected a mapping of {tp.__name__} fields")
        return build(tp, value, prefix=key + ".")
    return _coerce_scalar(key, value, tp)


def _coerce_scalar(key: str, value: Any, tp) -> Any:
    """:func:`_coerce` for the scalar annotations (bool, int, float, str, Any)."""
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key} = {value!r}: expected true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key} = {value!r}: expected an integer")
        return value
    if tp is float:
        if isinstance(value, str):
            # YAML 1.1 reads "3e-3" (no dot) as a string; accept any plain decimal float literal.
            try:
                value = float(value.strip()) if value.strip().lower() not in ("nan", "inf", "-inf", "+inf") else value
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key} = {value!r}: expected a number")
        return float(value)
    if tp is str:
        if isinstance(value, dict):
            raise ConfigError(f"{key} = {value!r}: expected a string (YAML read the braces as a mapping: quote "
                              f"the value, e.g. {key}='{{prompt}}')")
        if not isinstance(value, str):
            raise ConfigError(f"{key} = {value!r}: expected a string")
        return value
    if tp is Any:
        return value
    raise TypeError(f"unsupported config annotation {tp!r} for {key}")


def _check_range(key: str, value: Any, meta: dict) -> None:
    if value is None:
        return
    values = value if isinstance(value, tuple) else (value,)
    for v in values:
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            continue
        if meta.get("ge") is not None and not v >= meta["ge"]:
            raise ConfigError(f"{key} = {value!r}: must be >= {meta['ge']}")
        if meta.get("gt") is not None and not v > meta["gt"]:
            raise ConfigError(f"{key} = {value!r}: must be > {meta['gt']}")
        if meta.get("le") is not None and not v <= meta["le"]:
            raise ConfigError(f"{key} = {value!r}: must be <= {meta['le']}")
        if meta.get("lt") is not None and not v < meta["lt"]:
            raise ConfigError(f"{key} = {value!r}: must be < {meta['lt']}")
    choices = meta.get("choices")
    if choices is not None and value not in choices:
        near = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise ConfigError(f"{key} = {value!r}: must be one of {list(choices)}{hint}")


def build(cls, data: dict | None, prefix: str = ""):
    """Build dataclass ``cls`` from a nested dict, validating keys, types and ranges.

    Unknown keys fail with a "did you mean" suggestion. After the fields are set, the
    dataclass's own ``validate()`` (if any) checks cross-field constraints.
    """
    data = dict(data or {})
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    for k in data:
        if k not in fields:
            near = difflib.get_close_matches(k, list(fields), n=1, cutoff=0.6)
            hint = f" (did you mean {prefix}{near[0]}?)" if near else ""
            raise ConfigError(f"unknown config key {prefix}{k}{hint}; {prefix.rstrip('.') or 'the top level'}"
                              f" has: {', '.join(sorted(fields))}")
    kwargs = {}
    for name, f in fields.items():
        key = prefix + name
        if name in data:
            value = _coerce(key, data[name], hints[name])
        elif f.default is not dataclasses.MISSING:
            value = f.default
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            value = f.default_factory()  # type: ignore[misc]
        else:
            raise ConfigError(f"missing required config key {key}")
        _check_range(key, value, f.metadata)
        kwargs[name] = value
    obj = cls(**kwargs)
    validate = getattr(obj, "validate", None)
    if validate is not None:
        try:
            validate()
        except ConfigError as e:
            raise ConfigError(f"{prefix}{e}") from None
    return obj


def validate_tree(obj, prefix: str = "") -> None:
    """Re-run range checks and ``validate()`` on an already built tree (e.g. after ``replace``)."""
    build(type(obj), to_dict(obj), prefix)


def to_dict(obj) -> Any:
    """Config tree -> plain nested dict (tuples become lists), suitable for YAML."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, tuple):
        return [to_dict(v) for v in obj]
    return obj


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"a.b.c=value"`` -> (["a", "b", "c"], value parsed as YAML)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected key.sub=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r}: empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override {key}: cannot parse value {raw!r}: {e}") from None
    return key.split("."), value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply dotted overrides to a nested dict (in a copy)."""
    import copy
    data = copy.deepcopy(data or {})
    for text in overrides:
        path, value = parse_override(text)
        node = data
        for part in path[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"override {text!r}: {part} is not a section")
            node = child
        node[path[-1]] = value
    return data


def describe(cls, prefix: str = "") -> list[str]:
    """Lines documenting every option of ``cls``: dotted key, type, default, allowed, doc."""
    lines = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = prefix + f.name
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            lines.extend(describe(tp, key + "."))
            continue
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else "required")  # type: ignore[misc]
        allowed = []
        for name, sym in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            if f.metadata.get(name) is not None:
                allowed.append(f"{sym}{f.metadata[name]}")
        if f.metadata.get("choices"):
            allowed.append(f"one of {list(f.metadata['choices'])}")
        doc = f.metadata.get("doc", "")
        lines.append(f"{key}: {_type_name(tp)} = {default!r}" + (f" [{', '.join(allowed)}]" if allowed else "")
                     + (f"  # {doc}" if doc else ""))
    return lines


def add_config_arguments(parser, without: str = "the built-in defaults") -> None:
    """``--config FILE`` and trailing ``key.sub=value`` overrides on an ``argparse`` parser, shared by every
    subcommand that takes a config (here, below the command modules, so none of them imports ``cli``);
    ``without``: what the command uses when --config is not given, for its help."""
    parser.add_argument("--config", default=None, help="a packaged preset's name (passrate-jax info --presets) or "
                                                        f"a YAML file (default: {without})")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value", help="dotted config overrides")


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


# The presets shipped inside the package (passrate_jax/configs/*.yaml; the repository's configs/ links here).
PRESET_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")


def preset_names() -> list[str]:
    """The packaged presets' names (file names without ``.yaml``), sorted."""
    if not os.path.isdir(PRESET_DIR):
        return []
    return sorted(name[:-5] for name in os.listdir(PRESET_DIR) if name.endswith(".yaml"))


def preset_summary(name: str) -> str:
    """The first line of a packaged preset's leading comment: what it runs."""
    with open(os.path.join(PRESET_DIR, f"{name}.yaml")) as f:
        for line in f:
            if line.startswith("#"):
                return line.lstrip("#").strip()
            if line.strip():
                break
    return ""


def resolve_preset(spec: str | os.PathLike, relative_to: str | None = None) -> str:
    """The file a ``--config`` value or ``base:`` names: a path (relative to ``relative_to``, the including
    file's directory, else the working directory) when it exists, else the packaged preset of that name
    (``qwen3_gsm8k``, ``qwen3_gsm8k.yaml`` and ``configs/qwen3_gsm8k.yaml`` all name it, from any
    directory). ConfigError listing the presets, with a "did you mean", when neither exists."""
    spec = os.fspath(spec)
    path = os.path.join(relative_to, spec) if relative_to and not os.path.isabs(spec) else spec
    if os.path.isfile(path):
        return os.path.abspath(path)
    directory, base = os.path.split(spec)
    name = base[:-5] if base.endswith(".yaml") else base
    names = preset_names()
    if name in names and os.path.basename(os.path.normpath(directory or "configs")) == "configs":
        return os.path.join(PRESET_DIR, f"{name}.yaml")
    near = difflib.get_close_matches(name, names, n=1)
    hint = f" (did you mean {near[0]!r}?)" if near else ""
    raise ConfigError(f"config file {path!r} does not exist and is no packaged preset{hint}; presets: "
                      f"{', '.join(names)} (passrate-jax info --presets describes them)")


def read_preset(path: str | os.PathLike, _seen: tuple = ()) -> dict:
    """A YAML preset as a dict (``path``: a file, or a packaged preset's name, see :func:`resolve_preset`).
    A top-level ``base: other.yaml`` (relative to this file, else a packaged preset) is loaded first
    and this file's keys are merged over it, section by section, so presets state only what differs."""
    path = resolve_preset(path) if not _seen else os.fspath(path)
    if path in _seen:
        raise ConfigError(f"config file {path!r}: circular base chain {' -> '.join(_seen + (path,))}")
    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except OSError as e:
        raise UserFileError(f"config file {path!r}: cannot be read ({e.strerror})") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path!r} is not valid YAML: {' '.join(str(e).split())}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path!r}: top level must be a mapping, got {type(data).__name__}")
    base = data.pop("base", None)
    if base is not None:
        if not isinstance(base, str):
            raise ConfigError(f"base = {base!r} in {path!r}: expected a file name or a preset's name")
        try:
            base_path = resolve_preset(base, relative_to=os.path.dirname(path))
        except ConfigError as e:
            raise ConfigError(f"base = {base!r} in {path!r}: {e}") from None
        data = _merge(read_preset(base_path, _seen + (path,)), data)
    return data
