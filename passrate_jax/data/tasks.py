"""Built-in procedural tasks with step-by-step reference solutions: column arithmetic and countdown.

    task = TASKS["arithmetic"]
    problem = task.sample(seed=0, split="train", index=17)          # deterministic
    text = problem.prompt + reference_solution(problem)              # supervised warm-start target
    reward = task.verify(problem, sampled_response)                  # 1.0 or 0.0

Responses are written one step per line and end with a line ``=> N``, so a prefix cut at a line break
is a partial solution or a partial mistake: the material Prefix Sampling replays (DESIGN 2.4). The
prompt is the raw model input and ends with a newline; the response is what follows it.

arithmetic, column addition from the rightmost column; each line is one column's digits, then the
incoming carry as a last ``+c`` term when non-zero, then the column total. The answer is the last
line's total followed by the earlier totals' last digits, bottom to top::

    457+168        7+8=15
                   5+6+1=12
                   4+1+1=6
                   => 625

column subtraction (top >= bottom): a column that must borrow writes its top digit plus ten (``12``),
the incoming borrow is a last ``-1`` term, and the answer is the lines' results bottom to top::

    402-158        12-8=4
                   10-5-1=4
                   4-1-1=2
                   => 244

worked, the same problems with the working around the columns written out: the problem copied (where
a misread shows), the column lines, the whole equation as a check (where the answer's digits are put
in order), then the answer; about 37 characters on levels 1-6 where arithmetic has 21::

    457+168        457+168
                   7+8=15
                   5+6+1=12
                   4+1+1=6
                   457+168=625
                   => 625

countdown, numbers sorted in the prompt; each operation uses two available values (a given number, at
most once each, or an earlier unconsumed result) and the last result is the target::

    2 3 7 9 -> 23  7*3=21
                   21+2=23
                   => 23

Splits: a problem is held out iff a hash of its canonical form (the prompt, with addition operands
sorted so ``a+b`` and ``b+a`` fall together) lands in the held-out fraction; sampling rejects draws of
the other split, so train and held-out can never share a problem.
"""

from __future__ import annotations

import dataclasses
import functools
import random
from collections.abc import Callable

from passrate_jax.data import repair
from passrate_jax.data.countdown import (COUNTDOWN_LEVELS, CountdownLevel, countdown_length, countdown_solution,
                                         draw_countdown)
from passrate_jax.data.problem import ID_MASK, Problem, hash_int, make_problem
from passrate_jax.data.verifiers import column_count, verify_arithmetic, verify_countdown, verify_worked

SPLITS = ("train", "heldout")
# Bounds the rejection loop of sample(): a level too narrow to hold a problem of the asked split
# fails loudly instead of spinning forever.
_MAX_DRAWS = 20_000


# ----------------------------------------------------------------------------------------------------------
# Arithmetic
# ----------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ArithmeticLevel:
    """Every operand has exactly ``digits`` digits (0..9 when ``digits`` is 1); the number of columns
    with a carry/borrow out lies in [min_carries, max_carries]. Subtraction has two operands, top >= bottom."""
    digits: int
    operands: int = 2
    op: str = "+"
    min_carries: int = 0
    max_carries: int | None = None

    def __post_init__(self):
        if not 1 <= self.digits <= 12:
            raise ValueError(f"digits = {self.digits}: must be in [1, 12]")
        # Up to 9 operands keeps every carry a single digit, which the length bound assumes.
        if not 2 <= self.operands <= 9:
            raise ValueError(f"operands = {self.operands}: must be in [2, 9]")
        if self.op not in "+-" or len(self.op) != 1:
            raise ValueError(f"op = {self.op!r}: must be '+' or '-'")
        if self.op == "-" and self.operands != 2:
            raise ValueError(f"operands = {self.operands}: subtraction takes exactly 2")
        hi = self.digits if self.max_carries is None else self.max_carries
        if not 0 <= self.min_carries <= hi <= self.digits:
            raise ValueError(f"carries in [{self.min_carries}, {self.max_carries}]: must lie within [0, digits]")


ARITHMETIC_LEVELS = (
    ArithmeticLevel(1),
    ArithmeticLevel(2, max_carries=0),
    ArithmeticLevel(2, min_carries=1),
    ArithmeticLevel(2, op="-"),
    ArithmeticLevel(3, min_carries=1),
    ArithmeticLevel(3, op="-", min_carries=1),
    ArithmeticLevel(3, operands=3),
    ArithmeticLevel(4, min_carries=2),
    ArithmeticLevel(4, op="-", min_carries=2),
    ArithmeticLevel(5, min_carries=3),
)

# Longer column problems for a regime where RL has room to learn (configs/headroom.yaml): every
# response has 2-5 column lines (about 33 tokens on average), and no-carry levels that a small model
# learns fully sit beside carry-heavy ones it rarely solves, so a group of 8 is often all right or all
# wrong at the start of RL (DESIGN 2.2's saturated regime).
COLUMN_LEVELS = (
    ArithmeticLevel(2, max_carries=0),
    ArithmeticLevel(3, max_carries=0),
    ArithmeticLevel(4, max_carries=0),
    ArithmeticLevel(3, min_carries=1),
    ArithmeticLevel(3, op="-", min_carries=1),
    ArithmeticLevel(4, min_carries=2),
    ArithmeticLevel(3, operands=3),
    ArithmeticLevel(5, min_carries=3),
)


def _addition_steps(numbers: tuple[int, ...]) -> tuple[list[str], int]:
    """Column lines of a column addition and the number of columns that carry."""
    texts = [str(n) for n in numbers]
    lines, carry, carries = [], 0, 0
    for col in range(column_count(numbers)):
        terms = [int(t[-1 - col]) for t in texts if col < len(t)] + ([carry] if carry else [])
        total = sum(terms)
        lines.append("+".join(map(str, terms)) + f"={total}")
        carry = total // 10
        carries += carry > 0
    return lines, carries


def _subtraction_steps(top: int, bottom: int) -> tuple[list[str], int]:
    """Column lines of a column subtraction (top >= bottom) and the number of columns that borrow."""
    t_text, b_text = str(top), str(bottom)
    lines, borrow, borrows = [], 0, 0
    for col in range(len(t_text)):
        digit = int(t_text[-1 - col])
        below = [int(b_text[-1 - col])] if col < len(b_text) else []
        taken = sum(below) + borrow
        lifted = digit + 10 if digit < taken else digit
        terms = [lifted] + below + ([borrow] if borrow else [])
        lines.append("-".join(map(str, terms)) + f"={lifted - taken}")
        borrow = int(lifted != digit)
        borrows += borrow
    return lines, borrows


def _arithmetic_steps(problem: Problem) -> tuple[list[str], int]:
    if problem.op == "-":
        return _subtraction_steps(*problem.numbers)
    return _addition_steps(problem.numbers)


def _draw_arithmetic(rng: random.Random, spec: ArithmeticLevel, level: int, task: str = "arithmetic") -> Problem | None:
    lo = 0 if spec.digits == 1 else 10 ** (spec.digits - 1)
    numbers = tuple(rng.randrange(lo, 10 ** spec.digits) for _ in range(spec.operands))
    if spec.op == "-":
        numbers = tuple(sorted(numbers, reverse=True))
        target = numbers[0] - numbers[1]
        _, carries = _subtraction_steps(*numbers)
    else:
        target = sum(numbers)
        _, carries = _addition_steps(numbers)
    hi = spec.digits if spec.max_carries is None else spec.max_carries
    if not spec.min_carries <= carries <= hi:
        return None
    prompt = spec.op.join(map(str, numbers)) + "\n"
    return make_problem(task, prompt, answer=str(target), level=level, numbers=numbers, target=target,
                    op=spec.op, carries=carries)


def _arithmetic_split_key(problem: Problem) -> str:
    numbers = sorted(problem.numbers) if problem.op == "+" else problem.numbers
    return problem.op.join(map(str, numbers))


def _arithmetic_solution(problem: Problem) -> str:
    lines, _ = _arithmetic_steps(problem)
    return "\n".join(lines + [f"=> {problem.answer}"])


def _worked_solution(problem: Problem) -> str:
    expression = problem.prompt.rstrip("\n")
    lines, _ = _arithmetic_steps(problem)
    return "\n".join([expression] + lines + [f"{expression}={problem.answer}", f"=> {problem.answer}"])


def _arithmetic_length(spec: ArithmeticLevel) -> tuple[int, int]:
    prompt = spec.operands * spec.digits + spec.operands
    # A column line: operands + 1 one-digit terms (the carry is < 10 with <= 9 operands; a borrowing
    # top digit "1d" takes the carry's place in subtraction), their signs, "=", a <= 2-digit total, "\n".
    line = 2 * spec.operands + 5
    return prompt, spec.digits * line + len("=> ") + spec.digits + 1


def _worked_length(spec: ArithmeticLevel) -> tuple[int, int]:
    prompt, solution = _arithmetic_length(spec)
    # The copied problem and its newline, then the check line: the problem, "=", the answer, newline.
    return prompt, solution + prompt + prompt + spec.digits + 2


# ----------------------------------------------------------------------------------------------------------
# The task record and registry
# ----------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Task:
    """A procedural task: per-level settings plus the functions that draw, solve, verify and bound it.

    Levels are numbered from ``first_level`` (1 unless the task was cut by :func:`task_with_levels`) to
    ``first_level + len(levels) - 1``, so a level keeps its number in every restriction.
    """
    name: str
    levels: tuple
    draw: Callable[[random.Random, object, int], Problem | None]
    split_key: Callable[[Problem], str]
    reference_solution: Callable[[Problem], str]
    verify: Callable[[Problem, str], float]
    length_bound: Callable[[object], tuple[int, int]]
    heldout_fraction: float = 0.1
    first_level: int = 1

    def __post_init__(self):
        if not 0.0 < self.heldout_fraction < 1.0:
            raise ValueError(f"heldout_fraction = {self.heldout_fraction}: must be in (0, 1)")

    @property
    def difficulty_levels(self) -> tuple[int, ...]:
        return tuple(range(self.first_level, self.first_level + len(self.levels)))

    def level_spec(self, level: int):
        """The settings of ``level`` (numbered as in the full task)."""
        if level not in self.difficulty_levels:
            raise ValueError(f"level = {level}: {self.name} has levels {self.difficulty_levels}")
        return self.levels[level - self.first_level]

    def prompt_text(self, problem: Problem) -> str:
        return problem.prompt

    def split_of(self, problem: Problem) -> str:
        """"heldout" or "train", from the canonical problem alone (never from how it was sampled)."""
        bucket = hash_int(f"split|{self.name}|{self.split_key(problem)}") / (ID_MASK + 1)
        return "heldout" if bucket < self.heldout_fraction else "train"

    def max_chars(self, level: int) -> tuple[int, int]:
        """Upper bounds (prompt characters, reference-solution characters) at ``level``, for sizing
        the sampler's context and generation length."""
        return self.length_bound(self.level_spec(level))

    def sample(self, seed: int, split: str, index: int, level: int | None = None) -> Problem:
        """The problem at ``index`` of ``split`` ("train" or "heldout"), a pure function of the arguments.

        With ``level`` None the level is drawn uniformly from ``difficulty_levels`` per index.
        """
        if split not in SPLITS:
            raise ValueError(f"split = {split!r}: must be one of {SPLITS}")
        rng = random.Random(hash_int(f"{self.name}|{seed}|{split}|{index}"))
        if level is None:
            level = rng.choice(self.difficulty_levels)
        spec = self.level_spec(level)
        for _ in range(_MAX_DRAWS):
            problem = self.draw(rng, spec, level)
            if problem is not None and self.split_of(problem) == split:
                return problem
        raise RuntimeError(f"{self.name} level {level} ({spec}) gave no {split} problem in {_MAX_DRAWS} "
                           "draws: the level is too narrow")


def arithmetic_task(levels: tuple[ArithmeticLevel, ...] = ARITHMETIC_LEVELS, heldout_fraction: float = 0.1) -> Task:
    """Column addition/subtraction written column by column with carries (see the module docstring)."""
    return Task("arithmetic", tuple(levels), _draw_arithmetic, _arithmetic_split_key, _arithmetic_solution,
                verify_arithmetic, _arithmetic_length, heldout_fraction)


def worked_task(levels: tuple[ArithmeticLevel, ...] = ARITHMETIC_LEVELS, heldout_fraction: float = 0.1) -> Task:
    """The arithmetic problems answered in the worked format: the problem copied, its columns, the
    whole equation as a check, then the answer (see the module docstring)."""
    return Task("worked", tuple(levels), functools.partial(_draw_arithmetic, task="worked"),
                _arithmetic_split_key, _worked_solution, verify_worked, _worked_length, heldout_fraction)


def countdown_task(levels: tuple[CountdownLevel, ...] = COUNTDOWN_LEVELS, heldout_fraction: float = 0.1) -> Task:
    """Reach a target from given numbers with + - *, one operation per line (see the module docstring)."""
    return Task("countdown", tuple(levels), draw_countdown, lambda p: p.prompt, countdown_solution,
                verify_countdown, countdown_length, heldout_fraction)


def columns_task(heldout_fraction: float = 0.1) -> Task:
    """Column arithmetic on :data:`COLUMN_LEVELS` (2- to 5-digit). Its problems are ``arithmetic``
    problems (``Problem.task``), so they are solved and verified exactly like those."""
    return dataclasses.replace(arithmetic_task(COLUMN_LEVELS, heldout_fraction), name="columns")


# The testbed's levels (configs/testbed.yaml): 1- to 4-digit addition, so answers run 1 to 4 columns.
REPAIR_LEVELS = (ArithmeticLevel(1), ArithmeticLevel(2, min_carries=1), ArithmeticLevel(3, min_carries=1),
                 ArithmeticLevel(4, min_carries=2))


def repair_task(heldout_fraction: float = 0.1) -> Task:
    """Column addition whose answers may slip and repair a column (passrate_jax/data/repair.py)."""
    return Task("repair", REPAIR_LEVELS, functools.partial(_draw_arithmetic, task="repair"), _arithmetic_split_key,
                repair.solution, repair.verify, repair.length_bound, heldout_fraction)


TASKS: dict[str, Task] = {"arithmetic": arithmetic_task(), "countdown": countdown_task(), "columns": columns_task(),
                          "worked": worked_task(), "repair": repair_task()}


def task_with_levels(name: str, max_level: int = 0, min_level: int = 1) -> Task:
    """Built-in task ``name`` restricted to its levels ``min_level``..``max_level`` (max_level 0: the
    last), numbered as in the full task. Verification does not depend on the level set, so
    ``TASKS[name].verify`` scores the restricted task's problems too."""
    task = TASKS[name]
    top = max_level or len(task.levels)
    if not 1 <= top <= len(task.levels):
        raise ValueError(f"max_level = {max_level}: {name} has levels 1..{len(task.levels)} (0: all)")
    if not 1 <= min_level <= top:
        raise ValueError(f"min_level = {min_level}: must be in [1, max_level = {top}]")
    if (min_level, top) == (1, len(task.levels)):
        return task
    return dataclasses.replace(task, levels=task.levels[min_level - 1:top], first_level=min_level)


def reference_solution(problem: Problem) -> str:
    """The step-by-step target response of a built-in problem (no trailing newline; eos follows)."""
    return TASKS[problem.task].reference_solution(problem)


def verify(problem: Problem, response: str) -> float:
    """Reward 1.0 or 0.0 of ``response`` to a built-in problem; never raises on bad model output."""
    return TASKS[problem.task].verify(problem, response)
