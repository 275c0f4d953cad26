"""Rollout allocation (DESIGN.md section 2): which prompts get rollouts, and how many.

Pure, jit-compatible pieces (optax-style state + functions) and one host-driven allocator:

- :func:`validity_probability`: SARA's closed-form Beta-binomial validity predictor.
- :mod:`.measures`: the four "why 50%" measures of DESIGN section 1.
- :func:`sara_decide`, :func:`pilot_classify`, selection (:func:`select_prompts`,
  :func:`selection_update`), Prefix Sampling controllers (:func:`prefix_control_update`).
- :class:`Allocator`: every composition of DESIGN 2.5 behind one round-by-round interface.
"""

from passrate_jax.allocation.allocator import Allocator
from passrate_jax.allocation.protocol import (AllocatorState, Prefix, Request, Result, StepResult, TrainGroup,
                                              state_from_dict, state_to_dict)
from passrate_jax.allocation.beta_binomial import log_run_probability, validity_probability
from passrate_jax.allocation.group_queue import (GroupQueue, pilot_priority, queue_expire, queue_init, queue_push,
                                                 queue_take)
from passrate_jax.allocation.measures import (filter_survival, reward_entropy, rloo_advantage_energy,
                                              success_failure_pairs)
from passrate_jax.allocation.pilot_commit import EVICT, KEEP, SKIP, pilot_classify, pilot_size
from passrate_jax.allocation.prefix_control import (PrefixControlState, bucket_index, bucket_kind,
                                                    bucket_successes, choose_minority, num_buckets, plan_replays,
                                                    prefix_control_init, prefix_control_update, replay_eligible)
from passrate_jax.allocation.sara import ABANDON, CONFIRM, CONTINUE, sara_decide
from passrate_jax.allocation.selection import (SelectionState, dps_mixed_probability, observed_state,
                                               select_prompts, selection_init, selection_prior, selection_scores,
                                               selection_update)

__all__ = [
    "Allocator", "AllocatorState", "Prefix", "Request", "Result", "StepResult", "TrainGroup",
    "state_from_dict", "state_to_dict", "log_run_probability", "validity_probability", "GroupQueue",
    "pilot_priority", "queue_expire", "queue_init", "queue_push", "queue_take", "filter_survival",
    "reward_entropy", "rloo_advantage_energy", "success_failure_pairs", "EVICT", "KEEP", "SKIP",
    "pilot_classify", "pilot_size", "PrefixControlState", "bucket_index", "bucket_kind", "bucket_successes",
    "choose_minority", "num_buckets", "plan_replays", "prefix_control_init", "prefix_control_update", "replay_eligible",
    "ABANDON", "CONFIRM", "CONTINUE", "sara_decide", "SelectionState", "dps_mixed_probability",
    "observed_state", "select_prompts", "selection_init", "selection_prior", "selection_scores",
    "selection_update",
]
