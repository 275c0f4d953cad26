"""The countdown task's levels, draws, reference solutions and length bounds (registered in
:mod:`passrate_jax.data.tasks`, whose docstring shows the format)."""

from __future__ import annotations

import dataclasses
import random

from passrate_jax.data.problem import Problem, make_problem


@dataclasses.dataclass(frozen=True)
class CountdownLevel:
    """``numbers`` given numbers in [1, max_number]; the generating solution combines ``operations + 1``
    of them (the rest are distractors) with ``operations`` operations into a target in [1, max_target]
    that is not itself a given number; every intermediate result is in [1, max_value] and differs
    from its operands (no ``x*1``)."""
    numbers: int
    operations: int
    max_number: int = 10
    max_target: int = 100
    max_value: int = 999

    def __post_init__(self):
        if not 2 <= self.numbers <= 6:
            raise ValueError(f"numbers = {self.numbers}: must be in [2, 6]")
        if not 1 <= self.operations < self.numbers:
            raise ValueError(f"operations = {self.operations}: must be in [1, numbers - 1]")
        if not 2 <= self.max_number <= self.max_value or not 2 <= self.max_target <= self.max_value:
            raise ValueError(f"max_number = {self.max_number}, max_target = {self.max_target}: "
                             f"must be in [2, max_value = {self.max_value}]")


COUNTDOWN_LEVELS = (
    CountdownLevel(3, 1),
    CountdownLevel(3, 2),
    CountdownLevel(4, 2, max_number=12),
    CountdownLevel(4, 3, max_number=12),
)


def draw_countdown(rng: random.Random, spec: CountdownLevel, level: int) -> Problem | None:
    given = [rng.randint(1, spec.max_number) for _ in range(spec.numbers)]
    pool = given[: spec.operations + 1]  # given is random, so its head is a random subset
    solution = []
    for _ in range(spec.operations):
        i, j = rng.sample(range(len(pool)), 2)
        a, b = pool[i], pool[j]
        op = rng.choice("+-*")
        if op == "-" and a < b:
            a, b = b, a
        c = a + b if op == "+" else a - b if op == "-" else a * b
        if not 1 <= c <= spec.max_value or c in (a, b):
            return None
        pool = [x for k, x in enumerate(pool) if k not in (i, j)] + [c]
        solution.append((a, op, b, c))
    target = pool[0]
    if target > spec.max_target or target in given:
        return None
    numbers = tuple(sorted(given))
    prompt = " ".join(map(str, numbers)) + f" -> {target}\n"
    return make_problem("countdown", prompt, answer=str(target), level=level, numbers=numbers, target=target,
                    solution=tuple(solution))


def countdown_solution(problem: Problem) -> str:
    lines = [f"{a}{op}{b}={c}" for a, op, b, c in problem.solution]
    return "\n".join(lines + [f"=> {problem.answer}"])


def countdown_length(spec: CountdownLevel) -> tuple[int, int]:
    number, target, value = (len(str(x)) for x in (spec.max_number, spec.max_target, spec.max_value))
    prompt = spec.numbers * (number + 1) + len("-> ") + target + 1
    return prompt, spec.operations * (3 * value + 3) + len("=> ") + target
