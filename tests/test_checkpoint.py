"""Orbax run checkpoints: exact round trip of dtypes and values, keep-last-N, incomplete saves ignored, a
checkpoint of another allocator layout refused in one line."""

import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from passrate_jax.allocation import Allocator, state_to_dict
from passrate_jax.allocation.config import AllocationConfig, PrefixSamplingConfig
from passrate_jax.configlib import ConfigError
from passrate_jax.run.checkpoint import RunCheckpointer
from passrate_jax.run.train import check_allocator_layout


def _state(seed):
    k = jax.random.key(seed)
    return {
        "params": {"w": jax.random.normal(k, (3, 4)), "b": jnp.arange(4, dtype=jnp.bfloat16)},
        "opt": (jnp.int32(seed), jnp.zeros((2,))),
        "rng": jax.random.key_data(jax.random.fold_in(k, 1)),
        "alloc": {"alpha": jnp.full((5,), 1.5 + seed), "beta": jnp.ones((5,))},
    }


def _assert_equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_round_trip_keep_and_resume(tmp_path):
    ckpt = RunCheckpointer(tmp_path, keep=2, async_save=True)
    for step in (1, 2, 3):
        ckpt.save(step, _state(step), {"step": step, "data_position": [step, 7]})
    ckpt.wait()
    assert ckpt.all_steps() == [2, 3] and ckpt.latest_step() == 3
    state, meta = ckpt.restore(None, _state(0))
    _assert_equal(state, _state(3))
    assert meta == {"step": 3, "data_position": [3, 7]}
    state2, _ = ckpt.restore(2, _state(0))
    _assert_equal(state2, _state(2))
    ckpt.close()
    # A fresh checkpointer on the same run directory sees the same checkpoints (resume after exit).
    again = RunCheckpointer(tmp_path, keep=2)
    assert again.latest_step() == 3
    again.close()


def test_incomplete_save_is_ignored(tmp_path):
    ckpt = RunCheckpointer(tmp_path, keep=3, async_save=False)
    ckpt.save(1, _state(1), {"step": 1})
    ckpt.close()
    # What a process killed mid-save leaves behind: Orbax's temporary directory, never renamed.
    shutil.copytree(os.path.join(ckpt.path, "1"), os.path.join(ckpt.path, "2.orbax-checkpoint-tmp-1234567"))
    resumed = RunCheckpointer(tmp_path, keep=3)
    assert resumed.latest_step() == 1
    state, meta = resumed.restore(None, _state(0))
    _assert_equal(state, _state(1))
    resumed.close()


def test_restore_without_checkpoint_names_path(tmp_path):
    ckpt = RunCheckpointer(tmp_path)
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        ckpt.restore(None, _state(0))
    ckpt.close()


def test_a_checkpoint_with_another_allocator_layout_is_refused_in_one_line(tmp_path):
    """A checkpoint of a version that kept the queues as pilot_buffer/... and surplus/... (before each
    policy owned its queue state) names the layout change; the current layout passes."""
    allocator = Allocator(AllocationConfig(method="pilot_commit"), PrefixSamplingConfig(), num_prompts=16)
    state = allocator.init(jax.random.PRNGKey(0))
    current = state_to_dict(state)
    old = {k.replace("policy/buffer/", "pilot_buffer/"): v for k, v in current.items()}
    ckpt = RunCheckpointer(tmp_path, async_save=False)
    ckpt.save(1, {"allocator": old}, {"step": 1})
    ckpt.save(2, {"allocator": current}, {"step": 2})
    check_allocator_layout(ckpt.saved_structure(2), state, "run")
    with pytest.raises(ConfigError) as err:
        check_allocator_layout(ckpt.saved_structure(1), state, "run")
    ckpt.close()
    message = str(err.value)
    assert "\n" not in message and "another layout" in message and "pilot_buffer/" in message
