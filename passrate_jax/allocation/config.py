"""Static hyper-parameters of every allocation method (DESIGN.md section 2). Defaults are DESIGN's."""

from __future__ import annotations

import dataclasses
from typing import Literal

from passrate_jax.configlib import ConfigError, option, section


@dataclasses.dataclass(frozen=True)
class DSConfig:
    """DAPO dynamic sampling."""
    gen_batch_multiple: int = option(3, ge=1, doc="generation batch = gen_batch_multiple * B prompts")
    max_gen_batches: int = option(10, ge=1)
    keep_surplus: bool = option(False, doc="ideal DS: keep surplus valid groups for the next step (ours)")


@dataclasses.dataclass(frozen=True)
class SaraConfig:
    """SARA sequential allocation."""
    mode: Literal["fill", "fixed_budget"] = option(
        "fill", doc="fill: open prompts until B confirmed groups are complete (capped at DS's worst case); "
                    "fixed_budget: spend at most B * N rollouts a step")
    tau_confirm: float = option(0.9, ge=0, le=1)
    tau_abandon: float = option(0.45, ge=0, le=1)
    round_schedule: tuple[int, ...] = option((2, 2), ge=1,
                                              doc="probe rollouts per round; a confirmed group is completed to N")
    prior_a: float = option(1.0, gt=0)
    prior_b: float = option(1.0, gt=0)
    max_rounds: int = option(256, ge=1, doc="rounds per step before SARA stops, a safety bound (ours)")

    def validate(self) -> None:
        if self.tau_abandon >= self.tau_confirm:
            raise ConfigError(f"tau_abandon = {self.tau_abandon}: must be < tau_confirm = "
                              f"{self.tau_confirm}")


@dataclasses.dataclass(frozen=True)
class PilotCommitConfig:
    """Pilot-Commit. ``mode``: fill (the released code's loop: pilot and commit in rounds until B groups
    are committed) or budgeted (the paper's framing: a fixed per-step budget, ``pilot_budget_fraction``
    of it piloting in the first round, the rest committed to the highest-variance pilots; see
    docs/design.md 2.3)."""
    mode: Literal["fill", "budgeted"] = option(
        "fill", doc="fill: pilot and commit in rounds until B groups are committed (the released code); budgeted: "
                    "spend at most allocation.budget (default B * N) a step, pilot_budget_fraction of it on a "
                    "first-round pilot stage, the rest on commits (the paper)")
    pilot_budget_fraction: float = option(0.5, gt=0, lt=1, doc="budgeted mode: share of the step budget spent "
                                                               "on the first round's pilots")
    pilot_pool_ratio: int = option(3, ge=1)
    pilot_fraction: float = option(0.25, gt=0, lt=1, doc="n_p = round(pilot_fraction * N)")
    p_low: float = option(0.125, ge=0, le=1)
    p_high: float = option(0.25, ge=0, le=1)
    buffer_max_age: int = option(4, ge=0)
    evict_steps: int = option(0, ge=0, doc="a prompt whose pilot succeeded on every rollout is left out of the "
                                           "next evict_steps steps; 0: for the rest of the run (the released code)")
    max_rounds: int = option(10, ge=1)


@dataclasses.dataclass(frozen=True)
class SelectionConfig:
    """Predictive prompt selection (MoPPS / DPS)."""
    method: Literal["none", "mopps", "dps"] = option("none")
    pool_ratio: int = option(8, ge=1, doc="candidate pool = pool_ratio * B")
    mopps_lambda: float = option(0.5, ge=0, le=1)
    mopps_alpha0: float = option(1.0, gt=0)
    mopps_beta0: float = option(1.0, gt=0)
    dps_lambda: float = option(0.7, ge=0, le=1)
    dps_alpha0: float = option(1.0, gt=0)


@dataclasses.dataclass(frozen=True)
class AllocationConfig:
    """Which prompts get rollouts, and how many."""
    method: Literal["uniform", "ds", "sara", "pilot_commit"] = option("uniform")
    num_prompts: int = option(8, ge=1, doc="B: groups trained per step")
    group_size: int = option(8, ge=2, doc="N: rollouts per group")
    budget: int | None = option(None, ge=1, doc="rollout budget per step; None: B * N for uniform, "
                                 "fixed-budget SARA and budgeted Pilot-Commit, gen_batch_multiple * max_gen_batches * B * N for SARA fill, "
                                 "unbounded for DS and fill Pilot-Commit (their round limits bound them)")
    ds: DSConfig = section(DSConfig)
    sara: SaraConfig = section(SaraConfig)
    pilot_commit: PilotCommitConfig = section(PilotCommitConfig)
    selection: SelectionConfig = section(SelectionConfig)

    def validate(self) -> None:
        if self.method == "pilot_commit":
            pc = self.pilot_commit
            n_p = int(min(max(round(pc.pilot_fraction * self.group_size), 1), self.group_size - 1))
            if not any(pc.p_low <= s / n_p <= 1 - pc.p_high for s in range(n_p + 1)):
                raise ConfigError(
                    f"pilot_commit.pilot_fraction = {pc.pilot_fraction}: with group_size = {self.group_size} the "
                    f"pilot has {n_p} rollout(s) and no pilot pass rate lies in [p_low, 1 - p_high] = "
                    f"[{pc.p_low}, {1 - pc.p_high}], so nothing would ever be committed")
            budget = self.budget if self.budget is not None else self.num_prompts * self.group_size
            if pc.mode == "budgeted" and int(pc.pilot_budget_fraction * budget) < n_p:
                raise ConfigError(
                    f"pilot_commit.pilot_budget_fraction = {pc.pilot_budget_fraction}: of a step budget of {budget} "
                    f"rollouts it leaves {int(pc.pilot_budget_fraction * budget)} for pilots of {n_p} rollouts each, "
                    f"so no pilot would run; raise it or allocation.budget")


@dataclasses.dataclass(frozen=True)
class PrefixSamplingConfig:
    """Prefix Sampling: bidirectional pass-rate steering by prefix replay."""
    enabled: bool = option(False)
    mode: Literal["adaptive", "fixed", "hard_only"] = option("adaptive")
    target: float = option(0.5, gt=0, lt=1)
    deadzone: float = option(0.03, ge=0, lt=0.5)
    step: float = option(0.05, gt=0, le=1)
    ema_decay: float = option(0.9, ge=0, lt=1)
    ratio_init: float = option(0.25, gt=0, lt=1)
    ratio_min: float = option(0.05, gt=0, lt=1)
    ratio_max: float = option(0.95, gt=0, lt=1)
    max_replay_share: float = option(0.5, gt=0, le=1,
                                     doc="a step opens at most int(max_replay_share * B) re-rollout groups (ours)")
    timing: Literal["next_step", "same_step"] = option(
        "next_step", doc="next_step: a step's skewed groups are replayed in the first round of the next step; "
                         "same_step: in a later round of the same step, under the policy that produced them "
                         "(one extra round a step for it)")
    placement: Literal["in_place", "on_top"] = option(
        "in_place", doc="in_place: re-rollout groups count toward the step's B trained groups (they take the "
                        "place of fresh prompts; same budget); on_top: the step trains B fresh groups plus the "
                        "re-rollout groups, and its rollout budget rises by int(max_replay_share * B) * N")
    granularity: Literal["tokens", "lines"] = option(
        "tokens", doc="how a text prefix is cut: tokens (r of the response's tokens, snapped back to a line break "
                      "within the last 10% of the cut) or lines (round(r * L) of its L whole lines, at least one "
                      "and never all; a one-line response is cut by tokens). Text tasks only")

    def validate(self) -> None:
        if not self.ratio_min <= self.ratio_init <= self.ratio_max:
            raise ConfigError(f"ratio_init = {self.ratio_init}: must lie in [ratio_min, ratio_max]"
                              f" = [{self.ratio_min}, {self.ratio_max}]")

    def replay_slots(self, num_prompts: int) -> int:
        """Re-rollout groups a step may open when enabled: int(max_replay_share * B)."""
        return int(self.max_replay_share * num_prompts)

    def extra_groups(self, num_prompts: int) -> int:
        """Groups a step may train beyond B: the replay slots when enabled and placed on top, else 0."""
        return self.replay_slots(num_prompts) if self.enabled and self.placement == "on_top" else 0


def check_prefix_sampling(ps: PrefixSamplingConfig, cfg: AllocationConfig) -> None:
    """Constraints between Prefix Sampling and the allocation it runs on; raises :class:`ConfigError`."""
    if ps.enabled and ps.timing == "same_step" and ps.placement == "in_place" and ps.replay_slots(
            cfg.num_prompts) >= cfg.num_prompts:
        raise ConfigError(f"prefix_sampling.max_replay_share = {ps.max_replay_share}: with timing same_step and "
                          f"placement in_place it holds back int(max_replay_share * B) = "
                          f"{ps.replay_slots(cfg.num_prompts)} of the B = {cfg.num_prompts} groups for replays of "
                          f"the step's own groups, leaving none to replay; use a share below 1 (or placement on_top)")
