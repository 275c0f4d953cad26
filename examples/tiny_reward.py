"""A reward function for the tiny example (examples/make_tiny_model.py): full credit for the right sum
as the response's first number, partial credit for starting with a digit at all. The partial credit
is what gives a random model a learning signal: its groups' rewards differ long before any answer is right.

Called as fn(prompt, response, reference, **fields) for every answer, in worker processes; the float
it returns is the reward (data.reward_threshold decides what counts as a success for allocation).
"""
import re


def reward(prompt, response, reference, **fields):
    match = re.match(r"\s*(\d+)", response)
    if match is None:
        return 0.0
    return 1.0 if match.group(1) == reference.strip() else 0.25
