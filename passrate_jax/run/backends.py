"""How a run's session becomes its rollout backend. The backends (``rollout/text.py``, ``rollout/env.py``)
take the parts they need (the sampler, prompt ids, decode and verify callables, numbers); what those
parts are in a run, read from the session and its config, is known here, in run/."""

from __future__ import annotations

from passrate_jax.data.env_source import task_of
from passrate_jax.envs import resolve_env
from passrate_jax.envs.replay import TurnCodec
from passrate_jax.rollout.env import EnvRollouts
from passrate_jax.rollout.text import TextRollouts
from passrate_jax.run.config import episode_limits


def text_backend(session) -> TextRollouts:
    """The text backend of ``session``'s training pool: its sampler, prompts, decoding and verifier."""
    cfg = session.cfg
    return TextRollouts(session.sampler, session.prompt_ids, decode=session.decode, verify=session.verify,
                        max_new_tokens=cfg.sampling.max_new_tokens, pad_id=session.tokenizer.pad_id,
                        newline_id=session.newline_id, prefix_granularity=cfg.prefix_sampling.granularity,
                        success_threshold=cfg.data.reward_threshold, slots=cfg.sampling.slots,
                        chunk_tokens=cfg.sampling.chunk_tokens, lookahead=cfg.sampling.lookahead,
                        longest_prompt=max(map(len, session.prompt_tokens), default=1),
                        harvest=cfg.sampling.harvest)


def env_backend(session) -> EnvRollouts:
    """The environment backend of ``session``'s training pool: the tasks of its prompt records in
    ``data.env``, within the episode limits of its config and model."""
    cfg = session.cfg
    tasks = [task_of(r) for r in session.prompts]
    max_turns, turn_tokens, max_len = episode_limits(cfg.data, cfg.sampling,
                                                     session.sampler.model_cfg.max_position_embeddings)
    return EnvRollouts(resolve_env(cfg.data.env), tasks.__getitem__, session.prompt_ids, TurnCodec(session.tokenizer),
                       session.sampler, max_turns=max_turns, max_len=max_len, turn_tokens=turn_tokens,
                       pad_id=session.tokenizer.pad_id, success_threshold=cfg.data.reward_threshold,
                       slots=cfg.sampling.slots, chunk_tokens=cfg.sampling.chunk_tokens,
                       harvest=cfg.sampling.harvest)
