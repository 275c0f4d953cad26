"""The prompt source a run's ``DataConfig`` describes, over every kind of source.

Kept apart from ``sources.py`` because it depends on the sources built on it (TFDS, environments),
which themselves import ``sources.py``: one place depends on all of them, and nothing depends back.
"""

from __future__ import annotations

import dataclasses

from passrate_jax.data.env_source import env_source
from passrate_jax.data.sources import Fields, PromptSource, builtin_source, file_source
from passrate_jax.data.tfds_builtin import BUILDER_NAME, tfds_source


def make_source(cfg) -> PromptSource:
    """The prompt source a :class:`passrate_jax.run.config.DataConfig` describes."""
    fields = Fields(cfg.prompt_field, cfg.answer_field, cfg.id_field, cfg.reference_extract)
    common = dict(seed=cfg.seed, shuffle=cfg.shuffle, default_heldout=cfg.eval_size)
    match cfg.source:
        case "builtin":
            return builtin_source(cfg.task, level=cfg.level or None, train_size=cfg.train_size,
                                  max_level=cfg.max_level, min_level=cfg.min_level,
                                  level_weights=cfg.level_weights, **common)
        case "jsonl" | "parquet":
            return file_source(cfg.path, cfg.eval_path, file_format=cfg.source, fields=fields,
                               skip_bad_rows=cfg.skip_bad_rows, **common)
        case "env":
            return env_source(cfg.env, level=cfg.level or None, train_size=cfg.train_size, max_level=cfg.max_level,
                              **common)
        case "tfds":
            if not fields.id and cfg.tfds_name.split("/")[0] == BUILDER_NAME:
                # The built-in build carries the tasks' own ids: keep them, so a prompt has the same id
                # whether it is streamed or read from the prepared dataset.
                fields = dataclasses.replace(fields, id="prompt_id")
            return tfds_source(cfg.tfds_name, cfg.tfds_data_dir or None, train_split=cfg.train_split,
                               eval_split=cfg.eval_split, fields=fields, skip_bad_rows=cfg.skip_bad_rows, **common)
    raise ValueError(f"source = {cfg.source!r}: unknown")
