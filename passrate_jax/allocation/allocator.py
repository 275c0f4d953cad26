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
groups, when and where its timing and placement objects (:mod:`.replay`) say; the round machine
(:mod:`.machine`) runs them. :func:`make_setup` chooses the policy and those objects once, from the
configs. The persistent state is the :class:`AllocatorState` pytree (:func:`init_state`; round-trips
through :func:`state_to_dict`).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from passrate_jax.allocation.config import AllocationConfig, PrefixSamplingConfig, check_prefix_sampling
from passrate_jax.allocation.group_queue import queue_init
from passrate_jax.allocation.family import POLICIES, Family
from passrate_jax.allocation.composition import UNBOUNDED, Knobs, Setup
from passrate_jax.allocation.prefix_control import controller_gains, prefix_control_init
from passrate_jax.allocation.protocol import (AllocatorState, Prefix, Request, Result, StepResult, TrainGroup,
                                              state_from_dict, state_to_dict)
from passrate_jax.allocation.replay import PLACEMENTS, TIMINGS
from passrate_jax.allocation.selection import METHODS, selection_init
from passrate_jax.allocation.step import StepRun, decision_device

__all__ = ["Allocator", "AllocatorState", "Prefix", "Request", "Result", "StepResult", "TrainGroup",
           "state_from_dict", "state_to_dict", "init_state", "knobs_from_config", "make_setup"]


def knobs_from_config(cfg: AllocationConfig, ps: PrefixSamplingConfig) -> Knobs:
    """The knobs the configs set."""
    policy = POLICIES[cfg.method]
    budget = cfg.budget if cfg.budget is not None else policy.default_budget(cfg)
    # Re-rollout groups placed on top of B are paid on top of the method's budget; replays in the
    # same step need one round after the last fresh groups complete.
    budget += ps.extra_groups(cfg.num_prompts) * cfg.group_size
    rounds = policy.max_rounds(cfg) + (TIMINGS[ps.timing].extra_rounds if ps.enabled else 0)
    return Knobs(tau_confirm=jnp.float32(cfg.sara.tau_confirm), tau_abandon=jnp.float32(cfg.sara.tau_abandon),
                 schedule=jnp.asarray(cfg.sara.round_schedule, jnp.int32), gains=controller_gains(ps),
                 selection=jnp.int32(METHODS.index(cfg.selection.method)), ps_on=jnp.asarray(ps.enabled),
                 budget=jnp.int32(min(budget, UNBOUNDED)), keep_surplus=jnp.asarray(cfg.ds.keep_surplus),
                 policy=jnp.int32(list(POLICIES).index(cfg.method)), max_rounds=jnp.int32(rounds),
                 train_saturated=jnp.asarray(policy.trains_saturated))


def make_setup(cfg: AllocationConfig, ps: PrefixSamplingConfig, num_prompts: int, family: bool = False) -> Setup:
    """The static setup of a composition; the method's policy and Prefix Sampling's timing and placement
    are chosen here, once. Compositions that
    differ only in what :class:`Knobs` carry get equal setups (so jit compiles them once). ``family``:
    a setup that runs every method (:class:`Family`), the method then being the knob ``policy``."""
    policy = Family() if family else POLICIES[cfg.method]
    widest = dataclasses.replace(cfg, sara=dataclasses.replace(cfg.sara, mode="fill"))
    max_budget = cfg.budget if cfg.budget is not None else policy.default_budget(widest)
    static = dataclasses.replace(cfg, budget=None, selection=dataclasses.replace(cfg.selection, method="none"),
                                 sara=dataclasses.replace(cfg.sara, mode="fill"),
                                 ds=dataclasses.replace(cfg.ds, keep_surplus=False),
                                 method="uniform" if family else cfg.method)
    return Setup(cfg=static, ps=dataclasses.replace(ps, enabled=False), num_prompts=num_prompts, policy=policy,
                 max_budget=min(max_budget, UNBOUNDED), timing=TIMINGS[ps.timing], placement=PLACEMENTS[ps.placement])


def init_state(setup: Setup, key) -> AllocatorState:
    """A fresh state for ``setup`` (of one method, or a :class:`~.family.Family`): uninformed selection
    models, the policy's own state (empty queues), an empty replay queue, controllers at ratio_init."""
    return AllocatorState(step=jnp.zeros((), jnp.int32), key=jnp.asarray(key, jnp.uint32),
                          next_group_key=jnp.zeros((), jnp.int32), evicted_until=jnp.zeros((setup.num_prompts,), jnp.int32),
                          selection=selection_init(setup.num_prompts, setup.cfg.selection),
                          policy=setup.policy.init(setup), replay_queue=queue_init(setup.B, setup.N),
                          prefix_control=prefix_control_init(setup.N, setup.ps))


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
    def retires_in_any_order(self) -> bool:
        """Whether the slot engine may observe a request as soon as its rollouts are scored, not in issue
        order (rollout/events.py). True for SARA fill without a set budget, selection or Prefix Sampling:
        trained plus pending groups never exceed B there, so every group it confirms is trained, and each
        prompt's fate (abandoned, or confirmed and trained) depends only on its own rollouts (its key, hence
        its rollouts, is its place in the step's fixed prompt order). The prompts it opens are then the
        shortest prefix of that order holding B trained groups, whenever each group's events come: the
        same groups as round mode, whatever the answers' lengths, with no prompt waiting on another's
        longest answer. A set budget, a selection method (candidates drawn per opening) or replays make
        decisions depend on the order of events, so those keep issue order. Fill's own safety bounds
        (its budget of gen_batch_multiple * max_gen_batches * B * N rollouts, ``sara.max_rounds``) are
        the exception: a step that reaches one stops at a point that depends on the order of events
        (every step of the engine study, docs/results_engine.md, trained B groups within 158 rounds)."""
        c = self.cfg
        return (c.method == "sara" and c.sara.mode == "fill" and c.budget is None and c.selection.method == "none"
                and not self.ps.enabled)

    @property
    def decides_at_start(self) -> bool:
        """Whether a step makes every request when it starts, before any rollout is scored: uniform
        allocation, its replays (next-step Prefix Sampling) included, with or without selection. The order
        in which the slot engine starts its rollouts then changes no decision, so the engine starts the
        longest prompts first (rollout/events.py). Every other composition decides on the outcomes of its
        first requests, which its later requests wait on in issue order, so those start in issue order."""
        return self.cfg.method == "uniform" and not (self.ps.enabled and self.ps.timing == "same_step")

    @property
    def max_groups(self) -> int:
        """The most groups a step trains: B, plus the replay slots when re-rollout groups go on top."""
        return self.cfg.num_prompts + self.ps.extra_groups(self.cfg.num_prompts)

    def init(self, key) -> AllocatorState:
        """Fresh state: uninformed selection models, empty queues, controllers at ratio_init."""
        return init_state(self.setup, key)

    def start_step(self, state: AllocatorState) -> StepRun:
        """Begin a step; returns its :class:`StepRun` (requests / observe / finish). Where the state lives on
        an accelerator, its machine runs on the host's CPU (:func:`~.step.decision_device`), so that its
        decisions do not queue behind the decoding."""
        return StepRun(self.setup, self.knobs, state, decision_device(state))
