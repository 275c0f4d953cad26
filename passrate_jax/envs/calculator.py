"""A tool-use arithmetic environment: a calculator with numbered registers.

The task is an expression; the policy evaluates it one operation per turn with the calculator, which
stores every result in the next register, and finally answers::

    calc (2+7)*3             <- prompt (first observation)
    add 2 7                  <- assistant turn
    r1=9                     <- observation
    mul r1 3
    r2=27
    answer r2                <- ends the episode; reward 1 iff the answered value is the expression's

Grammar (one action per line, words separated by spaces; nothing else is accepted)::

    add|sub|mul OPERAND OPERAND     OPERAND = integer literal (-?digits, at most 6) | r1..r9 (a set register)
    answer OPERAND

Anything else is an error observation (``err: ...``) that leaves the state unchanged. The state is the
tuple of register values and the answer, so it changes with every successful operation. Levels 1..4
are the number of operations in the expression; operands are 1..9 (one character each: a small
character-level model learns to copy them quickly) and every intermediate value stays within
[-999, 999], so observations are a few characters long.
"""

from __future__ import annotations

import random
import re
from typing import NamedTuple

from passrate_jax.envs.base import EnvTask, Transition, sample_task, stable_hash

NAME = "calculator"
_OPS = {"add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b}
_SYMBOL = {"+": "add", "-": "sub", "*": "mul"}
_LITERAL = re.compile(r"-?\d{1,6}")
_REGISTER = re.compile(r"r([1-9])")
_MAX_REGISTERS = 9
_MAX_ABS = 10 ** 6      # bigger results are refused, so observations stay short whatever the policy does
_MAX_INTERMEDIATE = 999  # task generation: every value an expert computes


class CalcState(NamedTuple):
    """Register values r1, r2, ... in order of computation, and the answered value (None: not yet)."""
    registers: tuple[int, ...] = ()
    answer: int | None = None


def _draw_tree(rng: random.Random, ops: int):
    """A random expression tree with ``ops`` operations: a leaf int, or (symbol, left, right)."""
    if ops == 0:
        return rng.randint(1, 9)
    left = rng.randint(0, ops - 1)
    return (rng.choice("+-*"), _draw_tree(rng, left), _draw_tree(rng, ops - 1 - left))


def _render(tree) -> str:
    if isinstance(tree, int):
        return str(tree)
    sym, a, b = tree
    wrap = lambda t: _render(t) if isinstance(t, int) else f"({_render(t)})"  # noqa: E731
    return f"{wrap(a)}{sym}{wrap(b)}"


def _expert(tree) -> tuple[list[str], int, bool]:
    """Post-order actions computing ``tree`` (left subtree first), its value, and whether every
    intermediate value stays within the generation bound."""
    actions: list[str] = []
    ok = True

    def visit(t) -> tuple[str, int]:
        nonlocal ok
        if isinstance(t, int):
            return str(t), t
        sym, a, b = t
        (ra, va), (rb, vb) = visit(a), visit(b)
        value = _OPS[_SYMBOL[sym]](va, vb)
        ok = ok and abs(value) <= _MAX_INTERMEDIATE
        actions.append(f"{_SYMBOL[sym]} {ra} {rb}")
        return f"r{len(actions)}", value

    ref, value = visit(tree)
    return actions + [f"answer {ref}"], value, ok


class CalculatorEnv:
    """See the module docstring. Stateless object: every method is a pure function."""
    name = NAME
    levels = 4
    max_turns = 6  # the hardest level needs 5 turns: one slack turn for a recovered mistake

    def sample(self, seed: int, split: str, index: int, level: int | None = None, max_level: int = 0) -> EnvTask:
        return sample_task(NAME, self.levels, self._draw, seed=seed, split=split, index=index, level=level,
                           max_level=max_level)

    def _draw(self, rng: random.Random, level: int) -> EnvTask | None:
        tree = _draw_tree(rng, level)
        actions, value, ok = _expert(tree)
        if not ok:
            return None
        prompt = f"calc {_render(tree)}\n"
        return EnvTask(NAME, stable_hash(f"{NAME}|{prompt}"), level, prompt, (value,), tuple(actions))

    def reset(self, task: EnvTask) -> tuple[CalcState, str]:
        return CalcState(), task.prompt.rstrip("\n")

    def _operand(self, state: CalcState, word: str) -> int | str:
        """The value of an operand word, or an error message."""
        if _LITERAL.fullmatch(word):
            return int(word)
        m = _REGISTER.fullmatch(word)
        if m is None:
            return "bad operand"
        k = int(m.group(1))
        return state.registers[k - 1] if k <= len(state.registers) else f"r{k} unset"

    def step(self, task: EnvTask, state: CalcState, action: str) -> Transition:
        def error(message: str) -> Transition:
            return Transition(state, f"err: {message}", False, True)

        words = action.split(" ")
        verb, args = words[0], words[1:]
        if verb in _OPS:
            if len(args) != 2:
                return error(f"{verb} takes 2 operands")
            values = [self._operand(state, w) for w in args]
            bad = next((v for v in values if isinstance(v, str)), None)
            if bad is not None:
                return error(bad)
            if len(state.registers) >= _MAX_REGISTERS:
                return error("registers full")
            value = _OPS[verb](*values)
            if abs(value) > _MAX_ABS:
                return error("overflow")
            new = state._replace(registers=state.registers + (value,))
            return Transition(new, f"r{len(new.registers)}={value}", False, False)
        if verb == "answer":
            if len(args) != 1:
                return error("answer takes 1 operand")
            value = self._operand(state, args[0])
            if isinstance(value, str):
                return error(value)
            return Transition(state._replace(answer=value), f"answered {value}", True, False)
        return error("unknown action")

    def reward(self, task: EnvTask, state: CalcState) -> float:
        return float(state.answer is not None and state.answer == task.spec[0])

    def state_json(self, state: CalcState) -> dict:
        return {"registers": list(state.registers), "answer": state.answer}
