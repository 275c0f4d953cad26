"""Bad input fails early and clearly: before any model is built or step is run, naming the key or file
and the numbers involved. (The table "What happens on bad input" of docs/guide.md points at these tests.)"""

import errno
import os
from collections import namedtuple

import pytest

from passrate_jax.run import session as session_module
from passrate_jax.run.config import load_config
from passrate_jax.configlib import ConfigError
from passrate_jax.run.metrics import read_jsonl
from passrate_jax.run.train import train
from tests.test_train_e2e import TINY, hash_reward


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
    """A save that hits ENOSPC stops the run with the OS error (no silent loss); the checkpoint before
    it is intact, and rerunning resumes from it with every step recorded once."""
    from passrate_jax.run.checkpoint import RunCheckpointer
    monkeypatch.setattr(session_module.Session, "score", lambda self, records, texts: hash_reward(records, texts))
    original = RunCheckpointer.save

    def save(self, step, state, meta):
        if step == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.path)
        return original(self, step, state, meta)

    cfg = load_config(None, TINY + ["steps=3", "checkpoint.every_steps=1"])
    monkeypatch.setattr(RunCheckpointer, "save", save)
    with pytest.raises(OSError, match="No space left on device"):
        train(cfg, str(tmp_path), progress=False, log=lambda *a: None)
    monkeypatch.setattr(RunCheckpointer, "save", original)
    logs = []
    train(cfg, str(tmp_path), progress=False, log=logs.append)
    assert any("from the checkpoint of step 1" in str(line) for line in logs)
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [0, 1, 2, 3]
