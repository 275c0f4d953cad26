"""``passrate-jax info``: the resolved config, the devices, the mesh and the model's parameter count."""

from __future__ import annotations

from passrate_jax.configlib import PRESET_DIR, preset_names, preset_summary


def parameter_count(model_cfg) -> int:
    """Number of parameters of the model ``model_cfg`` describes, computed from abstract shapes (no allocation)."""
    import jax
    from flax import nnx

    from passrate_jax.model import Transformer

    abstract = nnx.eval_shape(lambda: Transformer(model_cfg, rngs=nnx.Rngs(0)))
    state = nnx.state(abstract, nnx.Param)
    return sum(int(x.size) for x in jax.tree.leaves(state))


def print_presets() -> None:
    """One line per packaged preset: its name and what it runs."""
    names = preset_names()
    width = max(map(len, names), default=0)
    for name in names:
        print(f"{name:<{width}}  {preset_summary(name)}")
    print(f"(--config NAME from any directory, or base: NAME in your own YAML; the files are in {PRESET_DIR})")


def run(args) -> int:
    if getattr(args, "presets", False):
        print_presets()
        return 0
    # Here, not at the top: the config module imports JAX (about 2 s), which listing the presets need not wait for.
    from passrate_jax.run.config import check_inputs, dump_config, load_config

    cfg = load_config(args.config, args.overrides)  # fails here, before jax starts, on a bad config
    check_inputs(cfg)
    import jax

    from passrate_jax.sharding import make_mesh

    model_cfg = cfg.model
    if model_cfg.pretrained is not None:
        import json
        import os

        from passrate_jax.model import config_from_hf
        with open(os.path.join(model_cfg.pretrained, "config.json")) as f:
            model_cfg = config_from_hf(json.load(f))
    mesh = make_mesh(cfg.mesh)
    print("# resolved config")
    print(dump_config(cfg), end="")
    print("# devices")
    for d in jax.devices():
        print(f"  {d.id}: {d.platform} {d.device_kind}")
    print(f"# mesh\n  {dict(mesh.shape)}")
    print(f"# model\n  parameters: {parameter_count(model_cfg):,}")
    return 0
