"""The supervised warm start a run's config asks for, by the kind of its tasks: the built-in tasks'
reference solutions (``sft.py``) or an environment's expert trajectories, executed in the environment
so their observations are exactly what the policy will see. Other sources have no solutions and skip it.
"""

from __future__ import annotations

import numpy as np

from passrate_jax.data.formatting import PromptFormat
from passrate_jax.envs import resolve_env
from passrate_jax.envs.base import Environment
from passrate_jax.envs.replay import TurnCodec, expert_trajectory, trajectory_tokens
from passrate_jax.plugins import fingerprint
from passrate_jax.run.config import Config
from passrate_jax.run.sft import cache_path, pack_example, run_warm_start


def warm_start(session, progress: bool = True) -> dict | None:
    """Warm-start ``session.model`` in place (cached, see ``sft.run_warm_start``); None when the config
    turns it off or the source has nothing to learn from."""
    cfg = session.cfg
    if not cfg.warm_start.enabled or cfg.warm_start.steps == 0:
        return None
    if cfg.data.source == "env":
        env = resolve_env(cfg.data.env)
        return run_warm_start(cfg, session.model, session.tokenizer, progress=progress, log=session.log,
                              batches=lambda step: expert_batch(env, cfg, step, session.tokenizer),
                              key=_cache_extra(cfg))
    if cfg.data.source != "builtin":
        session.log("warm start: skipped (only the built-in tasks have reference solutions)")
        return None
    return run_warm_start(cfg, session.model, session.tokenizer, progress=progress, log=session.log,
                          key=_cache_extra(cfg))


def warm_start_file(cfg: Config) -> str | None:
    """The file :func:`warm_start` loads ``cfg``'s warm start from, or trains it into when it is absent;
    None when the config trains none. A study asks it to know whether a run would train a warm start
    that a sibling run is training already."""
    if not cfg.warm_start.enabled or cfg.warm_start.steps == 0 or cfg.data.source not in ("env", "builtin"):
        return None
    return cache_path(cfg, _cache_extra(cfg))


def _cache_extra(cfg: Config) -> dict | None:
    """The cache key's ``extra`` of ``cfg``'s warm start: an environment's settings, none for the built-in tasks."""
    return warm_start_key(cfg) if cfg.data.source == "env" else None


def expert_batch(env: Environment, cfg: Config, step: int, tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """Warm-start batch ``step``: expert trajectories of train tasks, a pure function of (data seed, step);
    loss mask 1 on the expert's actions only, as in RL."""
    ws, data, codec, fmt = cfg.warm_start, cfg.data, TurnCodec(tokenizer), PromptFormat.from_config(cfg.data)
    rows = []
    for i in range(ws.batch_size):
        task = env.sample(data.seed, "train", step * ws.batch_size + i, data.level or None, data.max_level)
        ids, mask = trajectory_tokens(fmt.encode(task.prompt, tokenizer), [],
                                      expert_trajectory(env, task, codec, data.max_turns or None,
                                                        data.reward_threshold))
        rows.append(pack_example(ids, mask, ws.max_len, tokenizer.pad_id, task.prompt))
    return np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows])


def warm_start_key(cfg: Config) -> dict:
    """What besides the model and warm-start settings determines an environment's expert batches: the
    cache key's ``extra`` (``passrate_jax.run.sft.cache_key``). A plugin environment enters by its file
    content, so editing its code re-runs the warm start; a built-in one by its name."""
    data = cfg.data
    return dict(env=fingerprint(data.env), level=data.level, max_turns=data.max_turns, template=data.template,
                data_seed=data.seed)
