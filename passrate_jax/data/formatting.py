"""Prompt formatting (task template, optional chat template) and final-answer extraction.

    fmt = PromptFormat(template="Solve. Put the answer in \\boxed{}.\\n{prompt}", chat=True)
    text = fmt.render(record.prompt, tokenizer)          # the model's input
    answer = extract_answer(response, "boxed")            # "1/2", or None when there is none

Extraction only *finds* text with plain string scanning and anchored regular expressions: nothing in a
model's output is ever executed or evaluated here. Every extractor returns None when the response has
no answer of its kind, which every verifier scores 0.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Literal

ExtractMode = Literal["none", "boxed", "gsm8k", "last_number"]
EXTRACT_MODES: tuple[str, ...] = ("none", "boxed", "gsm8k", "last_number")
PROMPT_PLACEHOLDER = "{prompt}"

# Commands whose argument is a final answer; \fbox is what some models write instead of \boxed.
_BOX_COMMANDS = ("\\boxed", "\\fbox")
# A number: optional sign, digits with optional thousands separators, optional decimals, or a simple
# fraction a/b. Digit runs are bounded so a runaway string of digits is not a "number" we return.
_NUMBER = re.compile(r"(?<![\w.])[-+]?(?:\d{1,3}(?:,\d{3})+|\d{1,64})(?:\.\d{1,64})?(?:/\d{1,64})?(?![\w])")


@dataclasses.dataclass(frozen=True)
class PromptFormat:
    """How a dataset prompt becomes the model's input text.

    ``template`` holds ``{prompt}`` exactly once; it is substituted literally (not ``str.format``), so
    other braces, as in ``\\boxed{}``, need no escaping. With ``chat`` the filled template is the user
    turn (after an optional ``system`` turn) rendered by the tokenizer's chat template with the
    generation prompt appended, the form instruct models are trained on.
    """
    template: str = PROMPT_PLACEHOLDER
    chat: bool = False
    system: str = ""

    def __post_init__(self):
        if self.template.count(PROMPT_PLACEHOLDER) != 1:
            raise ValueError(f"template = {self.template!r}: must contain {PROMPT_PLACEHOLDER} exactly once")

    @classmethod
    def from_config(cls, cfg) -> PromptFormat:
        """From a :class:`passrate_jax.run.config.DataConfig` (``template``, ``chat_template``, ``system_prompt``)."""
        return cls(cfg.template, cfg.chat_template, cfg.system_prompt)

    def messages(self, prompt: str) -> list[dict[str, str]]:
        """The chat messages of ``prompt``: an optional system turn, then the filled template as user turn."""
        turns = [{"role": "system", "content": self.system}] if self.system else []
        return turns + [{"role": "user", "content": self.template.replace(PROMPT_PLACEHOLDER, prompt)}]

    def render(self, prompt: str, tokenizer=None) -> str:
        """The model input text for ``prompt``; ``tokenizer`` (a :class:`passrate_jax.text.tokenizer.Tokenizer`)
        is needed only when ``chat`` is set. Encode the result with ``add_bos=False``: a chat template
        writes its own BOS."""
        if not self.chat:
            return self.template.replace(PROMPT_PLACEHOLDER, prompt)
        if tokenizer is None:
            raise ValueError("PromptFormat(chat=True).render needs a tokenizer with apply_chat_template")
        return tokenizer.apply_chat_template(self.messages(prompt), add_generation_prompt=True)

    def encode(self, prompt: str, tokenizer) -> list[int]:
        """The model input ids for ``prompt``: rendered, with the tokenizer's BOS unless a chat template
        (which writes its own) rendered it."""
        add_bos = not self.chat and getattr(tokenizer, "bos_id", None) is not None
        return tokenizer.encode(self.render(prompt, tokenizer), add_bos=add_bos)

    def render_all(self, prompts: Sequence[str], tokenizer=None) -> list[str]:
        return [self.render(p, tokenizer) for p in prompts]


def _braced(text: str, start: int) -> str | None:
    """The contents of the brace group opening at ``text[start] == "{"``, or None when it never closes.

    A backslash escapes the next character, so ``\\{`` and ``\\}`` (literal braces in LaTeX, as in a
    set ``\\{1, 2\\}``) do not open or close groups.
    """
    depth, i = 0, start
    while i < len(text):
        ch = text[i]
        if ch == "\\":
            i += 2
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1:i]
        i += 1
    return None


def extract_boxed(text: str) -> str | None:
    """The argument of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, braces balanced.

    When the last box never closes (a response cut off by the length limit) the answer is None, not an
    earlier box: the model's final answer is incomplete. ``\\boxed 5`` (one token, no braces) gives "5".
    """
    at = max(text.rfind(cmd) for cmd in _BOX_COMMANDS)
    if at < 0:
        return None
    cmd = next(c for c in _BOX_COMMANDS if text.startswith(c, at))
    i = at + len(cmd)
    if i < len(text) and text[i].isalpha():  # "\boxedx" is another command, not a box
        return None
    while i < len(text) and text[i] == " ":
        i += 1
    if i < len(text) and text[i] == "{":
        inner = _braced(text, i)
        return inner.strip() if inner is not None else None
    m = re.match(r"[^\s${}]+", text[i:])
    return m[0] if m else None


def extract_gsm8k(text: str) -> str | None:
    """The rest of the line after the last ``####`` (GSM8K's answer marker), stripped; None if empty."""
    at = text.rfind("####")
    if at < 0:
        return None
    answer = text[at + 4:].split("\n", 1)[0].strip()
    return answer or None


def extract_last_number(text: str) -> str | None:
    """The last number in ``text``: an integer (thousands separators allowed), decimal or fraction ``a/b``."""
    last = None
    for m in _NUMBER.finditer(text):
        last = m[0]
    return last


def extract_answer(text: str, mode: ExtractMode) -> str | None:
    """The final answer of ``text`` by ``mode``: "boxed", "gsm8k", "last_number", or "none" (the whole
    text, stripped). None when there is no answer of that kind or ``text`` is not a string."""
    if not isinstance(text, str):
        return None
    match mode:
        case "none":
            return text.strip() or None
        case "boxed":
            return extract_boxed(text)
        case "gsm8k":
            return extract_gsm8k(text)
        case "last_number":
            return extract_last_number(text)
    raise ValueError(f"mode = {mode!r}: must be one of {EXTRACT_MODES}")
