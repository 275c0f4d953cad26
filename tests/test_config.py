"""Config tree: every preset loads; bad keys, types and values fail naming the key, the value and what is allowed."""

import dataclasses
import pathlib
import subprocess
import sys

import pytest

from passrate_jax.run.config import Config, dump_config, load_config
from passrate_jax.configlib import ConfigError, apply_overrides, describe, parse_override

CONFIGS = sorted((pathlib.Path(__file__).parent.parent / "configs").glob("**/*.yaml"))


def test_there_are_presets():
    assert any(p.name == "default.yaml" for p in CONFIGS)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_preset_loads_and_round_trips(path):
    cfg = load_config(path)
    assert isinstance(cfg, Config)
    # The dumped YAML is itself a valid config that loads to the same tree.
    dumped = path.parent / "__never_written__"
    assert not dumped.exists()
    import yaml
    again = load_config(None, [f"{k}={yaml.safe_dump(v, default_flow_style=True).strip()}"
                               for k, v in yaml.safe_load(dump_config(cfg)).items()])
    assert again == cfg


def test_defaults_are_valid_and_hashable():
    cfg = load_config(None)
    hash(cfg.allocation)  # static settings are passed to jit as static arguments
    hash(cfg.sampling)
    assert cfg.allocation.sara.tau_confirm == 0.9 and cfg.allocation.sara.tau_abandon == 0.45
    assert cfg.prefix_sampling.deadzone == 0.03 and cfg.prefix_sampling.step == 0.05


def test_frozen():
    cfg = load_config(None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.steps = 3  # type: ignore[misc]


@pytest.mark.parametrize("override, fragments", [
    ("allocation.methd=sara", ["unknown config key allocation.methd", "did you mean allocation.method"]),
    ("alocation.method=sara", ["unknown config key alocation", "did you mean allocation"]),
    ("allocation.method=sra", ["allocation.method = 'sra'", "must be one of", "did you mean 'sara'"]),
    ("allocation.group_size=1", ["allocation.group_size = 1", "must be >= 2"]),
    ("allocation.group_size=8.5", ["allocation.group_size = 8.5", "expected an integer"]),
    ("rl.clip_low=abc", ["rl.clip_low = 'abc'", "expected a number"]),
    ("prefix_sampling.enabled=maybe", ["prefix_sampling.enabled = 'maybe'", "expected true or false"]),
    ("allocation.sara.tau_abandon=0.95", ["allocation.sara.tau_abandon = 0.95", "must be < tau_confirm = 0.9"]),
    ("sampling.top_p=0", ["sampling.top_p = 0", "must be > 0"]),
    ("sampling.row_buckets=[8, 4]", ["sampling.row_buckets = [8, 4]", "increasing"]),
    ("model.num_kv_heads=3", ["model.num_kv_heads = 3", "must divide num_heads = 4"]),
    ("allocation=3", ["allocation = 3", "expected a mapping"]),
    ("data.template={prompt}", ["data.template", "quote the value"]),
    ("steps", ["expected key.sub=value"]),
    ("rl.recompute_old_logprobs=false", ["rl.recompute_old_logprobs = False", "set it to true"]),
])
def test_bad_overrides_name_key_value_and_allowed(override, fragments):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    for fragment in fragments:
        assert fragment in str(err.value), (fragment, str(err.value))


def test_lr_schedule_note_counts_optimizer_updates():
    # A cosine decay over 50 steps of the default preset at one update per step (45 after 5 of warm-up) ...
    decay = ["steps=50", "optimizer.decay_steps=45", "optimizer.final_lr_fraction=0"]
    assert load_config(CONFIGS[0].parent / "default.yaml", decay).lr_schedule_note() is None
    # ... ends at step 13 of 50 with four minibatches per step: the run is told so.
    note = load_config(CONFIGS[0].parent / "default.yaml", decay + ["rl.minibatches=4"]).lr_schedule_note()
    assert "update 50 (step 13 of 50, 4 updates per step)" in note and "stays at 0" in note
    assert load_config(None, ["optimizer.decay_steps=0", "rl.minibatches=4"]).lr_schedule_note() is None


def test_bad_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(bad)
    bad.write_text("allocation:\n  method: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_override_parsing():
    assert parse_override("a.b=3") == (["a", "b"], 3)
    assert parse_override("a=[1, 2]") == (["a"], [1, 2])
    assert parse_override("a.b=null") == (["a", "b"], None)
    assert apply_overrides({"a": {"b": 1}}, ["a.c=x"]) == {"a": {"b": 1, "c": "x"}}
    cfg = load_config(None, ["allocation.sara.round_schedule=[1, 1, 2]", "model.head_dim=16"])
    assert cfg.allocation.sara.round_schedule == (1, 1, 2)
    assert cfg.model.head_dim == 16


def test_describe_lists_every_leaf():
    lines = describe(Config)
    assert any(line.startswith("allocation.sara.tau_confirm: float = 0.9 [>=0, <=1]") for line in lines)
    assert any(line.startswith("allocation.method:") and "pilot_commit" in line for line in lines)


def test_cli_bad_config_fails_before_compute():
    # A bad key exits with status 2 and a one-line message, before any device is touched.
    code = ("import sys; from passrate_jax.cli.main import main; rc = main(['info', 'allocation.methd=sara']);"
            "from jax._src import xla_bridge; assert not xla_bridge._backends, 'backend initialised'; sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "did you mean allocation.method" in proc.stderr


def test_base_presets_merge_section_by_section(tmp_path):
    (tmp_path / "a.yaml").write_text("steps: 7\nallocation: {method: sara, num_prompts: 4}\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\nallocation: {method: ds}\n")
    cfg = load_config(tmp_path / "b.yaml")
    assert (cfg.steps, cfg.allocation.method, cfg.allocation.num_prompts) == (7, "ds", 4)
    (tmp_path / "c.yaml").write_text("base: c.yaml\n")
    with pytest.raises(ConfigError, match="circular base"):
        load_config(tmp_path / "c.yaml")
    (tmp_path / "d.yaml").write_text("base: missing.yaml\n")
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "d.yaml")
