"""Grading: answer extraction, equivalence on every benchmark's real answer formats, and the
hard time limit (adversarial answers, non-main threads, orphaned workers).

Gold answers below are copied from the benchmark files described in
shared/data/benchmarks/README.md; the tests do not read those files.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stages.core.reward import equivalence, workers
from stages.core.reward.equivalence import fast_verdict, split_top_level
from stages.core.reward.extraction import extract_answer, last_boxed
from stages.core.reward.grades import Grade
from stages.core.reward.registry import grade, grade_many, is_correct

TIMEOUT = 1.0
SLACK = 2.0  # the brief's bound: a grading returns within timeout + 2 s
HANG = "\\boxed{10^{10^{10^{10}}}}"  # sympy evaluates this power for minutes


@pytest.fixture(scope="module", autouse=True)
def warm_worker():
    """Start a worker once, so timed tests measure comparisons, not an interpreter start."""
    assert grade("\\boxed{\\sqrt{12}}", "2\\sqrt{3}", "math").correct
    yield


# ---------------------------------------------------------------------------------------------
# Extraction
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so $\\boxed{42}$.", "42"),
        ("first \\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt{3}}{2}"),
        ("\\boxed{\\{1,2\\}}", "\\{1,2\\}"),
        ("\\fbox{7}", "7"),
        ("$\\boxed 5$", "5"),
        ("\\boxed {12}", "12"),
        ("\\boxed{}", None),
        ("\\boxed{1+{2", None),
        ("no box here", None),
    ],
)
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("Step 1 ... \\boxed{2} ... final \\boxed{3}", "3"),
        ("Janet sells 9 eggs.\n#### 18", "18"),
        ("She makes 2,125 dollars.\n#### 2,125", "2,125"),
        ("Final Answer: The final answer is $0.554$. I hope it is correct.", "0.554"),
        ("**Answer:** 42.", "42"),
        ("The answer is: x = 5", "x = 5"),
        ("Answer: \\boxed{7}\n#### 8", "7"),  # boxed beats every fallback
        ("Answer: 7\n#### 8", "7"),  # the "Answer:" line beats ####
        ("\\boxed{1+{2 so the answer is 3", "3"),  # unclosed box: fall back
        ("I computed it but never said it", None),
        ("", None),
    ],
)
def test_extract_math(response, expected):
    assert extract_answer(response, "math") == expected


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("Banks control access. \\boxed{A}", "A"),
        ("\\boxed{\\text{(C)}}", "C"),
        ("So the answer is (B) mall.", "B"),
        ("**Answer: D**", "D"),
        ("The answer is option E", "E"),
        ("Let me weigh them.\nC", "C"),
        ("Reasoning...\nB. library", "B"),
        ("(A) is wrong, (C) is right because ...", "C"),
        ("a bank is a place", None),  # lower-case "a" is an article
        ("Answer: bank", None),
        ("", None),
    ],
)
def test_extract_choice(response, expected):
    assert extract_answer(response, "choice") == expected


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("\\boxed{Yes}", "yes"),
        ("\\boxed{\\text{no}}", "no"),
        ("Albany, GA has about 75,000 people. So the answer is no.", "no"),
        ("Answer: True", "yes"),
        ("There is no record of it ... yes", "yes"),  # the last yes/no word
        ("false", "no"),
        ("maybe", None),
    ],
)
def test_extract_boolean(response, expected):
    assert extract_answer(response, "boolean") == expected


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        # several formulas on the answer line: the final value, not the first formula
        ("Final Answer: The largest $n$ is 34.", "34"),
        ("Final Answer: The value of $x$ is $5$.", "5"),
        ("Final Answer: The sum of $a$ and $b$ is $7$.", "7"),
        ("Answer: Therefore $m+n$ = 1,234", "1,234"),
        ("Answer: the side $AB$ is 12 cm.", "12 cm"),
        ("**Final Answer:** Choosing $k$ of them gives $\\binom{10}{3}$.", "\\binom{10}{3}"),
        # formulas joined only by commas / and / or are one answer of several parts
        ("Final Answer: $x = 1$ and $x = -1$", "x = 1, x = -1"),
        ("Answer: The solutions are $2$, $3$, and $5$.", "2, 3, 5"),
        # an escaped dollar inside a formula is a dollar sign, not its end (MATH-500 golds)
        ("Final Answer: The final answer is $\\$18.90$. I hope it is correct.", "\\$18.90"),
        ("Answer: It costs $\\$32,\\!348$ in total.", "\\$32,\\!348"),
        # no formula: a number stated at the end after "is"
        ("Answer: the largest n is 34.", "34"),
        # one formula: as before
        ("Answer: $\\frac{1}{2}$", "\\frac{1}{2}"),
        ("Answer: $5$ apples.", "5"),
        ("Answer: $f(x) = 2x+1$", "f(x) = 2x+1"),
        ("The answer is: x = 5", "x = 5"),
    ],
)
def test_answer_line_gives_its_final_value(line, expected):
    assert extract_answer(line, "math") == expected


def test_answer_line_final_value_is_graded():
    assert grade("Final Answer: The largest $n$ is 34.", "34", "math").correct
    assert not grade("Final Answer: The largest $n$ is 35.", "34", "math").correct
    assert grade("Final Answer: $x = 1$ and $x = -1$", "1, -1", "math").correct
    assert grade("Final Answer: The final answer is $\\$18.90$.", "\\$18.90", "math").correct


def test_unknown_answer_type_is_a_caller_error():
    with pytest.raises(ValueError, match="answer_type"):
        grade("\\boxed{1}", "1", "number")
    with pytest.raises(ValueError, match="answer_type"):
        extract_answer("1", "free")


# ---------------------------------------------------------------------------------------------
# Every benchmark's answer format
# ---------------------------------------------------------------------------------------------
CORRECT = [
    # GSM8K: gold after "####", thousands separators; numbers compare as numbers
    ("gsm8k", "She earns $2125 in total. \\boxed{2125}", "2,125"),
    ("gsm8k", "#### 1,450,000", "1,450,000"),
    ("gsm8k", "#### 1450000", "1,450,000"),
    ("gsm8k", "So it costs \\boxed{\\$18}.", "18"),
    ("gsm8k", "#### 72", "72"),
    ("gsm8k", "\\boxed{-10}", "-10"),
    ("gsm8k", "\\boxed{18.00}", "18"),
    # MATH-500: LaTeX golds, nested braces, \dfrac, intervals, tuples, text, degrees
    ("math500", "\\boxed{\\dfrac{14}{3}}", "\\frac{14}{3}"),
    ("math500", "\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt3}{2}"),
    (
        "math500",
        "\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}",
        "\\left( 3, \\frac{\\pi}{2} \\right)",
    ),
    ("math500", "\\boxed{(3, \\pi/2)}", "\\left( 3, \\frac{\\pi}{2} \\right)"),
    ("math500", "\\boxed{\\text{Evelyn}}", "\\text{Evelyn}"),
    ("math500", "\\boxed{Evelyn}", "\\text{Evelyn}"),
    ("math500", "\\boxed{90}", "90^\\circ"),
    ("math500", "\\boxed{90^{\\circ}}", "90^\\circ"),
    ("math500", "\\boxed{5}", "x=5"),
    ("math500", "\\boxed{(3,4]}", "(3,4]"),
    ("math500", "\\boxed{[-2, 7]}", "x \\in [-2,7]"),
    ("math500", "\\boxed{(-\\infty,2)\\cup(3,\\infty)}", "(-\\infty, 2) \\cup (3, \\infty)"),
    ("math500", "\\boxed{10080}", "10,\\!080"),
    ("math500", "\\boxed{11111111100}", "11,\\! 111,\\! 111,\\! 100"),
    ("math500", "\\boxed{\\$32,348}", "\\$32,\\!348"),
    ("math500", "\\boxed{C}", "\\text{(C)}"),
    ("math500", "\\boxed{5.4}", "5.4 \\text{ cents}"),
    ("math500", "\\boxed{\\frac{270}{7}}", "\\frac{270}7\\text{ degrees}"),
    ("math500", "\\boxed{1-2x+x^5-x^4+x^3-x^2+x-2+2x}", "x^5 - x^4 + x^3 - x^2 + x - 1"),
    ("math500", "\\boxed{1-\\sqrt{5}, -2, 1+\\sqrt{5}}", "\\{1\\pm\\sqrt{5},-2\\}"),
    ("math500", "\\boxed{-2, 1}", "1,-2"),
    ("math500", "\\boxed{2\\sqrt{3}}", "\\sqrt{12}"),
    # OlympiadBench: several answers (order-free), tuples, intervals, equations
    ("olympiad", "\\boxed{7, 5}", "5,7"),
    ("olympiad", "\\boxed{\\{5, 7\\}}", "5,7"),
    ("olympiad", "\\boxed{5 \\text{ and } 7}", "5,7"),
    ("olympiad", "\\boxed{(4,5,7), (1,8,19), (2,7,13)}", "(1,8,19), (2,7,13), (4,5,7)"),
    ("olympiad", "\\boxed{(2,4)}", "(2,4)"),
    ("olympiad", "\\boxed{\\frac{1}{2}, 8}", "8, \\frac{1}{2}"),
    ("olympiad", "\\boxed{[\\frac{1}{2}, 8]}", "[\\frac{1}{2}, 8]"),
    ("olympiad", "\\boxed{f(x)=x+1, f(x)=-1}", "f(x)=-1, f(x)=x+1"),
    ("olympiad", "\\boxed{2^{1009}}", "2^{1009}"),
    ("olympiad", "\\boxed{x=\\pm 1}", "1,-1"),
    # Minerva: decimals, scientific notation, units, tolerance
    ("minerva", "\\boxed{1.24 \\times 10^{-8}}", "1.24e-8"),
    ("minerva", "\\boxed{4.46e19}", "4.46e19"),
    ("minerva", "\\boxed{1 \\times 10^{11}}", "1e11"),
    ("minerva", "\\boxed{6630 \\text{ K}}", "6630"),
    ("minerva", "\\boxed{0.554 \\, \\mathrm{m}}", "0.554"),
    ("minerva", "\\boxed{7.353 \\times 10^{14} \\text{ Hz}}", "7.353e14"),
    ("minerva", "\\boxed{0.55401}", "0.554"),  # within rel_tol 1e-4
    ("minerva", "Final Answer: The final answer is $1.4142$. I hope it is correct.", "\\sqrt{2}"),
    ("minerva", "\\boxed{2\\pi/\\omega}", "2 \\pi / \\omega"),
    # AIME: zero-padded keys; AMC: float keys
    ("aime", "\\boxed{25}", "025"),
    ("aime", "\\boxed{025}", "025"),
    ("aime", "\\boxed{73}", "073"),
    ("amc", "\\boxed{27}", "27.0"),
    ("amc", "\\boxed{-1}", "-1.0"),
    ("amc", "\\boxed{3159}", "3159.0"),
    # our generated arithmetic
    ("arith", "82*1=82, 61+82=143, 143-82=61. #### 61", "61"),
]

WRONG = [
    ("gsm8k", "#### 2,126", "2,125"),
    ("gsm8k", "\\boxed{1,234}", "1234.5"),
    ("math500", "\\boxed{\\frac{14}{5}}", "\\frac{14}{3}"),
    ("math500", "\\boxed{[3,4]}", "(3,4]"),
    ("math500", "\\boxed{(4, 3)}", "(3,4)"),
    ("math500", "\\boxed{\\text{Navin}}", "\\text{Evelyn}"),
    ("math500", "\\boxed{2x}", "2"),
    ("math500", "\\boxed{2 x}", "2"),
    ("olympiad", "\\boxed{5}", "5,7"),
    ("olympiad", "\\boxed{5, 7, 9}", "5,7"),
    ("olympiad", "\\boxed{(1,8,19), (2,7,13)}", "(1,8,19), (2,7,13), (4,5,7)"),
    ("olympiad", "\\boxed{(2,4,6)}", "(2,4)"),
    ("minerva", "\\boxed{5 \\times 10^{-8}}", "1.24e-8"),
    ("minerva", "\\boxed{0.5541}", "0.554"),  # 1.8e-4 relative: outside 1e-4
    ("minerva", "\\boxed{4.46e18}", "4.46e19"),
    ("aime", "\\boxed{26}", "025"),
    ("aime", "\\boxed{250}", "025"),
    ("amc", "\\boxed{27.5}", "27.0"),
    ("arith", "#### 60", "61"),
]


@pytest.mark.parametrize(("bench", "response", "gold"), CORRECT)
def test_correct_answers(bench, response, gold):
    result = grade(response, gold, "math")
    assert result == Grade(True, result.extracted, None), bench


@pytest.mark.parametrize(("bench", "response", "gold"), WRONG)
def test_wrong_answers(bench, response, gold):
    result = grade(response, gold, "math")
    assert not result.correct, bench
    assert result.error is None, result  # compared and found different, not a failure


@pytest.mark.parametrize(
    ("response", "gold", "expected"),
    [
        ("A revolving door controls access: \\boxed{A}", "A", True),
        ("The answer is (B) library.", "A", False),
        ("\\boxed{E}", "E", True),
        ("I cannot decide.", "C", False),
    ],
)
def test_commonsenseqa_letters(response, gold, expected):
    assert is_correct(response, gold, "choice") is expected


@pytest.mark.parametrize(
    ("response", "gold", "expected"),
    [
        ("Albany, GA has ~75,000 people, NY ~100,000. \\boxed{No}", "no", True),
        ("So the answer is yes.", "no", False),
        ("Answer: true", "yes", True),
        ("\\boxed{no}", "False", True),  # a JSON bool key that was stringified
    ],
)
def test_strategyqa_yes_no(response, gold, expected):
    assert is_correct(response, gold, "boolean") is expected


def test_errors_name_the_reason():
    assert grade("no answer here", "5", "math") == Grade(False, None, "no_answer")
    assert grade("I pick none", "A", "choice").error == "no_answer"
    assert grade("\\boxed{1}", "", "math").error == "bad_gold: empty"
    assert grade("\\boxed{A}", "bank", "choice").error.startswith("bad_gold")
    long = grade("\\boxed{" + "1+" * 2000 + "1}", "4001", "math")
    assert (long.correct, long.error) == (False, "answer_too_long")


def test_relative_tolerance_is_an_option():
    assert grade("\\boxed{0.5541}", "0.554", "math", rel_tol=1e-3).correct
    assert not grade("\\boxed{0.55401}", "0.554", "math", rel_tol=0.0).correct
    # integers never use the tolerance: 100001 is not 100000
    assert not grade("\\boxed{100001}", "100000", "math", rel_tol=1e-4).correct


# MATH-500's spelling: the row break "\\" followed by a space
MATRIX = "\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix}"


@pytest.mark.parametrize("boxed", [
    "\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix}",
    "\\begin{pmatrix} 1 & 2 \\\\3 & 4 \\end{pmatrix}",
    "\\begin{pmatrix}1&2\\\\ 3&4\\end{pmatrix}",
])
def test_matrix_rows_survive_a_space_after_the_row_break(boxed):
    assert equivalence.normalise(MATRIX) == MATRIX  # the row break "\\" is kept whole
    result = grade(f"So $\\boxed{{{boxed}}}$.", MATRIX, "math")
    assert result == Grade(True, boxed, None)


@pytest.mark.parametrize("boxed", [
    "\\begin{pmatrix} 1 & 2 \\\\ 3 & 5 \\end{pmatrix}",
    "\\begin{pmatrix} 1 & 2 \\\\3 & 5 \\end{pmatrix}",
    "\\begin{pmatrix} 1 & 5 & 4 \\end{pmatrix}",  # what "1 & 2 \ 3 & 4" (rows lost) was read as
    "\\begin{pmatrix} 1 & 2 & 3 & 4 \\end{pmatrix}",
])
def test_a_different_matrix_is_wrong(boxed):
    result = grade(f"\\boxed{{{boxed}}}", MATRIX, "math")
    assert (result.correct, result.error) == (False, None)


def test_spacing_macros_still_go():
    assert equivalence.normalise("11,\\! 111") == "11,111"
    assert equivalence.normalise("2\\,\\text{cm}") == "2 \\text{cm}"
    assert equivalence.normalise("a~b\\;c") == "a b c"


def test_split_top_level_keeps_brackets_and_thousands():
    assert split_top_level("(1,8,19), (2,7,13)") == ["(1,8,19)", "(2,7,13)"]
    assert split_top_level("[0, 1)") == ["[0, 1)"]
    assert split_top_level("1,234") == ["1,234"]
    assert split_top_level("2500,7500") == ["2500", "7500"]
    assert split_top_level("$69$,$84$") == ["69", "84"]


@given(st.integers(min_value=-(10**12), max_value=10**12))
@settings(max_examples=60, deadline=None)
def test_integers_in_any_written_form(n):
    assert fast_verdict(f"{n:,}", str(n), 1e-4) is True
    assert fast_verdict(f"{n}.0", str(n), 1e-4) is True
    assert fast_verdict(f"0{n}" if n >= 0 else f"-0{-n}", str(n), 1e-4) is True
    assert fast_verdict(str(n + 1), str(n), 1e-4) is False


# ---------------------------------------------------------------------------------------------
# Never hang, never raise
# ---------------------------------------------------------------------------------------------
_fresh = itertools.count(2)


def _ready_worker() -> None:
    """Wait until an idle worker is ready (a replacement starts after each timeout), so that
    timed calls measure the comparison; the pair is new each time, so the cache cannot answer."""
    n = next(_fresh)
    assert grade(f"\\boxed{{\\sqrt{{{2 * n * n}}}}}", f"{n}\\sqrt{{2}}", "math").correct


def _timed(fn, *args, **kwargs):
    _ready_worker()
    start = time.monotonic()
    result = fn(*args, **kwargs)
    return result, time.monotonic() - start


def test_runaway_power_times_out():
    result, seconds = _timed(grade, HANG, "5", "math", timeout_s=TIMEOUT)
    assert result == Grade(False, "10^{10^{10^{10}}}", "timeout")
    assert seconds < TIMEOUT + SLACK


@pytest.mark.parametrize(
    "response",
    [
        "\\boxed{10^10^10^10}",  # parsed left to right: 10^1000, compared quickly
        "\\boxed{1+{2",
        "",
        "x" * 1_000_000,
        "Answer: \\(" * 100_000,
        "\\boxed{" * 100_000,
        "The answer is \\boxed{" + "(" * 500 + "}",
        bytes(range(256)).decode("latin-1") * 400,
        b"\xff\xfe\x00garbage\x80",
        None,
    ],
    ids=[
        "tower",
        "unbalanced",
        "empty",
        "megabyte",
        "many-inline",
        "many-boxes",
        "parens",
        "binary",
        "bytes",
        "none",
    ],
)
def test_adversarial_responses_are_incorrect_and_bounded(response):
    result, seconds = _timed(grade, response, "5", "math", timeout_s=TIMEOUT)
    assert not result.correct
    assert seconds < TIMEOUT + SLACK
    if response != "\\boxed{10^10^10^10}":  # that one is a real (wrong) answer
        assert result.error is not None


def test_megabyte_response_with_an_answer_is_graded():
    response = "blah " * 200_000 + "\\boxed{\\frac{1}{2}}"
    result, seconds = _timed(grade, response, "0.5", "math")
    assert result.correct
    assert seconds < SLACK


@given(st.text(alphabet=" \\{}$^/.,-0123456789abex()[]=;\nABC", max_size=400))
@settings(max_examples=80, deadline=2000)
def test_fuzzed_text_is_handled_in_process_quickly(text):
    for answer_type in ("math", "choice", "boolean"):
        extract_answer(text, answer_type)
    fast_verdict(text, "5", 1e-4)
    fast_verdict(text, "1, 2", 1e-4)


def test_grading_in_threads_and_timeout_off_the_main_thread():
    pairs = [
        ("\\boxed{\\sqrt{8}}", "2\\sqrt{2}"),
        ("\\boxed{\\dfrac{2}{4}}", "0.5"),
        ("\\boxed{(1, 2]}", "(1,2]"),
        ("\\boxed{x^2+2x+1}", "(x+1)^2"),
    ]
    with ThreadPoolExecutor(max_workers=4) as executor:
        results = list(executor.map(lambda p: grade(p[0], p[1], "math"), pairs))
    assert all(r.correct for r in results), results

    box: dict[str, object] = {}

    def target():
        start = time.monotonic()
        box["result"] = grade(HANG, "5", "math", timeout_s=TIMEOUT)
        box["seconds"] = time.monotonic() - start

    _ready_worker()
    thread = threading.Thread(target=target)
    thread.start()
    thread.join(TIMEOUT + SLACK + 5)
    assert box["result"] == Grade(False, "10^{10^{10^{10}}}", "timeout")
    assert box["seconds"] < TIMEOUT + SLACK


def test_grade_many_matches_grade_and_shares_workers():
    responses = ["\\boxed{\\frac{1}{2}}", "#### 1,234", "\\boxed{B}", "yes", "\\boxed{2}", HANG]
    golds = ["0.5", "1234", "B", "no", "\\sqrt{4}", "5"]
    types = ["math", "math", "choice", "boolean", "math", "math"]
    results = grade_many(responses, golds, types, timeout_s=TIMEOUT, max_workers=2)
    assert [r.correct for r in results] == [True, True, True, False, True, False]
    assert results[-1].error == "timeout"  # one overrun costs one answer, not the batch
    singles = zip(responses[:-1], golds[:-1], types[:-1], strict=True)
    assert results[:-1] == [grade(r, g, t) for r, g, t in singles]
    two = grade_many(["#### 3", "#### 4"], ["3", "3"], "math")
    assert [r.correct for r in two] == [True, False]
    group, seconds = _timed(grade_many, [HANG] * 4, ["5"] * 4, "math", timeout_s=TIMEOUT)
    assert {r.error for r in group} == {"timeout"}
    assert seconds < TIMEOUT + SLACK  # identical answers are compared once
    with pytest.raises(ValueError, match="lengths"):
        grade_many(["a"], ["a", "b"], "math")


def test_orphaned_worker_stops_itself():
    """A worker whose parent is gone mid-job ends by its CPU limit, not after minutes."""
    worker = workers._Worker()
    worker._wait_ready()
    worker._conn.send((1, "10^{10^{10^{10}}}", "5", 1e-4, 0.1))
    worker._conn.close()  # as if the parent died
    try:
        worker._process.wait(timeout=15)
    finally:
        worker.kill()
    assert worker._process.returncode is not None
    assert worker._process.returncode != 0


def test_forked_child_gets_its_own_workers():
    if not hasattr(os, "fork"):
        pytest.skip("no fork on this platform")
    pid = os.fork()
    if pid == 0:  # child: must not talk to the parent's workers
        ok = grade("\\boxed{\\sqrt{50}}", "5\\sqrt{2}", "math").correct
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert grade("\\boxed{\\sqrt{18}}", "3\\sqrt{2}", "math").correct
