"""Everything a run builds from its config before the first step: mesh, tokenizer, prompt pool and
held-out set, rewarder, model, sampler and the rollout backend. Shared by ``train``, ``eval`` and ``sft``."""

from __future__ import annotations

import dataclasses
import functools
import json
import os

import numpy as np
from flax import nnx

from passrate_jax.run.backends import env_backend, text_backend
from passrate_jax.run.config import Config, check_inputs
from passrate_jax.run.held_out import evaluate_session
from passrate_jax.run.warm_start import warm_start
from passrate_jax.configlib import ConfigError
from passrate_jax.data.formatting import PromptFormat
from passrate_jax.data.rewards import Rewarder
from passrate_jax.data.configured import make_source
from passrate_jax.data.sources import PromptRecord
from passrate_jax.rollout.loop import RolloutBackend
from passrate_jax.model import create_model
from passrate_jax.sampling.sampler import Sampler
from passrate_jax.sharding import make_mesh
from passrate_jax.text.tokenizer import load_tokenizer


def max_positions(cfg: Config) -> int:
    """The model's position limit: a pretrained checkpoint's own (its config.json), else ``cfg.model``'s."""
    if cfg.model.pretrained is not None:
        path = os.path.join(cfg.model.pretrained, "config.json")
        if os.path.isfile(path):  # else loading the checkpoint fails with its own message
            with open(path) as f:
                return int(json.load(f).get("max_position_embeddings", cfg.model.max_position_embeddings))
    return cfg.model.max_position_embeddings


def check_context_fits(cfg: Config, records, token_lists) -> None:
    """Fail before any compute when the longest prompt plus ``sampling.max_new_tokens`` (one assistant
    turn of an environment) exceeds the model's positions, naming both numbers."""
    if not token_lists:
        return
    longest = max(range(len(token_lists)), key=lambda i: len(token_lists[i]))
    need, limit = len(token_lists[longest]) + cfg.sampling.max_new_tokens, max_positions(cfg)
    if need > limit:
        raise ConfigError(f"prompt {records[longest].prompt_id} is {len(token_lists[longest])} tokens; with "
                          f"sampling.max_new_tokens = {cfg.sampling.max_new_tokens} a rollout needs {need} positions, "
                          f"more than model.max_position_embeddings = {limit}. Lower sampling.max_new_tokens, "
                          "shorten the prompts (data.template), or use a model with more positions")


@dataclasses.dataclass
class Session:
    cfg: Config
    mesh: object
    tokenizer: object
    prompts: list[PromptRecord]
    prompt_tokens: list[list[int]]
    heldout: list[PromptRecord]
    heldout_tokens: list[list[int]]
    rewarder: Rewarder
    model: nnx.Module
    sampler: Sampler
    source: object
    log: object = print

    @classmethod
    def create(cls, cfg: Config, log=print) -> Session:
        """Build the run's stages. The prompt pool is the source's first epoch (its rows in the seeded
        order); the allocator keys its per-prompt state by position in this pool."""
        check_inputs(cfg)  # the checkpoint and prompt files, each named by its key when missing
        mesh = make_mesh(cfg.mesh)
        tokenizer = load_tokenizer(cfg.model.pretrained)
        if cfg.model.pretrained is None and tokenizer.vocab_size > cfg.model.vocab_size:
            raise ConfigError(f"model.vocab_size = {cfg.model.vocab_size}: the built-in tokenizer needs at least "
                              f"{tokenizer.vocab_size}")
        source = make_source(cfg.data)
        if source.size is None:
            raise ConfigError(f"data.train_size = {cfg.data.train_size}: allocation keeps per-prompt state, so the "
                              "built-in task needs a finite prompt pool (e.g. data.train_size=2048); or start from "
                              "a preset: --config default")
        prompts = source.take(source.size)
        fmt = PromptFormat.from_config(cfg.data)
        prompt_tokens = [fmt.encode(r.prompt, tokenizer) for r in prompts]
        heldout = source.heldout(cfg.data.eval_size)
        heldout_tokens = [fmt.encode(r.prompt, tokenizer) for r in heldout]  # once: every evaluation reuses them
        check_context_fits(cfg, prompts + heldout, prompt_tokens + heldout_tokens)
        model = create_model(cfg.model, seed=cfg.seed, mesh=mesh)
        eos = tokenizer.eos_id
        stop = tuple(i for i in getattr(tokenizer, "stop_ids", ()) if i != eos)
        sampling = dataclasses.replace(cfg.sampling, stop_token_ids=tuple(cfg.sampling.stop_token_ids) + stop)
        sampler = Sampler(model, sampling, eos_id=eos, pad_id=tokenizer.pad_id, mesh=mesh)
        if sampling.store_contexts:  # a replayed prefix is part of an earlier response: at most max_new_tokens
            longest = max(map(len, prompt_tokens + heldout_tokens), default=1)
            sampler.reserve_store(sampling.store_contexts, longest + sampling.max_new_tokens)
        return cls(cfg, mesh, tokenizer, prompts, prompt_tokens, heldout, heldout_tokens,
                   Rewarder.from_config(cfg.data), model, sampler, source, log)

    # --------------------------------------------------------------- parts
    @property
    def graphdef(self):
        return nnx.split(self.model)[0]

    @property
    def params(self):
        return nnx.split(self.model)[1]

    @property
    def newline_id(self) -> int | None:
        ids = self.tokenizer.encode("\n")
        return ids[0] if len(ids) == 1 else None

    def prompt_ids(self, index: int) -> list[int]:
        return self.prompt_tokens[index]

    def decode(self, ids) -> str:
        """Model output -> text; ids the tokenizer does not know (a padded vocabulary) are dropped."""
        return self.tokenizer.decode([i for i in ids if 0 <= i < self.tokenizer.vocab_size])

    def score(self, records, texts) -> np.ndarray:
        """Rewards of responses ``texts`` to prompt records (the one place a run calls its verifier)."""
        return self.rewarder(records, texts)

    def verify(self, prompt_indices, texts) -> np.ndarray:
        return self.score([self.prompts[i] for i in prompt_indices], texts)

    def data_metrics(self) -> dict:
        return {**self.source.metrics(), **{f"verifier/{k}": v for k, v in self.rewarder.metrics().items()}}

    @functools.cached_property
    def backend(self) -> RolloutBackend:
        """How this run's tasks are rolled out, scored and batched: text answers or the episodes of a
        multi-turn environment, chosen here from ``data.source``, once."""
        if self.cfg.data.source == "env":
            return env_backend(self)
        return text_backend(self)

    def warm_start(self, progress: bool = True) -> dict | None:
        """The supervised warm start the config asks for (built-in tasks and environments); updates the
        model (``passrate_jax.run.warm_start``)."""
        return warm_start(self, progress)

    def evaluate(self, params, *, seed: int = 0, num_samples: int = 0, ks=(1,), greedy: bool = True) -> dict:
        """Greedy held-out accuracy (overall and per level) of ``params``; pass@k with ``num_samples``
        (``greedy=False``: those only). Environments: success of whole episodes (``passrate_jax.run.held_out``)."""
        return evaluate_session(self, params, seed=seed, num_samples=num_samples, ks=ks, greedy=greedy)

    def close(self) -> None:
        self.rewarder.close()
