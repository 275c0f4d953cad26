"""Hugging Face checkpoint import/export (config.json + *.safetensors) for Llama / Qwen2 / Qwen3.

No hub access: a checkpoint is a local directory. Tensors are read one at a time with ``safetensors``
(numpy) and, when a mesh is given, placed straight into their ``NamedSharding`` so no device ever
holds a whole unsharded model.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from passrate_jax.model.config import ModelConfig, RopeScaling
from passrate_jax.model.lora import merged_model
from passrate_jax.model.transformer import Transformer
from passrate_jax.sharding import param_shardings

# architecture -> model_type written back on save
ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
_ROPE_TYPES = {"default": "none", "none": "none", "llama3": "llama3", "linear": "linear"}


class CheckpointFormatError(ValueError):
    """A checkpoint directory is missing files or tensors, or uses an unsupported feature."""


def _rope_from_hf(hf: dict) -> tuple[float, RopeScaling]:
    # transformers 5 nests theta and scaling in rope_parameters; transformers 4 has top-level
    # rope_theta plus an optional rope_scaling dict whose kind is "rope_type" (or legacy "type").
    params = hf.get("rope_parameters")
    if params:
        theta, scaling = params.get("rope_theta", hf.get("rope_theta", 10000.0)), params
    else:
        theta, scaling = hf.get("rope_theta", 10000.0), hf.get("rope_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in _ROPE_TYPES:
        raise CheckpointFormatError(f"rope_type = {kind!r}: supported are {sorted(_ROPE_TYPES)}")
    rs = RopeScaling()
    if _ROPE_TYPES[kind] != "none":
        rs = RopeScaling(
            rope_type=_ROPE_TYPES[kind], factor=float(scaling.get("factor", 1.0)),
            low_freq_factor=float(scaling.get("low_freq_factor", rs.low_freq_factor)),
            high_freq_factor=float(scaling.get("high_freq_factor", rs.high_freq_factor)),
            original_max_position_embeddings=int(scaling.get(
                "original_max_position_embeddings", rs.original_max_position_embeddings)))
    return float(theta), rs


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """Translate a Hugging Face ``config.json`` dict (transformers 4 or 5 layout) into a ModelConfig.

    Raises :class:`CheckpointFormatError` naming the architecture or feature when unsupported.
    """
    archs = hf.get("architectures") or []
    arch = archs[0] if archs else {v: k for k, v in ARCHITECTURES.items()}.get(hf.get("model_type"))
    if arch not in ARCHITECTURES:
        raise CheckpointFormatError(f"architecture {arch!r} (model_type {hf.get('model_type')!r}) is not "
                                    f"supported; supported: {sorted(ARCHITECTURES)}")
    kind = ARCHITECTURES[arch]
    if hf.get("hidden_act", "silu") != "silu":
        raise CheckpointFormatError(f"hidden_act = {hf['hidden_act']!r}: only 'silu' is supported")
    if hf.get("mlp_bias"):
        raise CheckpointFormatError("mlp_bias = true: MLP biases are not supported")
    if hf.get("use_sliding_window"):
        raise CheckpointFormatError("use_sliding_window = true: sliding-window attention is not supported")
    if kind in ("llama", "qwen3") and hf.get("attention_bias"):
        # These families put a bias on o_proj too; only Qwen2's q/k/v-only biases are implemented.
        raise CheckpointFormatError(f"attention_bias = true for {arch}: not supported")
    theta, scaling = _rope_from_hf(hf)
    heads = int(hf["num_attention_heads"])
    head_dim = hf.get("head_dim")
    if head_dim is not None and int(head_dim) * heads == int(hf["hidden_size"]):
        head_dim = None  # canonical form: only an independent head_dim is spelled out
    cfg = ModelConfig(
        vocab_size=int(hf["vocab_size"]), hidden_size=int(hf["hidden_size"]),
        intermediate_size=int(hf["intermediate_size"]), num_layers=int(hf["num_hidden_layers"]),
        num_heads=heads, num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=None if head_dim is None else int(head_dim), rope_theta=theta, rope_scaling=scaling,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=kind == "qwen2", qk_norm=kind == "qwen3")
    cfg.validate()
    return cfg


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The ``config.json`` dict for ``cfg``: Qwen3 when it has q/k norms, Qwen2 when it has biases,
    Llama otherwise. Rope settings are written in both the transformers 4 and 5 layouts."""
    if cfg.qk_norm and cfg.attention_bias:
        raise CheckpointFormatError("qk_norm together with attention_bias has no Hugging Face architecture")
    arch = ("Qwen3ForCausalLM" if cfg.qk_norm else
            "Qwen2ForCausalLM" if cfg.attention_bias else "LlamaForCausalLM")
    rs = cfg.rope_scaling
    scaling = None if rs.rope_type == "none" else {"rope_type": rs.rope_type, "factor": rs.factor}
    if rs.rope_type == "llama3":
        scaling.update(low_freq_factor=rs.low_freq_factor, high_freq_factor=rs.high_freq_factor,
                       original_max_position_embeddings=rs.original_max_position_embeddings)
    return {
        "architectures": [arch], "model_type": ARCHITECTURES[arch],
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.resolved_head_dim, "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": arch == "Qwen2ForCausalLM",
        "rope_theta": cfg.rope_theta, "rope_scaling": scaling,
        "rope_parameters": {"rope_type": rs.rope_type if scaling else "default", "rope_theta": cfg.rope_theta,
                            **(scaling or {})},
        "torch_dtype": cfg.param_dtype,
    }


def _tensor_map(cfg: ModelConfig) -> list[tuple[str, tuple, str, int | None]]:
    """(Hugging Face name, nnx state path, layout kind, layer) for every model weight; ``layer`` is the
    index into the stacked [L, ...] weight, None for the weights outside the layers."""
    entries = [("model.embed_tokens.weight", ("embed",), "copy", None),
               ("model.norm.weight", ("final_norm", "weight"), "copy", None)]
    if not cfg.tie_embeddings:
        entries.append(("lm_head.weight", ("lm_head",), "transpose", None))
    per_layer = [("input_layernorm.weight", ("input_norm", "weight"), "copy"),
                 ("post_attention_layernorm.weight", ("post_attention_norm", "weight"), "copy"),
                 ("self_attn.o_proj.weight", ("attn", "o"), "out_heads"),
                 ("mlp.gate_proj.weight", ("mlp", "gate"), "transpose"),
                 ("mlp.up_proj.weight", ("mlp", "up"), "transpose"),
                 ("mlp.down_proj.weight", ("mlp", "down"), "transpose")]
    for p in "qkv":
        per_layer.append((f"self_attn.{p}_proj.weight", ("attn", p), "in_heads"))
        if cfg.attention_bias:
            per_layer.append((f"self_attn.{p}_proj.bias", ("attn", f"{p}_bias"), "reshape"))
    if cfg.qk_norm:
        per_layer += [("self_attn.q_norm.weight", ("attn", "q_norm", "weight"), "copy"),
                      ("self_attn.k_norm.weight", ("attn", "k_norm", "weight"), "copy")]
    for i in range(cfg.num_layers):
        entries += [(f"model.layers.{i}.{name}", ("layers",) + path, kind, i) for name, path, kind in per_layer]
    return entries


def _to_model_layout(kind: str, x: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    # torch Linear stores [out, in]; our kernels are [in, ...out] with heads split out.
    if kind in ("transpose", "in_heads", "out_heads"):
        x = x.T
    return x.reshape(shape)


def _to_hf_layout(kind: str, x: np.ndarray) -> np.ndarray:
    if kind == "in_heads":
        return np.ascontiguousarray(x.reshape(x.shape[0], -1).T)
    if kind == "out_heads":
        return np.ascontiguousarray(x.reshape(-1, x.shape[-1]).T)
    if kind == "transpose":
        return np.ascontiguousarray(x.T)
    return np.ascontiguousarray(x.reshape(-1)) if kind == "reshape" else x


def _tensor_files(directory: str) -> dict[str, str]:
    """Tensor name -> safetensors file, from model.safetensors.index.json or by listing every file."""
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return {name: os.path.join(directory, file) for name, file in weight_map.items()}
    files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if not files:
        raise CheckpointFormatError(f"{directory!r}: no *.safetensors files")
    where = {}
    for path in files:
        with safe_open(path, framework="np") as f:
            where.update({name: path for name in f.keys()})
    return where


def load_pretrained(directory: str | os.PathLike, dtype=None, mesh: jax.sharding.Mesh | None = None,
                    *, param_dtype=None) -> Transformer:
    """Load a Llama / Qwen2 / Qwen3 checkpoint directory into a :class:`Transformer`.

    Args:
      directory: holds config.json and model.safetensors (or shards + model.safetensors.index.json).
      dtype: compute dtype ("float32" / "bfloat16"); default float32. Also the parameter dtype
        unless ``param_dtype`` is given.
      mesh: when given, each tensor is placed directly in its ``NamedSharding``
        (see :func:`passrate_jax.sharding.param_shardings`).
      param_dtype: parameter storage dtype; default ``dtype``.

    Raises:
      CheckpointFormatError: unsupported architecture, missing files or tensors (all named).
    """
    directory = os.fspath(directory)
    config_path = os.path.join(directory, "config.json")
    if not os.path.exists(config_path):
        raise CheckpointFormatError(f"{directory!r}: no config.json")
    with open(config_path) as f:
        cfg = config_from_hf(json.load(f))
    dtype = jnp.dtype(dtype or "float32").name
    cfg = dataclasses.replace(cfg, pretrained=directory, dtype=dtype,
                              param_dtype=jnp.dtype(param_dtype or dtype).name)

    abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    variables = dict(nnx.to_flat_state(state))
    shardings = None
    if mesh is not None:
        shardings = dict(nnx.to_flat_state(param_shardings(state, mesh)))

    files = _tensor_files(directory)
    entries = _tensor_map(cfg)
    _check_tensor_names(directory, files, entries)
    _read_tensors(files, entries, variables, shardings, cfg.num_layers)
    return nnx.merge(graphdef, state)


def _check_tensor_names(directory: str, files: dict[str, str], entries) -> None:
    """CheckpointFormatError naming the tensors the model needs that the checkpoint lacks, or those it
    holds that the model would silently drop."""
    missing = [name for name, *_ in entries if name not in files]
    if missing:
        raise CheckpointFormatError(f"{directory!r}: missing tensors {missing}")
    # A tied checkpoint may still store lm_head (transformers ties it on load); old ones store
    # rotary inv_freq buffers. Anything else unknown means a feature this model would silently drop.
    expected = {name for name, *_ in entries}
    unexpected = sorted(n for n in files if n not in expected and n != "lm_head.weight"
                        and not n.endswith("rotary_emb.inv_freq"))
    if unexpected:
        raise CheckpointFormatError(f"{directory!r}: unexpected tensors {unexpected[:10]}")


def _read_tensors(files: dict[str, str], entries, variables: dict, shardings: dict | None, num_layers: int) -> None:
    """Set each model variable from its checkpoint tensor(s), converted to the model's layout and dtype
    and placed in its sharding."""
    handles: dict[str, Any] = {}
    try:
        # A stacked [L, ...] weight is assembled on the host from its L tensors, then placed once.
        host: dict[tuple, np.ndarray] = {}
        # Weight by weight (each stacked one's layers in a row), so the host holds one weight at a time.
        for name, path, kind, layer in sorted(entries, key=lambda e: (e[1], -1 if e[3] is None else e[3])):
            if files[name] not in handles:
                handles[files[name]] = safe_open(files[name], framework="np")
            var = variables[path]
            shape = var.shape if layer is None else var.shape[1:]
            x = handles[files[name]].get_tensor(name)
            if x.size != int(np.prod(shape)):
                raise CheckpointFormatError(f"tensor {name}: shape {x.shape} does not fit {shape}")
            x = _to_model_layout(kind, x, shape).astype(var.get_value().dtype)
            if layer is not None:
                host.setdefault(path, np.empty(var.shape, x.dtype))[layer] = x
                if layer < num_layers - 1:
                    continue
                x = host.pop(path)
            var.set_value(jax.device_put(x, shardings[path].get_value() if shardings else None))
    finally:
        handles.clear()


def save_pretrained(model: Transformer, directory: str | os.PathLike) -> None:
    """Write ``config.json`` and ``model.safetensors`` that transformers' ``from_pretrained`` loads.

    LoRA adapters are merged into the weights first (:func:`passrate_jax.model.lora.merged_model`).
    Parameters are gathered to host memory (fine on one host; multi-host needs a process-0 gather).
    """
    model = merged_model(model)
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    cfg = model.cfg
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config_to_hf(cfg), f, indent=2)
    variables = dict(nnx.to_flat_state(nnx.state(model)))
    host = {path: np.asarray(jax.device_get(v[...])) for path, v in variables.items()}
    tensors = {name: _to_hf_layout(kind, host[path] if layer is None else host[path][layer])
               for name, path, kind, layer in _tensor_map(cfg)}
    # transformers refuses safetensors files whose metadata does not name a known framework.
    save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
