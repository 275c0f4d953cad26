"""Weights & Biases through the metrics writer: an offline run writes its W&B files with every
metrics.jsonl key and the plots; enabling it without wandb installed fails before compute."""

import glob
import json
import os
import sys

import pytest
import wandb  # noqa: F401  a declared test dependency: a broken install fails here, it never skips

from passrate_jax.run.config import load_config
from passrate_jax.configlib import ConfigError
from passrate_jax.run.metrics import read_jsonl
from passrate_jax.run.trackers import scalars
from passrate_jax.run.train import train
from tests.test_train_e2e import TINY as E2E_TINY

# The end-to-end tests' tiny run, smaller still: fewer prompts and tokens, an evaluation every step.
TINY = [*E2E_TINY, "data.train_size=8", "data.eval_size=2", "sampling.max_new_tokens=8", "eval_every=1"]


def wandb_records(path: str) -> list[bytes]:
    """The protobuf records of a ``.wandb`` file: a 7-byte header, then LevelDB-log framing (32 KiB blocks
    of chunks with a 7-byte header: crc32, little-endian length, type FULL/FIRST/MIDDLE/LAST)."""
    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    records, pos, partial = [], 7, b""
    while pos + 7 <= len(data):
        room = 32768 - pos % 32768
        if room < 7:  # the rest of a block too short for a header is padding
            pos += room
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0 and length == 0:
            break
        partial = chunk if kind in (1, 2) else partial + chunk
        if kind in (1, 4):
            records.append(partial)
    return records


def wandb_history(path: str) -> tuple[list[dict], dict]:
    """The history rows and the run record (config, tags) of an offline ``.wandb`` file (wandb's own
    protobuf messages)."""
    from wandb.proto import wandb_internal_pb2

    rows, config = [], {}
    for data in wandb_records(path):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        kind = record.WhichOneof("record_type")
        if kind == "history":
            rows.append({"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in record.history.item})
        elif kind == "run":
            config = {"tags": list(record.run.tags), "project": record.run.project, "name": record.run.display_name,
                      **{i.key: json.loads(i.value_json) for i in record.run.config.update}}
    return rows, config


def test_offline_wandb_run_writes_every_metric_and_the_plots(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    options = ["logging.wandb=true", "logging.wandb_mode=offline", "logging.wandb_project=test",
               "logging.wandb_name=tiny-run", "logging.wandb_tags=[ci,tiny]"]
    train(load_config(None, TINY + ["steps=2"] + options), str(tmp_path), progress=False, log=lambda *a: None)
    files = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    run_id = (tmp_path / "wandb_id").read_text()
    assert len(files) == 1 and files[0].endswith(f"run-{run_id}.wandb")
    rows, run = wandb_history(files[0])
    logged = {row["_step"]: row for row in rows if "_step" in row}
    for record in read_jsonl(tmp_path / "metrics.jsonl"):
        row = logged[record["step"]]
        for key, value in scalars(record).items():
            assert row[key] == pytest.approx(value), key
    assert "pass_rate_hist/0" in logged[1] and "update/loss" in logged[1]
    assert any(key.startswith("plots/") for row in rows for key in row)
    assert run["tags"] == ["ci", "tiny"] and run["project"] == "test" and run["name"] == "tiny-run"
    assert run["data"]["task"] == "arithmetic"  # the whole config travels with the run
    images = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "files" / "media" / "images" / "plots" / "*.png"))
    assert images

    # Resumed, the run logs its new steps under the same W&B run id.
    train(load_config(None, TINY + ["steps=3"] + options), str(tmp_path), progress=False, log=lambda *a: None)
    files = sorted(glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb")))
    assert len(files) == 2 and all(f.endswith(f"run-{run_id}.wandb") for f in files)
    steps = [{row["_step"] for row in wandb_history(f)[0] if "_step" in row} for f in files]
    assert {0, 1, 2} <= steps[0] and 3 in steps[1] and 3 not in steps[0]


def test_scalars_flatten_records_the_way_tensorboard_names_them():
    record = {"step": 3, "a": 1.5, "b": {"c": 2}, "hist": [0, 4], "gone": None, "flag": True, "text": "x"}
    assert scalars(record) == {"a": 1.5, "b/c": 2, "hist/0": 0, "hist/1": 4, "flag": 1}


def test_wandb_enabled_but_not_installed_fails_before_compute(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb now raises ImportError
    with pytest.raises(ConfigError, match=r"logging.wandb = true: wandb is not installed.*passrate-jax\[wandb\]"):
        load_config(None, ["logging.wandb=true"])
    assert load_config(None, []).logging.wandb is False
