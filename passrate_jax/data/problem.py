"""One prompt of a built-in task (:class:`Problem`) and the stable hash its id and split come from."""

from __future__ import annotations

import dataclasses
import hashlib

ID_MASK = (1 << 63) - 1


def hash_int(text: str) -> int:
    """A stable 63-bit hash (unlike hash(), the same in every process and Python version)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big") & ID_MASK


@dataclasses.dataclass(frozen=True)
class Problem:
    """One prompt of a built-in task.

    ``numbers`` are the operands in prompt order (arithmetic) or the given numbers, sorted (countdown);
    ``target`` is the exact value of the answer; ``carries`` counts columns with a carry (borrow for
    subtraction) out, 0 for countdown; ``solution`` is countdown's generating operations
    ``(a, op, b, result)``, empty for arithmetic.
    """
    task: str
    prompt_id: int
    prompt: str
    answer: str
    level: int
    numbers: tuple[int, ...]
    target: int
    op: str = ""
    carries: int = 0
    solution: tuple[tuple[int, str, int, int], ...] = ()

    @property
    def metadata(self) -> dict:
        """What a prompt source carries beside (id, prompt, answer)."""
        return {"task": self.task, "level": self.level, "op": self.op, "carries": self.carries,
                "operations": len(self.solution)}


def make_problem(task: str, prompt: str, **fields) -> Problem:
    """A problem of ``task`` whose id is a stable hash of (task, prompt)."""
    return Problem(task=task, prompt_id=hash_int(f"{task}|{prompt}"), prompt=prompt, **fields)
