"""Verification that cannot hang or crash training: a spawned process pool with a per-call timeout.

    counter = WarningCounter()
    with VerifierPool(workers=2, timeout_s=5.0, counter=counter, preload=("math_verify",)) as pool:
        rewards = pool.map(math_equal, [(pred, ref), ...])     # floats; 0.0 for a call that failed
    metrics.update(counter.metrics())                            # {"verify/timeout": 1, ...}

Why a pool: math-verify's own timeout uses ``signal.alarm``, which only works on a process's main thread
and cannot interrupt C code (a huge integer power in sympy), so a pathological answer could stall the
training loop forever. Each call runs in a worker process instead; a call that outlives ``timeout_s``
scores 0 and its worker is killed and replaced while the other workers keep going. A call that raises,
returns a non-finite value or kills its worker also scores 0. Every such event is counted in a
:class:`WarningCounter` the loop reports as metrics; none of them raises. (A worker that cannot even
start, say math-verify is not installed, raises RuntimeError: that is a broken setup, not a bad answer.)

Workers use the "spawn" start method: forking a process that has initialised JAX (threads, device
handles) is unsafe. As with any spawned workers, a script that builds a pool must keep its top-level
work under ``if __name__ == "__main__":`` (workers re-import the main module).
"""

from __future__ import annotations

import collections
import importlib
import logging
import math
import multiprocessing
import multiprocessing.connection
import os
import re
import time
import traceback
from collections.abc import Callable, Iterable, Sequence

log = logging.getLogger(__name__)

# Answers longer than this are not sent to math-verify: no final answer is this long, and parsing cost
# grows with length (a runaway generation stuffed into \boxed{} would otherwise burn a whole timeout).
MAX_ANSWER_CHARS = 1000
# How long a worker may take to start (a spawned interpreter importing sympy) before the pool gives
# up; generous because a few shared cores can be slow. Start-up time is never charged to a call.
_STARTUP_TIMEOUT_S = 120.0
# Warnings logged in full per kind; after that they are only counted, so a bad run does not flood logs.
_LOGGED_PER_KIND = 5


class WarningCounter:
    """Counts verification events that scored 0 instead of raising, by kind ("timeout", "error",
    "restart", ...), and logs the first few of each kind."""

    def __init__(self) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self.last: dict[str, str] = {}  # the latest event of each kind, in short: what a stop line quotes

    def warn(self, kind: str, message: str, detail: str = "") -> None:
        self.counts[kind] += 1
        self.last[kind] = detail or message
        if self.counts[kind] <= _LOGGED_PER_KIND:
            log.warning("verifier %s (%d so far): %s", kind, self.counts[kind], message)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def metrics(self, prefix: str = "verify/") -> dict[str, int]:
        """Cumulative counts as metrics, e.g. ``{"verify/timeout": 2, "verify/error": 0, ...}``."""
        kinds = {"timeout", "error", "restart"} | set(self.counts)
        return {f"{prefix}{k}": self.counts[k] for k in sorted(kinds)}


def _where(trace: str) -> str:
    """`` at FILE:LINE`` of the innermost frame of a formatted traceback ('' when it has none), so a one-line
    report of an exception still says where it was raised."""
    frames = re.findall(r'File "([^"]+)", line (\d+)', trace or "")
    return f" at {frames[-1][0]}:{frames[-1][1]}" if frames else ""


def _worker(conn, preload: tuple[str, ...], setup: tuple | None = None) -> None:
    """A worker process: import ``preload``, run ``setup`` (``(fn, args)``, e.g. import a reward plugin),
    say ready, then run ``(fn, args)`` calls until told to stop.

    Exceptions travel back as text with their traceback: an exception object from arbitrary code may not pickle.
    """
    for name in preload:
        importlib.import_module(name)
    if setup is not None:
        setup[0](*setup[1])
    conn.send(("ready", os.getpid()))
    while True:
        message = conn.recv()
        if message is None:
            return
        fn, args = message
        try:
            reply = (True, fn(*args))
        except BaseException as e:  # noqa: BLE001 - any failure of verified code is a 0 reward, not a crash
            reply = (False, f"{type(e).__name__}: {e}", traceback.format_exc())
        try:
            conn.send(reply)
        except Exception as e:  # an unpicklable return value
            conn.send((False, f"cannot return {type(reply[1]).__name__}: {e}"))


class _Slot:
    """One worker process and the call it is running: (index, deadline), or None when idle."""

    def __init__(self, ctx, preload: tuple[str, ...], setup: tuple | None = None) -> None:
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_worker, args=(child, preload, setup), daemon=True)
        self.process.start()
        child.close()
        self.ready = False
        self.started = time.monotonic()
        self.call: tuple[int, float] | None = None

    def kill(self) -> None:
        self.process.kill()
        self.process.join()
        self.conn.close()


class VerifierPool:
    """Runs picklable functions in ``workers`` spawned processes, each call limited to ``timeout_s``.

    Workers start on the first :meth:`map` (so a pool no call needs costs nothing) and stay up between
    calls. A call is handed to an idle, started worker only, so its deadline (hand-over + ``timeout_s``)
    bounds its own run time, never a wait in a queue or a worker's start-up imports. A call past its
    deadline has its worker killed and replaced; the other workers keep going. ``setup = (fn, args)`` runs
    in each worker at start-up, after the ``preload`` imports (importing a reward plugin, say).
    """

    def __init__(self, workers: int = 2, timeout_s: float = 5.0, counter: WarningCounter | None = None,
                 preload: Sequence[str] = (), setup: tuple | None = None) -> None:
        if workers < 1:
            raise ValueError(f"workers = {workers}: must be >= 1")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s = {timeout_s}: must be > 0")
        self.workers = workers
        self.timeout_s = float(timeout_s)
        self.counter = counter if counter is not None else WarningCounter()
        self._preload = tuple(preload)
        self._setup = setup
        self._traceback_logged = False
        self._ctx = multiprocessing.get_context("spawn")
        self._slots: list[_Slot] = []
        # Seconds from hand-over to result or kill of each call of the last map (NaN: never handed over).
        self.call_seconds: list[float] = []

    def map(self, fn: Callable[..., float], calls: Iterable[tuple]) -> list[float]:
        """``[float(fn(*args)) for args in calls]`` run in the workers; a call that times out, raises,
        kills its worker, or returns something that is not a finite number gives 0.0 and a counted
        warning. ``fn`` must be importable by name (a module-level function) for workers to load it."""
        calls = list(calls)
        results = [0.0] * len(calls)
        self.call_seconds = [math.nan] * len(calls)
        todo = collections.deque(range(len(calls)))
        while len(self._slots) < self.workers:
            self._slots.append(_Slot(self._ctx, self._preload, self._setup))
        while todo or any(s.call for s in self._slots):
            now = time.monotonic()
            for k, slot in enumerate(self._slots):
                if slot.ready and slot.call is None and todo:
                    i = todo.popleft()
                    try:
                        slot.conn.send((fn, calls[i]))
                    except (BrokenPipeError, ConnectionResetError):  # the idle worker died since its last call
                        todo.appendleft(i)
                        self._replace(k)
                        continue
                    slot.call = (i, now + self.timeout_s)
            if not any(s.ready for s in self._slots) and \
                    all(now - s.started > _STARTUP_TIMEOUT_S for s in self._slots):
                raise RuntimeError(f"no verifier worker started within {_STARTUP_TIMEOUT_S:g} s")
            deadlines = [s.call[1] for s in self._slots if s.call]
            wait = max(0.0, min(deadlines) - now) if deadlines else 1.0
            for conn in multiprocessing.connection.wait([s.conn for s in self._slots], timeout=wait):
                slot = next(s for s in self._slots if s.conn is conn)
                self._receive(slot, fn, calls, results)
            now = time.monotonic()
            for k, slot in enumerate(self._slots):
                if slot.call and slot.call[1] <= now:
                    i = slot.call[0]
                    self._finished(slot)
                    self.counter.warn("timeout", f"{_name(fn)}{_short(calls[i])} ran over {self.timeout_s:g} s",
                                      detail=f"ran over its {self.timeout_s:g} s limit (data.verify_timeout_s)")
                    self._replace(k)
        return results

    def _receive(self, slot: _Slot, fn, calls, results) -> None:
        try:
            message = slot.conn.recv()
        except (EOFError, OSError):  # the worker died: a crash in native code, or killed from outside
            if not slot.ready:
                slot.process.join()
                raise RuntimeError(f"a verifier worker died while starting (exit code {slot.process.exitcode}, "
                                   f"preloading {self._preload}); see its error output above") from None
            if slot.call:
                self._finished(slot)
                self.counter.warn("error", f"{_name(fn)}{_short(calls[slot.call[0]])} killed its worker",
                                  detail="killed its worker process")
            self._replace(self._slots.index(slot))
            return
        if message[0] == "ready":
            slot.ready = True
            return
        if slot.call is None:
            return
        i, _ = slot.call
        self._finished(slot)
        slot.call = None
        results[i] = self._reward(fn, calls[i], *message)

    def _finished(self, slot: _Slot) -> None:
        i, deadline = slot.call
        self.call_seconds[i] = time.monotonic() - (deadline - self.timeout_s)

    def _replace(self, k: int) -> None:
        """Kill worker ``k`` (with whatever call it was running) and start a fresh one in its place."""
        self._slots[k].kill()
        self._slots[k] = _Slot(self._ctx, self._preload, self._setup)
        self.counter.warn("restart", "a verifier worker was killed and replaced")

    def _reward(self, fn, args, ok: bool, value, trace: str = "") -> float:
        if not ok:
            self.counter.warn("error", f"{_name(fn)}{_short(args)} raised {value}", detail=value + _where(trace))
            if trace and not self._traceback_logged:  # the first in full, once: enough to find the bug
                self._traceback_logged = True
                log.warning("first verifier error of this pool (later ones are counted only):\n%s", trace)
            return 0.0
        try:
            reward = float(value)
        except (TypeError, ValueError):
            reward = math.nan
        if not math.isfinite(reward):
            self.counter.warn("error", f"{_name(fn)}{_short(args)} returned {value!r:.80}, not a finite number",
                              detail=f"returned {value!r:.80}, not a finite number")
            return 0.0
        return reward

    def close(self) -> None:
        """Stop the workers (politely, then by force); a later :meth:`map` starts new ones."""
        for slot in self._slots:
            try:
                slot.conn.send(None)
            except OSError:
                pass
        for slot in self._slots:
            slot.process.join(timeout=1.0)
            slot.kill()
        self._slots = []

    def __enter__(self) -> VerifierPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: the process machinery may already be gone
            pass


def _name(fn) -> str:
    return getattr(fn, "__name__", repr(fn))


def _short(args: tuple, limit: int = 120) -> str:
    text = repr(args)
    return text if len(text) <= limit else text[:limit] + "...)"


# ----------------------------------------------------------------------------------------------------------
# The math-verify call the workers run
# ----------------------------------------------------------------------------------------------------------


def _latex(text: str) -> str:
    """Wrap bare text in ``$...$`` so math-verify's LaTeX extractor reads it (it needs an anchor)."""
    return text if "$" in text or "\\(" in text or "\\[" in text else f"${text}$"


def _config():
    from math_verify import LatexExtractionConfig
    return [LatexExtractionConfig(try_extract_without_anchor=True)]


_PARSED_REFERENCES: dict[str, list] = {}
_MAX_PARSED_REFERENCES = 4096


def _parse_reference(reference: str, timeout_s: int):
    """A reference parsed once per worker: a group's answers share one, and parsing is most of a call.
    Only successful parses are kept, so a parse cut short by the timeout is tried again next time."""
    from math_verify import parse
    if reference in _PARSED_REFERENCES:
        return _PARSED_REFERENCES[reference]
    gold = parse(_latex(reference), _config(), parsing_timeout=timeout_s)
    if gold:
        if len(_PARSED_REFERENCES) >= _MAX_PARSED_REFERENCES:
            _PARSED_REFERENCES.clear()
        _PARSED_REFERENCES[reference] = gold
    return gold


def math_equal(prediction: str, reference: str, timeout_s: int = 5) -> float:
    """1.0 iff math-verify finds ``prediction`` mathematically equal to ``reference`` (fractions,
    decimals, percentages, LaTeX, sets, equations ``x = 3`` against ``3``), else 0.0.

    Only math-verify's LaTeX parser (an ANTLR grammar to sympy) is used, never its plain-expression
    parser, which is built on sympy's ``parse_expr`` and so on ``eval``: model output is never executed.
    ``timeout_s`` is math-verify's own (signal-based) limit; run this through :class:`VerifierPool`,
    whose timeout also covers code a signal cannot interrupt. Raises only on internal failures, which
    the pool scores 0 and counts.
    """
    from math_verify import parse, verify

    if not isinstance(prediction, str) or not isinstance(reference, str):
        return 0.0
    if not prediction.strip() or len(prediction) > MAX_ANSWER_CHARS:
        return 0.0
    gold = _parse_reference(reference, timeout_s)
    pred = parse(_latex(prediction), _config(), parsing_timeout=timeout_s)
    if not gold or not pred:
        return 0.0
    return float(verify(gold, pred, timeout_seconds=timeout_s))
