"""Exact verifiers for the built-in tasks: response text -> reward 1.0 or 0.0.

Model output is parsed line by line with strict, anchored regular expressions whose numbers have a
bounded number of digits, then checked with integer arithmetic; nothing is ever ``eval``ed. Any
malformed response (wrong format, leading zeros, extra text, a non-string) scores 0.0 and never raises,
so a verifier cannot stop training however bad a sample is.

Every task shares the response layout: one step per line, then a final line ``=> N``. Trailing spaces
and newlines are ignored; anything else out of format is a failure.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from passrate_jax.data.problem import Problem

# Far above any reference solution (< 128 chars) yet small enough that parsing stays cheap: a runaway
# sample that never emitted eos is rejected without splitting megabytes of text.
MAX_RESPONSE_CHARS = 4096

# Decimal integers without leading zeros and with a digit cap, so int() never meets a pathological
# string (Python refuses int() of > 4300 digits with an exception).
_NUM = r"(0|[1-9][0-9]{0,17})"
_FINAL = re.compile(r"=> " + _NUM)
# Arithmetic column step, e.g. "5+6+1=12" or "12-8-1=3": a column's terms and their exact value.
_COLUMN = re.compile(r"([0-9]{1,2}(?:[+-][0-9]{1,2}){0,10})=([0-9]{1,3})")
_TERM = re.compile(r"([+-]?)([0-9]+)")
# Countdown operation, e.g. "7*3=21".
_OPERATION = re.compile(_NUM + r"([-+*])" + _NUM + "=" + _NUM)


def _lines(response: object) -> list[str] | None:
    """The response's lines with trailing blank space dropped; None when it cannot be a valid answer."""
    if not isinstance(response, str) or len(response) > MAX_RESPONSE_CHARS:
        return None
    text = response.rstrip(" \n")
    return text.split("\n") if text else None


def _final_answer(line: str) -> int | None:
    m = _FINAL.fullmatch(line)
    return int(m[1]) if m else None


def column_count(numbers: tuple[int, ...]) -> int:
    """Columns of a column addition/subtraction: the width of the widest operand."""
    return max(len(str(n)) for n in numbers)


def verify_arithmetic(problem: Problem, response: str) -> float:
    """1.0 iff ``response`` is a well-formed column computation with the right final answer.

    Required: exactly one step line per column (``column_count(problem.numbers)``), each a true equation
    using only the problem's operator (``+`` or ``-``) with at most ``operands + 1`` terms (the carry or
    borrow is one extra term), then ``=> answer`` equal to ``problem.answer``. Steps are checked for
    truth, not for being the reference's columns: the reward is for the answer, the format keeps the
    model writing its work (which Prefix Sampling replays).
    """
    lines = _lines(response)
    if lines is None or len(lines) != column_count(problem.numbers) + 1:
        return 0.0
    for line in lines[:-1]:
        m = _COLUMN.fullmatch(line)
        if m is None:
            return 0.0
        terms = _TERM.findall(m[1])
        if len(terms) > len(problem.numbers) + 1:
            return 0.0
        if any(sign and sign != problem.op for sign, _ in terms):
            return 0.0
        value = sum(-int(d) if sign == "-" else int(d) for sign, d in terms)
        if value != int(m[2]):
            return 0.0
    answer = _final_answer(lines[-1])
    return float(answer is not None and answer == problem.target)


def verify_worked(problem: Problem, response: str) -> float:
    """1.0 iff ``response`` is the worked format of a right answer: the problem copied exactly as given,
    column lines that :func:`verify_arithmetic` accepts, the check line ``<problem>=<answer>``, then
    ``=> answer`` equal to ``problem.answer``. A miscopied problem scores 0 whatever follows."""
    lines = _lines(response)
    expression = problem.prompt.rstrip("\n")
    if lines is None or len(lines) < 4 or lines[0] != expression:
        return 0.0
    answer = _final_answer(lines[-1])
    if answer is None or lines[-2] != f"{expression}={answer}":
        return 0.0
    return verify_arithmetic(problem, "\n".join(lines[1:-2] + lines[-1:]))


def verify_countdown(problem: Problem, response: str) -> float:
    """1.0 iff ``response`` reaches ``problem.target`` by valid operations.

    Each operation line ``a op b=c`` (op in ``+ - *``, non-negative integers) must take ``a`` and ``b``
    from the pool of available values (the given numbers, each usable once, plus results of earlier
    operations not yet consumed), and ``c`` must equal ``a op b`` exactly; ``c`` joins the pool. At
    least one operation is required and the final line ``=> N`` must equal both the last result and
    the target.
    """
    lines = _lines(response)
    if lines is None or len(lines) < 2:
        return 0.0
    pool = Counter(problem.numbers)
    result = None
    for line in lines[:-1]:
        m = _OPERATION.fullmatch(line)
        if m is None:
            return 0.0
        a, op, b, c = int(m[1]), m[2], int(m[3]), int(m[4])
        for value in (a, b):
            if pool[value] <= 0:
                return 0.0
            pool[value] -= 1
        exact = a + b if op == "+" else a - b if op == "-" else a * b
        if exact != c:
            return 0.0
        pool[c] += 1
        result = c
    answer = _final_answer(lines[-1])
    return float(answer is not None and answer == result == problem.target)
