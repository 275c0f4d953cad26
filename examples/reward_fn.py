"""A reward plugin: full credit for the right final answer, a little for the right format."""
import re

FINAL = re.compile(r"(?:answer is|=>)\s*(-?[\d,]+(?:\.\d+)?)\s*\.?\s*$")


def reward(prompt, response, reference, **fields):
    match = FINAL.search(response.strip())
    if match is None:
        return 0.0                      # no final answer line
    answer = match.group(1).replace(",", "")
    return 1.0 if answer == reference.strip() else 0.1
