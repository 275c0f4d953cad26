"""TFDS: the built-in tasks prepared as an array_record dataset read back like any TFDS dataset."""

import json
import subprocess
import sys

import pytest

from passrate_jax.run.config import load_config
from passrate_jax.data.rewards import Rewarder
from passrate_jax.data.configured import make_source
from passrate_jax.data.sources import BadDataError, Fields, builtin_source
from passrate_jax.data.tfds_builtin import prepare_builtin, tfds_source

TRAIN, TEST = 300, 40


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """The countdown task prepared once for the module: (tfds name, data_dir)."""
    data_dir = tmp_path_factory.mktemp("tfds")
    return prepare_builtin(data_dir, "countdown", seed=3, train_size=TRAIN, test_size=TEST), str(data_dir)


def test_round_trip_holds_the_same_problems_as_the_builtin_stream(prepared):
    name, data_dir = prepared
    assert name == f"passrate_builtin/countdown_seed3_level0_train{TRAIN}_test{TEST}"
    src = tfds_source(name, data_dir, fields=Fields(id="prompt_id"), shuffle=False)
    records = src.take(TRAIN)
    stream = builtin_source("countdown", seed=3).take(TRAIN)
    # TFDS stores rows in its own order, so compare as multisets (a countdown prompt can recur with
    # another generating solution). Text comes back as str, numbers as int lists.
    def rows(rs):
        return sorted(json.dumps([r.prompt_id, r.prompt, r.answer, {k: v for k, v in r.metadata.items() if k != "row"}],
                                 sort_keys=True) for r in rs)
    assert rows(records) == rows(stream)
    held = src.heldout(TEST)
    assert len(held) == TEST and {r.prompt for r in held} == {r.prompt for r in builtin_source(
        "countdown", seed=3).heldout(TEST)}
    json.dumps([r.metadata for r in records])


def test_tfds_records_verify_with_the_task_verifier(prepared):
    name, data_dir = prepared
    cfg = load_config(None, ["data.source=tfds", f"data.tfds_name={name}", f"data.tfds_data_dir={data_dir}"]).data
    src = make_source(cfg)
    records = src.take(10)
    rewarder = Rewarder.from_config(cfg)
    assert rewarder.verifier == "task"
    assert rewarder(records, [r.metadata["solution"] for r in records]).tolist() == [1.0] * 10
    assert rewarder(records, ["=> 0"] * 10).tolist() == [0.0] * 10
    # make_source keeps the tasks' own ids for the built-in build.
    assert {r.prompt_id for r in records} <= {r.prompt_id for r in builtin_source("countdown", seed=3).take(TRAIN)}


def test_tfds_position_resumes_across_an_epoch(prepared):
    name, data_dir = prepared
    a = tfds_source(name, data_dir, seed=9)
    a.take(TRAIN - 5)
    b = tfds_source(name, data_dir, seed=9)
    b.restore(json.loads(json.dumps(a.state())))
    assert b.take(20) == a.take(20)
    assert a.state()["epoch"] == 1


def test_tfds_field_errors_name_the_feature(prepared):
    name, data_dir = prepared
    with pytest.raises(BadDataError, match=r"field 'question': no such feature"):
        tfds_source(name, data_dir, fields=Fields(prompt="question"))
    with pytest.raises(FileNotFoundError, match="prepare it"):
        tfds_source(name, data_dir, train_split="validation")
    # An empty operator is a bad answer field here: rows fail, with skipping every row is bad.
    with pytest.raises(BadDataError, match=r"\[train\]:\d+: field 'op'"):
        tfds_source(name, data_dir, fields=Fields(answer="op")).take(1)
    with pytest.raises(ValueError, match="every row is bad"):
        tfds_source(name, data_dir, fields=Fields(answer="op"), skip_bad_rows=True).take(1)


def test_a_fresh_process_reads_it_without_the_builder(prepared):
    """The prepared files alone suffice: a process that never imports our builder reads them."""
    name, data_dir = prepared
    code = ("import tensorflow_datasets as tfds\n"
            f"ds = tfds.data_source({name!r}, split='test', data_dir={data_dir!r}, download=False)\n"
            "print(len(ds), ds[0]['prompt'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    count, prompt = out.stdout.split(" ", 1)
    assert int(count) == TEST and "->" in prompt and prompt.startswith("b'")
