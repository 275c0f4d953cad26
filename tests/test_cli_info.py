"""``passrate-jax info`` prints the resolved config, the devices, the mesh and the parameter count."""

from passrate_jax.cli.main import main
from passrate_jax.cli.info import parameter_count
from passrate_jax.model import ModelConfig


def test_parameter_count_matches_formula():
    cfg = ModelConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, tie_embeddings=True)
    d, h, kv, hd, f = 32, 4, 2, 8, 64
    per_layer = d * h * hd + 2 * d * kv * hd + h * hd * d + 3 * d * f + 2 * d
    assert parameter_count(cfg) == 100 * d + 2 * per_layer + d


def test_info_prints_config_devices_mesh_and_parameters(capsys):
    assert main(["info", "--config", "configs/default.yaml", "model.num_layers=2"]) == 0
    out = capsys.readouterr().out
    assert "# resolved config" in out and "num_layers: 2" in out
    assert "# devices" in out and "cpu" in out.lower()
    assert "# mesh" in out and "'data'" in out
    assert "parameters:" in out


def test_overrides_may_come_before_and_after_options(capsys):
    import pytest

    from passrate_jax.cli.main import build_parser, parse
    args = parse(build_parser(), ["train", "data.source=jsonl", "data.path=a.jsonl", "--run-dir", "runs/x", "steps=4",
                                  "--config", "c.yaml", "seed=1"])
    assert args.overrides == ["data.source=jsonl", "data.path=a.jsonl", "steps=4", "seed=1"]
    assert args.run_dir == "runs/x" and args.config == "c.yaml"
    assert main(["info", "--config", "configs/default.yaml", "steps=7", "--config", "configs/default.yaml",
                 "model.num_layers=1"]) == 0
    out = capsys.readouterr().out
    assert "steps: 7" in out and "num_layers: 1" in out
    with pytest.raises(SystemExit):
        parse(build_parser(), ["train", "--run-dir", "runs/x", "steps=4", "--no-such-flag"])
    assert "unrecognized arguments: --no-such-flag" in capsys.readouterr().err
