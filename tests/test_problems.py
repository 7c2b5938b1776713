"""The arithmetic generator and prompt rendering."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stages.core.problems import (
    Problem,
    generate_arithmetic,
    render_prompt,
    split_of,
    worked_solution,
)


def test_worked_solution_by_hand():
    assert worked_solution("61+82-82*1") == ("82*1=82, 61+82=143, 143-82=61. #### 61", 61)
    assert worked_solution("1-4+3*7") == ("3*7=21, 1-4=-3, -3+21=18. #### 18", 18)
    assert worked_solution("7*0") == ("7*0=0. #### 0", 0)
    assert worked_solution("3-9") == ("3-9=-6. #### -6", -6)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 30), min_size=2, max_size=6), st.data())
def test_worked_solution_matches_python(operands, data):
    ops = [data.draw(st.sampled_from("+-*")) for _ in operands[1:]]
    expr = str(operands[0]) + "".join(o + str(v) for o, v in zip(ops, operands[1:], strict=True))
    text, value = worked_solution(expr)
    assert value == eval(expr)  # noqa: S307 - digits and + - * only
    assert text.endswith(f"#### {value}")
    # every step is itself a true equation
    for step in text.split(". ####")[0].split(", "):
        lhs, rhs = step.split("=")
        a, op, b = _split_binary(lhs)
        assert {"+": a + b, "-": a - b, "*": a * b}[op] == int(rhs)


def _split_binary(lhs: str) -> tuple[int, str, int]:
    for i in range(1, len(lhs)):
        if lhs[i] in "+-*":
            return int(lhs[:i]), lhs[i], int(lhs[i + 1 :])
    raise AssertionError(lhs)


def test_generator_is_deterministic_and_distinct():
    a = generate_arithmetic(300, seed=5)
    b = generate_arithmetic(300, seed=5)
    c = generate_arithmetic(300, seed=6)
    assert a == b
    assert a != c
    assert len({p.question for p in a}) == 300
    assert len({p.problem_id for p in a}) == 300


def test_generator_respects_knobs():
    probs = generate_arithmetic(200, seed=0, min_terms=5, max_terms=6, max_add=29, max_mul=9)
    for p in probs:
        expr = p.question.removesuffix("=?")
        terms = sum(expr.count(o) for o in "+-*") + 1
        assert 5 <= terms <= 6 and p.level == str(terms)
        assert "**" not in expr and p.answer == str(eval(expr))  # noqa: S307
        assert p.answer_type == "math" and p.solution.endswith(f"#### {p.answer}")


def test_train_and_test_splits_never_share_a_question():
    train = generate_arithmetic(500, seed=0, max_terms=3, split="train")
    test = generate_arithmetic(100, seed=0, max_terms=3, split="test")
    assert not {p.question for p in train} & {p.question for p in test}
    assert all(split_of(p.question) == "test" for p in test)


def test_too_small_a_space_is_a_clear_error():
    with pytest.raises(ValueError, match="space is too small"):
        generate_arithmetic(500, seed=0, min_terms=2, max_terms=2, max_add=3, max_mul=3)


def test_render_prompt_with_and_without_choices():
    p = Problem("1", "s", "Where?", "B", "choice", choices=["here", "there"])
    assert render_prompt("Q: {question}\nA:", p) == "Q: Where?\nA. here\nB. there\nA:"
    m = Problem("2", "s", "1+1=?", "2", "math")
    assert render_prompt("Q: {question} A:", m) == "Q: 1+1=? A:"
    # braces elsewhere in the template (\boxed{}) are kept as they are
    assert render_prompt(r"{question} \boxed{}", m) == r"1+1=? \boxed{}"


def test_problem_checks_its_type():
    with pytest.raises(ValueError, match="answer_type"):
        Problem("1", "s", "q", "a", "essay")
    with pytest.raises(ValueError, match="choices"):
        Problem("1", "s", "q", "A", "choice")
