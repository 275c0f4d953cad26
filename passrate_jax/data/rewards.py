"""Rewards for prompt records: extract the response's final answer, compare it with the reference.

    rewarder = Rewarder.from_config(cfg.data)
    rewards = rewarder(records, responses)      # float32 [n], each 0.0 or 1.0
    metrics.update(rewarder.metrics())          # verifier timeouts / errors, counted
    rewarder.close()

Verifiers (``DataConfig.verifier``):
- ``task``: the built-in task's exact step-by-step verifier (``passrate_jax.data.tasks``), for records
  of the built-in source or of its TFDS build;
- ``exact``: the extracted answer equals the reference after whitespace and ``$`` are stripped;
- ``numeric``: both parse as numbers (integers with thousands separators, decimals, fractions ``a/b``,
  a trailing ``%`` is *not* a number) and are equal within ``rel_tol``;
- ``math``: numeric or exact first (in process, cheap), then math-verify's symbolic equivalence in a
  :class:`VerifierPool` with a per-call timeout; answers math-verify cannot decide in any timeout (deep
  nesting, integers of more than ``MAX_DIGITS`` digits, see :func:`too_complex`) score 0 without it.
- a reward plugin (``DataConfig.reward_fn``, ``"path/to/file.py:function"``): the user's
  ``fn(prompt, response, reference, **fields)`` run in the :class:`VerifierPool` with the same per-answer
  timeout; its bool or float is the reward as is (see ``passrate_jax.plugins``).
Nothing is ever ``eval``ed; on any failure the reward is 0.
"""

from __future__ import annotations

import fractions
import math
import re
from collections.abc import Sequence
from typing import Literal

import numpy as np

from passrate_jax.data.formatting import extract_answer
from passrate_jax.data.math_verify_pool import MAX_ANSWER_CHARS, VerifierPool, WarningCounter, math_equal
from passrate_jax.data.sources import PromptRecord, builtin_problem
from passrate_jax.data.tasks import TASKS
from passrate_jax.plugins import call_reward, load_reward_fn, preload_reward

VerifierKind = Literal["task", "exact", "numeric", "math"]
# Numbers longer than this are not parsed: Fraction of a 10,000-digit string is slow and no reference
# answer needs it.
_MAX_NUMBER_CHARS = 64
_NUMERIC = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d{1,3})?(?:/[-+]?\d+(?:\.\d*)?)?")
# Answers math-verify would spend seconds on, refused up front (0 reward, counted as "too_complex")
# so that they do not each burn a timeout and a worker restart: bracket nesting deeper than this (its
# LaTeX parser is exponential in nested bare groups: depth 10 takes ~2.5 s) ...
MAX_NESTING = 6
# ... and integers too large to compute at all: sympy evaluates an integer power or factorial exactly,
# in C code no signal interrupts, so 9999999^{9999999} (70 million digits) would burn a whole timeout
# and a worker. Only a value estimated to exceed MAX_DIGITS digits is refused; anything smaller, such
# as 2^{123456} (37,166 digits, verified in ~0.1 s) or 3!!, goes to math-verify under the timeout.
# 2^{3000000} (903,090 digits) verifies in ~0.7 s on a loaded 2-core CPU.
MAX_DIGITS = 2_000_000
# Literal integer power towers (a^b, a^{b}, a^{b^{c}}, with braces) and factorial chains (n!, n!!):
# math-verify reads n!! as (n!)!, as sympy does.
_TOWER = re.compile(r"\d+(?:\s*\^\s*\{?\s*[-+]?\d+)+")
_FACTORIALS = re.compile(r"(\d+)((?:\s*!)+)")
_LOG10_MAX = math.log10(MAX_DIGITS)
# Wrappers a model (or a dataset) puts around a plain number: $...$, \(...\), \text{...}, a final period.
_STRIP = re.compile(r"^\$+|\$+$|^\\\(|\\\)$|\.$")


def _normalise(text: str) -> str:
    text = text.strip()
    previous = None
    while previous != text:
        previous, text = text, _STRIP.sub("", text).strip()
    return text


def _log10_digits_of_tower(text: str) -> float:
    """log10 of the number of digits of the literal power tower ``text`` (right-associative)."""
    numbers = [abs(int(n)) for n in re.findall(r"\d+", text)]
    log10_value = math.log10(max(numbers[-1], 1))  # log10 of the exponent evaluated so far
    for base in reversed(numbers[:-1]):
        if base <= 1:
            return 0.0
        digits_log10 = log10_value + math.log10(math.log10(base))  # log10(exponent * log10(base))
        if digits_log10 > _LOG10_MAX:
            return digits_log10
        log10_value = 10 ** log10_value * math.log10(base)  # log10(base ** exponent)
    return math.log10(max(log10_value, 1.0))


def _log10_digits_of_factorials(n: int, bangs: int) -> float:
    """log10 of the number of digits of n followed by ``bangs`` factorials, each of the one before."""
    value_log10 = math.log10(max(n, 1))
    for _ in range(bangs):
        if value_log10 > _LOG10_MAX:  # the argument alone has more digits than allowed
            return math.inf
        value = 10 ** value_log10
        value_log10 = math.lgamma(value + 1) / math.log(10)  # log10(value!)
    return math.log10(max(value_log10, 1.0))


def too_large(answer: str) -> bool:
    """Whether ``answer`` holds a literal integer power or factorial with more than ``MAX_DIGITS`` digits."""
    if any(_log10_digits_of_tower(m[0]) > _LOG10_MAX for m in _TOWER.finditer(answer)):
        return True
    return any(_log10_digits_of_factorials(int(m[1]), m[2].count("!")) > _LOG10_MAX
               for m in _FACTORIALS.finditer(answer))


def too_complex(answer: str) -> bool:
    """Whether ``answer`` is too long, too deeply nested (see ``MAX_NESTING``), or holds an integer too
    large to compute (see ``MAX_DIGITS``) for math-verify to decide within any timeout."""
    if len(answer) > MAX_ANSWER_CHARS or too_large(answer):
        return True
    depth = 0
    for ch in answer:
        if ch in "{([":
            depth += 1
            if depth > MAX_NESTING:
                return True
        elif ch in "})]":
            depth = max(0, depth - 1)
    return False


def exact_match(prediction: str | None, reference: str) -> float:
    """1.0 iff ``prediction`` equals ``reference`` after stripping whitespace, ``$`` and a final period."""
    if not isinstance(prediction, str):
        return 0.0
    return float(_normalise(prediction) == _normalise(reference))


def parse_number(text: str | None) -> fractions.Fraction | None:
    """``text`` as an exact fraction: "1,234", "-0.5", "3/4", "1e-3", "\\frac{3}{4}"; None otherwise."""
    if not isinstance(text, str):
        return None
    text = _normalise(text).replace(",", "").replace(" ", "")
    m = re.fullmatch(r"-?\\[dt]?frac\{(\d+)\}\{(\d+)\}", text)
    if m:
        text = ("-" if text.startswith("-") else "") + f"{m[1]}/{m[2]}"
    if len(text) > _MAX_NUMBER_CHARS or not _NUMERIC.fullmatch(text):
        return None
    try:
        if "/" in text:
            num, den = text.split("/")
            return fractions.Fraction(num) / fractions.Fraction(den)
        return fractions.Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None


def numeric_match(prediction: str | None, reference: str, rel_tol: float = 1e-6) -> float:
    """1.0 iff both are numbers (see :func:`parse_number`) equal exactly or within ``rel_tol``
    (relative to the reference; absolute below magnitude 1), so 0.333333 does not match 1/3 but 0.5,
    1/2 and 2/4 match each other."""
    a, b = parse_number(prediction), parse_number(reference)
    if a is None or b is None:
        return 0.0
    if a == b:
        return 1.0
    return float(abs(a - b) <= rel_tol * max(1, abs(b)))


class Rewarder:
    """Scores responses to prompt records with one verifier and answer-extraction mode, or with the
    reward plugin ``reward_fn`` (which then replaces both).

    ``math`` verification runs in a lazily started :class:`VerifierPool`; call :meth:`close` (or use it
    as a context manager) to stop its workers. :meth:`metrics` reports the pool's counted failures.
    """

    def __init__(self, verifier: VerifierKind = "math", extract: str = "boxed", *, timeout_s: float = 5.0,
                 workers: int = 2, counter: WarningCounter | None = None, reward_fn: str = "") -> None:
        if verifier not in ("task", "exact", "numeric", "math"):
            raise ValueError(f"verifier = {verifier!r}: must be one of task, exact, numeric, math")
        self.verifier = verifier
        self.reward_fn = reward_fn
        self.extract = extract
        self.timeout_s = float(timeout_s)
        self.counter = counter if counter is not None else WarningCounter()
        self._pool = None
        if reward_fn:
            load_reward_fn(reward_fn)  # a wrong spec or signature fails here, not in a worker
            self._pool = VerifierPool(workers, timeout_s, self.counter, setup=(preload_reward, (reward_fn,)))
        elif verifier == "math":
            self._pool = VerifierPool(workers, timeout_s, self.counter, preload=("math_verify",))

    @classmethod
    def from_config(cls, cfg) -> Rewarder:
        """From a :class:`passrate_jax.run.config.DataConfig`, with ``verifier: auto`` resolved."""
        return cls(cfg.resolved_verifier, cfg.answer_extract, timeout_s=cfg.verify_timeout_s,
                   workers=cfg.verify_workers, reward_fn=cfg.reward_fn)

    def __call__(self, records: Sequence[PromptRecord], responses: Sequence[str]) -> np.ndarray:
        """Rewards float32 [len(records)]: 0.0 or 1.0, or a plugin's value (0.0 where it raised, timed
        out or returned a non-finite number); never raises on bad model output."""
        if len(records) != len(responses):
            raise ValueError(f"{len(records)} records but {len(responses)} responses")
        if self.reward_fn:
            calls = [(self.reward_fn, r.prompt, text, r.answer, dict(r.metadata))
                     for r, text in zip(records, responses)]
            return np.asarray(self._pool.map(call_reward, calls), np.float32)
        if self.verifier == "task":
            return np.asarray([TASKS[r.metadata["task"]].verify(builtin_problem(r), text)
                               for r, text in zip(records, responses)], np.float32)
        answers = [extract_answer(text, self.extract) for text in responses]
        if self.verifier == "exact":
            rewards = [exact_match(a, r.answer) for a, r in zip(answers, records)]
        elif self.verifier == "numeric":
            rewards = [numeric_match(a, r.answer) for a, r in zip(answers, records)]
        else:
            rewards = self._math(answers, [r.answer for r in records])
        return np.asarray(rewards, np.float32)

    def _math(self, answers: list[str | None], references: list[str]) -> list[float]:
        rewards = [max(numeric_match(a, ref), exact_match(a, ref)) for a, ref in zip(answers, references)]
        # Only answers the cheap checks rejected go to the pool; an absent answer is simply wrong.
        todo = []
        for i, (reward, answer) in enumerate(zip(rewards, answers)):
            if reward == 0.0 and answer:
                if too_complex(answer):
                    self.counter.warn("too_complex", f"answer {answer[:80]!r} not verified")
                else:
                    todo.append(i)
        # math-verify's own limit applies to each of its three steps (two parses, one comparison), so a
        # quarter of ours (whole seconds: it uses signal.alarm) lets it give up before the pool kills a worker.
        seconds = max(1, int(self.timeout_s // 4))
        results = self._pool.map(math_equal, [(answers[i], references[i], seconds) for i in todo])
        for i, value in zip(todo, results):
            rewards[i] = 1.0 if value == 1.0 else 0.0
        return rewards

    def metrics(self) -> dict[str, int]:
        return self.counter.metrics()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()

    def __enter__(self) -> Rewarder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
