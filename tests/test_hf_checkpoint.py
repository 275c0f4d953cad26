"""Hugging Face checkpoint I/O: export loads in transformers, sharded checkpoints, both config layouts,
and errors that name the unsupported architecture or the missing tensor."""

import json
import os

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from conftest import TINY_HF_CONFIGS, forward, torch_logits
from passrate_jax.model import (CheckpointFormatError, ModelConfig, RopeScaling, config_from_hf, config_to_hf,
                                create_model, load_pretrained, save_pretrained)

TOKENS = np.random.default_rng(0).integers(0, 64, (2, 7))


SHAPE = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4)


@pytest.mark.parametrize("cfg", [
    ModelConfig(**SHAPE, num_kv_heads=2, head_dim=16, qk_norm=True, tie_embeddings=False),
    ModelConfig(**SHAPE, num_kv_heads=1, attention_bias=True, tie_embeddings=True,
                rope_scaling=RopeScaling(rope_type="llama3", factor=4.0, original_max_position_embeddings=32)),
], ids=["qwen3_untied", "qwen2_tied_llama3_rope"])
def test_save_pretrained_loads_in_transformers(cfg, tmp_path):
    import transformers

    model = create_model(cfg, seed=3)
    save_pretrained(model, tmp_path)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(hf_model).__name__ == config_to_hf(cfg)["architectures"][0]
    positions = np.stack([np.arange(7), np.arange(7) + 50])
    np.testing.assert_allclose(forward(model, TOKENS, positions), torch_logits(hf_model, TOKENS, positions),
                               atol=1e-4)
    # And back: our own loader round-trips the export exactly.
    again = load_pretrained(tmp_path)
    assert again.cfg == cfg.__class__(**{**cfg.__dict__, "pretrained": str(tmp_path)})
    np.testing.assert_array_equal(np.asarray(again.layers.mlp.down[...][1]),
                                  np.asarray(model.layers.mlp.down[...][1]))
    # A config naming the checkpoint builds the loaded model, not a random one.
    via_cfg = create_model(again.cfg, seed=99)
    np.testing.assert_array_equal(np.asarray(via_cfg.embed[...]), np.asarray(model.embed[...]))


def _write_sharded(src: str, dst: str) -> list[str]:
    """Re-save a single-file checkpoint as two shards plus model.safetensors.index.json."""
    os.makedirs(dst)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    names = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((names[::2], names[1::2])):
        file = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, os.path.join(dst, file), metadata={"format": "pt"})
        weight_map.update({n: file for n in part})
    with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with open(os.path.join(src, "config.json")) as f, open(os.path.join(dst, "config.json"), "w") as g:
        g.write(f.read())
    return names


def test_sharded_checkpoint_with_index_loads(hf_checkpoint, tmp_path):
    src, hf_model = hf_checkpoint("qwen2")
    _write_sharded(src, str(tmp_path / "sharded"))
    model = load_pretrained(tmp_path / "sharded")
    tokens = TOKENS + 20
    np.testing.assert_allclose(forward(model, tokens), torch_logits(hf_model, tokens), atol=1e-4)


def test_config_layouts_transformers4_and_5_agree():
    v5 = dict(TINY_HF_CONFIGS["llama"])
    v4 = {k: v for k, v in v5.items() if k != "rope_parameters"}
    rope = dict(v5["rope_parameters"])
    v4["rope_theta"] = rope.pop("rope_theta")
    v4["rope_scaling"] = {**rope, "type": rope.pop("rope_type")}  # legacy "type" key
    cfg4, cfg5 = config_from_hf(v4), config_from_hf(v5)
    assert cfg4 == cfg5
    assert cfg5.rope_theta == 10000.0 and cfg5.rope_scaling.rope_type == "llama3"
    assert cfg5.rope_scaling.original_max_position_embeddings == 64 and cfg5.tie_embeddings
    plain = {k: v for k, v in v4.items() if k != "rope_scaling"}
    assert config_from_hf(plain).rope_scaling.rope_type == "none"
    # Our export carries both layouts, so it reads back identically either way.
    exported = config_to_hf(cfg5)
    assert config_from_hf({k: v for k, v in exported.items() if k != "rope_parameters"}) == cfg5
    v5_only = {k: v for k, v in exported.items() if k not in ("rope_theta", "rope_scaling")}
    assert config_from_hf(v5_only) == cfg5
    qwen3 = config_from_hf(TINY_HF_CONFIGS["qwen3"])
    assert qwen3.qk_norm and qwen3.head_dim == 16 and not qwen3.attention_bias


def test_unsupported_architecture_is_named(tmp_path):
    hf = {**TINY_HF_CONFIGS["llama"], "architectures": ["MistralForCausalLM"], "model_type": "mistral"}
    with pytest.raises(CheckpointFormatError, match="MistralForCausalLM"):
        config_from_hf(hf)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(CheckpointFormatError, match="MistralForCausalLM"):
        load_pretrained(tmp_path)
    with pytest.raises(CheckpointFormatError, match="yarn"):
        config_from_hf({**TINY_HF_CONFIGS["qwen2"], "rope_parameters": {"rope_type": "yarn", "factor": 4.0}})


def test_missing_and_unexpected_tensors_are_named(hf_checkpoint, tmp_path):
    src, _ = hf_checkpoint("qwen3")
    tensors = load_file(os.path.join(src, "model.safetensors"))
    config = open(os.path.join(src, "config.json")).read()
    gone = "model.layers.1.self_attn.k_norm.weight"
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "config.json").write_text(config)
    save_file({n: t for n, t in tensors.items() if n != gone}, str(tmp_path / "a" / "model.safetensors"))
    with pytest.raises(CheckpointFormatError, match=gone.replace(".", r"\.")):
        load_pretrained(tmp_path / "a")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "config.json").write_text(config)
    extra = "model.layers.0.self_attn.o_proj.bias"
    save_file({**tensors, extra: np.zeros(32, np.float32)}, str(tmp_path / "b" / "model.safetensors"))
    with pytest.raises(CheckpointFormatError, match=extra.replace(".", r"\.")):
        load_pretrained(tmp_path / "b")
    with pytest.raises(CheckpointFormatError, match="no config.json"):
        load_pretrained(tmp_path)
