"""Built-in procedural tasks: deterministic generation, disjoint splits, formats and exact verifiers."""

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from passrate_jax.data.tasks import (
    TASKS, ArithmeticLevel, CountdownLevel, Problem, arithmetic_task, countdown_task, reference_solution, verify,
)
from passrate_jax.text.tokenizer import CharTokenizer

ARITH, COUNT, WORKED = TASKS["arithmetic"], TASKS["countdown"], TASKS["worked"]
ALPHABET = set("\n" + "".join(chr(c) for c in range(32, 127)))


def _arith(*numbers, op="+"):
    """A hand-made arithmetic problem (the verifier reads only numbers, op and target)."""
    target = numbers[0] - numbers[1] if op == "-" else sum(numbers)
    return Problem("arithmetic", 0, op.join(map(str, numbers)) + "\n", str(target), 1, numbers, target, op)


def _worked(*numbers, op="+"):
    return dataclasses.replace(_arith(*numbers, op=op), task="worked")


def _countdown(numbers, target, solution=()):
    prompt = " ".join(map(str, sorted(numbers))) + f" -> {target}\n"
    return Problem("countdown", 0, prompt, str(target), 1, tuple(sorted(numbers)), target, solution=solution)


def _per_level(task, n, split="train", seed=0):
    return [task.sample(seed, split, i, level=level) for level in task.difficulty_levels for i in range(n)]


@pytest.mark.parametrize("task", TASKS.values(), ids=TASKS.keys())
def test_sampling_is_a_pure_function_of_seed_split_index(task):
    a = [task.sample(3, "train", i) for i in range(50)]
    assert a == [task.sample(3, "train", i) for i in range(50)]
    assert len({p.prompt for p in a}) > 40
    assert [p.prompt for p in a] != [task.sample(4, "train", i).prompt for i in range(50)]
    assert {p.level for p in a} == set(task.difficulty_levels)  # level=None spreads over all levels


def test_generation_and_prompt_ids_are_pinned():
    # Golden values: generation must not drift across processes or Python versions (hashlib + random.Random).
    p = ARITH.sample(0, "train", 5, level=5)
    assert (p.prompt, reference_solution(p), p.prompt_id) == (
        "777+473\n", "7+3=10\n7+7+1=15\n7+4+1=12\n=> 1250", 4434256707278471774)
    q = COUNT.sample(0, "train", 3, level=3)
    assert (q.prompt, reference_solution(q), q.prompt_id) == (
        "2 7 8 11 -> 63\n", "11-2=9\n9*7=63\n=> 63", 4121917359492938401)
    # The id names the prompt text: repeated draws of a prompt share it, distinct prompts never do.
    ids = {}
    for i in range(400):
        r = ARITH.sample(1, "train", i, level=1)
        assert ids.setdefault(r.prompt, r.prompt_id) == r.prompt_id and 0 <= r.prompt_id < 2 ** 63
    assert len(set(ids.values())) == len(ids) < 400


@pytest.mark.parametrize("task", TASKS.values(), ids=TASKS.keys())
def test_train_and_heldout_never_share_a_problem(task):
    train = [task.sample(0, "train", i) for i in range(2000)] + [task.sample(1, "train", i) for i in range(1000)]
    heldout = [task.sample(0, "heldout", i) for i in range(1000)]
    assert {task.split_of(p) for p in train} == {"train"}
    assert {task.split_of(p) for p in heldout} == {"heldout"}
    assert not {task.split_key(p) for p in train} & {task.split_key(p) for p in heldout}
    assert not {p.prompt_id for p in train} & {p.prompt_id for p in heldout}
    assert {p.level for p in heldout} == set(task.difficulty_levels)


def test_addition_split_ignores_operand_order():
    a, b = _arith(123, 456), _arith(456, 123)
    assert ARITH.split_of(a) == ARITH.split_of(b) and a.prompt != b.prompt
    assert ARITH.split_key(_arith(9, 5, op="-")) != ARITH.split_key(_arith(5, 9, op="-"))


@pytest.mark.parametrize("task", TASKS.values(), ids=TASKS.keys())
def test_reference_solutions_verify_and_fit_alphabet_and_length(task):
    tok = CharTokenizer()
    for split in ("train", "heldout"):
        for p in _per_level(task, 40, split):
            solution = reference_solution(p)
            assert task.verify(p, solution) == 1.0 == verify(p, solution)
            assert task.verify(p, solution + "\n \n") == 1.0  # trailing blank space is ignored
            assert set(p.prompt + solution) <= ALPHABET
            tok.encode(p.prompt + solution)
            assert p.prompt.endswith("\n") and task.prompt_text(p) == p.prompt
            assert solution.split("\n")[-1] == f"=> {p.answer}" and int(p.answer) == p.target
            prompt_max, solution_max = task.max_chars(p.level)
            assert len(p.prompt) <= prompt_max and len(solution) <= solution_max
    for level in task.difficulty_levels:
        assert sum(task.max_chars(level)) <= 100  # the built-in model's context is ~128 characters


def test_arithmetic_levels_control_digits_operands_and_carries():
    for p in _per_level(ARITH, 60):
        spec = ARITH.level_spec(p.level)
        assert len(p.numbers) == spec.operands and p.op == spec.op
        assert all(len(str(n)) == spec.digits for n in p.numbers)
        hi = spec.digits if spec.max_carries is None else spec.max_carries
        assert spec.min_carries <= p.carries <= hi
        columns = reference_solution(p).split("\n")[:-1]
        assert len(columns) == spec.digits
        # A carry (borrow) out of a column shows as a two-digit total (a lifted "1d" top digit).
        written = sum(int(line.split("=")[1]) >= 10 for line in columns) if p.op == "+" else \
            sum(len(line.split("-")[0]) == 2 for line in columns)
        assert written == p.carries
        if p.op == "-":
            assert p.numbers[0] >= p.numbers[1] and p.target >= 0
    assert [ARITH.level_spec(lv).digits for lv in ARITH.difficulty_levels] == [1, 2, 2, 2, 3, 3, 3, 4, 4, 5]
    assert {p.carries for p in _per_level(ARITH, 30) if p.level == 2} == {0}


def test_countdown_levels_control_numbers_and_operations():
    for p in _per_level(COUNT, 60):
        spec = COUNT.level_spec(p.level)
        assert len(p.numbers) == spec.numbers and len(p.solution) == spec.operations
        assert all(1 <= n <= spec.max_number for n in p.numbers) and list(p.numbers) == sorted(p.numbers)
        assert 1 <= p.target <= spec.max_target and p.target not in p.numbers
        assert all(1 <= c <= spec.max_value and c not in (a, b) for a, _, b, c in p.solution)


def test_docstring_formats():
    assert reference_solution(_arith(457, 168)) == "7+8=15\n5+6+1=12\n4+1+1=6\n=> 625"
    assert reference_solution(_arith(402, 158, op="-")) == "12-8=4\n10-5-1=4\n4-1-1=2\n=> 244"
    assert reference_solution(_arith(99, 1)) == "9+1=10\n9+1=10\n=> 100"
    assert reference_solution(_arith(1000, 999, op="-")) == "10-9=1\n10-9-1=0\n10-9-1=0\n1-1=0\n=> 1"
    cd = _countdown((2, 3, 7, 9), 23, ((7, "*", 3, 21), (21, "+", 2, 23)))
    assert reference_solution(cd) == "7*3=21\n21+2=23\n=> 23"


@pytest.mark.parametrize("response", [
    "7+8=15\n5+6+1=12\n4+1+1=6\n=> 635",      # wrong digit in the final answer
    "7+8=15\n5+6+1=12\n4+1+1=7\n=> 625",      # a false step
    "7+8=15\n4+1+1=6\n=> 625",                # a column missing
    "7+8=15\n5+6+1=12\n4+1+1=6\n=> 625\n1",   # text after the answer
    "7+8=15\n5+6+1=12\n4+1+1=6\n=> 0625",     # leading zero
    "7+8=15\n5+6+1=12\n4+1+1=6\n=>625",       # malformed final line
    "7+8=15\n5+6+1=12\n4+1+1=6\n625",         # no final marker
    "7-8+16=15\n5+6+1=12\n4+1+1=6\n=> 625",   # operator of the wrong kind
    "7+8+0+0+0=15\n5+6+1=12\n4+1+1=6\n=> 625",  # more terms than operands + carry
    " 7+8=15\n5+6+1=12\n4+1+1=6\n=> 625",     # leading space
    "7+8=15\r\n5+6+1=12\r\n4+1+1=6\r\n=> 625",
    "=> 625", "625", "", "\n\n", "hello", "=> " + "9" * 5000, "9" * 5000 + "=15\n1=1\n1=1\n=> 625",
    "7+8=15\n5+6+1=12\n4+1+1=6\n=> 625" + " " * 5000, None, b"=> 625", 625,
])
def test_arithmetic_rejects_corrupted_responses(response):
    assert ARITH.verify(_arith(457, 168), response) == 0.0


def test_arithmetic_accepts_equivalent_steps():
    # Steps are checked for truth and count, not for the reference's term order.
    assert ARITH.verify(_arith(457, 168), "8+7=15\n1+5+6=12\n4+1+1=6\n=> 625") == 1.0
    assert ARITH.verify(_arith(402, 158, op="-"), "12-8=4\n10-5-1=4\n4-1-1=2\n=> 244") == 1.0
    assert ARITH.verify(_arith(402, 158, op="-"), "12-8=4\n10-5-1=4\n4-1-1=2\n=> 245") == 0.0


def test_worked_format_copies_the_problem_and_checks_the_equation():
    assert reference_solution(_worked(457, 168)) == "457+168\n7+8=15\n5+6+1=12\n4+1+1=6\n457+168=625\n=> 625"
    assert reference_solution(_worked(402, 158, op="-")) == \
        "402-158\n12-8=4\n10-5-1=4\n4-1-1=2\n402-158=244\n=> 244"
    # Arithmetic's levels and column lines; only the lines around the columns differ.
    assert WORKED.levels == ARITH.levels
    for w in [WORKED.sample(0, "train", i) for i in range(50)]:
        a = dataclasses.replace(w, task="arithmetic")
        assert reference_solution(w).split("\n")[1:-2] == reference_solution(a).split("\n")[:-1]
        assert verify(a, reference_solution(w)) == 0.0 and verify(w, reference_solution(a)) == 0.0


def test_worked_responses_average_30_tokens_on_the_default_levels():
    # Issue 16's "responses average >= 30 tokens with intermediate lines", on levels 1-6 (arithmetic: 21).
    six = [p for p in (WORKED.sample(0, "heldout", i) for i in range(2000)) if p.level <= 6]
    lengths = [len(CharTokenizer().encode(reference_solution(p))) + 1 for p in six]  # + eos
    assert np.mean(lengths) >= 30
    assert min(len(reference_solution(p).split("\n")) for p in six) >= 4


@pytest.mark.parametrize("response", [
    "457+186\n7+6=13\n5+8+1=14\n4+1+1=6\n457+186=643\n=> 643",  # the problem miscopied, solved as copied
    "457+168\n7+8=15\n5+6+1=12\n4+1+1=6\n=> 625",             # no check line
    "7+8=15\n5+6+1=12\n4+1+1=6\n457+168=625\n=> 625",         # no copied problem
    "457+168\n7+8=15\n5+6+1=12\n4+1+1=6\n457+168=635\n=> 625",  # check line disagrees with the answer
    "457+168\n7+8=15\n5+6+1=12\n4+1+1=6\n457+168=635\n=> 635",  # check and answer agree, both wrong
    "457+168\n7+8=15\n5+6+1=12\n4+1+1=7\n457+168=625\n=> 625",  # a false column
    "457+168\n7+8=15\n4+1+1=6\n457+168=625\n=> 625",           # a column missing
    "168+457\n7+8=15\n5+6+1=12\n4+1+1=6\n168+457=625\n=> 625",  # copied in another order
    "457+168\n457+168=625\n=> 625", "457+168\n=> 625", "=> 625", "", None,
])
def test_worked_rejects_corrupted_responses(response):
    assert WORKED.verify(_worked(457, 168), response) == 0.0


def test_worked_accepts_equivalent_steps():
    assert WORKED.verify(_worked(457, 168), "457+168\n8+7=15\n1+5+6=12\n4+1+1=6\n457+168=625\n=> 625") == 1.0
    assert WORKED.verify(_worked(457, 168), "457+168\n7+8=15\n5+6+1=12\n4+1+1=6\n457+168=625\n=> 625\n") == 1.0


CD = _countdown((2, 3, 7, 9), 23, ((7, "*", 3, 21), (21, "+", 2, 23)))


@pytest.mark.parametrize("response", [
    "7*3=22\n22+1=23\n=> 23",          # wrong intermediate result
    "7*3=21\n21+2=24\n=> 23",          # wrong last result
    "7*3=21\n21+2=23\n=> 24",          # final answer off
    "7*3=21\n21+2=23\n=> 21",          # final answer is not the last result
    "7*3=21\n9+3=12\n21+2=23\n=> 23",  # 3 used twice
    "7*7=49\n49-26=23\n=> 23",         # 7 reused, 26 never available
    "7*3=21\n21+2=23\n23-21=2\n=> 23", # 21 was consumed
    "20+3=23\n=> 23",                  # 20 was not given
    "9-7=2\n2-3=-1\n=> 23",            # negative results are out of format
    "7*3=21\n21+2=23", "=> 23", "23", "", " ", "garbage\n=> 23",
    "7x3=21\n21+2=23\n=> 23", "7*3=21\n21+02=23\n=> 23", "7*3 = 21\n21+2=23\n=> 23",
    "9" * 5000 + "*3=21\n=> 23", "=> " + "2" * 10000, "1" * 40 + "+1=2\n=> 23", None,
])
def test_countdown_rejects_corrupted_responses(response):
    assert COUNT.verify(CD, response) == 0.0


def test_countdown_accepts_any_valid_solution():
    # Any valid route counts, not only the reference; the 9 is a distractor there but usable here.
    assert COUNT.verify(CD, "7*2=14\n14+9=23\n=> 23") == 1.0
    assert COUNT.verify(CD, "3*7=21\n2+21=23\n=> 23") == 1.0
    assert COUNT.verify(CD, "9*2=18\n18+7=25\n25-2=23\n=> 23") == 0.0  # 2 used twice
    assert COUNT.verify(_countdown((3, 3, 5), 9), "3*3=9\n=> 9") == 1.0  # equal given numbers are two numbers
    assert COUNT.verify(_countdown((3, 5, 6), 9), "3*3=9\n=> 9") == 0.0


@pytest.mark.parametrize("task", TASKS.values(), ids=TASKS.keys())
def test_every_single_digit_substitution_fails(task):
    # Each digit sits in an equation or the final answer whose other numbers are fixed, so any change
    # to it (a wrong carry, a wrong intermediate result, a wrong answer digit) must cost the reward.
    for p in [task.sample(2, "train", i) for i in range(16)]:
        solution = reference_solution(p)
        for k, ch in enumerate(solution):
            if ch.isdigit():
                for d in "0123456789".replace(ch, ""):
                    assert task.verify(p, solution[:k] + d + solution[k + 1:]) == 0.0, (solution, k, d)


_TEXT = st.text(alphabet=sorted(ALPHABET) + list("\t\r\x00é"), max_size=80)


@settings(max_examples=200, deadline=None)
@given(data=st.data(), task_name=st.sampled_from(sorted(TASKS)), index=st.integers(0, 10 ** 6))
def test_verifiers_never_raise_and_reward_is_binary(data, task_name, index):
    task = TASKS[task_name]
    p = task.sample(0, "train", index)
    solution = reference_solution(p)
    cut = data.draw(st.integers(0, len(solution)))
    junk = data.draw(_TEXT)
    for response in (junk, solution[:cut] + junk, solution[:cut] + junk + solution[cut:], junk + solution):
        assert task.verify(p, response) in (0.0, 1.0)
    if cut < len(solution):
        assert task.verify(p, solution[:cut]) == 0.0  # a strict prefix is never a full answer


def test_bad_arguments_and_narrow_levels_fail_loudly():
    with pytest.raises(ValueError, match="split"):
        ARITH.sample(0, "test", 0)
    with pytest.raises(ValueError, match="level"):
        ARITH.sample(0, "train", 0, level=0)
    with pytest.raises(ValueError, match="operands"):
        ArithmeticLevel(3, operands=3, op="-")
    with pytest.raises(ValueError, match="carries"):
        ArithmeticLevel(2, min_carries=3)
    with pytest.raises(ValueError, match="operations"):
        CountdownLevel(3, 3)
    with pytest.raises(ValueError, match="heldout_fraction"):
        countdown_task(heldout_fraction=0.0)
    # 1-digit sums without carry are ~30 problems: far too few for a 0.01% held-out share.
    narrow = arithmetic_task(levels=(ArithmeticLevel(1, max_carries=0),), heldout_fraction=1e-4)
    with pytest.raises(RuntimeError, match="too narrow"):
        narrow.sample(0, "heldout", 0)
