"""Every policy by name, and the :class:`Family` that runs them all in one compile (the simulator's
setup, :func:`~.allocator.make_setup` with ``family=True``)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from passrate_jax.allocation.composition import Policy
from passrate_jax.allocation.policies import DynamicSampling, PilotCommit, Sara, Uniform

POLICIES: dict[str, Policy] = {"uniform": Uniform(), "ds": DynamicSampling(), "sara": Sara(),
                               "pilot_commit": PilotCommit()}


@dataclasses.dataclass(frozen=True)
class Family:
    """Every policy of ``members`` in one compile: ``knobs.policy`` (an index into ``members``) picks
    the one a run uses, under ``lax.switch`` (a real branch while the index is not vmapped). The table
    is sized for the largest member. The simulator runs all its methods on one such setup.

    Its state is the tuple of the members' states, each member seeing its own (:func:`_as_member`).
    Only the member running fills its queues, so the hooks that keep them (``begin``, ``held_prompts``,
    ``end``) run for every member, the others' queues being empty; ``plan`` and ``decide`` switch."""
    members: tuple[Policy, ...] = tuple(POLICIES.values())
    trains_saturated = None  # a knob: members differ

    def default_budget(self, cfg):
        return max(m.default_budget(cfg) for m in self.members)

    def capacity(self, setup):
        return max(m.capacity(setup) for m in self.members)

    def max_open(self, setup):
        return max(m.max_open(setup) for m in self.members)

    def max_rounds(self, cfg):
        return max(m.max_rounds(cfg) for m in self.members)

    def plan(self, setup, knobs, state, t):
        branches = [_as_member(functools.partial(m.plan, setup, knobs), i) for i, m in enumerate(self.members)]
        return jax.lax.switch(knobs.policy, branches, state, t)

    def decide(self, setup, knobs, state, t, fresh, completed):
        branches = [_as_member(functools.partial(m.decide, setup, knobs), i) for i, m in enumerate(self.members)]
        return jax.lax.switch(knobs.policy, branches, state, t, fresh, completed)

    def next_request(self, setup, knobs, n, s, probes):
        branches = [functools.partial(m.next_request, setup, knobs) for m in self.members]
        return jax.lax.switch(knobs.policy, branches, n, s, probes)

    def init(self, setup):
        return tuple(m.init(setup) for m in self.members)

    def begin(self, setup, knobs, state, t):
        for i, m in enumerate(self.members):
            state, t = _as_member(functools.partial(m.begin, setup, knobs), i)(state, t)
        return state, t

    def held_prompts(self, state, num_prompts):
        held = [m.held_prompts(state.replace(policy=state.policy[i]), num_prompts) for i, m in enumerate(self.members)]
        return functools.reduce(jnp.logical_or, held)

    def end(self, setup, state, now):
        observations = []
        for i, m in enumerate(self.members):
            state, seen = _as_member(functools.partial(m.end, setup), i)(state, now)
            observations.append(seen)
        return state, tuple(jnp.concatenate(parts) for parts in zip(*observations))


def _as_member(hook, i: int):
    """A member's ``hook(state, ...) -> (state, ...)`` over the :class:`Family`'s state: the member sees
    its own policy state, and what it returns goes back into the family's tuple."""
    def run(state, *args):
        own, *rest = hook(state.replace(policy=state.policy[i]), *args)
        policy = state.policy[:i] + (own.policy,) + state.policy[i + 1:]
        return (own.replace(policy=policy), *rest)
    return run
