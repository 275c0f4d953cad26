"""Decoder-only transformer (Llama 3 / Qwen2 / Qwen3) in Flax NNX and Hugging Face checkpoint I/O."""

from passrate_jax.model.config import LoRAConfig, ModelConfig, RopeScaling
from passrate_jax.model.hf_io import (CheckpointFormatError, config_from_hf, config_to_hf,
                                      load_pretrained, save_pretrained)
from passrate_jax.model.factory import create_model
from passrate_jax.model.lora import merge_lora, merged_model, reference_params
from passrate_jax.model.transformer import KVCache, Layout, Transformer, init_cache

__all__ = ["ModelConfig", "RopeScaling", "LoRAConfig", "Transformer", "Layout", "KVCache", "init_cache",
           "create_model", "load_pretrained", "save_pretrained", "merge_lora", "merged_model", "reference_params", "config_from_hf", "config_to_hf", "CheckpointFormatError"]
