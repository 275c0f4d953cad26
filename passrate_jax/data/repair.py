"""The testbed task ``repair`` (configs/testbed.yaml): column addition whose answers may slip and repair.

A response is arithmetic's column lines and ``=> answer`` (``tasks.py``), except that a column total may
be written one too high and then repaired on the next line, which redoes that column::

    457+168        7+8=15
                   5+6+1=13
                   redo 5+6+1=12
                   4+1+1=6
                   => 625

Half of the reference solutions (chosen by a hash of the problem) slip once, at a column chosen the same
way, and repair it; the warm start imitates both, so the model slips at some rate and repairs some of
its slips. An outcome is then made along the whole answer rather than decided by its first line, as in
the worked format, where a misread copied into the first line is carried through consistently (issue 38:
the regime where Prefix Sampling's premise, a prefix *shifting* a group's pass rate, can hold). Repairs
and the mix of 1- to 4-digit levels spread answer lengths.

The verifier accepts a false column line only when its total is exactly one too high and the next line
redoes it (same terms, true total); any other false line, or a redo after a true line, scores 0. So every
digit of a reference solution still matters (a changed digit never leaves a valid response), and a slip
left unrepaired costs the reward.
"""

from __future__ import annotations

import hashlib
import re

from passrate_jax.data.verifiers import MAX_RESPONSE_CHARS, column_count, verify_arithmetic

SLIP_RATE = 0.5  # share of reference solutions that slip once and repair it
REDO = "redo "
_COLUMN = re.compile(r"([0-9]{1,2}(?:\+[0-9]{1,2}){0,10})=([0-9]{1,3})")


def _unit(text: str) -> float:
    """A stable uniform number in [0, 1) from ``text`` (the same in every process)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big") / 2.0 ** 64


def _column_lines(numbers: tuple[int, ...]) -> list[tuple[str, int]]:
    """(terms, total) of each column of a column addition, rightmost first; the carry is the last term."""
    texts, carry, out = [str(n) for n in numbers], 0, []
    for col in range(column_count(numbers)):
        terms = [int(t[-1 - col]) for t in texts if col < len(t)] + ([carry] if carry else [])
        total = sum(terms)
        out.append(("+".join(map(str, terms)), total))
        carry = total // 10
    return out


def slip_column(problem) -> int | None:
    """The column (0 = rightmost) whose total the reference solution writes one too high, or None."""
    key = problem.prompt
    if _unit(f"repair|slip|{key}") >= SLIP_RATE:
        return None
    return int(_unit(f"repair|column|{key}") * column_count(problem.numbers))


def solution(problem) -> str:
    """The reference response: the column lines, the slipped one (if any) followed by its redo, then
    ``=> answer``. Only addition problems (the testbed's levels)."""
    if problem.op != "+":
        raise ValueError(f"op = {problem.op!r}: the repair task is column addition only")
    slip, lines = slip_column(problem), []
    for col, (terms, total) in enumerate(_column_lines(problem.numbers)):
        if col == slip:
            lines += [f"{terms}={total + 1}", f"{REDO}{terms}={total}"]
        else:
            lines.append(f"{terms}={total}")
    return "\n".join(lines + [f"=> {problem.answer}"])


def _off_by(line: re.Match) -> int:
    """A column line's written total minus its true total (0: the line is true)."""
    return int(line[2]) - sum(int(t) for t in line[1].split("+"))


# Why an answer fails (:func:`fault`), in the order the verifier meets them along the answer.
FAULTS = ("malformed line", "slip not redone", "other false total", "redo of other terms or still false",
          "redo of a true line", "true lines, wrong answer")


def fault(problem, response: str) -> str | None:
    """None when ``response`` verifies; else the first rule it breaks, one of :data:`FAULTS` (benchmarks/
    repair_failures.py counts them: a fault a later line could have repaired, a slip not redone, against
    one no line can, shows whether a replayed prefix decides a group or shifts it). Never raises."""
    if not isinstance(response, str) or len(response) > MAX_RESPONSE_CHARS:
        return FAULTS[0]
    lines = response.rstrip(" \n").split("\n")
    kept, i = [], 0
    while i < len(lines) - 1:
        m = _COLUMN.fullmatch(lines[i])
        if m is None:
            # A well-formed redo after a true line redoes that line; any other unparsable line is malformed.
            redo_of_kept = lines[i].startswith(REDO) and kept and _COLUMN.fullmatch(lines[i][len(REDO):])
            return FAULTS[4] if redo_of_kept else FAULTS[0]
        off = _off_by(m)
        if off == 0:
            kept.append(lines[i])
            i += 1
            continue
        redo = _COLUMN.fullmatch(lines[i + 1][len(REDO):]) if lines[i + 1].startswith(REDO) else None
        if redo is None:
            return FAULTS[1] if off == 1 else FAULTS[2]
        if redo[1] != m[1] or _off_by(redo) != 0:
            return FAULTS[3]
        if off != 1:
            return FAULTS[2]
        kept.append(lines[i + 1][len(REDO):])
        i += 2
    return None if verify_arithmetic(problem, "\n".join(kept + lines[-1:])) == 1.0 else FAULTS[5]


def verify(problem, response: str) -> float:
    """1.0 iff ``response`` is a column addition (``verify_arithmetic``'s rules) in which every false
    column line has a total exactly one too high and is followed by its redo (same terms, true total),
    no redo follows a true line, and ``=> answer`` is right (:func:`fault` finds none). Never raises on
    bad output."""
    return 1.0 if fault(problem, response) is None else 0.0


def length_bound(spec) -> tuple[int, int]:
    """(prompt, solution) character bounds at an addition level ``spec`` (``tasks.ArithmeticLevel``):
    arithmetic's column lines, one of them written twice with a ``redo `` mark, then the answer."""
    prompt = spec.operands * spec.digits + spec.operands
    line = 2 * spec.operands + 5
    return prompt, (spec.digits + 1) * line + len(REDO) + len("=> ") + spec.digits + 1
