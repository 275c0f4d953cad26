"""Prompt sources: exact resume from a saved position, epochs and shuffling, file field mapping, bad rows."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from passrate_jax.run.config import load_config
from passrate_jax.data.configured import make_source
from passrate_jax.data.sources import (BadDataError, Fields, PromptRecord, builtin_problem, builtin_source,
                                       file_source, read_jsonl, stable_id)
from passrate_jax.data.tasks import TASKS


def _ids(records):
    return [r.prompt_id for r in records]


def _resume_matches(make, first: int, then: int):
    """Take ``first`` records, save the position through JSON, and check that a fresh source restored
    there yields exactly what the original yields next."""
    a = make()
    a.take(first)
    saved = json.loads(json.dumps(a.state()))
    b = make()
    b.restore(saved)
    expected, got = a.take(then), b.take(then)
    assert got == expected
    return expected


def _write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_builtin_stream_resumes_exactly_and_matches_the_task():
    make = lambda: builtin_source("arithmetic", seed=3)
    records = _resume_matches(make, 7, 5)
    # Record i of the stream is problem i of the task's train split.
    assert [r.prompt for r in records] == [TASKS["arithmetic"].sample(3, "train", i).prompt for i in range(7, 12)]
    assert make().state()["size"] is None


def test_builtin_pool_shuffles_each_epoch_and_resumes_across_the_boundary():
    make = lambda: builtin_source("countdown", seed=1, train_size=10)
    src = make()
    epoch0, epoch1 = src.take(10), src.take(10)
    assert sorted(_ids(epoch0)) == sorted(_ids(epoch1))  # same pool every epoch ...
    assert _ids(epoch0) != _ids(epoch1)                  # ... in a new order
    assert src.state()["epoch"] == 1
    # Saved mid-epoch 0, the next 16 records run through the boundary into epoch 1.
    assert _resume_matches(make, 6, 16) == make().take(22)[6:]
    # Saved exactly at the end of an epoch.
    assert _resume_matches(make, 10, 3) == epoch1[:3]


def test_shuffle_is_seeded_and_can_be_turned_off(tmp_path):
    path = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"q{i}", "answer": str(i)} for i in range(20)])
    order = lambda **kw: [r.prompt for r in file_source(path, **kw).take(20)]
    assert order(seed=0) == order(seed=0) != order(seed=1)
    assert order(shuffle=False) == [f"q{i}" for i in range(20)]


def test_restore_rejects_a_position_saved_for_other_data(tmp_path):
    path = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"q{i}", "answer": "1"} for i in range(5)])
    state = file_source(path, seed=0).state()
    with pytest.raises(ValueError, match="seed"):
        file_source(path, seed=1).restore(state)
    with pytest.raises(ValueError, match="out of range"):
        file_source(path).restore(dict(state, index=9))


def test_jsonl_field_mapping_ids_and_metadata(tmp_path):
    rows = [{"question": "What is 2+3?", "solution": "2+3=5\n#### 5", "uid": "a-1", "level": 2},
            {"question": "What is 10/4?", "solution": "#### 2.5", "uid": 7}]
    path = _write_jsonl(tmp_path / "gsm.jsonl", rows)
    fields = Fields(prompt="question", answer="solution", id="uid", reference_extract="gsm8k")
    a, b = read_jsonl(path, fields)
    assert (a.prompt, a.answer, a.prompt_id) == ("What is 2+3?", "5", stable_id("a-1"))
    assert (b.answer, b.prompt_id) == ("2.5", 7)
    assert a.metadata == {"level": 2, "solution": "2+3=5\n#### 5", "row": 1}
    # Without an id field the id is a stable hash of the prompt.
    assert read_jsonl(path, Fields("question", "solution"))[0].prompt_id == stable_id("What is 2+3?")


def test_parquet_matches_jsonl(tmp_path):
    rows = [{"q": f"problem {i}", "a": str(i * i), "extra": i} for i in range(12)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "p.parquet")
    _write_jsonl(tmp_path / "p.jsonl", rows)
    fields = Fields(prompt="q", answer="a")
    from_parquet = file_source(str(tmp_path / "p.parquet"), fields=fields, seed=4).take(12)
    from_jsonl = file_source(str(tmp_path / "p.jsonl"), fields=fields, seed=4).take(12)
    assert from_parquet == from_jsonl
    assert sorted(r.answer for r in from_parquet) == sorted(str(i * i) for i in range(12))
    with pytest.raises(BadDataError, match=r"p\.parquet: field 'question': no such column"):
        file_source(str(tmp_path / "p.parquet"), fields=Fields(prompt="question", answer="a"))


@pytest.mark.parametrize("line, field, problem", [
    ('{"prompt": "ok", "answer": ', None, "malformed JSON"),
    ('{"answer": "1"}', "prompt", "missing"),
    ('{"prompt": "   ", "answer": "1"}', "prompt", "non-empty string"),
    ('{"prompt": "q", "answer": null}', "answer", "missing"),
    ('{"prompt": "q", "answer": "no marker"}', "answer", "no gsm8k answer"),
    ('["prompt", "answer"]', None, "expected a JSON object"),
])
def test_bad_rows_fail_with_file_line_and_field(tmp_path, line, field, problem):
    path = _write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "fine", "answer": "#### 1"}, "", line])
    with pytest.raises(BadDataError) as info:
        file_source(path, fields=Fields(reference_extract="gsm8k"))
    message = str(info.value)
    assert message.startswith(f"{path}:3: ")  # blank lines still count: line numbers match an editor's
    assert problem in message
    assert (info.value.line, info.value.field) == (3, field)
    if field:
        assert f"field {field!r}" in message


def test_skip_bad_rows_counts_them(tmp_path):
    good = [{"prompt": f"q{i}", "answer": "1"} for i in range(4)]
    rows = good[:2] + ["{not json", {"prompt": "", "answer": "1"}, {"prompt": "q"}] + good[2:]
    path = _write_jsonl(tmp_path / "mixed.jsonl", rows)
    src = file_source(path, skip_bad_rows=True, shuffle=False)
    assert [r.prompt for r in src.take(4)] == ["q0", "q1", "q2", "q3"]
    assert src.metrics()["data/skipped_rows"] == 3
    assert [m.split(": ")[0] for m in src.bad.messages] == [f"{path}:3", f"{path}:4", f"{path}:5"]
    with pytest.raises(BadDataError, match="no usable rows"):
        file_source(_write_jsonl(tmp_path / "all_bad.jsonl", ["{", "{"]), skip_bad_rows=True)


def test_heldout_is_fixed_and_disjoint_from_train():
    src = builtin_source("arithmetic", seed=0, default_heldout=50)
    held = src.heldout()
    assert len(held) == 50 and held == src.heldout(50) and src.heldout(5) == held[:5]
    assert not {r.prompt for r in held} & {r.prompt for r in src.take(500)}


def test_builtin_records_rebuild_a_verifiable_problem():
    for task in TASKS.values():
        for record in builtin_source(task.name, seed=2).take(20):
            problem = builtin_problem(record)
            assert problem.prompt_id == record.prompt_id
            assert task.verify(problem, record.metadata["solution"]) == 1.0
            json.dumps(record.metadata)  # metadata must survive checkpoints and logs


def test_make_source_from_config(tmp_path):
    path = _write_jsonl(tmp_path / "t.jsonl", [{"q": f"x{i}", "a": "#### 3"} for i in range(3)])
    evals = _write_jsonl(tmp_path / "e.jsonl", [{"q": "held", "a": "#### 4"}])
    cfg = load_config(None, ["data.source=jsonl", f"data.path={path}", f"data.eval_path={evals}",
                             "data.prompt_field=q", "data.answer_field=a", "data.reference_extract=gsm8k"])
    src = make_source(cfg.data)
    assert sorted(r.prompt for r in src.take(3)) == ["x0", "x1", "x2"]
    assert src.heldout() == [PromptRecord(stable_id("held"), "held", "4", {"solution": "#### 4", "row": 1})]
    assert cfg.data.resolved_verifier == "math"
    builtin = make_source(load_config(None, ["data.task=countdown", "data.train_size=4", "data.level=2"]).data)
    assert builtin.size == 4 and {r.metadata["level"] for r in builtin.take(8)} == {2}
