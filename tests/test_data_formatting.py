"""Prompt templates, chat templates and final-answer extraction."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from passrate_jax.run.config import load_config
from passrate_jax.data.formatting import PromptFormat, extract_answer
from passrate_jax.text.tokenizer import CharTokenizer


@pytest.mark.parametrize("text, expected", [
    ("so the answer is \\boxed{42}.", "42"),
    ("\\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),            # the last box
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt{3}}{2}"),              # nested braces
    ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),                                  # escaped braces are literal
    ("\\boxed{ 7 }", "7"),
    ("\\boxed 5 apples", "5"),
    ("\\fbox{x=3}", "x=3"),
    ("\\boxed{12} and then \\boxed{\\frac{1}{", None),                     # truncated last box: no answer
    ("no box at all: 12", None),
    ("\\boxedfoo{3}", None),
    ("\\boxed{}", ""),
])
def test_boxed(text, expected):
    assert extract_answer(text, "boxed") == expected


@pytest.mark.parametrize("text, expected", [
    ("She has 3+4=7 apples.\n#### 7", "7"),
    ("#### 1,000\n", "1,000"),
    ("#### 3\nwait\n#### 4 ", "4"),
    ("####   \n", None),
    ("the answer is 7", None),
])
def test_gsm8k(text, expected):
    assert extract_answer(text, "gsm8k") == expected


@pytest.mark.parametrize("text, expected", [
    ("3 apples and 4 pears make 7.", "7"),
    ("total: -12.5 dollars", "-12.5"),
    ("about 1,234,567 people", "1,234,567"),
    ("ratio 3/4", "3/4"),
    ("x2 and y3", None),               # digits inside identifiers are not numbers
    ("v1.2.3", None),
    ("nothing here", None),
])
def test_last_number(text, expected):
    assert extract_answer(text, "last_number") == expected


def test_none_mode_and_bad_input():
    assert extract_answer("  42 \n", "none") == "42"
    assert extract_answer("   ", "none") is None
    assert extract_answer(None, "boxed") is None  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="mode = 'last'"):
        extract_answer("1", "last")  # type: ignore[arg-type]


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from("\\boxed{}#0123456789 ,./-x\n"), max_size=200))
def test_extraction_never_raises_and_returns_substrings(text):
    for mode in ("none", "boxed", "gsm8k", "last_number"):
        out = extract_answer(text, mode)
        assert out is None or out in text


def test_template_is_literal_and_chat_wraps_it():
    fmt = PromptFormat(template="Put the answer in \\boxed{}.\n{prompt}")
    assert fmt.render("What is {x}?") == "Put the answer in \\boxed{}.\nWhat is {x}?"
    chat = PromptFormat(template="Q: {prompt}", chat=True, system="Be brief.")
    assert chat.render("1+1", CharTokenizer()) == "system: Be brief.\nuser: Q: 1+1\nassistant: "
    with pytest.raises(ValueError, match="needs a tokenizer"):
        chat.render("1+1")
    with pytest.raises(ValueError, match="exactly once"):
        PromptFormat(template="{prompt} {prompt}")


def test_format_from_config():
    # Quoted: unquoted YAML reads "{prompt}" as a mapping.
    cfg = load_config(None, ["data.template='Solve: {prompt}'", "data.chat_template=true"]).data
    assert PromptFormat.from_config(cfg).render("2+2", CharTokenizer()) == "user: Solve: 2+2\nassistant: "
    assert PromptFormat.from_config(load_config(None).data).render("12+30\n") == "12+30\n"
