"""What ``passrate-jax study`` compares: the methods (each a set of config overrides with a preset of the
same composition in configs/) and the source papers' claims it checks (docs/design.md section 2.6).

A data module on its own, so that the study driver (``runner.py``) and its report (``report.py``)
both read it without importing each other.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

# name -> (label, config overrides on top of the base preset). Each name has a preset of the same
# composition in configs/ (tests/test_study.py checks they agree). SARA is the fill mode (B valid groups
# per step, docs/design.md 2.2); `sara_fixed` the fixed-budget mode (B * N rollouts per step).
# PS adaptive on uniform allocation: the ``ps_adaptive`` method, and the base the PS investigation's
# methods each change one switch of.
PS_ADAPTIVE = ("allocation.method=uniform", "prefix_sampling.enabled=true", "prefix_sampling.mode=adaptive")
PILOT_COMMIT_BUDGETED = ("allocation.method=pilot_commit", "allocation.pilot_commit.mode=budgeted",
                         "allocation.pilot_commit.pilot_budget_fraction=0.5", "allocation.pilot_commit.pilot_fraction=0.5",
                         "allocation.pilot_commit.p_low=0.25", "allocation.pilot_commit.p_high=0.25")
METHODS: dict[str, tuple[str, tuple[str, ...]]] = {
    "grpo": ("GRPO (uniform)", ("allocation.method=uniform",)),
    "ds": ("DS (DAPO dynamic sampling)", ("allocation.method=ds",)),
    "ds_ideal": ("ideal DS (keeps its surplus)", ("allocation.method=ds", "allocation.ds.keep_surplus=true")),
    "mopps": ("MoPPS", ("allocation.method=uniform", "allocation.selection.method=mopps")),
    "dps": ("DPS", ("allocation.method=uniform", "allocation.selection.method=dps")),
    "sara": ("SARA (fill)", ("allocation.method=sara",)),
    "sara_fixed": ("SARA fixed budget", ("allocation.method=sara", "allocation.sara.mode=fixed_budget")),
    "sara_dps": ("SARA + DPS", ("allocation.method=sara", "allocation.selection.method=dps")),
    # Pilot-Commit as its paper frames it (GRPO's budget B x N, half of it a pilot stage of 4-rollout
    # pilots, configs/pilot_commit.yaml), and the released code's fill loop (configs/pilot_commit_fill.yaml).
    "pilot_commit": ("Pilot-Commit (budgeted)", PILOT_COMMIT_BUDGETED),
    "pilot_commit_fill": ("Pilot-Commit fill loop", ("allocation.method=pilot_commit",
                                                     "allocation.pilot_commit.mode=fill")),
    "ps_adaptive": ("PS adaptive", PS_ADAPTIVE),
    "ps_fixed": ("PS fixed 0.25", ("allocation.method=uniform", "prefix_sampling.enabled=true",
                                   "prefix_sampling.mode=fixed", "prefix_sampling.ratio_init=0.25")),
    "ps_hard_only": ("PS hard-only", ("allocation.method=uniform", "prefix_sampling.enabled=true",
                                      "prefix_sampling.mode=hard_only")),
    "ps_sara_dps": ("PS + SARA + DPS", ("allocation.method=sara", "allocation.selection.method=dps",
                                        "prefix_sampling.enabled=true", "prefix_sampling.mode=adaptive")),
    # Why PS does or does not help (docs/design.md 2.4): PS adaptive with one switch changed each.
    "ps_same_step": ("PS adaptive, replayed in the same step", (*PS_ADAPTIVE, "prefix_sampling.timing=same_step")),
    "ps_on_top": ("PS adaptive, replays on top of B", (*PS_ADAPTIVE, "prefix_sampling.placement=on_top")),
    "ps_lines": ("PS adaptive, prefixes of whole lines", (*PS_ADAPTIVE, "prefix_sampling.granularity=lines")),
    # Every cut at most 12% of the source answer's tokens: inside the built-in worked answer's first line
    # (the copied problem, 15-19% of an answer), so the replay's continuation writes most of the copy.
    "ps_first_line": ("PS adaptive, cuts inside the first line (r <= 0.12)",
                      (*PS_ADAPTIVE, "prefix_sampling.ratio_init=0.1", "prefix_sampling.ratio_max=0.12")),
}
# The PS investigation's methods: run with ``passrate-jax study --methods grpo ps_adaptive ps_same_step ...``;
# not in the default study.
PS_INVESTIGATION = ("ps_same_step", "ps_on_top", "ps_lines", "ps_first_line")
DEFAULT_METHODS = tuple(m for m in METHODS if m not in PS_INVESTIGATION)  # what ``study`` runs by default
# Every method starts from "no selection, no PS" (and PS's switches at their defaults); its overrides
# switch on what it uses.
NEUTRAL = ("allocation.selection.method=none", "prefix_sampling.enabled=false", "prefix_sampling.timing=next_step",
           "prefix_sampling.placement=in_place", "prefix_sampling.granularity=tokens")
BASELINES = ("grpo", "ds")  # every ratio is reported against both
# HEADLINE_METHODS (below CLAIMS): every method a claim of the papers is tested on, with both baselines.
# ``--headline-seeds`` gives these more seeds than the rest, so that every verdict of the claims table
# rests on the same paired seeds at a fraction of the cost of giving every method all of them.


@dataclasses.dataclass(frozen=True)
class Claim:
    """One claim of a source paper, quoted exactly (docs/design.md 2.6), and how this study tests it.

    source: the paper. measure: a per-seed measure of ``study_analysis.COMPARED``. kind: ``factor`` (the
    method's factor over the baseline, oriented so that above 1 favours the method; ``value`` is the
    claimed factor), ``above`` (method - baseline > 0: the method's accuracy is above the baseline's)
    or ``match`` (|method - baseline| within ``value``, our equivalence margin). scale: the models the
    paper measured the claim on (this study's model is far smaller; the report says so beside the
    verdict). premise: which premise probe of ``probes.py`` the claim rests on (``ps``, ``selection``,
    ``budget`` or None) and ``premise_method`` the run it is read from (default: ``method``)."""
    label: str
    quote: str
    source: str
    method: str
    baseline: str
    measure: str
    kind: Literal["factor", "above", "match"]
    value: float
    scale: str = ""
    premise: Literal["ps", "selection", "budget"] | None = None
    premise_method: str | None = None

    @property
    def premise_run(self) -> str:
        return self.premise_method or self.method


PS, SARA, PC = "Prefix Sampling paper", "SARA paper", "Pilot-Commit paper"
PS4B, PS14B, SARA_SCALE, PC_SCALE = "Qwen3-4B", "Qwen3-14B", "1.5B / 3B", "1.5B-14B"
CLAIMS = (
    Claim("PS adaptive: fewer steps to converge than GRPO", "4B 1.92x, 8B 1.56x, 14B 1.51x, 32B 1.40x "
          "(tested against 4B's 1.92x, the paper's smallest model and its ablation's)", PS,
          "ps_adaptive", "grpo", "steps_to_target", "factor", 1.92, PS4B, "ps"),
    Claim("PS adaptive: end-to-end wall clock against GRPO", "14B 2.01x, 32B 1.55x (tested against 14B's 2.01x)",
          PS, "ps_adaptive", "grpo", "seconds_to_target", "factor", 2.01, PS14B, "ps"),
    Claim("PS adaptive: valid groups per batch against GRPO", "+41.7% (14B), +28.8% (32B) (tested against "
          "14B's 1.417x)", PS, "ps_adaptive", "grpo", "valid_groups_per_step", "factor", 1.417, PS14B, "ps"),
    Claim("PS fixed (r = 0.25): fewer steps than GRPO", "PS-fix (r = 0.25) 1.61x (4B)", PS,
          "ps_fixed", "grpo", "steps_to_target", "factor", 1.61, PS4B, "ps"),
    Claim("PS hard-only adaptive: fewer steps than GRPO", "hard-only adaptive 1.13x (4B)", PS,
          "ps_hard_only", "grpo", "steps_to_target", "factor", 1.13, PS4B, "ps"),
    Claim("SARA: fewer rollouts than DS", "22% fewer rollouts than DS (cost ratio 0.78, so DS / SARA = 1.28x)",
          SARA, "sara", "ds", "rollouts_to_target", "factor", 1 / 0.78, SARA_SCALE),
    Claim("SARA: accuracy matching DPS", "accuracy matching DPS (tested as |SARA - DPS| final accuracy "
          "within 0.02, our margin)", SARA, "sara", "dps", "final_accuracy", "match", 0.02, SARA_SCALE,
          "selection", "dps"),
    Claim("SARA: accuracy below the DS oracle", "both below the DS oracle (tested as DS - SARA final "
          "accuracy > 0)", SARA, "ds", "sara", "final_accuracy", "above", 0.0, SARA_SCALE),
    Claim("DPS: accuracy below the DS oracle", "both below the DS oracle (tested as DS - DPS final "
          "accuracy > 0)", SARA, "ds", "dps", "final_accuracy", "above", 0.0, SARA_SCALE, "selection", "dps"),
    Claim("SARA + DPS: fewer rollouts than DS", "67% fewer rollouts than DS (cost ratio 0.33, so "
          "DS / (SARA + DPS) = 3.03x)", SARA, "sara_dps", "ds", "rollouts_to_target", "factor", 1 / 0.33,
          SARA_SCALE, "selection"),
    Claim("SARA + DPS: accuracy slightly above DS", "with accuracy slightly above DS (tested as final "
          "accuracy difference > 0)", SARA, "sara_dps", "ds", "final_accuracy", "above", 0.0, SARA_SCALE,
          "selection"),
    # The paper's framing is budget-aware, so its claim against GRPO is tested with the budgeted form at
    # GRPO's budget; the released code's fill loop is the one compared with DS (DESIGN.md 2.3).
    Claim("Pilot-Commit (budgeted): fewer cumulative rollouts than GRPO", "target accuracy reached with up to "
          "1.9x fewer cumulative rollouts than GRPO (a best case)", PC, "pilot_commit", "grpo",
          "rollouts_to_target", "factor", 1.9, PC_SCALE, "budget"),
    Claim("Pilot-Commit (fill loop): fewer cumulative rollouts than DS", "up to 4.0x fewer than DAPO (DS) "
          "(a best case)", PC, "pilot_commit_fill", "ds", "rollouts_to_target", "factor", 4.0, PC_SCALE),
)

HEADLINE_METHODS = tuple(m for m in METHODS if m in BASELINES or any(m in (c.method, c.baseline, c.premise_run)
                                                                     for c in CLAIMS))
