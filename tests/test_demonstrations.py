"""Misread warm-start demonstrations: consistent with the misreading, wrong for the true problem, at the
configured rate and levels; and the level window (data.min_level) that the headroom regime uses."""

import dataclasses
import hashlib
import json
import random

import numpy as np
import pytest

from passrate_jax.run.config import Config, ConfigError, load_config
from passrate_jax.configlib import to_dict
from passrate_jax.data.demonstrations import Misreads, demonstration, misread
from passrate_jax.data.tasks import TASKS, reference_solution, task_with_levels, verify
from passrate_jax.run.sft import cache_key, sft_batch
from passrate_jax.text.tokenizer import CharTokenizer

ARITH = TASKS["arithmetic"]


def _digits_changed(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    return sum(x != y for m, n in zip(a, b) for x, y in zip(str(m), str(n)))


@pytest.mark.parametrize("level", ARITH.difficulty_levels)
def test_misread_changes_one_digit_and_its_solution_is_consistent_but_wrong(level):
    for i in range(60):
        p = ARITH.sample(0, "train", i, level=level)
        m = misread(p, random.Random(i))
        # One operand digit read wrongly, every operand's width (so the column count) kept.
        assert (m.op, m.level, len(m.numbers)) == (p.op, p.level, len(p.numbers))
        assert [len(str(n)) for n in m.numbers] == [len(str(n)) for n in p.numbers]
        assert _digits_changed(p.numbers, m.numbers) == 1
        assert m.prompt == m.op.join(map(str, m.numbers)) + "\n"
        if m.op == "-":
            assert m.numbers[0] >= m.numbers[1] and m.target == m.numbers[0] - m.numbers[1]
        else:
            assert m.target == sum(m.numbers)
        text = reference_solution(m)
        # Working and answer match the misread problem; the real verifier scores them wrong on the true one.
        assert verify(m, text) == 1.0 and text.endswith(f"=> {m.target}")
        assert verify(p, text) == 0.0


def test_worked_misreads_show_in_the_copied_problem():
    worked = TASKS["worked"]
    for i in range(60):
        p = worked.sample(0, "train", i, level=5)
        m = misread(p, random.Random(i))
        text = reference_solution(m)
        assert m.task == "worked" and text.split("\n")[0] == m.prompt.rstrip("\n") != p.prompt.rstrip("\n")
        assert verify(m, text) == 1.0 and verify(p, text) == 0.0


def test_misread_draws_every_digit_position():
    p = ARITH.sample(0, "train", 0, level=7)  # three 3-digit operands: nine positions
    seen = {(i, j) for k in range(600) for m in [misread(p, random.Random(k))]
            for i, (a, b) in enumerate(zip(p.numbers, m.numbers)) for j in range(3) if str(a)[j] != str(b)[j]}
    assert len(seen) == 9


@pytest.mark.parametrize("rate, min_level", [(0.3, 3), (0.5, 1), (1.0, 5)])
def test_demonstrations_misread_at_the_configured_rate_and_levels(rate, min_level):
    spec = Misreads(rate, min_level)
    wrong = {True: 0, False: 0}
    count = {True: 0, False: 0}
    for i in range(3000):
        p = ARITH.sample(1, "train", i)
        text = demonstration(p, spec, seed=1, index=i)
        assert text == demonstration(p, spec, seed=1, index=i)  # a pure function
        lines = text.split("\n")
        assert len(lines) == len(reference_solution(p).split("\n"))
        corrupted = verify(p, text) == 0.0
        if corrupted:  # still correct working: every column line is a true equation, only the answer differs
            assert verify(dataclasses.replace(p, target=int(lines[-1][3:])), text) == 1.0
        eligible = p.level >= min_level
        count[eligible] += 1
        wrong[eligible] += corrupted
    assert wrong[False] == 0
    n = count[True]
    assert abs(wrong[True] / n - rate) <= 4 * np.sqrt(rate * (1 - rate) / n) + 1e-9


def test_rate_zero_gives_the_reference_solutions():
    for i in range(200):
        p = ARITH.sample(0, "train", i)
        assert demonstration(p, Misreads(), 0, i) == reference_solution(p)


def test_bad_misread_settings_fail_loudly():
    with pytest.raises(ValueError, match="misread_rate = 1.5"):
        Misreads(1.5)
    with pytest.raises(ValueError, match="misread_min_level = 0"):
        Misreads(0.5, 0)
    with pytest.raises(ValueError, match="arithmetic and worked only"):
        misread(TASKS["countdown"].sample(0, "train", 0), random.Random(0))
    with pytest.raises(ConfigError, match="warm_start.misread_rate = 0.5"):
        load_config(None, ["warm_start.misread_rate=0.5", "data.task=countdown"])


def test_level_window_keeps_level_numbers():
    t = task_with_levels("arithmetic", max_level=8, min_level=3)
    assert t.difficulty_levels == (3, 4, 5, 6, 7, 8)
    levels = {t.sample(0, "heldout", i).level for i in range(300)}
    assert levels == set(range(3, 9))
    p = t.sample(0, "train", 4, level=5)
    assert p == ARITH.sample(0, "train", 4, level=5)  # a level's problems do not depend on the window
    assert task_with_levels("arithmetic") is ARITH
    with pytest.raises(ValueError, match="min_level = 7"):
        task_with_levels("arithmetic", max_level=6, min_level=7)
    with pytest.raises(ConfigError, match="min_level = 7"):
        load_config(None, ["data.max_level=6", "data.min_level=7"])


def test_level_weights_shape_the_train_draws_only():
    from passrate_jax.data.configured import make_source

    weights = (4.0, 0.0, 1.0, 1.0, 1.0, 1.0)
    cfg = load_config(None, ["data.max_level=6", f"data.level_weights={list(weights)}"]).data
    weighted, uniform = make_source(cfg), make_source(load_config(None, ["data.max_level=6"]).data)
    records = weighted.take(4000)
    draws = [r.metadata["level"] for r in records]
    counts = np.bincount(draws, minlength=7)[1:]
    expected = 4000 * np.array(weights) / sum(weights)
    # Binomial counts: within 4 standard errors of their expectation; the zero-weight level never drawn.
    assert np.all(np.abs(counts - expected) <= 4 * np.sqrt(expected * (1 - expected / 4000)) + 1e-9), counts
    assert counts[1] == 0
    # A problem is a pure function of (seed, index) as before, drawn at its level like any other.
    again = make_source(cfg).take(50)
    assert [r.prompt for r in again] == [r.prompt for r in records[:50]]
    assert all(ARITH.sample(0, "train", i, level=r.metadata["level"]).prompt == r.prompt for i, r in enumerate(again))
    # The held-out prompts stay uniform: the same prompts with or without weights.
    assert [r.prompt for r in weighted.heldout(64)] == [r.prompt for r in uniform.heldout(64)]
    for bad in (["data.level_weights=[1,1]"], ["data.level_weights=[0,0,0,0,0,0]"],
                ["data.level_weights=[1,1,1,1,1,-1]"], ["data.level=2", "data.level_weights=[1,1,1,1,1,1]"]):
        with pytest.raises(ConfigError, match="level_weights = "):
            load_config(None, ["data.max_level=6", *bad])


def test_warm_start_cache_key_is_unchanged_by_default_and_follows_the_options():
    cfg = Config()
    legacy = {"model": to_dict(cfg.model), "task": "arithmetic", "max_level": 0, "seed": 0, "version": 1,
              "warm_start": {k: v for k, v in to_dict(dataclasses.replace(cfg.warm_start, cache_dir=None)).items()
                             if not k.startswith("misread") and k != "level_weights"}}
    # Warm starts cached before these options existed stay valid.
    assert cache_key(cfg) == hashlib.sha256(json.dumps(legacy, sort_keys=True).encode()).hexdigest()[:16]
    keys = {cache_key(load_config(None, o)) for o in (
        [], ["warm_start.misread_rate=0.5"], ["warm_start.misread_rate=0.5", "warm_start.misread_min_level=3"],
        ["data.min_level=2"], ["warm_start.level_weights=[2,1,1,1,1,1,1,1,1,1]"])}
    assert len(keys) == 5
    assert cache_key(load_config(None, ["warm_start.misread_min_level=3"])) == cache_key(cfg)


def test_sft_batch_trains_on_the_misread_demonstrations():
    tok = CharTokenizer()
    spec = Misreads(0.5, 2)
    tokens, mask = sft_batch("arithmetic", 0, 3, 16, tok, 72, 8, 2, spec)
    task = task_with_levels("arithmetic", 8, 2)
    for row, weights, i in zip(tokens, mask, range(48, 64)):
        p = task.sample(0, "train", i)
        assert tok.decode(row[weights > 0]) == demonstration(p, spec, 0, i)  # eos is dropped by decode
    plain, _ = sft_batch("arithmetic", 0, 3, 16, tok, 72, 8, 2)
    assert (tokens != plain).any()


def test_warm_start_level_weights_shape_the_demonstrations():
    tok = CharTokenizer()
    weights = (3.0, 0.0, 1.0, 1.0, 1.0, 1.0)
    tokens, _ = sft_batch("arithmetic", 0, 2, 700, tok, 48, 6, level_weights=weights)
    levels = []
    for row, i in zip(tokens, range(1400, 2100)):
        text = tok.decode(row[row != tok.pad_id])
        # Each row is the train problem at its index, drawn at its weighted level, with its reference solution.
        matches = [lv for lv in ARITH.difficulty_levels[:6] if text.startswith(ARITH.sample(0, "train", i, lv).prompt)]
        levels.append(matches[0])
    counts = np.bincount(levels, minlength=7)[1:]
    expected = 700 * np.array(weights) / sum(weights)
    assert np.all(np.abs(counts - expected) <= 4 * np.sqrt(expected) + 1e-9), counts
    assert counts[1] == 0  # a zero weight: never drawn
    again, _ = sft_batch("arithmetic", 0, 2, 700, tok, 48, 6, level_weights=weights)
    assert (again == tokens).all()  # a pure function of (seed, step)
    uniform, _ = sft_batch("arithmetic", 0, 2, 700, tok, 48, 6)
    assert (uniform != tokens).any()
    with pytest.raises(ValueError, match=r"warm_start.level_weights = \[1.0, 2.0\]"):
        sft_batch("arithmetic", 0, 0, 4, tok, 48, 6, level_weights=(1.0, 2.0))
    for bad, field in ((["warm_start.level_weights=[1,1]"], "warm_start.level_weights"),
                       (["data.level=2", "warm_start.level_weights=[1,1,1,1,1,1]"], "warm_start.level_weights")):
        with pytest.raises(ConfigError, match=f"{field} = "):
            load_config(None, ["data.max_level=6", *bad])
    assert load_config(None, ["data.max_level=6", "warm_start.enabled=false",
                              "warm_start.level_weights=[1,1]"]).warm_start.level_weights == (1.0, 1.0)


def test_columns_task_has_long_multi_line_solutions_and_verifies_as_arithmetic():
    cols = TASKS["columns"]
    problems = [cols.sample(0, "train", i) for i in range(2000)]
    lengths = [len(CharTokenizer().encode(reference_solution(p))) + 1 for p in problems]  # + eos
    assert np.mean(lengths) >= 30  # the headroom regime's "responses average >= 30 tokens"
    assert min(len(reference_solution(p).split("\n")) for p in problems) >= 3  # >= 2 column lines + answer
    assert {p.level for p in problems} == set(range(1, 9))
    for p in problems[:200]:
        assert p.task == "arithmetic" and verify(p, reference_solution(p)) == 1.0
        assert cols.split_of(p) == "train"
    assert sum(p.carries == 0 for p in problems if p.level <= 3) == sum(p.level <= 3 for p in problems)
