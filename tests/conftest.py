"""Shared test fixtures."""

import functools
import gc

import jax
import numpy as np
import pytest
from flax import nnx

# --- model: tiny Hugging Face reference checkpoints (no download) -----------------------------------

# Tiny configs covering each family's distinguishing feature: Llama 3 RoPE scaling + tied embeddings,
# Qwen2 q/k/v biases, Qwen3 q/k norms with GQA and head_dim != hidden / heads.
TINY_HF_CONFIGS = {
    "llama": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=96, hidden_size=32,
        intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=True,
        # theta and original_max_position_embeddings chosen so head_dim 8 has one unscaled, one smoothed
        # and two divided frequency bands.
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "qwen2": dict(
        architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=96, hidden_size=32,
        intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    "qwen3": dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=96, hidden_size=32,
        intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
}


def make_hf_model(kind: str, seed: int = 0):
    """A random transformers model for ``TINY_HF_CONFIGS[kind]`` with every weight perturbed (norm
    weights and biases too, which HF initialises to the trivial ones / zeros)."""
    import torch
    import transformers

    cfg = dict(TINY_HF_CONFIGS[kind])
    arch = cfg.pop("architectures")[0]
    cfg.pop("model_type")
    config_cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(config_cls(**cfg)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.1 * torch.randn_like(p))
    return model


def torch_logits(model, tokens_bt, positions_bt=None, attention_mask_bt=None) -> np.ndarray:
    """float32 numpy logits from a transformers model."""
    import torch

    kwargs = {}
    if positions_bt is not None:
        kwargs["position_ids"] = torch.as_tensor(np.asarray(positions_bt), dtype=torch.long)
    if attention_mask_bt is not None:
        kwargs["attention_mask"] = torch.as_tensor(np.asarray(attention_mask_bt), dtype=torch.long)
    with torch.no_grad():
        out = model(torch.as_tensor(np.asarray(tokens_bt), dtype=torch.long), **kwargs)
    return out.logits.float().numpy()


def saved_params(run_dir, step: int) -> list[np.ndarray]:
    """The parameter leaves of ``run_dir``'s checkpoint ``step``, which must be its latest."""
    from passrate_jax.run.checkpoint import RunCheckpointer

    ckpt = RunCheckpointer(run_dir)
    assert ckpt.latest_step() == step
    state, _ = ckpt.restore_saved(step)
    ckpt.close()
    return [np.asarray(x) for x in jax.tree.leaves(state["params"])]


@functools.partial(jax.jit, static_argnums=0)
def _jit_forward(graphdef, state, tokens, positions, mask):
    return nnx.merge(graphdef, state)(tokens, positions, mask)


def forward(model, tokens, positions=None, mask=None) -> np.ndarray:
    """Jitted model forward as numpy: one compile per (model config, shapes) instead of one per op."""
    graphdef, state = nnx.split(model)
    return np.asarray(_jit_forward(graphdef, state, tokens, positions, mask))


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """Factory: ``hf_checkpoint(kind) -> (directory, torch_model)``, saved once per session."""
    cache = {}

    def get(kind: str):
        if kind not in cache:
            model = make_hf_model(kind)
            directory = tmp_path_factory.mktemp(f"hf_{kind}")
            model.save_pretrained(directory)
            cache[kind] = (str(directory), model)
        return cache[kind]

    return get


@pytest.fixture(scope="session")
def warm_start_cache(tmp_path_factory):
    """One warm-start cache per test session: tests that warm-start the same model the same way
    (test_presets_real.py, test_sharding_loop.py) train it once."""
    return tmp_path_factory.mktemp("warm_start_cache")


# --- compile cache: identical programs built by different tests (every end-to-end run builds the same
# sampler and update programs) compile once per machine instead of once per test.
import os as _os
import tempfile as _tempfile

jax.config.update("jax_compilation_cache_dir", _os.path.join(_tempfile.gettempdir(), "passrate-jax-test-xla-cache"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


# --- memory maps: XLA:CPU gives each compiled kernel its own memory mappings, and JAX's caches keep every
# program the suite compiles alive. One pytest process compiles thousands of programs, enough to reach
# Linux's per-process limit (vm.max_map_count, 65530 by default), where the next compile fails inside
# XLA with a segfault or abort. A user's run compiles a handful of programs and is nowhere near it.
def _map_count() -> int | None:
    try:
        with open("/proc/self/maps", "rb") as maps:
            return sum(1 for _ in maps)
    except OSError:  # not Linux: no such limit to watch
        return None


def _map_limit() -> int:
    try:
        with open("/proc/sys/vm/max_map_count") as limit:
            return int(limit.read())
    except (OSError, ValueError):
        return 65530


_CLEAR_ABOVE_MAPS = _map_limit() // 3  # the limit is a kernel setting: read it once per session


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """After each test module, past a third of the map limit, drop JAX's caches so the programs no test
    still holds are freed (a later compile of the same program loads it from the compile cache above)."""
    yield
    count = _map_count()
    if count is not None and count > _CLEAR_ABOVE_MAPS:
        jax.clear_caches()
        gc.collect()
