"""Warm-start demonstrations that misread the problem at a known rate.

RLVR mostly turns pass@k into pass@1: a warm start that solves a problem in some samples but not in
most leaves RL something to learn, while one trained to its capacity leaves almost nothing. A misread
demonstration copies one operand digit wrongly and then solves the misread problem correctly, working
and answer consistent with the misreading::

    457+168   (true problem)      demonstration:  7+8=15      (the 4 read as a 9)
                                                  5+6+1=12
                                                  9+1+1=11
                                                  => 1125

Every line of it is a true equation, so the format and the column arithmetic are learnt exactly as from
a clean demonstration; only the final answer is wrong for the true problem (the verifier scores it 0).
A model trained on a mixture learns to misread at about the demonstrations' rate, so its greedy answer
(each digit's most likely copy) stays right while a sampled answer is often wrong: high pass@8, low
pass@1. Levels below ``min_level`` keep clean demonstrations, so the easiest problems stay solved in
every sample (the all-right groups of a saturated regime).

    spec = Misreads(rate=0.5, min_level=3)
    text = problem.prompt + demonstration(problem, spec, seed=0, index=17)   # deterministic
"""

from __future__ import annotations

import dataclasses
import random

from passrate_jax.data.problem import Problem, hash_int, make_problem
from passrate_jax.data.tasks import _arithmetic_steps, reference_solution


@dataclasses.dataclass(frozen=True)
class Misreads:
    """``rate``: fraction of demonstrations at levels >= ``min_level`` that solve a misread problem."""
    rate: float = 0.0
    min_level: int = 1

    def __post_init__(self):
        if not 0.0 <= self.rate <= 1.0:
            raise ValueError(f"misread_rate = {self.rate}: must be in [0, 1]")
        if self.min_level < 1:
            raise ValueError(f"misread_min_level = {self.min_level}: must be >= 1")

    def applies(self, problem: Problem) -> bool:
        """Whether ``problem``'s level is one whose demonstrations may be misread."""
        return self.rate > 0.0 and problem.level >= self.min_level


NO_MISREADS = Misreads()


def _digit_choices(numbers: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """Every (operand index, digit position from the left, new digit) that keeps each operand's width
    (no new leading zero; a one-digit operand may become 0)."""
    out = []
    for i, n in enumerate(numbers):
        text = str(n)
        for j, old in enumerate(text):
            lowest = 1 if j == 0 and len(text) > 1 else 0
            out += [(i, j, d) for d in range(lowest, 10) if d != int(old)]
    return out


def misread(problem: Problem, rng: random.Random) -> Problem:
    """``problem`` with one operand digit read wrongly, drawn uniformly over the digit changes that keep
    every operand's width (and, for subtraction, top >= bottom): the problem a misreading solver solves.
    Its level is the true problem's; its prompt, id and answer are the misread problem's own."""
    if problem.task not in ("arithmetic", "worked"):
        raise ValueError(f"task = {problem.task!r}: misread demonstrations exist for arithmetic and worked only")
    choices = []
    for i, j, d in _digit_choices(problem.numbers):
        text = str(problem.numbers[i])
        numbers = problem.numbers[:i] + (int(text[:j] + str(d) + text[j + 1:]),) + problem.numbers[i + 1:]
        if problem.op != "-" or numbers[0] >= numbers[1]:
            choices.append(numbers)
    numbers = rng.choice(choices)  # never empty: lowering the bottom's or raising the top's digit is valid
    target = numbers[0] - numbers[1] if problem.op == "-" else sum(numbers)
    read = dataclasses.replace(problem, numbers=numbers, target=target)
    _, carries = _arithmetic_steps(read)
    return make_problem(problem.task, problem.op.join(map(str, numbers)) + "\n", answer=str(target),
                    level=problem.level, numbers=numbers, target=target, op=problem.op, carries=carries)


def demonstration(problem: Problem, spec: Misreads, seed: int, index: int) -> str:
    """The warm-start target response for the ``index``-th training problem of ``seed``: with
    probability ``spec.rate`` (at levels >= ``spec.min_level``) the reference solution of a misread copy,
    else the reference solution. A pure function of its arguments."""
    if not spec.applies(problem):
        return reference_solution(problem)
    rng = random.Random(hash_int(f"misread|{seed}|{index}|{problem.prompt_id}"))
    if rng.random() >= spec.rate:
        return reference_solution(problem)
    return reference_solution(misread(problem, rng))
