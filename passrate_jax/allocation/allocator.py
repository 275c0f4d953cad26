"""The allocator interface a host loop drives round by round (DESIGN.md 2.5, docs/interfaces.md).

    allocator = Allocator(cfg.allocation, cfg.prefix_sampling, num_prompts=len(dataset))
    state = allocator.init(jax.random.PRNGKey(seed))
    for step in range(steps):
        run = allocator.start_step(state)
        while requests := run.requests():
            run.observe([Result(r.group_key, verify(sample(r))) for r in requests])
        result, state = run.finish()     # result.groups: what to train on; result.rollouts_spent

Every composition {uniform, ds, sara, pilot_commit} x {none, mopps, dps} x {PS off, on} is this one
object: the base method's policy (:mod:`.policies`) decides which groups are opened, probed, completed
and kept; the selection method decides which prompts are opened; Prefix Sampling adds re-rollout
groups; the round machine (:mod:`.machine`) runs them. The persistent state is the
:class:`AllocatorState` pytree (round-trips through :func:`state_to_dict`).
"""

from __future__ import annotations

import jax.numpy as jnp

from passrate_jax.allocation.config import AllocationConfig, PrefixSamplingConfig, check_prefix_sampling
from passrate_jax.allocation.group_queue import queue_init
from passrate_jax.allocation.policies import UNBOUNDED, knobs_from_config, make_setup
from passrate_jax.allocation.prefix_control import prefix_control_init
from passrate_jax.allocation.protocol import (AllocatorState, Prefix, Request, Result, StepResult, TrainGroup,
                                              state_from_dict, state_to_dict)
from passrate_jax.allocation.selection import selection_init
from passrate_jax.allocation.step import StepRun

__all__ = ["Allocator", "AllocatorState", "Prefix", "Request", "Result", "StepResult", "TrainGroup",
           "state_from_dict", "state_to_dict"]


class Allocator:
    """Static description of one composition; makes states and step runs. Holds no arrays."""

    def __init__(self, cfg: AllocationConfig, prefix_sampling: PrefixSamplingConfig, num_prompts: int):
        """``num_prompts``: size of the prompt dataset (prompt ids are 0 .. num_prompts - 1)."""
        if num_prompts < 1:
            raise ValueError(f"num_prompts = {num_prompts}: must be >= 1")
        check_prefix_sampling(prefix_sampling, cfg)
        self.cfg = cfg
        self.ps = prefix_sampling
        self.num_prompts = num_prompts
        self.setup = make_setup(cfg, prefix_sampling, num_prompts)
        self.knobs = knobs_from_config(cfg, prefix_sampling)

    @property
    def budget(self) -> float:
        """Rollouts a step may spend: ``cfg.budget``, else B * N for uniform and fixed-budget SARA,
        DS's worst case (gen_batch_multiple * max_gen_batches * B * N) for SARA fill (DESIGN 2.2),
        unbounded for DS and Pilot-Commit, which their round limits bound; plus N per replay slot when
        Prefix Sampling places its re-rollout groups on top of B."""
        budget = int(self.knobs.budget)
        return float("inf") if budget >= UNBOUNDED else budget

    @property
    def max_groups(self) -> int:
        """The most groups a step trains: B, plus the replay slots when re-rollout groups go on top."""
        return self.cfg.num_prompts + self.ps.extra_groups(self.cfg.num_prompts)

    def init(self, key) -> AllocatorState:
        """Fresh state: uninformed selection models, empty queues, controllers at ratio_init."""
        cfg, b, n = self.cfg, self.cfg.num_prompts, self.cfg.group_size
        return AllocatorState(
            step=jnp.zeros((), jnp.int32), key=jnp.asarray(key, jnp.uint32),
            next_group_key=jnp.zeros((), jnp.int32),
            evicted=jnp.zeros((self.num_prompts,), bool),
            selection=selection_init(self.num_prompts, cfg.selection),
            pilot_buffer=queue_init(2 * cfg.pilot_commit.pilot_pool_ratio * b, n),
            replay_queue=queue_init(b, n),
            surplus=queue_init(b, n),
            prefix_control=prefix_control_init(n, self.ps))

    def start_step(self, state: AllocatorState) -> StepRun:
        """Begin a step; returns its :class:`StepRun` (requests / observe / finish)."""
        return StepRun(self.setup, self.knobs, state)
