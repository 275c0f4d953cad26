"""Supervised warm start: next-token cross-entropy on the built-in tasks' step-by-step solutions.

RL with binary rewards needs pass rates spread over (0, 1): a random model solves nothing and every
group is saturated. A short supervised stage on reference solutions makes easy prompts mostly solved
and hard ones rarely, which is the regime where allocation matters. The result is cached under a hash
of everything that determines it, so later runs (and resumed runs) skip it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from passrate_jax.run.config import Config, WarmStartConfig
from passrate_jax.configlib import to_dict
from passrate_jax.distributed import is_primary, to_host
from passrate_jax.data.demonstrations import NO_MISREADS, Misreads, demonstration
from passrate_jax.data.sources import check_level_weights, weighted_level
from passrate_jax.data.tasks import task_with_levels
from passrate_jax.rl.losses import token_logprobs


def encode_example(tokenizer, prompt: str, response: str, max_len: int) -> tuple[np.ndarray, np.ndarray]:
    """``bos + prompt + response + eos`` padded to ``max_len``; the mask marks the response and eos
    tokens (aligned with the tokens: token t is predicted from position t - 1)."""
    p = tokenizer.encode(prompt, add_bos=True)
    r = tokenizer.encode(response) + [tokenizer.eos_id]
    return pack_example(p + r, [0] * len(p) + [1] * len(r), max_len, tokenizer.pad_id, f"{prompt!r} + {response!r}")


def pack_example(ids, mask, max_len: int, pad_id: int, what: str = "") -> tuple[np.ndarray, np.ndarray]:
    """Token ids and their 0/1 loss mask (aligned with the ids) right-padded to ``max_len``; ValueError
    naming ``warm_start.max_len`` when the example (described by ``what``) does not fit."""
    if len(ids) > max_len:
        raise ValueError(f"warm_start.max_len = {max_len}: an example needs {len(ids)} tokens ({what})")
    tokens = np.full((max_len,), pad_id, np.int32)
    weights = np.zeros((max_len,), np.float32)
    tokens[:len(ids)] = ids
    weights[:len(ids)] = mask
    return tokens, weights


def sft_batch(task_name: str, seed: int, step: int, batch_size: int, tokenizer, max_len: int, max_level: int = 0,
              min_level: int = 1, misreads: Misreads = NO_MISREADS, level_weights: tuple[float, ...] = ()):
    """The training batch of ``step``: a pure function of (seed, step), so a warm start is reproducible.
    ``misreads``: the share of demonstrations that solve a misread problem (data/demonstrations.py);
    ``level_weights``: relative weights of the levels in the demonstrations (empty: uniform)."""
    task = task_with_levels(task_name, max_level, min_level)
    check_level_weights(task, level_weights, "warm_start.level_weights")
    indices = range(step * batch_size, (step + 1) * batch_size)
    # Its own level stream: with the same weights as data.level_weights the demonstrations are not
    # simply the RL train pool's problems.
    problems = ((i, task.sample(seed, "train", i, weighted_level(task, seed, i, level_weights, "warm_start_level")))
                for i in indices)
    rows = [encode_example(tokenizer, p.prompt, demonstration(p, misreads, seed, i), max_len) for i, p in problems]
    return np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows])


def sft_loss(graphdef, params, tokens_bt, mask_bt):
    """Mean next-token cross-entropy (nats) over the masked (response) tokens."""
    model = nnx.merge(graphdef, params)
    logp, _ = token_logprobs(model(tokens_bt, attention_mask_bt=tokens_bt != 0), tokens_bt)
    return -jnp.sum(jnp.where(mask_bt > 0, logp, 0.0)) / jnp.maximum(jnp.sum(mask_bt), 1.0)


def make_sft_step(graphdef, optimizer: optax.GradientTransformation):
    """A jitted ``(params, opt_state, tokens, mask) -> (params, opt_state, loss)`` with donated state."""
    def step(params, opt_state, tokens_bt, mask_bt):
        loss, grads = jax.value_and_grad(lambda p: sft_loss(graphdef, p, tokens_bt, mask_bt))(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
    return jax.jit(step, donate_argnums=(0, 1))


def cache_key(cfg: Config, extra: dict | None = None) -> str:
    """Hash of everything that determines the warm-start result (not its cache location); ``extra``: what
    else determines the batches of a caller's own ``batches`` (e.g. an environment's settings)."""
    ws = to_dict(dataclasses.replace(cfg.warm_start, cache_dir=None))
    data = {"model": to_dict(cfg.model), "warm_start": ws, "task": cfg.data.task,
            "max_level": cfg.data.max_level, "seed": cfg.seed, "version": 1, **(extra or {})}
    # The demonstration options enter the hash only when set, so warm starts cached before they existed stay valid.
    if ws.pop("misread_rate") > 0:
        data.update(misread_rate=cfg.warm_start.misread_rate, misread_min_level=ws["misread_min_level"])
    ws.pop("misread_min_level")
    if ws.pop("level_weights"):
        data.update(level_weights=list(cfg.warm_start.level_weights))
    if cfg.data.min_level > 1:
        data.update(min_level=cfg.data.min_level)
    blob = json.dumps(data, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def cache_path(cfg: Config, extra: dict | None = None) -> str:
    root = cfg.warm_start.cache_dir or os.environ.get("PASSRATE_JAX_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "passrate-jax")
    return os.path.join(root, "warm_start", f"{cache_key(cfg, extra)}.safetensors")


def _flat(params) -> dict[str, np.ndarray]:
    return {"/".join(str(getattr(k, "key", k)) for k in path): v
            for path, v in jax.tree_util.tree_leaves_with_path(to_host(params))}


def _unflat(flat: dict[str, np.ndarray], like):
    def load(path, leaf):
        name = "/".join(str(getattr(k, "key", k)) for k in path)
        return jnp.asarray(flat[name], dtype=leaf.dtype)
    return jax.tree_util.tree_map_with_path(load, like)


def run_warm_start(cfg: Config, model: nnx.Module, tokenizer, *, progress: bool = True,
                   log=print, batches=None, key: dict | None = None) -> dict:
    """Train ``model`` in place on the task's reference solutions, or load the cached result.
    ``batches(step) -> (tokens, mask)`` replaces the built-in tasks' batches (:func:`sft_batch`), e.g.
    with expert trajectories of an environment (``passrate_jax.run.warm_start``); ``key``: the settings
    those batches depend on, hashed into the cache key.

    Returns a summary dict: ``cached`` (bool), ``steps``, ``final_loss`` (None when cached), ``path``.
    """
    from safetensors.numpy import load_file, save_file

    ws: WarmStartConfig = cfg.warm_start
    graphdef, params = nnx.split(model, nnx.Param)
    path = cache_path(cfg, key)
    if os.path.exists(path):
        nnx.update(model, _unflat(load_file(path), params))
        log(f"warm start: loaded cached weights from {path}")
        return {"cached": True, "steps": ws.steps, "final_loss": None, "path": path}

    schedule = optax.warmup_cosine_decay_schedule(0.0, ws.learning_rate, max(ws.warmup_steps, 1),
                                                  max(ws.steps, ws.warmup_steps + 1), ws.learning_rate * 0.1)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.0))
    opt_state = optimizer.init(params)
    step_fn = make_sft_step(graphdef, optimizer)
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=ws.steps, desc="warm start", unit="step", dynamic_ncols=True)
    loss = None
    for step in range(ws.steps):
        tokens, mask = batches(step) if batches is not None else sft_batch(
            cfg.data.task, cfg.seed, step, ws.batch_size, tokenizer, ws.max_len, cfg.data.max_level,
            cfg.data.min_level, Misreads(ws.misread_rate, ws.misread_min_level), ws.level_weights)
        params, opt_state, loss = step_fn(params, opt_state, tokens, mask)
        if bar is not None:
            bar.update(1)
            if step % 20 == 0 or step == ws.steps - 1:
                bar.set_postfix(loss=f"{float(loss):.3f}")
    if bar is not None:
        bar.close()
    nnx.update(model, params)
    flat = _flat(params)  # a collective in multi-process runs: every process takes part
    if is_primary():  # every host computed the same weights; one writes them
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        save_file(flat, tmp)
        os.replace(tmp, path)  # atomic: a killed warm start never leaves a half-written cache entry
    final = None if loss is None else float(loss)
    log(f"warm start: {ws.steps} steps, final loss {final}, cached at {path}")
    return {"cached": False, "steps": ws.steps, "final_loss": final, "path": path}
