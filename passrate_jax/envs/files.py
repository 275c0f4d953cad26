"""A small in-memory file-editing environment: edit the files until they match a goal, then say done.

    files a=cat b=dog        <- prompt: the files now ...
    goal a=catx c=dog        <- ... and the files wanted
    append a x               <- assistant turn
    a=catx                   <- observation: the changed file
    copy b c
    c=dog
    delete b
    b deleted
    done                     <- ends the episode; reward 1 iff the files equal the goal exactly

Grammar (one action per line, words separated by single spaces)::

    write NAME TEXT     create or overwrite          NAME = one letter a..e
    append NAME TEXT    add TEXT to the end           TEXT = 1..6 lowercase letters
    delete NAME
    copy NAME NAME      overwrite (or create) the second with the first's content
    done

Anything else, or an action on a missing file, is an error observation (``err: ...``) that leaves the
files unchanged. Contents are capped at 12 characters and the file system at 5 files. Levels 1..4 are
the number of edits the expert plan needs (the plan: for each goal file in name order, append when
its current content is a prefix of the goal, else copy a file that already holds the goal content,
else write; then delete what the goal lacks; then ``done``).
"""

from __future__ import annotations

import random
import re
from typing import NamedTuple

from passrate_jax.envs.base import EnvTask, Transition, sample_task, stable_hash

NAME = "files"
_NAMES = "abcde"
_NAME = re.compile(r"[a-e]")
_TEXT = re.compile(r"[a-z]{1,6}")
_MAX_CONTENT = 12
_MAX_FILES = 5
_TASK_CONTENT = 5  # task generation: no content longer than this, so prompts stay short


class FilesState(NamedTuple):
    """The files as sorted (name, content) pairs, and whether the policy said ``done``."""
    files: tuple[tuple[str, str], ...] = ()
    finished: bool = False


def _listing(files: dict[str, str]) -> str:
    return " ".join(f"{k}={v}" for k, v in sorted(files.items()))


def expert_plan(start: dict[str, str], goal: dict[str, str]) -> list[str]:
    """The canonical edit actions from ``start`` to ``goal`` (see the module docstring), ending in done."""
    cur, plan = dict(start), []
    for name in sorted(goal):
        want, have = goal[name], cur.get(name)
        if have == want:
            continue
        if have is not None and want.startswith(have):
            plan.append(f"append {name} {want[len(have):]}")
        else:
            src = next((n for n in sorted(cur) if n != name and cur[n] == want), None)
            plan.append(f"copy {src} {name}" if src else f"write {name} {want}")
        cur[name] = want
    plan += [f"delete {name}" for name in sorted(cur) if name not in goal]
    return plan + ["done"]


def _word(rng: random.Random, lo: int, hi: int) -> str:
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(lo, hi)))


class FilesEnv:
    """See the module docstring. Stateless object: every method is a pure function."""
    name = NAME
    levels = 4
    max_turns = 6  # the hardest level needs 5 turns (4 edits + done): one slack turn

    def sample(self, seed: int, split: str, index: int, level: int | None = None, max_level: int = 0) -> EnvTask:
        return sample_task(NAME, self.levels, self._draw, seed=seed, split=split, index=index, level=level,
                           max_level=max_level)

    def _draw(self, rng: random.Random, level: int) -> EnvTask | None:
        names = rng.sample(_NAMES[:4], rng.randint(1, 3))
        start = {n: _word(rng, 1, 4) for n in names}
        goal = dict(start)
        for _ in range(level):  # random edits; the level is the length of the plan that undoes them
            kind = rng.choice(("write", "append", "delete", "copy"))
            existing = sorted(goal)
            if kind == "write":
                goal[rng.choice(_NAMES[:4])] = _word(rng, 1, 4)
            elif kind == "append" and existing:
                n = rng.choice(existing)
                goal[n] += _word(rng, 1, 2)
            elif kind == "delete" and len(existing) > 1:
                del goal[rng.choice(existing)]
            elif kind == "copy" and existing:
                goal[rng.choice(_NAMES[:4])] = goal[rng.choice(existing)]
        if any(len(v) > _TASK_CONTENT for v in goal.values()):
            return None
        plan = expert_plan(start, goal)
        if len(plan) - 1 != level:
            return None
        prompt = f"files {_listing(start)}\ngoal {_listing(goal)}\n"
        spec = (tuple(sorted(start.items())), tuple(sorted(goal.items())))
        return EnvTask(NAME, stable_hash(f"{NAME}|{prompt}"), level, prompt, spec, tuple(plan))

    def reset(self, task: EnvTask) -> tuple[FilesState, str]:
        return FilesState(files=task.spec[0]), task.prompt.rstrip("\n")

    def step(self, task: EnvTask, state: FilesState, action: str) -> Transition:
        def error(message: str) -> Transition:
            return Transition(state, f"err: {message}", False, True)

        def changed(files: dict[str, str], observation: str) -> Transition:
            return Transition(state._replace(files=tuple(sorted(files.items()))), observation, False, False)

        files = dict(state.files)
        words = action.split(" ")
        verb, args = words[0], words[1:]
        if verb == "done" and not args:
            return Transition(state._replace(finished=True), "done", True, False)
        arity = {"write": 2, "append": 2, "delete": 1, "copy": 2}.get(verb)
        if arity is None or len(args) != arity:
            return error("bad action")
        if not _NAME.fullmatch(args[0]) or (verb == "copy" and not _NAME.fullmatch(args[1])):
            return error("bad name")
        if verb in ("write", "append") and not _TEXT.fullmatch(args[1]):
            return error("bad text")
        name = args[0]
        if verb != "write" and name not in files:
            return error(f"no file {name}")
        if verb == "delete":
            del files[name]
            return changed(files, f"{name} deleted")
        target, content = (args[1], files[name]) if verb == "copy" else (name, args[1])
        if verb == "append":
            content = files[name] + content
        if len(content) > _MAX_CONTENT:
            return error("too long")
        if target not in files and len(files) >= _MAX_FILES:
            return error("too many files")
        files[target] = content
        return changed(files, f"{target}={content}")

    def reward(self, task: EnvTask, state: FilesState) -> float:
        return float(state.finished and state.files == task.spec[1])

    def state_json(self, state: FilesState) -> dict:
        return {"files": dict(state.files), "finished": state.finished}
