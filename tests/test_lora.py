"""LoRA adapters: zero-initialised B is the base model, only adapters train, the KL reference is the
base with adapters off, and the merged export loads in transformers with the adapted model's logits."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import forward, torch_logits
from passrate_jax.model import (LoRAConfig, ModelConfig, create_model, load_pretrained, merge_lora, merged_model,
                                reference_params, save_pretrained)
from passrate_jax.rl.config import OptimizerConfig, RLConfig
from passrate_jax.rl.optimizer import make_optimizer
from passrate_jax.rl.train_step import make_train_step
from passrate_jax.sharding import MeshConfig, make_mesh
from test_rl_train_step import tiny_batch

BASE = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=8, qk_norm=True, tie_embeddings=False)
LORA = dataclasses.replace(BASE, lora=LoRAConfig(rank=4, alpha=8.0))
TOKENS = np.random.default_rng(0).integers(0, 64, (2, 9))


def _with_random_b(model):
    """The adapters as after some training: every B factor drawn nonzero."""
    state = nnx.state(model)
    keys = iter(jax.random.split(jax.random.key(5), 64))
    flat = {p: (v.replace(0.05 * jax.random.normal(next(keys), v.shape, v.get_value().dtype))
                if str(p[-1]).endswith("_lora_b") else v) for p, v in nnx.to_flat_state(state)}
    nnx.update(model, nnx.from_flat_state(flat))
    return model


def test_zero_b_equals_base_model_and_every_target_gets_an_adapter():
    base, adapted = create_model(BASE, seed=1), create_model(LORA, seed=1)
    np.testing.assert_array_equal(forward(adapted, TOKENS), forward(base, TOKENS))
    names = {str(p[-1]) for p, v in nnx.to_flat_state(nnx.state(adapted, nnx.LoRAParam))}
    assert names == {f"{t}_lora_{f}" for t in ("q", "k", "v", "o", "gate", "up", "down") for f in "ab"}
    assert adapted.layers.attn.q_lora_a.shape == (2, 32, 4) and adapted.layers.attn.o_lora_b.shape == (2, 4, 32)
    only_mlp = create_model(dataclasses.replace(BASE, lora=LoRAConfig(rank=2, targets=("down",))), seed=1)
    assert [str(p[-1]) for p, _ in nnx.to_flat_state(nnx.state(only_mlp, nnx.LoRAParam))] == ["down_lora_a",
                                                                                               "down_lora_b"]
    with pytest.raises(ValueError, match="lora.targets"):
        create_model(dataclasses.replace(BASE, lora=LoRAConfig(rank=2, targets=("qkv",))))


def test_adapters_on_a_pretrained_checkpoint_start_as_the_checkpoint(hf_checkpoint):
    directory, hf_model = hf_checkpoint("qwen3")
    loaded = load_pretrained(directory)
    adapted = create_model(dataclasses.replace(loaded.cfg, lora=LoRAConfig(rank=2), remat="full"), seed=0)
    assert adapted.cfg.lora.rank == 2 and adapted.cfg.remat == "full"
    np.testing.assert_allclose(forward(adapted, TOKENS), torch_logits(hf_model, TOKENS), atol=1e-4)


def test_only_adapters_train_and_the_reference_is_the_base():
    model = _with_random_b(create_model(LORA, seed=2))
    graphdef, params = nnx.split(model)
    mesh = make_mesh(MeshConfig(), jax.devices()[:1])
    fns = make_train_step(graphdef, params, RLConfig(kl_coef=0.05), make_optimizer(OptimizerConfig(learning_rate=1e-2)),
                          mesh)
    opt_state = fns.init(params)
    adapter_sizes = sorted(x.size for x in jax.tree.leaves(nnx.state(model, nnx.LoRAParam)))
    moments = sorted(x.size for x in jax.tree.leaves(opt_state) if x.size > 1)
    assert moments == sorted(adapter_sizes * 2)  # Adam's mu and nu, for the adapters alone
    before = jax.tree.map(np.asarray, params)
    batch = tiny_batch(with_ref=True)
    new, _, metrics = fns.step(jax.tree.map(jnp.copy, params), opt_state, batch, jax.random.key(0))
    assert np.isfinite(metrics["loss"]) and metrics["skipped_steps"] == 0
    for (path, old), (_, now) in zip(nnx.to_flat_state(before), nnx.to_flat_state(new)):
        if isinstance(old, nnx.LoRAParam):
            assert not np.array_equal(np.asarray(now[...]), old[...]), path
        else:
            np.testing.assert_array_equal(np.asarray(now[...]), old[...], err_msg=str(path))
    # Adapters off: exactly the base model, sharing its weight buffers.
    ref = reference_params(params)
    base_only = nnx.merge(nnx.graphdef(create_model(BASE)), nnx.state(create_model(BASE, seed=2)))
    np.testing.assert_allclose(forward(nnx.merge(graphdef, ref), TOKENS), forward(base_only, TOKENS), atol=1e-6)
    assert ref["layers"]["mlp"]["up"].get_value() is params["layers"]["mlp"]["up"].get_value()


def test_merged_export_loads_in_transformers_with_equal_logits(tmp_path):
    import transformers

    model = _with_random_b(create_model(LORA, seed=3))
    adapted = forward(model, TOKENS)
    assert np.abs(adapted - forward(create_model(BASE, seed=3), TOKENS)).max() > 1e-3  # the adapters matter
    merged = merged_model(model)
    assert merged.cfg.lora.rank == 0 and not jax.tree.leaves(nnx.state(merged, nnx.LoRAParam))
    np.testing.assert_allclose(forward(merged, TOKENS), adapted, atol=1e-5)
    paths = lambda state: sorted(p for p, _ in nnx.to_flat_state(state))
    assert paths(merge_lora(nnx.state(model), model.cfg)) == paths(nnx.state(create_model(BASE)))
    save_pretrained(model, tmp_path)  # merges the adapters on the way out
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    np.testing.assert_allclose(torch_logits(hf_model, TOKENS), adapted, atol=1e-4)
