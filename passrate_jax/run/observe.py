"""What a run's steps looked like, for the person watching it: rewards as scored (mean and standard
deviation, fractional rewards included), response lengths and truncation, reward errors counted by
cause, a few (prompt, completion, reward) samples, the run's totals its summary reports, and the
:class:`Reporter` that sends each step's record to the metrics sinks and the progress bar.

The reward errors of a step are the rewarder's counted failures during that step (a reward function or
verifier that raised, crashed its worker or returned no number: ``verifier_errors``; one that ran over
``data.verify_timeout_s``: ``verifier_timeouts``) plus those the rollout table marks (a verifier call that
raised in process, an environment's ``reward`` that raised). Failures while evaluating are counted apart,
``eval_verifier_errors`` / ``eval_verifier_timeouts`` in the record of the step that evaluated. Summed
over a fresh run, training and evaluation counts equal the rewarder's cumulative
``verifier/verify/error`` and ``verifier/verify/timeout``: one counter per cause, the same everywhere.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from passrate_jax.configlib import UserError
from passrate_jax.run.config import Config
from passrate_jax.run.metrics import MetricsWriter

# Per-step record key -> the rewarder counter's kind it counts.
ERROR_CAUSES = {"verifier_errors": "error", "verifier_timeouts": "timeout"}


class RewardFailure(UserError):
    """Every answer of a step failed to score: the reward function (or verifier) is broken, so training
    on its zeros would only waste the run."""


def scorer_name(data_cfg) -> str:
    """How messages name what scores answers: the user's reward function, the environment, or the verifier."""
    if data_cfg.reward_fn:
        return f"data.reward_fn = {data_cfg.reward_fn!r}"
    if data_cfg.source == "env":
        return f"the reward of data.env = {data_cfg.env!r}"
    return f"the {data_cfg.resolved_verifier} verifier (data.verifier)"


class RewardErrors:
    """Reward failures by cause over a stretch of a run (a step's rollouts, an evaluation): deltas of a
    rewarder's running counter since :meth:`mark`, plus the rollout table's own error marks."""

    def __init__(self, counter):
        self.counter = counter
        self._warned = False
        self.mark()

    def mark(self) -> None:
        """Start counting here (the start of a step, of an evaluation)."""
        self._seen = {kind: self.counter.counts[kind] for kind in ERROR_CAUSES.values()}

    def since_mark(self, prefix: str = "") -> dict[str, int]:
        """Failures by cause since :meth:`mark` (``{prefix}verifier_errors``, ...), and mark again."""
        out = {f"{prefix}{key}": self.counter.counts[kind] - self._seen[kind] for key, kind in ERROR_CAUSES.items()}
        self.mark()
        return out

    def step(self, table) -> dict[str, int]:
        """The step's failures (since the mark at its start) and the answers it scored."""
        seen = table["observed"].astype(bool)
        out = {"answers_scored": int(seen.sum()), **self.since_mark()}
        out["verifier_errors"] += int(table["verifier_error"][seen].sum())
        return out

    def first_warning(self, record: dict, data_cfg) -> str | None:
        """One line the first time a step's answers fail to score (later ones are only counted)."""
        failed = record["verifier_errors"] + record["verifier_timeouts"]
        if not failed or self._warned:
            return None
        self._warned = True
        return (f"warning: {scorer_name(data_cfg)} failed on {failed} of {record['answers_scored']} answers of step "
                f"{record['step']} ({self.last()}); each scores 0 and is counted in verifier_errors / "
                "verifier_timeouts (--debug logs every one)")

    def last(self) -> str:
        """The latest failure, in short (``ValueError: boom at my_reward.py:5``)."""
        return self.counter.last.get("error") or self.counter.last.get("timeout") or "no message kept"


def check_step_scored(record: dict, errors: RewardErrors, data_cfg) -> None:
    """:class:`RewardFailure` when every answer of the step failed to score, naming the scorer and its failure."""
    failed = record["verifier_errors"] + record["verifier_timeouts"]
    if record["answers_scored"] and failed >= record["answers_scored"]:
        raise RewardFailure(f"{scorer_name(data_cfg)} failed on every answer of step {record['step']} ({failed} of "
                            f"{record['answers_scored']}): {errors.last()}. Fix it and run again")


def rollout_stats(store, table) -> dict[str, float]:
    """Rewards as scored (``reward/mean``, ``reward/std``: a text run's scores, floats included; an
    environment's final-state rewards), tokens the policy generated (``response/length_mean``,
    ``response/length_max``: a text answer's completion, an episode's actions) and the fraction cut off by
    the token or turn limit (``response/truncated_fraction``), over the step's observed rollouts."""
    seen = table["observed"].astype(bool)
    if not seen.any():
        return {}
    scores = np.asarray(table["score"], float)[seen]
    lengths = np.array([store.generated_tokens(int(key), int(index))
                        for key, index in zip(table["group_key"][seen], table["index"][seen])])
    return {"reward/mean": float(scores.mean()), "reward/std": float(scores.std()),
            "response/length_mean": float(lengths.mean()), "response/length_max": int(lengths.max()),
            "response/truncated_fraction": float(table["truncated"][seen].mean())}


def groups_with_signal(store, groups) -> int:
    """Trained groups whose rewards as scored differ, so that their advantages (and the update) are not all
    zero: with fractional rewards a group can carry signal without a success, and the reverse."""
    count = 0
    for g in groups:
        kept = store.groups.get(g.group_key)
        scored = {kept.score(i, s) if kept else s for i, s in enumerate(g.rewards)}
        count += len(scored) > 1
    return count


def sample_rows(session, table, step: int, count: int) -> list[dict]:
    """Up to ``count`` of the step's rollouts as (step, prompt, completion, reward) rows, one per group first
    (so the rows show different prompts). The completion is what the rollout wrote after its prompt (the
    trajectory store's ``response``: a text answer, an episode's turns with the environment's observations)."""
    seen = np.flatnonzero(table["observed"].astype(bool))
    by_group: dict[int, int] = {}
    for row in seen:
        by_group.setdefault(int(table["group_key"][row]), int(row))
    picked = list(by_group.values())[:count]
    picked += [int(r) for r in seen if int(r) not in picked][:count - len(picked)]
    store, rows = session.backend.store, []
    for row in picked:
        key, index = int(table["group_key"][row]), int(table["index"][row])
        rows.append({"step": step, "prompt": session.prompts[store.groups[key].prompt].prompt,
                     "completion": session.decode(store.response(key, index)),
                     "reward": float(table["score"][row])})
    return rows


@dataclasses.dataclass
class RunTotals:
    """What the summary says about the steps this process ran."""
    steps: int = 0
    answers: int = 0
    errors: int = 0
    timeouts: int = 0
    signal_groups: int = 0

    def add(self, record: dict) -> None:
        self.steps += 1
        self.answers += record.get("answers_scored", 0)
        self.errors += record.get("verifier_errors", 0)
        self.timeouts += record.get("verifier_timeouts", 0)
        self.signal_groups += record.get("groups_with_signal", 0)

    def notes(self, data_cfg) -> list[str]:
        """Lines for the end of the run: reward failures, and a run that trained no group."""
        lines = []
        if self.errors or self.timeouts:
            what = f"raised on {self.errors}" if self.errors else ""
            if self.timeouts:
                what += (" and " if what else "") + f"timed out on {self.timeouts}"
            lines.append(f"warning: {scorer_name(data_cfg)} {what} of {self.answers} answers (reward 0 each; "
                         "metrics.jsonl: verifier_errors, verifier_timeouts)")
        if self.steps and not self.signal_groups:
            lines.append(f"warning: this run trained no group in {self.steps} steps: every group's rewards were "
                         "equal (e.g. all 0), so every advantage and update was zero. Look at the rewards "
                         "(reward/mean in metrics.jsonl, samples.jsonl); try easier data, partial credit in "
                         "data.reward_fn, or a warm start")
        return lines


class Reporter:
    """Where a run's records go: ``metrics.jsonl``, TensorBoard and W&B as configured
    (:class:`MetricsWriter.for_run`, primary host only; records past the checkpoint a run resumes from
    are dropped) and the progress bar."""

    def __init__(self, cfg: Config, run_dir: str, start: int | None, *, primary: bool, progress: bool):
        # A start without a checkpoint (start None) drops every record of an attempt killed before
        # its first checkpoint; a resume drops the records past the checkpoint it resumes from.
        self.writer = MetricsWriter.for_run(cfg, run_dir, truncate_after=-1 if start is None else start,
                                            enabled=primary)
        self.bar = None
        self.totals = RunTotals()
        if progress and cfg.logging.progress_bar and primary:
            from tqdm import tqdm
            self.bar = tqdm(total=cfg.steps, initial=start or 0, desc="train", unit="step", dynamic_ncols=True)

    def write(self, record: dict) -> None:
        """One record (step 0: the starting point; then one per step); its ``samples`` rows, if any, go
        to ``samples.jsonl`` and the trackers instead of the metrics."""
        samples = record.pop("samples", None)
        self.writer.write(record)
        self.writer.write_samples(samples or [])
        if record["step"] > 0:
            self.totals.add(record)
        if self.bar is not None and record["step"] > 0:
            self.bar.update(1)
            postfix = {k: f"{record[v]:.2f}" for k, v in PROGRESS_KEYS if v in record and record[v] == record[v]}
            if self.totals.errors or self.totals.timeouts:  # reward failures in sight while the run goes on
                postfix["reward_err"] = f"{self.totals.errors + self.totals.timeouts}/{self.totals.answers}"
            self.bar.set_postfix(postfix, refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self.writer.close()


PROGRESS_KEYS = (("acc", "train_accuracy"), ("reward", "reward/mean"), ("valid", "valid_group_fraction"), ("useful", "useful_rollout_fraction"),
                 ("eval", "eval_accuracy"), ("eval_sampled", "eval_sampled_accuracy"))
