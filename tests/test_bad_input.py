"""Bad input fails early and clearly: before any model is built or step is run, naming the key or file
and the numbers involved. (The table "What happens on bad input" of docs/guide.md points at these tests.)"""

import errno
import os
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


def test_switching_a_preset_to_a_file_drops_its_builtin_keys_with_one_warning():
    # configs/default.yaml sets max_level, train_size, level weights and misread demonstrations for its
    # built-in task; one flag switches it to a file, the ignored keys dropped and named in one line.
    file = ["data.source=jsonl", "data.path=x.jsonl"]
    lines = []
    cfg = load_config("configs/default.yaml", file, warn=lines.append)
    assert len(lines) == 1, lines
    for key in ("data.max_level=6", "data.train_size=2048", "data.level_weights=", "warm_start.misread_rate=0.85",
                "warm_start.level_weights="):
        assert key in lines[0], (key, lines[0])
    defaults = load_config(None)
    assert (cfg.data.max_level, cfg.data.train_size, cfg.data.level_weights, cfg.warm_start.misread_rate) == (
        defaults.data.max_level, defaults.data.train_size, defaults.data.level_weights,
        defaults.warm_start.misread_rate)
    assert cfg.model.hidden_size == 128 and cfg.allocation.num_prompts == 16  # the rest of the preset stays
    # A key the user sets on the command line that the source ignores is still refused.
    with pytest.raises(ConfigError, match=r"data\.max_level = 3: ignored by source jsonl"):
        load_config("configs/default.yaml", [*file, "data.max_level=3"], warn=lines.append)
    quiet = []  # a packaged preset that reads a file (qwen3_gsm8k over default) drops its base's keys silently
    load_config("qwen3_gsm8k", warn=quiet.append)
    assert quiet == []


def test_a_reward_function_replaces_the_presets_verifier(tmp_path):
    plugin = tmp_path / "score.py"
    plugin.write_text("def reward(prompt, response, reference, **fields):\n    return 1.0\n")
    lines = []
    cfg = load_config("qwen3_gsm8k", [f"data.reward_fn={plugin}:reward"], warn=lines.append)
    assert cfg.data.reward_fn.endswith("score.py:reward") and cfg.data.verifier == "auto"
    assert len(lines) == 1 and "data.verifier=math" in lines[0] and "data.reward_fn" in lines[0]
    with pytest.raises(ConfigError, match="give one"):  # both on the command line: which one is meant?
        load_config("qwen3_gsm8k", [f"data.reward_fn={plugin}:reward", "data.verifier=exact"], warn=lines.append)


def test_missing_prompt_file_is_named_before_compute(tmp_path, no_model):
    cfg = load_config(None, TINY + ["data.source=jsonl", f"data.path={tmp_path}/nope.jsonl", "data.level=0",
                                    "data.train_size=0"])
    with pytest.raises(FileNotFoundError, match=r"data\.path = '.*nope\.jsonl': no such file"):
        train(cfg, str(tmp_path / "run"), progress=False, log=lambda *a: None)
    assert not (tmp_path / "run").exists()  # a failed start leaves no run directory behind


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
