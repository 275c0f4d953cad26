"""benchmarks/rollout_engine.py's ratios: each method and engine against GRPO, seeds averaged first, for
seconds per rollout and for chunks per rollout (the count that bounds the seconds ratio)."""

import importlib.util
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).parents[1]
_spec = importlib.util.spec_from_file_location("rollout_engine_bench", ROOT / "benchmarks" / "rollout_engine.py")
bench = importlib.util.module_from_spec(_spec)
sys.modules["rollout_engine_bench"] = bench
_spec.loader.exec_module(bench)


def _row(method, engine, seed, seconds, chunks):
    return {"method": method, "engine": engine, "seed": seed, "s_per_rollout": seconds, "chunks_per_rollout": chunks}


def test_ratios_average_seeds_then_divide_by_grpo_per_engine():
    rows = [_row("grpo", "slots", 0, 3.0, 0.09), _row("grpo", "slots", 1, 5.0, 0.11),
            _row("grpo", "rounds", 0, 8.0, 0.02),
            _row("sara_fill", "slots", 0, 5.0, 0.12), _row("sara_fill", "slots", 1, 7.0, 0.08)]
    seconds, chunks = bench.ratios(rows), bench.ratios(rows, "chunks_per_rollout")
    assert seconds["sara_fill[slots] / grpo[slots]"] == pytest.approx(6.0 / 4.0)
    assert seconds["sara_fill[slots] / grpo[rounds]"] == pytest.approx(6.0 / 8.0)
    assert chunks["sara_fill[slots] / grpo[slots]"] == pytest.approx(0.10 / 0.10)
    assert chunks["grpo[rounds] / grpo[slots]"] == pytest.approx(0.02 / 0.10)
    assert set(seconds) == set(chunks) and len(seconds) == 6
