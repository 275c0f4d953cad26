"""Bad input fails early and clearly: before any model is built or step is run, naming the key or file
and the numbers involved. (The README table "What happens on bad input" points at these tests.)"""

import errno
import os
import re
from collections import namedtuple

import numpy as np
import pytest

from passrate_jax.run import session as session_module
from passrate_jax.run.config import load_config
from passrate_jax.configlib import ConfigError
from passrate_jax.run.metrics import read_jsonl
from passrate_jax.run.train import train
from passrate_jax.run.checkpoint import RunCheckpointer
from tests.conftest import saved_params
from tests.test_train_e2e import TINY, _comparable, hash_reward


@pytest.fixture
def no_model(monkeypatch):
    """Building a model counts as compute here: a check that is late enough to reach it fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError("the model was built before the bad input was caught")
    monkeypatch.setattr(session_module, "create_model", refuse)


@pytest.mark.parametrize("overrides", [
    [],                                                              # a text run on the built-in task
    ["data.source=env", "data.env=calculator", "data.level=1"],      # an environment run
])
def test_prompt_plus_new_tokens_beyond_positions_fails_before_compute(tmp_path, no_model, overrides):
    cfg = load_config(None, TINY + overrides + ["model.max_position_embeddings=40", "sampling.max_new_tokens=36"])
    with pytest.raises(ConfigError) as err:
        train(cfg, str(tmp_path), progress=False, log=lambda *a: None)
    message = str(err.value)
    assert "sampling.max_new_tokens = 36" in message and "model.max_position_embeddings = 40" in message
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.parametrize("source, extra", [
    ("jsonl", ["data.path=train.jsonl"]), ("parquet", ["data.path=train.parquet"]), ("tfds", ["data.tfds_name=gsm8k"]),
])
@pytest.mark.parametrize("key, value", [("level", 2), ("max_level", 3), ("train_size", 100)])
def test_keys_a_source_ignores_are_errors(source, extra, key, value):
    with pytest.raises(ConfigError, match=rf"data\.{key} = {value}: ignored by source {source}"):
        load_config(None, [f"data.source={source}", *extra, f"data.{key}={value}"])


def test_a_preset_that_switches_to_a_file_must_reset_builtin_keys():
    # configs/default.yaml sets max_level, train_size and level weights for its built-in task; a preset
    # based on it that reads a file must reset them (qwen3_gsm8k.yaml does), not have them silently ignored.
    file = ["data.source=jsonl", "data.path=x.jsonl"]
    with pytest.raises(ConfigError, match=r"data\.max_level = 6: ignored by source jsonl"):
        load_config("configs/default.yaml", [*file, "warm_start.misread_rate=0"])
    reset = [*file, "data.max_level=0", "data.train_size=0"]
    # The messages name the preset's own weights, whatever they are as shipped.
    shipped = load_config("configs/default.yaml")
    train_weights = re.escape(f"data.level_weights = {list(shipped.data.level_weights)}")
    with pytest.raises(ConfigError, match=train_weights + r": weights the built-in task's levels, so "
                                          r"needs data\.source builtin and data\.level 0 \(here jsonl, 0\); set "
                                          r"data\.level_weights=\[\]"):
        load_config("configs/default.yaml", reset)
    reset.append("data.level_weights=[]")
    with pytest.raises(ConfigError, match=r"warm_start\.misread_rate = 0\.85: misread demonstrations need"):
        load_config("configs/default.yaml", reset)
    warm_weights = re.escape(f"warm_start.level_weights = {list(shipped.warm_start.level_weights)}")
    with pytest.raises(ConfigError, match=warm_weights +
                       r": .*set warm_start\.level_weights=\[\]"):
        load_config("configs/default.yaml", [*reset, "warm_start.misread_rate=0"])
    load_config("configs/default.yaml", [*reset, "warm_start.misread_rate=0", "warm_start.level_weights=[]"])
    load_config("configs/qwen3_gsm8k.yaml")  # its warm start is off: the demonstration settings are moot


def test_missing_prompt_file_is_named_before_compute(tmp_path, no_model):
    cfg = load_config(None, TINY + ["data.source=jsonl", f"data.path={tmp_path}/nope.jsonl", "data.level=0",
                                    "data.train_size=0"])
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        train(cfg, str(tmp_path / "run"), progress=False, log=lambda *a: None)


def test_unwritable_run_dir_fails_before_compute(tmp_path, no_model):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    cfg = load_config(None, TINY + ["steps=1"])
    with pytest.raises(ConfigError, match="is not writable"):
        train(cfg, str(blocker / "run"), progress=False, log=lambda *a: None)


def test_run_dir_without_room_for_a_checkpoint_fails_before_training(tmp_path, monkeypatch):
    import passrate_jax.run.checkpoint as checkpoint
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 4096, 4096))
    cfg = load_config(None, TINY + ["steps=1"])
    with pytest.raises(ConfigError, match="MiB free; one checkpoint of this run needs"):
        train(cfg, str(tmp_path), progress=False, log=lambda *a: None)
    assert not (tmp_path / "metrics.jsonl").exists()


def test_disk_full_during_a_checkpoint_stops_the_run_and_it_resumes(tmp_path, monkeypatch):
    """With the shipped asynchronous saves, a save whose background write hits ENOSPC (its arrays written
    for real into Orbax's temporary directory, then the write of its JSON record fails) stops the run
    with the OS error at the next save, or at the end of the run when it was the last one: never a silent
    loss. The checkpoint before it is intact, and rerunning resumes from it and ends bit for bit where an
    uninterrupted run ends, every step recorded once."""
    import orbax.checkpoint as ocp
    monkeypatch.setattr(session_module.Session, "score", lambda self, records, texts: hash_reward(records, texts))
    write_json = ocp.JsonCheckpointHandler._save_fn
    full_at = set()

    async def write_json_or_fail(self, item, directory):  # runs in Orbax's background commit thread
        step = int(os.path.basename(os.path.dirname(os.fspath(directory))).split(".")[0])
        if step in full_at:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.fspath(directory))
        return await write_json(self, item, directory)

    monkeypatch.setattr(ocp.JsonCheckpointHandler, "_save_fn", write_json_or_fail)
    cfg = load_config(None, [o for o in TINY if not o.startswith("checkpoint.")] + ["steps=3", "checkpoint.every_steps=1"])
    assert cfg.checkpoint.async_save  # the shipped default
    for failing_step, previous in ((2, 1), (3, 2)):  # a save in the middle, the run's last save
        run_dir = tmp_path / f"fails_at_{failing_step}"
        full_at.add(failing_step)
        with pytest.raises(OSError, match="No space left on device"):
            train(cfg, str(run_dir), progress=False, log=lambda *a: None)
        full_at.clear()
        ckpt = RunCheckpointer(run_dir)
        assert ckpt.latest_step() == previous
        ckpt.close()
        assert f"{failing_step}.orbax-checkpoint-tmp" in os.listdir(run_dir / "checkpoints")  # the write began
        logs = []
        train(cfg, str(run_dir), progress=False, log=logs.append)
        assert any(f"from the checkpoint of step {previous}" in str(line) for line in logs)
        assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == [0, 1, 2, 3]
    train(cfg, str(tmp_path / "uninterrupted"), progress=False, log=lambda *a: None)
    want = _comparable(read_jsonl(tmp_path / "uninterrupted" / "metrics.jsonl"))
    for failing_step in (2, 3):
        run_dir = tmp_path / f"fails_at_{failing_step}"
        assert _comparable(read_jsonl(run_dir / "metrics.jsonl")) == want
        for x, y in zip(saved_params(tmp_path / "uninterrupted", 3), saved_params(run_dir, 3)):
            np.testing.assert_array_equal(x, y)
