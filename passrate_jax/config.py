"""The run's config tree: one frozen dataclass per section, loaded from a YAML preset plus overrides.

    cfg = load_config("configs/default.yaml", ["allocation.method=sara", "steps=20"])

Validation (keys, types, ranges, cross-field rules) happens here, before any compute.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Literal

import yaml

from passrate_jax.allocation.config import AllocationConfig, PrefixSamplingConfig
from passrate_jax.configlib import ConfigError, apply_overrides, build, option, section, to_dict
from passrate_jax.model.config import ModelConfig
from passrate_jax.rl.config import OptimizerConfig, RLConfig
from passrate_jax.sampling.config import SamplingConfig


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where prompts come from."""
    source: Literal["builtin"] = option("builtin")
    task: Literal["arithmetic", "countdown"] = option("arithmetic")
    seed: int = option(0, ge=0)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Device mesh: the product of the axis sizes must equal the device count; -1 means "the rest"."""
    data: int = option(-1, ge=-1, doc="data-parallel axis size (-1: fill)")
    fsdp: int = option(1, ge=-1, doc="fully-sharded data-parallel axis size")
    tensor: int = option(1, ge=-1, doc="tensor-parallel axis size")
    distributed: bool = option(False, doc="call jax.distributed.initialize() at start")

    def validate(self) -> None:
        sizes = (self.data, self.fsdp, self.tensor)
        if any(s == 0 for s in sizes):
            raise ConfigError(f"(data, fsdp, tensor) = {sizes}: each must be >= 1 or -1")
        if sum(s == -1 for s in sizes) > 1:
            raise ConfigError(f"(data, fsdp, tensor) = {sizes}: at most one axis may be -1")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Orbax checkpointing."""
    every_steps: int = option(10, ge=1)
    keep: int = option(3, ge=1)
    async_save: bool = option(True)


@dataclasses.dataclass(frozen=True)
class LoggingConfig:
    """Metrics output."""
    every_steps: int = option(1, ge=1)
    tensorboard: bool = option(True)
    progress_bar: bool = option(True)


@dataclasses.dataclass(frozen=True)
class Config:
    """A whole run."""
    seed: int = option(0, ge=0)
    steps: int = option(50, ge=0, doc="training steps")
    eval_every: int = option(10, ge=1)
    model: ModelConfig = section(ModelConfig)
    data: DataConfig = section(DataConfig)
    sampling: SamplingConfig = section(SamplingConfig)
    allocation: AllocationConfig = section(AllocationConfig)
    prefix_sampling: PrefixSamplingConfig = section(PrefixSamplingConfig)
    rl: RLConfig = section(RLConfig)
    optimizer: OptimizerConfig = section(OptimizerConfig)
    mesh: MeshConfig = section(MeshConfig)
    checkpoint: CheckpointConfig = section(CheckpointConfig)
    logging: LoggingConfig = section(LoggingConfig)


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Load a YAML preset (or the defaults when ``path`` is None), apply ``key.sub=value`` overrides,
    and validate. Raises :class:`ConfigError` naming the key and value on any problem."""
    data: dict = {}
    if path is not None:
        try:
            with open(path) as f:
                data = yaml.safe_load(f) or {}
        except FileNotFoundError:
            raise ConfigError(f"config file {str(path)!r} does not exist") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {str(path)!r} is not valid YAML: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {str(path)!r}: top level must be a mapping, got {type(data).__name__}")
    data = apply_overrides(data, list(overrides))
    return build(Config, data)


def dump_config(cfg: Config) -> str:
    """The resolved config as YAML."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)
