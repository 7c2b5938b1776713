"""The arithmetic generator and prompt rendering."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stages.core.data.problems import (
    WORD_TEMPLATES,
    Problem,
    generate_arithmetic,
    generate_word_problems,
    render_prompt,
    split_of,
    word_problem,
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


# ----- word problems -------------------------------------------------------------------------


def _expression_of(problem: Problem) -> str:
    """The expression a word problem tells, read back from its worked solution's steps."""
    steps = problem.solution.split(". ####")[0].split(", ")
    first = steps[0].split("=")[0]
    if len(steps) == 1:
        return first
    # the second step applies the last operator and operand to the first step's result
    rest = steps[1].split("=")[0]
    op_index = next(i for i in range(1, len(rest)) if rest[i] in "+-*")
    return first + rest[op_index:]


def test_word_problem_by_hand():
    import random

    story = word_problem(random.Random(0), "3+4")
    assert story in {t.format(name=n, item=i, box=b, a=3, b=4)
                     for t in WORD_TEMPLATES["+"]
                     for n in ("Tom", "Anna", "Sam", "Lily", "Ben", "Mia", "Leo", "Zoe", "Max",
                               "Emma", "Noah", "Ava")
                     for i in ("apples", "pencils", "marbles", "stickers", "cookies", "books",
                               "cards", "shells", "stamps", "balloons", "coins", "flowers")
                     for b in ("boxes", "bags", "baskets", "jars", "packs", "plates")}
    assert " 3 " in story and " 4 " in story
    assert word_problem(random.Random(0), "3+4") == story  # seeded
    s2 = word_problem(random.Random(1), "6*2-5")
    assert "6" in s2 and "2" in s2 and "5" in s2 and s2.endswith("?")


def test_word_problems_are_deterministic_distinct_and_correct():
    a = generate_word_problems(150, seed=3, max_add=9, max_mul=9)
    assert a == generate_word_problems(150, seed=3, max_add=9, max_mul=9)
    assert a != generate_word_problems(150, seed=4, max_add=9, max_mul=9)
    assert len({p.problem_id for p in a}) == len({p.question for p in a}) == 150
    exprs = [_expression_of(p) for p in a]
    assert len(set(exprs)) == 150  # distinct in their arithmetic, not only in the story
    for p, e in zip(a, exprs, strict=True):
        assert p.answer == str(eval(e))  # noqa: S307 - digits and + - * only
        assert p.answer_type == "math" and p.solution.endswith(f"#### {p.answer}")
        assert p.level == str(sum(e.count(o) for o in "+-*") + 1) in ("2", "3")
        # every count of the story is a whole number of things: no negative partial result
        for step in p.solution.split(". ####")[0].split(", "):
            assert int(step.rsplit("=", 1)[1]) >= 0
        numbers = [int(x) for x in e.replace("+", " ").replace("-", " ").replace("*", " ").split()]
        assert min(numbers) >= 2 and max(numbers) <= 9
        assert all(str(v) in p.question for v in numbers)
        assert p.question.endswith("?") and "{" not in p.question
    patterns = {"".join(c for c in e if c in "+-*") for e in exprs}
    assert patterns == set(WORD_TEMPLATES)  # every pattern occurs


def test_word_split_is_the_expressions_so_no_arithmetic_crosses_it():
    train = generate_word_problems(400, seed=0, max_add=19, max_mul=9, split="train")
    test = generate_word_problems(40, seed=0, max_add=19, max_mul=9, split="test")
    train_e = {_expression_of(p) for p in train}
    test_e = {_expression_of(p) for p in test}
    assert not train_e & test_e
    assert all(split_of(f"{e}=?") == "test" for e in test_e)
    assert all(split_of(f"{e}=?") == "train" for e in train_e)
    # nor with the expression generator's training questions of the same range
    expr_train = {p.question.removesuffix("=?") for p in
                  generate_arithmetic(2000, seed=0, max_terms=3, max_add=19, max_mul=9)}
    assert not expr_train & test_e


def test_word_style_through_generate_arithmetic():
    assert generate_arithmetic(20, seed=1, max_terms=3, max_add=9, style="word") == \
        generate_word_problems(20, seed=1, max_terms=3, max_add=9)
    with pytest.raises(ValueError, match="style"):
        generate_arithmetic(2, seed=1, style="poem")


def test_word_problems_refuse_more_than_two_operations_and_tiny_spaces():
    with pytest.raises(ValueError, match="2 or 3 terms"):
        generate_word_problems(5, seed=0, max_terms=4)
    with pytest.raises(ValueError, match="space is too small"):
        generate_word_problems(200, seed=0, min_terms=2, max_terms=2, max_add=4, max_mul=4)


def test_config_style_key():
    from stages.config import ConfigError, GeneratedSource, validate

    assert GeneratedSource(n=3).style == "expression"
    assert GeneratedSource(n=3, style="word", max_terms=3).style == "word"
    import yaml

    from tests.conftest import ROOT

    raw = yaml.safe_load((ROOT / "config" / "test.yaml").read_text())
    raw["datasets"]["rl"]["source"].update(style="word", max_terms=4)
    with pytest.raises(ConfigError, match="datasets.rl.source.*max_terms must be <= 3"):
        validate(raw, "t.yaml")
    raw["datasets"]["rl"]["source"].update(style="verse", max_terms=3)
    with pytest.raises(ConfigError, match="datasets.rl.source.style"):
        validate(raw, "t.yaml")
