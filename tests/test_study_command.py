"""``passrate-jax study --quick`` as a user runs it, with worker processes, to its report. A file of its
own, so that xdist runs it beside the shipped default's group (tests/test_as_shipped.py), not after it."""

import os

from passrate_jax.cli.main import main
from passrate_jax.run.config import load_config
from passrate_jax.run.metrics import read_jsonl
from passrate_jax.run.train import train
from passrate_jax.study import provenance
from passrate_jax.study.runner import make_plan
from tests.test_train_e2e import TINY, _comparable

HASH_REWARD = '''
import hashlib

def score(prompt, response, reference, **_):
    """1 for about half of all responses, decided by the text alone (the same in every process)."""
    return float(hashlib.blake2b(f"{prompt}|{response}".encode(), digest_size=1).digest()[0] % 2)
'''


def test_study_command_runs_in_worker_processes_and_reports(tmp_path, capsys):
    """``passrate-jax study --quick`` with two worker processes (``--jobs 2``), on the tiny model with a
    reward plugin (worker processes do not see a monkeypatch): it exits 0, writes its report naming the
    methods, and each run equals the same run trained alone in this process."""
    plugin = tmp_path / "hash_reward.py"
    plugin.write_text(HASH_REWARD)
    # The tiny model on the study's default base preset (configs/default.yaml): its level weights do not apply to level 1.
    tiny = TINY + ["data.level_weights=[]", "steps=2", "eval_every=2", f"data.reward_fn={plugin}:score",
                   "data.verify_workers=1"]
    out = tmp_path / "study"
    command = ["study", "--quick", "--methods", "grpo", "sara", "--seeds", "0", "1", "--out", str(out), "--no-progress"]
    assert main([*command, "--jobs", "0", *tiny]) == 2 and "--jobs 0" in capsys.readouterr().err
    assert main([*command, "--jobs", "2", *tiny]) == 0
    assert "study of 2 methods x 2 seeds" in capsys.readouterr().out
    report = (out / "results.md").read_text()
    assert "| GRPO (uniform) | " in report and "| SARA (fill) | " in report
    plan = make_plan("configs/default.yaml", ["grpo", "sara"], [0, 1], tiny, str(out), quick=True)
    # Each run recorded one attempt's numerics, the same in both workers and in this process (one machine,
    # one environment), so the report pairs every seed.
    prints = [provenance.fingerprints(plan.run_dir(m, s)) for m, s in plan.jobs()]
    assert prints == [{provenance.numerics_fingerprint()}] * 4
    assert "**Pairing**: 4 of 4 runs recorded" in report and "share one" in report
    train(load_config("configs/default.yaml", plan.config_overrides("sara", 1)), str(tmp_path / "alone"),
          progress=False, log=lambda *a: None)
    alone = _comparable(read_jsonl(tmp_path / "alone" / "metrics.jsonl"))
    assert [r["step"] for r in alone] == [0, 1, 2] and any(r.get("groups_trained", 0) > 0 for r in alone)
    assert _comparable(read_jsonl(os.path.join(plan.run_dir("sara", 1), "metrics.jsonl"))) == alone
