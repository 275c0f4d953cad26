"""Static model settings: one frozen dataclass covering Llama 3, Qwen2 and Qwen3 shapes."""

from __future__ import annotations

import dataclasses
from typing import Literal

from passrate_jax.configlib import ConfigError, option


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama 3 RoPE frequency scaling ("llama3" rope_type). ``factor == 1`` with type "none" disables it."""
    rope_type: Literal["none", "llama3", "linear"] = option("none", doc="RoPE scaling kind")
    factor: float = option(1.0, gt=0, doc="frequency scaling factor")
    low_freq_factor: float = option(1.0, gt=0)
    high_freq_factor: float = option(4.0, gt=0)
    original_max_position_embeddings: int = option(8192, ge=1)


LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """Low-rank adapters W + (alpha / rank) A B on the named projections; rank 0 turns them off. With
    adapters on, the update trains (and the optimizer holds state for) the adapters only."""
    rank: int = option(0, ge=0, doc="adapter rank r (0: no adapters, train every weight)")
    alpha: float = option(16.0, gt=0, doc="adapter scale numerator: the update is (alpha / rank) A B")
    targets: tuple[str, ...] = option(LORA_TARGETS, doc="projections that get adapters, among "
                                                        "q, k, v, o (attention) and gate, up, down (MLP)")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank if self.rank else 0.0

    def validate(self) -> None:
        unknown = [t for t in self.targets if t not in LORA_TARGETS]
        if unknown or (self.rank and not self.targets):
            raise ConfigError(f"targets = {list(self.targets)}: choose among {list(LORA_TARGETS)} "
                              "(at least one when lora.rank > 0)")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Decoder-only transformer shape. ``pretrained`` names a Hugging Face checkpoint directory;
    when set, the shape comes from its config.json and the fields here (but the dtypes) are ignored."""
    pretrained: str | None = option(None, doc="Hugging Face checkpoint directory (config.json, *.safetensors)")
    vocab_size: int = option(128, ge=2)
    hidden_size: int = option(128, ge=1)
    intermediate_size: int = option(384, ge=1)
    num_layers: int = option(4, ge=1)
    num_heads: int = option(4, ge=1)
    num_kv_heads: int = option(2, ge=1)
    head_dim: int | None = option(None, ge=1, doc="None: hidden_size // num_heads")
    rope_theta: float = option(10000.0, gt=0)
    rope_scaling: RopeScaling = dataclasses.field(default_factory=RopeScaling)
    rms_norm_eps: float = option(1e-6, gt=0)
    max_position_embeddings: int = option(2048, ge=1)
    tie_embeddings: bool = option(True, doc="share the input embedding with the output projection")
    attention_bias: bool = option(False, doc="q/k/v projection biases (Qwen2)")
    qk_norm: bool = option(False, doc="per-head RMSNorm on q and k (Qwen3)")
    dtype: Literal["float32", "bfloat16"] = option("float32", doc="compute dtype")
    param_dtype: Literal["float32", "bfloat16"] = option("float32", doc="parameter storage dtype")
    lora: LoRAConfig = dataclasses.field(default_factory=LoRAConfig)
    scan_layers: bool = option(True, doc="run the layers under one lax.scan over stacked weights (compile time "
                                         "flat in depth); false unrolls them (same weights, same results; compile "
                                         "time grows with depth, and decode runs in per-layer cache buffers, "
                                         "measured 1.3-1.5x the scanned decode of a 6-layer model on CPU)")
    remat: Literal["none", "full", "dots"] = option(
        "none", doc="activation rematerialisation of each layer in the update: none keeps every activation, full "
                    "keeps only the layer inputs, dots also keeps matmul outputs without a batch dimension")

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads

    def validate(self) -> None:
        try:
            self.lora.validate()
        except ConfigError as e:
            raise ConfigError(f"lora.{e}") from None
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_kv_heads = {self.num_kv_heads}: must divide num_heads = "
                              f"{self.num_heads}")
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ConfigError(f"hidden_size = {self.hidden_size}: must be divisible by num_heads = "
                              f"{self.num_heads} when head_dim is not set")
        if self.resolved_head_dim % 2:
            raise ConfigError(f"head_dim = {self.resolved_head_dim}: must be even for RoPE")
