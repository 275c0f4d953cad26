"""``passrate-jax plot`` writes every figure from a metrics file."""

import json

import pytest

from passrate_jax.cli.main import main
from passrate_jax.run.plot import plot_run


def _write_metrics(path):
    with open(path / "metrics.jsonl", "w") as f:
        for step in range(1, 6):
            record = {"step": step, "rollouts_total": 64 * step, "rollouts_step": 64, "valid_group_fraction": 0.5,
                      "train_accuracy": 0.1 * step, "pass_rate_hist": [1, 2, 3, 4, 5, 4, 3, 2, 1],
                      "ps/ratio/1": 0.25, "ps/ema/1": 0.4, "ps/ratio/7": 0.3, "ps/ema/7": 0.6}
            if step % 2 == 0:
                record["eval_accuracy"] = 0.2 * step
                record.update(eval_sampled_accuracy=0.1 * step, eval_sampled_accuracy_se=0.01 * step)
            f.write(json.dumps(record) + "\n")


def test_plot_run_writes_pngs(tmp_path):
    _write_metrics(tmp_path)
    paths = plot_run(tmp_path)
    names = sorted(p.rsplit("/", 1)[-1] for p in paths)
    assert names == ["accuracy_vs_rollouts.png", "groups_and_rollouts.png", "pass_rate_histogram.png",
                     "prefix_sampling.png"]
    for p in paths:
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_plot_cli_and_missing_run(tmp_path, capsys):
    _write_metrics(tmp_path)
    assert main(["plot", "--run-dir", str(tmp_path)]) == 0
    assert "accuracy_vs_rollouts.png" in capsys.readouterr().out
    with pytest.raises(FileNotFoundError, match="is .* a run directory"):
        plot_run(tmp_path / "nope")


def test_sampled_accuracy_drawn_with_its_standard_error(tmp_path, monkeypatch):
    from matplotlib.axes import Axes
    bands = []
    original = Axes.fill_between
    monkeypatch.setattr(Axes, "fill_between", lambda self, x, lo, hi, **kw: (
        bands.append((list(x), list(lo), list(hi), kw.get("label"))), original(self, x, lo, hi, **kw))[1])
    _write_metrics(tmp_path)
    plot_run(tmp_path)
    # Only the sampled accuracy records a standard error: one band, at 0.1 * step +- 0.01 * step.
    assert len(bands) == 1
    x, lo, hi, label = bands[0]
    assert x == [128, 256] and lo == pytest.approx([0.18, 0.36]) and hi == pytest.approx([0.22, 0.44])
    assert "standard error" in label
