"""``passrate-jax study``: a small end-to-end study on the tiny model (the real one is docs/results.md)."""

import os

import pytest

from passrate_jax.config import load_config
from passrate_jax.configlib import ConfigError
from passrate_jax.study import METHODS, NEUTRAL, make_plan, run_study
from passrate_jax.study_report import DISCUSSION_MARKER, write_report
from tests.test_train_e2e import TINY, fake_verifier  # noqa: F401 - fixture

# The preset of each method's composition (configs/); the study must run the same thing.
PRESETS = {"grpo": "uniform", "dapo_ds": "ds", "mopps": "mopps", "dps": "dps", "sara": "sara",
           "sara_dps": "sara_dps", "pilot_commit": "pilot_commit", "ps_fixed": "ps_fixed",
           "ps_hard_only": "ps_hard_only", "ps_adaptive": "ps", "ps_sara": "default", "ps_sara_dps": "ps_sara_dps"}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("method", list(METHODS))
def test_study_methods_match_their_presets(method):
    base = os.path.join(ROOT, "configs", "default.yaml")
    ours = load_config(base, [*NEUTRAL, *METHODS[method][1]])
    preset = load_config(os.path.join(ROOT, "configs", f"{PRESETS[method]}.yaml"))
    assert ours.allocation == preset.allocation and ours.prefix_sampling == preset.prefix_sampling


def test_bad_study_requests_fail_before_compute(tmp_path):
    with pytest.raises(ConfigError, match="--methods sarah: unknown"):
        make_plan(None, ["grpo", "sarah"], [0], [], str(tmp_path), quick=True)
    with pytest.raises(ConfigError, match="needs grpo"):
        make_plan(None, ["sara"], [0], [], str(tmp_path), quick=True)
    with pytest.raises(ConfigError, match="allocation.num_prompt"):
        make_plan(None, ["grpo"], [0], ["allocation.num_prompt=3"], str(tmp_path), quick=True)


def test_small_study_end_to_end(tmp_path, fake_verifier):  # noqa: F811
    tiny = [t for t in TINY if not t.startswith("eval_every")] + ["allocation.num_prompts=4", "steps=4",
                                                                  "eval_every=2", "data.eval_size=4"]
    plan = make_plan(None, ["grpo", "dapo_ds", "ps_sara"], [0, 1], tiny, str(tmp_path / "study"), quick=True)
    analysis = run_study(plan, progress=False)
    assert set(analysis["methods"]) == {"grpo", "dapo_ds", "ps_sara"}
    for m in analysis["methods"].values():
        assert m["seeds"] == [0, 1] and m["rollouts_total"]["n"] == 2 and m["rollouts_total"]["mean"] > 0
    assert analysis["methods"]["ps_sara"]["ps_pass_rate"], "PS runs report re-rollout pass rates per bucket"
    report = tmp_path / "results.md"
    report.write_text(f"old\n{DISCUSSION_MARKER}\nmy notes\n")
    paths = write_report(plan, analysis, str(report), command="passrate-jax study --quick")
    text = report.read_text()
    assert "| GRPO (uniform) | " in text and "| PS + SARA | " in text and "passrate-jax study --quick" in text
    assert "SARA: 22% fewer rollouts than DAPO" in text and text.endswith("my notes\n") and "old" not in text
    assert all(os.path.getsize(p) > 0 for p in paths)
    # A second invocation reuses the finished runs instead of training them again.
    metrics = tmp_path / "study" / "runs" / "grpo" / "seed0" / "metrics.jsonl"
    before = metrics.stat().st_mtime_ns
    run_study(plan, progress=False)
    assert metrics.stat().st_mtime_ns == before
