"""The run's config tree: one frozen dataclass per section, loaded from a YAML preset plus overrides.

    cfg = load_config("configs/default.yaml", ["allocation.method=sara", "steps=20"])

Validation (keys, types, ranges, cross-field rules) happens here, before any compute.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Literal

import yaml

from passrate_jax.allocation.config import AllocationConfig, PrefixSamplingConfig, check_prefix_sampling
from passrate_jax.configlib import (ConfigError, UserFileError, apply_overrides, build, option,  # noqa: F401
                                   PRESET_DIR, parse_override, read_preset, resolve_preset, section, to_dict)
from passrate_jax.data.tasks import TASKS
from passrate_jax.envs import resolve_env
from passrate_jax.model.config import ModelConfig
from passrate_jax.plugins import load_reward_fn
from passrate_jax.rl.config import OptimizerConfig, RLConfig
from passrate_jax.sampling.config import SamplingConfig
from passrate_jax.run.trackers import check_wandb_installed
from passrate_jax.sharding import MeshConfig  # noqa: F401  (defined next to the mesh; re-exported)


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where prompts come from, how the model sees them, and how its answers are scored (passrate_jax/data)."""
    source: Literal["builtin", "jsonl", "parquet", "tfds", "env"] = option(
        "builtin", doc="builtin: procedural task; jsonl/parquet: local file at path; tfds: array_record TFDS dataset; "
                       "env: multi-turn environment data.env (sampling.max_new_tokens is then per assistant turn)")
    task: Literal["arithmetic", "countdown", "columns", "worked", "repair"] = option(
        "arithmetic", doc="built-in task (source builtin); columns: longer 2- to 5-digit column arithmetic; "
                          "worked: arithmetic's problems with the problem copied and the equation checked; "
                          "repair: column addition whose slips are redone (the testbed, configs/testbed.yaml)")
    env: str = option("calculator", doc="multi-turn environment (source env): calculator, files, or your own "
                                        "class 'path/to/file.py:ClassName' / 'package.module:ClassName' "
                                        "(protocol: passrate_jax/envs/base.py)")
    max_turns: int = option(0, ge=0, doc="source env: assistant turns before an episode is cut off (reward of its "
                                         "state then); 0: the environment's default")
    seed: int = option(0, ge=0, doc="seed of the epoch shuffles and of the built-in problems")
    level: int = option(0, ge=0, doc="built-in difficulty level; 0 draws one per problem")
    max_level: int = option(0, ge=0, doc="with level 0: draw levels 1..max_level (0: every level)")
    min_level: int = option(1, ge=1, doc="builtin, with level 0: draw levels min_level..max_level")
    level_weights: tuple[float, ...] = option((), doc="builtin, with level 0: relative weights of levels min_level.."
                                                      "max_level in the train draws (empty: uniform); held-out "
                                                      "prompts stay uniform, so accuracy means the same")
    train_size: int = option(0, ge=0, doc="built-in: 0 = endless stream, else this many problems cycled in epochs")
    eval_size: int = option(256, ge=0, doc="held-out prompts per evaluation (the first K of the held-out split)")
    shuffle: bool = option(True, doc="reshuffle finite sources every epoch (seeded)")
    path: str = option("", doc="train file (source jsonl/parquet)")
    eval_path: str = option("", doc="held-out file, same format and fields; empty: no evaluation prompts")
    tfds_name: str = option("", doc="TFDS name, e.g. gsm8k or passrate_builtin/<config> (source tfds)")
    tfds_data_dir: str = option("", doc="TFDS data_dir; empty: TFDS's default")
    train_split: str = option("train", doc="TFDS train split")
    eval_split: str = option("test", doc="TFDS held-out split; empty: none")
    prompt_field: str = option("prompt", doc="row field holding the prompt")
    answer_field: str = option("answer", doc="row field holding the reference answer")
    id_field: str = option("", doc="row field holding a stable id (int, or str hashed); empty: hash of the prompt")
    reference_extract: Literal["none", "boxed", "gsm8k", "last_number"] = option(
        "none", doc="pull the reference out of a worked answer field (gsm8k: after ####)")
    skip_bad_rows: bool = option(False, doc="skip and count bad rows instead of failing on the first")
    template: str = option("{prompt}", doc="prompt template; {prompt} is replaced literally")
    chat_template: bool = option(False, doc="render the filled template through the tokenizer's chat template")
    system_prompt: str = option("", doc="system turn when chat_template; empty: none")
    answer_extract: Literal["none", "boxed", "gsm8k", "last_number"] = option(
        "boxed", doc="how the final answer is found in a response (not used by the task verifier)")
    verifier: Literal["auto", "task", "exact", "numeric", "math"] = option(
        "auto", doc="auto: task for built-in data, math otherwise")
    verify_timeout_s: float = option(5.0, gt=0, doc="per-answer limit of math verification, seconds")
    verify_workers: int = option(2, ge=1, doc="processes of the math verification pool")
    reward_fn: str = option("", doc="your reward function 'path/to/file.py:function' or 'package.module:function', "
                                    "called fn(prompt, response, reference, **fields) -> bool or float in the "
                                    "verification pool (verify_timeout_s per answer); replaces verifier and "
                                    "answer_extract. Its value is the reward for advantages as is")
    reward_threshold: float = option(0.5, doc="a rollout counts as a success for allocation (SARA, Pilot-Commit, "
                                              "DS, PS, selection, pass rates) iff its reward >= this")

    def validate(self) -> None:
        if self.template.count("{prompt}") != 1:
            raise ConfigError(f"template = {self.template!r}: must contain {{prompt}} exactly once")
        if self.source == "env":
            if self.reward_fn:
                raise ConfigError(f"reward_fn = {self.reward_fn!r}: not used with source env (the environment's "
                                  "reward(task, state) scores episodes)")
            levels = resolve_env(self.env, field="env").levels
            if self.level > levels or self.max_level > levels:
                raise ConfigError(f"level = {self.level}, max_level = {self.max_level}: environment {self.env} has "
                                  f"levels 1..{levels} (0: all)")
            if self.chat_template:
                raise ConfigError("chat_template = True: not supported with source env (turns are plain lines)")
        levels = len(TASKS[self.task].levels)
        if self.source == "builtin" and self.level > levels:
            raise ConfigError(f"level = {self.level}: {self.task} has levels 1..{levels} (0: mixed)")
        if self.source == "builtin" and self.max_level > levels:
            raise ConfigError(f"max_level = {self.max_level}: {self.task} has levels 1..{levels} (0: all)")
        if self.source in ("jsonl", "parquet", "tfds"):
            # These only shape procedural problems; a file or dataset is taken as it is.
            for key in ("level", "max_level", "train_size"):
                if getattr(self, key) != 0:
                    raise ConfigError(f"{key} = {getattr(self, key)}: ignored by source {self.source} (it "
                                      f"applies to sources builtin and env); set data.{key}=0")
        if self.min_level > 1 and (self.source != "builtin" or self.min_level > (self.max_level or levels)):
            raise ConfigError(f"min_level = {self.min_level}: needs source builtin and min_level <= max_level "
                              f"(here {self.max_level or levels})")
        if self.source in ("jsonl", "parquet") and not self.path:
            raise ConfigError(f"path = '': source {self.source} needs a file")
        if self.source == "tfds" and not self.tfds_name:
            raise ConfigError("tfds_name = '': source tfds needs a dataset name")
        if self.reward_fn:
            if self.verifier != "auto":
                raise ConfigError(f"verifier = {self.verifier!r}, reward_fn = {self.reward_fn!r}: give one (the "
                                  "reward function replaces the verifier)")
            load_reward_fn(self.reward_fn, field="reward_fn")  # configlib prefixes the section: data.reward_fn
        if self.verifier == "task" and not self._builtin_data:
            raise ConfigError(f"verifier = 'task': only for built-in task data, not source {self.source} "
                              f"{self.tfds_name or self.path!r}")

    @property
    def _builtin_data(self) -> bool:
        builtin_build = self.tfds_name.split("/")[0] == "passrate_builtin"  # tfds_builtin.BUILDER_NAME
        return self.source == "builtin" or (self.source == "tfds" and builtin_build)

    @property
    def resolved_verifier(self) -> str:
        """The verifier ``auto`` stands for: the task's own for built-in data, math equivalence otherwise."""
        if self.verifier != "auto":
            return self.verifier
        if self.source == "env":  # the environment scores its own episodes; nothing to start a math pool for
            return "exact"
        return "task" if self._builtin_data else "math"

    def check_level_weights(self, weights: tuple[float, ...], field: str) -> None:
        """ConfigError naming ``field`` unless ``weights`` is empty or one weight >= 0 per drawn level of
        the built-in task (levels min_level..max_level, a mixture: level 0), not all 0."""
        if not weights:
            return
        top = self.max_level or len(TASKS[self.task].levels)
        if self.source != "builtin" or self.level:
            raise ConfigError(f"{field} = {list(weights)}: weights the built-in task's levels, so needs data.source "
                              f"builtin and data.level 0 (here {self.source}, {self.level}); set {field}=[]")
        if len(weights) != top - self.min_level + 1 or min(weights) < 0 or sum(weights) <= 0:
            raise ConfigError(f"{field} = {list(weights)}: need {top - self.min_level + 1} weights >= 0 (levels "
                              f"{self.min_level}..{top}), not all 0")


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """Multi-process runs, one process per host (Cloud TPU pod workers, GPU nodes): JAX's own runtime,
    ``jax.distributed.initialize``. Every host runs the same program on its shard of the global batch."""
    initialize: bool = option(False, doc="initialize jax.distributed before anything else (also when the "
                                         "environment sets PASSRATE_JAX_DISTRIBUTED=1)")
    coordinator_address: str = option("", doc="host:port of process 0; empty: auto-detect (Cloud TPU, SLURM)")
    num_processes: int = option(0, ge=0, doc="processes in the run; 0: auto-detect")
    process_id: int = option(-1, ge=-1, doc="this process's id; -1: auto-detect")

    def validate(self) -> None:
        manual = (bool(self.coordinator_address), self.num_processes > 0, self.process_id >= 0)
        if any(manual) and not all(manual):
            raise ConfigError(f"coordinator_address = {self.coordinator_address!r}, num_processes = "
                              f"{self.num_processes}, process_id = {self.process_id}: give all three or none "
                              "(none: auto-detect on Cloud TPU / SLURM)")
        if all(manual) and self.process_id >= self.num_processes:
            raise ConfigError(f"process_id = {self.process_id}: must be < num_processes = {self.num_processes}")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Orbax checkpointing."""
    every_steps: int = option(10, ge=1)
    keep: int = option(3, ge=1)
    async_save: bool = option(True)


@dataclasses.dataclass(frozen=True)
class LoggingConfig:
    """Metrics output (metrics.jsonl gets a record every step; TensorBoard and W&B get the same)."""
    tensorboard: bool = option(True)
    progress_bar: bool = option(True)
    wandb: bool = option(False, doc="also log every metrics.jsonl key and the plots to Weights & Biases "
                                    "(pip install 'passrate-jax[wandb]')")
    wandb_project: str = option("passrate-jax", doc="W&B project")
    wandb_name: str = option("", doc="W&B run name; empty: the run directory's name")
    wandb_tags: tuple[str, ...] = option((), doc="W&B run tags")
    wandb_mode: Literal["online", "offline", "disabled"] = option(
        "online", doc="offline: write the W&B run under run_dir/wandb with no network (upload with wandb sync)")
    samples_every: int = option(10, ge=0, doc="every this many steps, a few (prompt, completion, reward) rows to "
                                              "run_dir/samples.jsonl, TensorBoard text and a W&B table; 0: none")
    samples_count: int = option(4, ge=1, doc="rows per sampled step (one per group first)")

    def validate(self) -> None:
        if self.wandb:
            check_wandb_installed()


@dataclasses.dataclass(frozen=True)
class WarmStartConfig:
    """Supervised warm start on the built-in task's reference solutions, so that pass rates spread
    over (0, 1) before RL. Cached by a hash of everything that determines its result."""
    enabled: bool = option(True)
    steps: int = option(400, ge=0)
    batch_size: int = option(64, ge=1)
    learning_rate: float = option(2e-3, gt=0)
    warmup_steps: int = option(20, ge=0)
    max_len: int = option(128, ge=8, doc="tokens per training sequence (prompt + solution + eos)")
    cache_dir: str | None = option(None, doc="None: $PASSRATE_JAX_CACHE or ~/.cache/passrate-jax")
    misread_rate: float = option(0.0, ge=0, le=1, doc="fraction of arithmetic demonstrations (at levels >= "
                                 "misread_min_level) that solve the problem with one operand digit misread "
                                 "(passrate_jax/data/demonstrations.py): a warm start with high pass@8, low pass@1")
    misread_min_level: int = option(1, ge=1, doc="levels below keep clean demonstrations")
    level_weights: tuple[float, ...] = option((), doc="builtin task: relative weights of levels data.min_level.."
                                              "data.max_level in the demonstrations (empty: uniform)")


@dataclasses.dataclass(frozen=True)
class Config:
    """A whole run."""
    seed: int = option(0, ge=0)
    steps: int = option(50, ge=0, doc="training steps")
    eval_every: int = option(10, ge=1)
    eval_samples: int = option(0, ge=0, doc="answers sampled per held-out prompt at each evaluation, at "
                               "sampling.temperature: eval_sampled_accuracy is their mean accuracy (pass@1, the "
                               "expected reward RL maximises); 0: greedy accuracy only")
    eval_greedy: Literal["every", "ends"] = option(
        "every", doc="greedy held-out accuracy at every evaluation, or (ends) only at step 0 and the last step "
        "when eval_samples > 0: greedy answers are a fifth of a 4-sample evaluation's cost")
    model: ModelConfig = section(ModelConfig)
    warm_start: WarmStartConfig = section(WarmStartConfig)
    data: DataConfig = section(DataConfig)
    sampling: SamplingConfig = section(SamplingConfig)
    allocation: AllocationConfig = section(AllocationConfig)
    prefix_sampling: PrefixSamplingConfig = section(PrefixSamplingConfig)
    rl: RLConfig = section(RLConfig)
    optimizer: OptimizerConfig = section(OptimizerConfig)
    mesh: MeshConfig = section(MeshConfig)
    distributed: DistributedConfig = section(DistributedConfig)
    checkpoint: CheckpointConfig = section(CheckpointConfig)
    logging: LoggingConfig = section(LoggingConfig)

    def validate(self) -> None:
        if not self.rl.recompute_old_logprobs:
            # make_train_step honours it (TrainBatch.old_logprobs); the training loop builds its batches
            # from stored token ids only, so "False" would silently train against zero log-probabilities.
            raise ConfigError("rl.recompute_old_logprobs = False: the training loop recomputes the old "
                              "log-probabilities with the trainer (it does not carry the sampler's); set it to true")
        # Checked here, not in DataConfig.validate, so that each error names its own section's field.
        self.data.check_level_weights(self.data.level_weights, "data.level_weights")
        if (self.warm_start.enabled and self.warm_start.misread_rate > 0
                and (self.data.source != "builtin" or self.data.task == "countdown")):
            raise ConfigError(f"warm_start.misread_rate = {self.warm_start.misread_rate}: misread demonstrations "
                              f"need data.source builtin and data.task arithmetic, columns or worked "
                              f"(got {self.data.source}, {self.data.task})")
        if self.warm_start.enabled:
            self.data.check_level_weights(self.warm_start.level_weights, "warm_start.level_weights")
        self._check_prefix_sampling()

    def _check_prefix_sampling(self) -> None:
        check_prefix_sampling(self.prefix_sampling, self.allocation)
        ps = self.prefix_sampling
        if ps.enabled and ps.granularity == "lines" and self.data.source == "env":
            raise ConfigError("prefix_sampling.granularity = 'lines': a multi-turn environment's prefix is cut at "
                              "whole assistant turns already; lines applies to text tasks only (use tokens)")

    def lr_schedule_note(self) -> str | None:
        """A warning when the learning-rate schedule ends before the run does: warm-up and decay count
        optimizer updates (``rl.ppo_epochs * rl.minibatches`` per step), not training steps."""
        opt, per_step = self.optimizer, self.rl.ppo_epochs * self.rl.minibatches
        end = opt.warmup_steps + opt.decay_steps
        if opt.decay_steps == 0 or end >= self.steps * per_step:
            return None
        floor = opt.final_lr_fraction * opt.learning_rate
        return (f"optimizer: warm-up + decay end at update {end} (step {-(-end // per_step)} of {self.steps}, "
                f"{per_step} updates per step); the learning rate stays at {floor:g} after it. Warm-up and decay "
                "count optimizer updates: scale optimizer.decay_steps by rl.ppo_epochs * rl.minibatches")


# Keys that only shape the built-in procedural tasks (and their warm start's demonstrations): a preset's
# values of them are dropped when a run switches it to a file or dataset source, which takes its rows as
# they are. The first three also shape environments' problems (source env).
PROCEDURAL_KEYS = ("data.level", "data.max_level", "data.train_size")
BUILTIN_ONLY_KEYS = ("data.min_level", "data.level_weights", "warm_start.misread_rate", "warm_start.misread_min_level",
                     "warm_start.level_weights")


def _pop(data: dict, key: str):
    section, _, name = key.rpartition(".")
    node = data.get(section) if section else data
    return node.pop(name, None) if isinstance(node, dict) else None


def adapt_preset(data: dict, explicit: set[str], warn) -> dict:
    """``data`` (a preset with overrides applied) with the preset's keys that the chosen source or reward
    ignores dropped, so that one flag (``data.source=jsonl``, ``data.reward_fn=...``) switches a preset:
    the built-in-only keys under a file, dataset or environment source, and the preset's ``data.verifier``
    and ``data.answer_extract`` under a reward function. Keys in ``explicit`` (set on the command line)
    are kept, so validation still refuses one the source ignores. ``warn`` gets one line naming those dropped."""
    section = data.get("data") if isinstance(data.get("data"), dict) else {}
    source = section.get("source", "builtin")
    keys = [] if source == "builtin" else list(BUILTIN_ONLY_KEYS) + ([] if source == "env" else list(PROCEDURAL_KEYS))
    reason = {k: f"data.source {source}" for k in keys}
    if section.get("reward_fn"):
        reason.update({k: "data.reward_fn" for k in ("data.verifier", "data.answer_extract")})
    dropped = {}
    for key, why in reason.items():
        if key not in explicit and (value := _pop(data, key)) is not None:
            defaults = Config()
            if value != to_dict(_get(defaults, key)):
                dropped.setdefault(why, []).append(f"{key}={value}")
    if dropped:
        warn("warning: the preset's " + "; ".join(f"{', '.join(ks)} do not apply with {why}"
                                                  for why, ks in dropped.items()) + ": dropped")
    return data


def _get(cfg, key: str):
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _stderr(line: str) -> None:
    print(line, file=sys.stderr)


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | tuple[str, ...] = (),
                warn=_stderr) -> Config:
    """Load a YAML preset (a file, or a packaged preset by name: ``default``, ``qwen3_gsm8k``; the
    defaults when ``path`` is None), apply ``key.sub=value`` overrides, drop the preset's keys the chosen
    source or reward function ignores (:func:`adapt_preset`, one ``warn`` line), and validate. Raises
    :class:`ConfigError` naming the key and value on any problem."""
    data = read_preset(path) if path is not None else {}
    data = apply_overrides(data, list(overrides))
    explicit = {".".join(parse_override(text)[0]) for text in overrides}
    # A packaged preset that reads a file (qwen3_gsm8k over default) drops its base's keys by design:
    # the warning is for a switch the user made, on the command line or in their own YAML.
    packaged = path is not None and resolve_preset(path).startswith(PRESET_DIR + os.sep)
    quiet = packaged and "data.source" not in explicit and "data.reward_fn" not in explicit
    return build(Config, adapt_preset(data, explicit, (lambda line: None) if quiet else warn))


def check_inputs(cfg: Config) -> None:
    """The files a run reads, checked before anything is built or any directory made: ``model.pretrained``
    must be a Hugging Face checkpoint directory, and a file source's ``data.path`` (and ``data.eval_path``)
    must exist. Each failure is one UserFileError naming the key, the value and the fix."""
    pretrained = cfg.model.pretrained
    if pretrained is not None:
        if not os.path.isdir(pretrained):
            raise UserFileError(f"model.pretrained = {pretrained!r}: no such directory; give a checkpoint directory "
                                "(config.json, *.safetensors, tokenizer.json), e.g. one examples/make_tiny_model.py "
                                "writes, or leave it unset for the built-in model")
        missing = [name for name in ("config.json", "tokenizer.json") if not os.path.isfile(
            os.path.join(pretrained, name))]
        if not any(name.endswith(".safetensors") for name in os.listdir(pretrained)):
            missing.append("*.safetensors")
        if missing:
            raise UserFileError(f"model.pretrained = {pretrained!r}: not a Hugging Face checkpoint, it lacks "
                                f"{', '.join(missing)}" + ("; a training run directory needs passrate-jax export "
                                "first" if os.path.isfile(os.path.join(pretrained, "config.yaml")) else ""))
    if cfg.data.source in ("jsonl", "parquet"):
        for key in ("path", "eval_path"):
            value = getattr(cfg.data, key)
            if value and not os.path.isfile(value):
                raise UserFileError(f"data.{key} = {value!r}: no such file (relative paths are from the working "
                                    f"directory {os.getcwd()!r})")


def episode_limits(data: DataConfig, sampling: SamplingConfig, max_positions: int) -> tuple[int, int, int]:
    """(turn limit, tokens per turn, context length limit) of an environment run's episodes:
    ``data.max_turns`` (0: the environment's own), ``sampling.max_new_tokens``, and the model's position
    limit ``max_positions``."""
    return data.max_turns or resolve_env(data.env).max_turns, sampling.max_new_tokens, max_positions


def dump_config(cfg: Config) -> str:
    """The resolved config as YAML."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)
