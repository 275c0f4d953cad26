"""A reward function of the kind ``data.reward_fn`` names, shipped so that the ``tiny_own_model`` preset
loads from any directory: ``data.reward_fn: passrate_jax.data.example_rewards:sum_with_partial_credit``.
Your own is a file, ``data.reward_fn=my_reward.py:reward``, with the same signature.

Called as ``fn(prompt, response, reference, **fields)`` for every answer, in worker processes; the float
it returns is the reward (``data.reward_threshold`` decides what counts as a success for allocation).
"""

import re


def sum_with_partial_credit(prompt, response, reference, **fields):
    """1.0 when the response's first number is the reference, 0.25 when it starts with some other number,
    else 0. The partial credit gives a random model a learning signal: its groups' rewards differ long
    before any answer is right."""
    match = re.match(r"\s*(\d+)", response)
    if match is None:
        return 0.0
    return 1.0 if match.group(1) == reference.strip() else 0.25
