"""The testbed task ``repair`` (passrate_jax/data/repair.py) and its preset configs/testbed.yaml: slips
that are redone verify, slips left alone or redone wrongly do not, and the preset meets the premises
that can be read off its config (issue 38). The generic task tests (test_tasks.py) cover it too."""

import importlib.util
import pathlib

import numpy as np
import pytest

from passrate_jax.data import repair
from passrate_jax.data.tasks import TASKS, Problem, reference_solution
from passrate_jax.run.config import load_config
from passrate_jax.study.runner import FULL

TASK = TASKS["repair"]
EXAMPLE = "7+8=15\n5+6+1=13\nredo 5+6+1=12\n4+1+1=6\n=> 625"
P = Problem("repair", 0, "457+168\n", "625", 3, (457, 168), 625, "+")  # the module docstring's example


def _problems(n=400, weights=(1, 1, 1, 1)):
    return [TASK.sample(0, "train", i, lv) for lv, w in zip(TASK.difficulty_levels, weights) for i in range(int(n * w))]


@pytest.mark.parametrize("text, expected", [
    (EXAMPLE, None),
    ("7+8=15\n5+6+1=12\n4+1+1=6\n=> 625", None),                                      # no slip at all
    (EXAMPLE.replace("redo 5+6+1=12\n", ""), "slip not redone"),
    (EXAMPLE.replace("5+6+1=13", "5+6+1=14"), "other false total"),                    # +2, not +1
    (EXAMPLE.replace("redo 5+6+1=12\n", "").replace("=13", "=11"), "other false total"),  # -1, not redone
    (EXAMPLE.replace("redo 5+6+1=12", "redo 5+6+1=13"), "redo of other terms or still false"),
    (EXAMPLE.replace("redo 5+6+1=12", "redo 6+5+1=12"), "redo of other terms or still false"),
    ("7+8=15\nredo 7+8=15\n5+6+1=12\n4+1+1=6\n=> 625", "redo of a true line"),
    ("redo 7+8=15\n5+6+1=12\n4+1+1=6\n=> 625", "malformed line"),                      # nothing before it
    ("7+8=15\nredo 7+8 = 15\n5+6+1=12\n4+1+1=6\n=> 625", "malformed line"),             # a redo, malformed
    ("7+8=15\n5+6+1=12\n4 +1+1=6\n=> 625", "malformed line"),
    ("7+8=15\n5+6=11\n4+1=5\n=> 515", "true lines, wrong answer"),                     # the carry dropped
    ("7+8=15\n5+6+1=12\n=> 625", "true lines, wrong answer"),                           # a column missing
])
def test_the_documented_example_and_why_its_variants_fail(text, expected):
    assert repair.fault(P, text) == expected
    assert repair.verify(P, text) == float(expected is None)


def test_half_the_references_slip_once_and_repair_it():
    problems = _problems()
    slipped = [p for p in problems if repair.slip_column(p) is not None]
    assert 0.45 <= len(slipped) / len(problems) <= 0.55
    for p in slipped[:50]:
        text = reference_solution(p)
        assert text.count("redo ") == 1 and TASK.verify(p, text) == 1.0
        unrepaired = "\n".join(line for line in text.split("\n") if not line.startswith("redo "))
        assert TASK.verify(p, unrepaired) == 0.0
    # The slipped column is spread over the answer, not always its first line.
    assert len({repair.slip_column(p) for p in slipped if len(str(p.numbers[0])) == 4}) == 4


def test_testbed_preset_meets_the_premises_its_config_decides():
    cfg = load_config("configs/testbed.yaml")
    assert cfg.data.task == "repair" and cfg.warm_start.misread_rate == 0.0
    # Revisits: GRPO opens B prompts a step; over the full study's horizon each train prompt >= 4 times.
    steps = int(next(o for o in FULL if o.startswith("steps=")).split("=")[1])
    assert cfg.allocation.num_prompts * steps / cfg.data.train_size >= 4
    # Lengths: with the preset's train level weights, p90 / median of the reference answers is >= 2.
    lengths = np.array([len(reference_solution(p)) for p in _problems(100, cfg.data.level_weights)])
    assert np.percentile(lengths, 90) / np.median(lengths) >= 2.0
    # Every answer fits the sampler and the warm start.
    longest = max(sum(TASK.max_chars(lv)) for lv in TASK.difficulty_levels)
    assert longest + 1 <= cfg.warm_start.max_len and TASK.max_chars(4)[1] + 1 <= cfg.sampling.max_new_tokens


def test_subtraction_is_refused():
    with pytest.raises(ValueError, match="op = '-'"):
        repair.solution(Problem("repair", 0, "9-3\n", "6", 1, (9, 3), 6, "-"))


_spec = importlib.util.spec_from_file_location(
    "repair_failures_bench", pathlib.Path(__file__).parents[1] / "benchmarks" / "repair_failures.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_group_kinds_are_prefix_samplings_buckets():
    assert [bench.group_kind(s, 8) for s in range(9)] == [
        "all wrong", "hard", "hard", "mixed", "mixed", "mixed", "easy", "easy", "all right"]


def test_the_benchmark_counts_each_failed_answer_by_its_fault_and_group():
    slip = EXAMPLE.replace("redo 5+6+1=12\n", "")
    redo_true = "7+8=15\nredo 7+8=15\n5+6+1=12\n4+1+1=6\n=> 625"
    groups = [(P, [EXAMPLE] * 7 + [slip]),                      # easy: one slip not redone
              (P, [EXAMPLE] + [slip] * 3 + [redo_true] * 4),    # hard
              (P, [EXAMPLE] * 8)]
    out = bench.tally(groups, 8, examples=1)
    assert out["easy"]["groups"] == 1 and out["easy"]["answers"] == 8
    assert out["easy"]["faults"] == {"slip not redone": 1}
    assert out["hard"]["faults"] == {"redo of a true line": 4, "slip not redone": 3}
    assert out["hard"]["examples"]["slip not redone"] == ["457+168 | " + slip.replace("\n", " / ")]
    assert out["all right"] == {"groups": 1, "answers": 8, "faults": {}, "examples": {}}
