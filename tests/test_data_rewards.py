"""Verifiers: exact, numeric and math-verify equivalence; the timeout pool scores 0 and counts, never crashes."""

import operator
import os
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from passrate_jax.config import load_config
from passrate_jax.data.math_verify_pool import VerifierPool, WarningCounter
from passrate_jax.data.rewards import Rewarder, exact_match, numeric_match, parse_number
from passrate_jax.data.sources import PromptRecord, builtin_source


def _records(answers):
    return [PromptRecord(i, f"question {i}", a) for i, a in enumerate(answers)]


@pytest.fixture(scope="module")
def math_rewarder():
    """One math rewarder for the module: its spawned workers import sympy once (seconds on 2 cores)."""
    with Rewarder("math", "boxed", timeout_s=3.0, workers=2) as rewarder:
        yield rewarder


@pytest.mark.parametrize("pred, ref, expected", [
    ("72", "72", 1.0), ("$72$", "72", 1.0), ("72.", "72", 1.0), (" 72 ", "72", 1.0),
    ("72.0", "72", 0.0), ("x=3", "3", 0.0), (None, "3", 0.0),
])
def test_exact(pred, ref, expected):
    assert exact_match(pred, ref) == expected


@pytest.mark.parametrize("pred, ref, expected", [
    ("0.5", "1/2", 1.0), ("2/4", "0.5", 1.0), ("\\frac{1}{2}", "0.5", 1.0), ("-\\dfrac{3}{4}", "-0.75", 1.0),
    ("1,000", "1000", 1.0), ("72.0", "72", 1.0), ("1e3", "1000", 1.0), ("$5$", "5", 1.0),
    ("0.3333333", "1/3", 1.0), ("0.333", "1/3", 0.0), ("71", "72", 0.0), ("1/0", "1", 0.0),
    ("50%", "0.5", 0.0), ("x", "1", 0.0), ("9" * 100, "1", 0.0), (None, "1", 0.0),
])
def test_numeric(pred, ref, expected):
    assert numeric_match(pred, ref) == expected


def test_parse_number_rejects_expressions():
    assert parse_number("2**10") is None and parse_number("__import__('os')") is None
    assert parse_number("3/4") == parse_number("0.75")


def test_math_equivalence(math_rewarder):
    cases = [  # (response, reference, reward)
        ("so \\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("\\boxed{0.5}", "\\frac{2}{4}", 1.0),
        ("\\boxed{\\frac{2}{4}}", "1/2", 1.0),
        ("\\boxed{50\\%}", "0.5", 1.0),
        ("\\boxed{x = 3}", "3", 1.0),
        ("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{1}{\\sqrt{2}}", 1.0),
        ("\\boxed{\\{2, 1\\}}", "\\{1, 2\\}", 1.0),
        ("\\boxed{\\frac{1}{3}}", "0.5", 0.0),
        ("\\boxed{x + 1}", "x - 1", 0.0),
        ("the answer is 0.5", "0.5", 0.0),  # no box: nothing was extracted
    ]
    rewards = math_rewarder(_records([c[1] for c in cases]), [c[0] for c in cases])
    assert rewards.dtype == np.float32
    assert rewards.tolist() == [c[2] for c in cases]


def test_task_verifier_through_the_rewarder():
    records = builtin_source("countdown", seed=5).take(6)
    responses = [r.metadata["solution"] for r in records[:3]] + ["=> 1", "", "\\boxed{3}"]
    rewarder = Rewarder.from_config(load_config(None, ["data.task=countdown"]).data)
    assert rewarder.verifier == "task"
    assert rewarder(records, responses).tolist() == [1, 1, 1, 0, 0, 0]


def test_pool_scores_timeouts_and_errors_zero_and_recovers():
    counter = WarningCounter()
    with VerifierPool(workers=2, timeout_s=0.5, counter=counter) as pool:
        # time.sleep(30) hangs far past the timeout; truediv(1, 0) raises; sleep returns None (not a number).
        start = time.monotonic()
        out = pool.map(operator.truediv, [(1, 2), (1, 0), (3, 4)])
        hung = pool.map(time.sleep, [(30,)])
        assert time.monotonic() - start < 20  # the hung call was cut off, not waited for
        assert out == [0.5, 0.0, 0.75] and hung == [0.0]
        assert counter.counts == {"error": 1, "timeout": 1, "restart": 1}
        # The replaced worker serves the next calls; calls beside a hung one finish on the other worker.
        # sum(range(10**13)) hangs in C code, where no signal-based timeout could interrupt it.
        mixed = pool.map(operator.add, [(1, 2), (2, 2)]) + pool.map(sum, [(range(10**13),), (range(3),), (range(4),)])
        assert mixed == [3.0, 4.0, 0.0, 3.0, 6.0]
        assert counter.metrics() == {"verify/error": 1, "verify/restart": 2, "verify/timeout": 2}
        assert pool.map(time.sleep, [(0,)]) == [0.0] and counter.counts["error"] == 2  # None is no reward


def test_pool_survives_a_worker_that_dies():
    counter = WarningCounter()
    with VerifierPool(workers=1, timeout_s=1.0, counter=counter) as pool:
        # os._exit kills the worker mid-call, as a segfault in a C extension would.
        assert pool.map(os._exit, [(3,)]) == [0.0]
        assert pool.map(operator.mul, [(6, 7)]) == [42.0]
        # A worker killed while idle, between calls, is replaced when the next call finds it gone.
        pool._slots[0].process.kill()
        pool._slots[0].process.join()
        assert pool.map(operator.mul, [(2, 3)]) == [6.0]
    assert counter.counts == {"error": 1, "restart": 2}


def test_a_worker_that_cannot_start_is_a_setup_error():
    with VerifierPool(workers=1, timeout_s=1.0, preload=("no_such_module_here",)) as pool:
        with pytest.raises(RuntimeError, match="died while starting"):
            pool.map(operator.add, [(1, 2)])


_PIECES = ["\\frac{", "}{", "}", "{", "^{", "10", "9", "0.5", "1/2", "\\sqrt{", "\\boxed{", "x", "=", "-", ",",
           "\\left(", "\\right)", "\\infty", "\\pi", "!", "%", "$", "\\\\", "é", "∞", "\U0001F600", "\x00", " "]
_ANSWER = st.one_of(
    st.text(max_size=40),                                                      # unicode noise
    st.lists(st.sampled_from(_PIECES), max_size=25).map("".join),             # LaTeX-shaped noise
    st.integers(1, 400).map(lambda n: "{" * n + "1" + "}" * n),                # deep nesting
    st.integers(2, 60).map(lambda n: "9" * n + "^{" + "9" * n + "}"),          # huge powers
    st.sampled_from(["9!!!!!!", "\\frac{1}{0}", "0^{-1}", "\\infty - \\infty", "1/2", "0.5", "\\frac{2}{4}"]),
)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.lists(_ANSWER, min_size=40, max_size=40), st.sampled_from(["1/2", "3", "\\sqrt{2}", "10^{100}"]))
def test_fuzz_math_rewards_are_binary(math_rewarder, answers, reference):
    """2,000 random and adversarial answers (50 batches of 40): rewards only 0 or 1, never an exception,
    and no batch takes longer than its answers' timeouts allow."""
    start = time.monotonic()
    rewards = math_rewarder(_records([reference] * len(answers)), [f"\\boxed{{{a}}}" for a in answers])
    assert set(rewards.tolist()) <= {0.0, 1.0}
    assert time.monotonic() - start < len(answers) * math_rewarder.timeout_s


def test_answers_that_stall_math_verify_score_zero_in_bounded_time(math_rewarder):
    stalls = ["10^{10^{10^{10}}}", "9999999^{9999999}", "{" * 12 + "1" + "}" * 12, "(" * 30 + "1" + ")" * 30]
    before = dict(math_rewarder.counter.counts)
    start = time.monotonic()
    rewards = math_rewarder(_records(["1"] * len(stalls)), [f"\\boxed{{{a}}}" for a in stalls])
    assert rewards.tolist() == [0.0] * len(stalls)
    # The tower is cut off by math-verify's own limit or by the pool; the rest are refused up front.
    assert time.monotonic() - start < math_rewarder.timeout_s + 5
    assert math_rewarder.counter.counts["too_complex"] - before.get("too_complex", 0) == 3
