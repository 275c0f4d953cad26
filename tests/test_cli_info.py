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


def test_the_command_list_is_what_each_module_registers_and_help_imports_no_jax():
    """``COMMANDS`` lists each command with the help its module registers (the list shown without importing
    the modules must not drift from them); ``--help``, ``--version`` and a mistyped command import none of
    them, and ``info --presets`` only the preset list, so they answer at once rather than after JAX's
    4-second import."""
    import argparse
    import subprocess
    import sys

    from passrate_jax.cli.main import COMMANDS, build_parser

    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    registered = {action.dest: action.help for action in subparsers._choices_actions}
    assert {name: summary for name, (_, summary) in COMMANDS.items()} == {k: v for k, v in registered.items()
                                                                         if k != "info"}
    for argv in (["--help"], ["--version"], ["trian"], ["info", "--presets"]):
        probe = ("import sys\nfrom passrate_jax.cli.main import main\ntry:\n    main(%r)\nexcept SystemExit:\n    pass\n"
                 "print('imported jax' if 'jax' in sys.modules else 'no jax', file=sys.stderr)" % argv)
        done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
        assert done.stderr.strip().endswith("no jax"), (argv, done.stderr[-2000:])
