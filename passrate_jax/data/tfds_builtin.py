"""TensorFlow Datasets: a builder for the built-in tasks, and a prompt source over any array_record dataset.

    name = prepare_builtin("/data/tfds", "arithmetic", train_size=10_000)   # once; no TensorFlow needed
    source = tfds_source(name, "/data/tfds", fields=Fields(id="prompt_id"))  # like any TFDS dataset

Only the array_record file format and ``tfds.data_source`` are used: both work without TensorFlow
installed (``tfds.load`` and the tfrecord format need it). ``data_source`` gives random access, so a
:class:`PromptSource` reads rows lazily by index and never holds the dataset in memory. Text features
come back as bytes and are decoded to str.

The builder writes the same problems ``builtin_source`` streams (problem i of the task's train split
for i < train_size, the first test_size of its held-out split) with the features the task verifiers
need; TFDS stores rows in its own (key-hash) order, so row i of the prepared split is not problem i.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import tensorflow_datasets as tfds
from etils import epath

from passrate_jax.data.sources import BadDataError, BadRows, Fields, PromptRecord, PromptSource, row_to_record
from passrate_jax.data.tasks import TASKS, reference_solution

BUILDER_NAME = "passrate_builtin"


@dataclasses.dataclass(eq=False)
class BuiltinTaskConfig(tfds.core.BuilderConfig):
    """Which problems a prepared built-in dataset holds; ``level`` 0 draws a level per problem."""
    task: str = "arithmetic"
    seed: int = 0
    train_size: int = 10_000
    test_size: int = 1_000
    level: int = 0


def builtin_config(task: str, seed: int = 0, train_size: int = 10_000, test_size: int = 1_000,
                   level: int = 0) -> BuiltinTaskConfig:
    """A config whose name spells out its settings, so differently built datasets never share a directory."""
    if task not in TASKS:
        raise ValueError(f"task = {task!r}: must be one of {sorted(TASKS)}")
    if train_size < 1 or test_size < 0:
        raise ValueError(f"train_size = {train_size}, test_size = {test_size}: need >= 1 and >= 0")
    name = f"{task}_seed{seed}_level{level}_train{train_size}_test{test_size}"
    return BuiltinTaskConfig(name=name, task=task, seed=seed, train_size=train_size, test_size=test_size,
                             level=level, description=f"built-in {task} task, {name}")


class PassrateBuiltin(tfds.core.GeneratorBasedBuilder):
    """The built-in procedural tasks as a TFDS dataset with splits "train" and "test" (held-out)."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Initial release."}
    BUILDER_CONFIGS = [builtin_config("arithmetic"), builtin_config("countdown")]

    @tfds.core.utils.classproperty
    @classmethod
    def code_path(cls) -> epath.Path:
        # TFDS 4.9's default looks the module up through importlib_resources, which it only installs
        # for Python < 3.9, so any builder living in a package fails on 3.11 without this override.
        return epath.Path(__file__)

    def _info(self) -> tfds.core.DatasetInfo:
        # builder=self (not a package-relative metadata directory) lets this builder live outside a
        # TFDS dataset package.
        return tfds.core.DatasetInfo(
            builder=self,
            description="Procedural step-by-step arithmetic / countdown problems of passrate-jax.",
            features=tfds.features.FeaturesDict({
                "prompt_id": tfds.features.Scalar(np.int64),
                "prompt": tfds.features.Text(),
                "answer": tfds.features.Text(),
                "solution": tfds.features.Text(),
                "task": tfds.features.Text(),
                "level": tfds.features.Scalar(np.int32),
                "op": tfds.features.Text(),
                "carries": tfds.features.Scalar(np.int32),
                "operations": tfds.features.Scalar(np.int32),
                "numbers": tfds.features.Sequence(tfds.features.Scalar(np.int64)),
                "target": tfds.features.Scalar(np.int64),
            }),
            supervised_keys=("prompt", "answer"),
        )

    def _split_generators(self, dl_manager):
        cfg = self.builder_config
        splits = {"train": self._generate_examples("train", cfg.train_size)}
        if cfg.test_size:
            splits["test"] = self._generate_examples("heldout", cfg.test_size)
        return splits

    def _generate_examples(self, split: str, count: int):
        cfg = self.builder_config
        task = TASKS[cfg.task]
        for i in range(count):
            p = task.sample(cfg.seed, split, i, cfg.level or None)
            # The key is the problem index: unique within a split, and stable, so TFDS's key-hash
            # shuffle (hence the stored order) is the same on every prepare.
            yield i, {"prompt_id": p.prompt_id, "prompt": p.prompt, "answer": p.answer,
                      "solution": reference_solution(p), "task": p.task, "level": p.level, "op": p.op,
                      "carries": p.carries, "operations": len(p.solution), "numbers": list(p.numbers),
                      "target": p.target}


def prepare_builtin(data_dir: str | os.PathLike, task: str, *, seed: int = 0, train_size: int = 10_000,
                    test_size: int = 1_000, level: int = 0) -> str:
    """Write the built-in ``task`` as an array_record TFDS dataset under ``data_dir`` (a no-op when it
    is already there) and return its TFDS name, ``"passrate_builtin/<config>"``."""
    config = builtin_config(task, seed, train_size, test_size, level)
    builder = PassrateBuiltin(config=config, data_dir=os.fspath(data_dir))
    builder.download_and_prepare(file_format="array_record")
    return f"{BUILDER_NAME}/{config.name}"


def _open(name: str, data_dir: str | None, split: str):
    """The random-access data source of one split; a builder's custom config (not in BUILDER_CONFIGS)
    is found through the prepared files."""
    try:
        return tfds.data_source(name, split=split, data_dir=data_dir or None, download=False)
    except Exception as e:  # TFDS raises several unrelated types for "not prepared" / "no such split"
        raise FileNotFoundError(f"TFDS dataset {name!r} split {split!r} under data_dir {data_dir!r} cannot be "
                                f"read ({type(e).__name__}: {e}); prepare it with file_format='array_record'") from e


def _check_features(source, fields: Fields, where: str) -> None:
    names = list(source.dataset_info.features.keys())
    for name in (fields.prompt, fields.answer, fields.id):
        if name and name not in names:
            raise BadDataError(where, None, name, f"no such feature; the dataset has {names}")


def tfds_source(name: str, data_dir: str | None = None, *, train_split: str = "train", eval_split: str = "test",
                fields: Fields = Fields(), seed: int = 0, shuffle: bool = True, skip_bad_rows: bool = False,
                default_heldout: int = 256) -> PromptSource:
    """A :class:`PromptSource` over a prepared array_record TFDS dataset, read lazily by index.

    A bad row fails with the split and 1-based row number, or with ``skip_bad_rows`` is skipped and
    counted when met. ``eval_split`` "" means no held-out records.
    """
    bad = BadRows(skip_bad_rows)
    train = _open(name, data_dir, train_split)
    where = f"tfds:{name}[{train_split}]"
    _check_features(train, fields, where)

    def get(i: int) -> PromptRecord | None:
        try:
            return row_to_record(train[i], fields, where, i + 1)
        except BadDataError as e:
            bad.handle(e)
            return None

    evals = _open(name, data_dir, eval_split) if eval_split else None
    eval_where = f"tfds:{name}[{eval_split}]"
    if evals is not None:
        _check_features(evals, fields, eval_where)

    def heldout(k: int) -> list[PromptRecord]:
        out: list[PromptRecord] = []
        for i in range(len(evals) if evals is not None else 0):
            if len(out) >= k:
                break
            try:
                out.append(row_to_record(evals[i], fields, eval_where, i + 1))
            except BadDataError as e:
                bad.handle(e)
        return out

    return PromptSource(f"tfds:{name}", get, len(train), heldout, seed=seed, shuffle=shuffle, bad=bad,
                        default_heldout=default_heldout)
