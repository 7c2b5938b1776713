r"""Graders: verl's math_dapo reproduced quirk by quirk, and the registry behind grade_many.

The expected values below were derived by reading verl's verl/utils/reward_score/math_dapo.py
line by line (compute_score -> is_correct_minerva -> normalize_final_answer); each case names the
upstream line it checks. No test reads verl.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from stages.core.reward import registry as grader_registry
from stages.core.reward.graders.verify import verify_many
from stages.core.reward.grades import Grade
from stages.core.reward.registry import GRADERS, grade, grade_many, register_grader, spec_of
from stages.core.reward.scores.math_dapo import INVALID, DapoScore, dapo_math, normalize_dapo

FILLER = "Let me think step by step about this problem. " * 20  # 920 characters, no label


# ---------------------------------------------------------------------------------------------
# dapo_math: extraction (the window and the "Answer:" pattern)
# ---------------------------------------------------------------------------------------------
EXTRACTION = [
    # (response, gold, extracted, correct, the upstream behaviour checked)
    ("Answer: 5", "5", "5", True, "the group after 'Answer:' is the prediction"),
    (FILLER + "\n\nAnswer: 34", "34", "34", True, "reasoning before the answer line is ignored"),
    ("ANSWER: 7", "7", "7", True, "(?i): any case"),
    ("so the final answer:7", "7", "7", True, "no word boundary before 'Answer', \\s* may be empty"),
    ("Answer : 5", "5", "5", True, "\\s* between 'Answer' and ':'"),
    ("Answer\n:\n5", "5", "5", True, "\\s* crosses line breaks on both sides of ':'"),
    ("Answer:\r\n5", "5", "5", True, "\\s* takes '\\r\\n' greedily, the group is the next line"),
    ("Answer:\nI think 5", "5", "Ithink5", False, "an empty label line takes the next line"),
    ("the answer is 5", "5", INVALID, False, "the colon is required"),
    ("Answers: 5", "5", INVALID, False, "'s' between 'Answer' and ':' is not \\s"),
    ("Answer: 3\nWait, let me recheck.\nAnswer: 4", "4", "4", True, "findall(...)[-1]: last line"),
    ("Answer: 3. Answer: 4", "4", "3.Answer:4", False,
     "[^\\n]+ runs to the line's end: one line holds one match, its first label"),
    ("My answer:\nAnswer: 5", "5", "Answer:5", False,
     "a label ending a line swallows the next line, whose own label is then never matched"),
    ("Answer: 5.", "5", "5.", False, "a trailing period stays in the prediction"),
    ("Answer: 5 apples", "5", "5apples", False, "prose after the answer stays"),
    ("so the answer is \\boxed{5}", "5", INVALID, False, "\\boxed{} without 'Answer:' is invalid"),
    ("Answer: \\boxed{5}", "5", "5", True, "\\boxed{} inside the answer line is unwrapped"),
    ("Answer: $\\boxed{5}$", "5", "5", True, "$...$ kept, then \\boxed{} unwrapped, then $ gone"),
    ("Answer: 5\n" + "x" * 300, "5", INVALID, False, "solution_str[-300:]: the line is cut off"),
    ("Answer: 5\n" + "y" * 290, "5", "5", True, "a window of exactly 300 starts at the label"),
    ("Answer: 5\n" + "y" * 291, "5", INVALID, False, "one more: it starts inside ('nswer: 5')"),
    ("Answer: 5\n" + "y" * 289 + "\nAnswer: 6", "6", "6", True,
     "window: the earlier line is outside, the later one inside"),
    ("z" * 100_000 + "\nAnswer: 12", "12", "12", True, "very long input: only the tail is read"),
    ("Answer:   ", "", "", True, "only spaces: the group keeps one space, normalised to ''"),
    ("Answer: x=", "", "", True, "text after '=' is empty and so is the gold"),
    ("Anſwer: 5", "5", "5", True, "IGNORECASE on str folds the long s (U+017F) to 's'"),
    ("Answer: 5\r", "5", "5", True, "'\\r' is in the group (not \\n), strip() removes it"),
    ("", "5", INVALID, False, "empty response"),
    ("I cannot solve this.", "[INVALID]", INVALID, True,
     "no match gives '[INVALID]', normalised and compared like a prediction"),
    ("Answer: Answer: 5", "Answer: 5", "Answer:5", True,
     "the gold is normalised whole, never searched for 'Answer:'"),
]


@pytest.mark.parametrize(("response", "gold", "extracted", "correct", "why"), EXTRACTION,
                         ids=[case[-1][:60] for case in EXTRACTION])
def test_dapo_extraction(response, gold, extracted, correct, why):
    assert dapo_math(response, gold) == DapoScore(1.0 if correct else -1.0, correct, extracted)


# ---------------------------------------------------------------------------------------------
# dapo_math: the normaliser, step by step (letters as in the module docstring)
# ---------------------------------------------------------------------------------------------
NORMALISE = [
    # (text, normalised, the upstream behaviour checked)
    ("x = 5", "5", "a: split('=')[-1]"),
    ("a=b=c", "c", "a: the last '=' wins"),
    ("x \\le 3", "x\\le3", "a: only '=' splits"),
    ("an apple", "apple", "b: 'an ' deleted"),
    ("mean 5", "me5", "b: 'an ' deleted inside a word"),
    ("a 5", "5", "b: 'a ' deleted"),
    ("banana split", "banansplit", "b: 'a ' deleted inside a word"),
    ("$5.$", "5", "b: '.$' -> '$' before the formula step"),
    ("\\$5", "5", "b: '\\$' deleted"),
    ("1\\ 000", "1000", "b: '\\ ' deleted, then the all-digit comma rule is moot"),
    ("1 000", "1000", "b: every ASCII space deleted"),
    ("1\t000", "1\t000", "b: a tab is not a space"),
    ("1\u00a0000", "1\u00a0000", "b: nor is a no-break space"),
    ("5 \\mbox{ cm}", "5", "b: mbox -> text; c: 'cm' then '\\text{}' deleted"),
    ("x ,\\text{and} y", "x,y", "b: ',\\text{and}' -> ','"),
    ("1 \\text{ and } 2", "12", "b: '\\text{and}' -> ','; j: then '1,2' is all digits"),
    ("5\\text{m}", "5", "b: '\\text{m}' -> '\\text{}'; c: deleted"),
    ("5 square units", "5", "c: 'square' and 'units' deleted"),
    ("\\sigma", "\\sia", "c: 'gm' deleted inside a macro"),
    ("issue", "is", "c: 'sue' deleted"),
    ("parameters", "para", "c: 'meters' deleted"),
    ("ccmm", "cm", "c: one pass per expression"),
    ("30^\\circ", "30", "c: '^\\circ' deleted"),
    ("30^{\\circ}", "30", "c: '^{\\circ}' deleted"),
    ("1,\\!000", "1000", "c: ',\\!' deleted"),
    ("1{,}000", "1000", "c: '{,}' deleted"),
    ("1, 2, \\ldots", "12", "c: '\\ldots' deleted; j: '1,2,' is digits and commas"),
    ("1,2,\\dots,n", "1,2,,n", "c: '\\dots' deleted; j: not all digits"),
    ('"5"', "5", "c: double quotes deleted"),
    ("5\\text{s}", "5", "c: '\\text{s}' deleted"),
    ("5\\mathrm{th}", "5", "c: '\\mathrm{th}' deleted"),
    ("5\\;\\text{kg}", "5kg", "c: '\\;' deleted; e: \\text unwrapped"),
    ("4 \\text{ cm}^2", "4", "c: 'cm' deleted, then '\\text{}^2'"),
    ("5\\text{\ns}", "5", "c: '\\text{\\ns}' (a gold may hold a line break)"),
    ("$1$ or $2$", "1", "d: the first formula of the line"),
    ("so $x$ works", "x", "d: text around the formula dropped"),
    ("$5", "5", "d: one '$' is no formula; i: it is deleted"),
    ("$1$ and\n$2$", "1\n2", "d: line by line ('.' stops at a line break)"),
    ("a$b$c\nd$e", "b\nde", "d: a line with one '$' keeps its text"),
    ("$\\frac1$", "\\frac{1}{}", "d: the formula keeps its '$' until i, so g takes it"),
    ("\\text{\\text{a}}", "\\text{a}", "e: up to the first '}', one pass"),
    ("\\textbf{5}", "5", "e: \\textbf unwrapped"),
    ("\\overline{12}", "12", "e: \\overline unwrapped"),
    ("\\overline{\\text{ab}}", "ab", "e: \\text first, then \\overline"),
    ("\\text{\\overline{a}", "\\overline{a", "e: \\text before \\overline takes the '}'"),
    ("\\text{\\textbf{a}", "\\textbf{a", "e: \\text before \\textbf takes the '}'"),
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}", "f: greedy to the last '}'"),
    ("\\boxed{1}, \\boxed{2}", "1},\\boxed{2", "f: from the first \\boxed{ to the last '}'"),
    ("\\boxed 5", "\\boxed5", "f: only '\\boxed{' is unwrapped"),
    ("\\fbox{5}", "\\fbox{5}", "f: \\fbox is not"),
    ("\\frac12", "\\frac{1}{2}", "g: \\frac shorthand"),
    ("\\dfrac12", "\\dfrac{1}{2}", "g: 'frac' inside \\dfrac; \\dfrac stays"),
    ("\\frac1{2}", "\\frac{1}{{}2}", "g: the second character may be '{'"),
    ("\\frac\\pi2", "\\frac{\\}{p}i2", "g: any two characters"),
    ("fraction", "frac{t}{i}on", "g: inside a word"),
    ("frac\nx", "frac{\n}{x}", "g: [^{] takes a line break (a gold's)"),
    ("\\sqrt2", "\\sqrt{2}", "h: \\sqrt shorthand"),
    ("\\sqrt[3]{8}", "\\sqrt{[}3]{8}", "h: any character but '{'"),
    ("1,000", "1000", "j: commas dropped from an all-digit number"),
    ("-1,000", "-1,000", "j: a sign is not a digit"),
    ("1,000.5", "1,000.5", "j: nor is a point"),
    ("(1,2)", "(1,2)", "j: tuples keep their commas"),
    ("\u0663,\u0660\u0660\u0660", "\u0663\u0660\u0660\u0660", "j: str.isdigit takes Arabic-Indic"),
    ("2,\u00b2", "2\u00b2", "j: str.isdigit takes a superscript two"),
    (",", ",", "j: ''.isdigit() is False"),
    ("1,000\n", "1,000", "k: strip() after the comma rule"),
    ("  7  ", "7", "k: surrounding whitespace"),
    ("[INVALID]", "[INVALID]", "nothing touches the no-answer marker"),
]


@pytest.mark.parametrize(("text", "normalised", "why"), NORMALISE,
                         ids=[case[-1][:60] for case in NORMALISE])
def test_normalize_dapo(text, normalised, why):
    assert normalize_dapo(text) == normalised


COMPARE = [
    # (response, gold, correct, the upstream behaviour checked)
    ("Answer: 1,000", "1000", True, "both sides become '1000'"),
    ("Answer: 1,000", "1,000\n", False, "a gold's trailing line break keeps its comma"),
    ("Answer: 1,000\t", "1000", False, "so does a prediction's trailing tab"),
    ("Answer: 1,000\r\n", "1000", False, "and a CRLF line end: the '\\r' is in the group"),
    ("Answer: 05", "5", False, "exact strings: no numeric equality"),
    ("Answer: 5.0", "5", False, "exact strings: no numeric equality"),
    ("Answer: 0.5", "\\frac{1}{2}", False, "exact strings: no symbolic equality"),
    ("Answer: \\frac12", "\\frac{1}{2}", True, "the shorthand is expanded on one side"),
    ("Answer: \\dfrac{1}{2}", "\\frac{1}{2}", False, "\\dfrac is not rewritten"),
    ("Answer: 2\\sqrt3", "2\\sqrt{3}", True, "\\sqrt shorthand expanded"),
    ("Answer: 42", "\\boxed{42}", True, "a boxed gold is unwrapped"),
    ("Answer: 3", "$x = 3$", True, "a gold's '=' and '$' are handled like a prediction's"),
    ("Answer: $5.$", "5", True, "'.$' -> '$' rescues a period inside a formula"),
    ("Answer: 5 \\text{ cm}", "5", True, "units removed"),
    ("Answer: \u22125", "-5", False, "a Unicode minus is not '-'"),
    ("Answer: \u03c0", "\\pi", False, "no Unicode-to-LaTeX mapping"),
    ("Answer: (1, 2)", "(1,2)", True, "spaces removed everywhere"),
]


@pytest.mark.parametrize(("response", "gold", "correct", "why"), COMPARE,
                         ids=[case[-1][:60] for case in COMPARE])
def test_dapo_comparison(response, gold, correct, why):
    result = dapo_math(response, gold)
    assert (result.correct, result.score) == (correct, 1.0 if correct else -1.0)


STRICT = [
    # (response, gold, extracted, correct, upstream's strict_box_verify=True path)
    ("so \\boxed{5}", "5", "5", True, "the last box's content, compared raw"),
    ("\\boxed{ 5 }", "5", " 5 ", False, "no normalisation of the prediction"),
    ("\\boxed{5}", " 5", "5", False, "nor of the gold"),
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}", "\\frac{1}{2}", True, "braces matched"),
    ("\\boxed{1} then \\boxed{2}", "2", "2", True, "the last box"),
    ("\\boxed{5}" + "x" * 100, "5", None, False, "only the last 100 characters"),
    ("\\boxed{1+{2}", "1+{2", None, False, "an unclosed box is none"),
    ("\\boxed {5}", "5", None, False, "'\\boxed {' is not a box"),
    ("Answer: 5", "5", None, False, "the Answer: line is not read"),
]


@pytest.mark.parametrize(("response", "gold", "extracted", "correct", "why"), STRICT,
                         ids=[case[-1][:60] for case in STRICT])
def test_dapo_strict_box(response, gold, extracted, correct, why):
    expected = DapoScore(1.0 if correct else -1.0, correct, extracted)
    assert dapo_math(response, gold, strict_box=True) == expected


# ---------------------------------------------------------------------------------------------
# dapo_math: properties
# ---------------------------------------------------------------------------------------------
_LABEL = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
# text rich in what the reward reacts to, mixed with arbitrary characters
_PIECES = st.sampled_from(["Answer:", "answer :", "\n", " ", "=", "$", "\\boxed{", "}", "{",
                           "\\frac", "\\sqrt", "\\text{", ",", ".", "1", "42", "cm", "an ", "a "])
_TEXTS = st.lists(st.one_of(_PIECES, st.text(max_size=5)), max_size=80).map("".join)


@settings(max_examples=300, deadline=None)
@given(response=st.one_of(st.text(), _TEXTS), gold=st.one_of(st.text(max_size=30), _TEXTS),
       strict=st.booleans())
def test_dapo_bounds(response, gold, strict):
    result = dapo_math(response, gold, strict_box=strict)
    assert result.score in (-1.0, 1.0)
    assert result.correct == (result.score == 1.0)


@settings(max_examples=300, deadline=None)
@given(response=st.one_of(st.text(), _TEXTS))
def test_dapo_invalid_iff_no_label(response):
    """No match in the window: "[INVALID]"; a match: never, since nothing the normaliser does
    brings a "[" into a prediction that lacks one."""
    found = _LABEL.search(response[-300:]) is not None
    extracted = dapo_math(response, "5").extracted
    if not found:
        assert extracted == INVALID
    elif "[" not in response:
        assert extracted != INVALID


_NUMERIC_GOLDS = st.one_of(
    st.integers(-10**12, 10**12).map(str),
    st.integers(0, 10**12).map(lambda n: f"{n:,}"),
    st.decimals(-10**6, 10**6, places=3, allow_nan=False, allow_infinity=False).map(str),
)


@settings(max_examples=300, deadline=None)
@given(gold=_NUMERIC_GOLDS, prefix=st.text(max_size=400))
def test_dapo_numeric_gold_matches_itself(gold, prefix):
    assume(re.search(r"(?i)answer", prefix) is None)  # ours must be the last label
    result = dapo_math(f"{prefix}\nAnswer: {gold}", gold)
    assert result.correct and result.score == 1.0


# ---------------------------------------------------------------------------------------------
# The registry
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def registry(monkeypatch):
    """A copy of GRADERS that the test may add to; the real one is restored afterwards."""
    monkeypatch.setattr(grader_registry, "GRADERS", dict(grader_registry.GRADERS))
    return grader_registry.GRADERS


def test_builtin_graders():
    assert {"verify", "math_dapo"} <= set(GRADERS)
    assert spec_of("verify").scored is False
    assert spec_of("math_dapo").scored is True
    assert spec_of("math_dapo").answer_types == ("math",)
    assert spec_of("verify").options == ("rel_tol", "max_workers")
    assert spec_of("math_dapo").options == ()


def test_unknown_grader_names_the_registered_ones():
    with pytest.raises(ValueError, match=r"unknown grader 'nope'.*math_dapo.*verify"):
        grade_many(["Answer: 5"], ["5"], "math", grader="nope")
    with pytest.raises(ValueError, match="unknown grader"):
        grade_many([], [], "math", grader="nope")  # even with nothing to grade


def test_user_grader_is_picked_by_grade_many(registry):
    calls = []

    @register_grader("first_char", scored=False, answer_types=("math", "choice"))
    def first_char(responses, golds, answer_types, timeout_s):
        calls.append((list(responses), list(golds), list(answer_types), timeout_s))
        return [Grade(r[:1] == g, r[:1]) for r, g in zip(responses, golds, strict=True)]

    assert registry["first_char"].fn is first_char
    grades = grade_many(["5 apples", "B", "x"], ["5", "B", "y"], ["math", "choice", "math"],
                        timeout_s=2.0, grader="first_char")
    assert grades == [Grade(True, "5"), Grade(True, "B"), Grade(False, "x")]
    assert calls == [(["5 apples", "B", "x"], ["5", "B", "y"], ["math", "choice", "math"], 2.0)]
    with pytest.raises(ValueError, match="first_char"):
        grade_many(["yes"], ["yes"], "boolean", grader="first_char")


def test_options_go_only_to_graders_that_take_them(registry):
    seen = {}

    @register_grader("with_workers", scored=False)
    def with_workers(responses, golds, answer_types, timeout_s, *, max_workers=1):
        seen["max_workers"] = max_workers
        return [Grade(True, None) for _ in responses]

    grade_many(["a"], ["a"], "math", max_workers=3, rel_tol=0.5, grader="with_workers")
    assert seen == {"max_workers": 3}
    with pytest.raises(ValueError, match="unknown options"):
        register_grader("bad_option", scored=False)(
            lambda responses, golds, answer_types, timeout_s, *, seed=0: [])


def test_duplicate_registration_is_refused(registry):
    with pytest.raises(ValueError, match="'verify' is already registered"):
        register_grader("verify", scored=False)(lambda *args: [])
    with pytest.raises(ValueError, match="unknown answer types"):
        register_grader("odd", scored=False, answer_types=("essay",))


def test_scored_flag_is_enforced(registry):
    @register_grader("forgets_score", scored=True)
    def forgets_score(responses, golds, answer_types, timeout_s):
        return [Grade(True, None) for _ in responses]

    @register_grader("sneaks_score", scored=False)
    def sneaks_score(responses, golds, answer_types, timeout_s):
        return [Grade(True, None, score=2.0) for _ in responses]

    @register_grader("drops_one", scored=False)
    def drops_one(responses, golds, answer_types, timeout_s):
        return []

    with pytest.raises(ValueError, match="'forgets_score' is registered with scored=True"):
        grade_many(["a"], ["a"], "math", grader="forgets_score")
    with pytest.raises(ValueError, match="'sneaks_score' is registered with scored=False"):
        grade_many(["a"], ["a"], "math", grader="sneaks_score")
    with pytest.raises(ValueError, match="'drops_one' must return one Grade per response"):
        grade_many(["a"], ["a"], "math", grader="drops_one")


def test_math_dapo_through_grade_many():
    responses = ["Answer: 5", "\\boxed{5}", "Answer: 1,000", "Answer: 5.", None, b"Answer: 7"]
    golds = ["5", "5", "1000", "5", "5", "7"]
    assert grade_many(responses, golds, "math", grader="math_dapo") == [
        Grade(True, "5", None, 1.0),
        Grade(False, INVALID, None, -1.0),
        Grade(True, "1000", None, 1.0),
        Grade(False, "5.", None, -1.0),
        Grade(False, INVALID, None, -1.0),  # None reads as "", bytes are decoded
        Grade(True, "7", None, 1.0),
    ]
    assert grade("Answer: 5", "5", "math", grader="math_dapo") == Grade(True, "5", None, 1.0)
    with pytest.raises(ValueError, match="grader 'math_dapo' reads answer types"):
        grade_many(["Answer: B"], ["B"], "choice", grader="math_dapo")


def test_one_grader_per_response():
    grades = grade_many(["\\boxed{5}", "\\boxed{5}", "Answer: 5"], ["5", "5", "5"], "math",
                        grader=["verify", "math_dapo", "math_dapo"])
    assert grades == [Grade(True, "5"), Grade(False, INVALID, None, -1.0),
                      Grade(True, "5", None, 1.0)]
    with pytest.raises(ValueError, match="1 graders"):
        grade_many(["a", "b"], ["a", "b"], "math", grader=["verify"])


def test_verify_is_the_unchanged_default():
    responses = ["#### 3", "\\boxed{\\frac{1}{2}}", "no answer", "\\boxed{B}"]
    golds, types = ["3", "0.5", "5", "B"], ["math", "math", "math", "choice"]
    expected = [Grade(True, "3"), Grade(True, "\\frac{1}{2}"), Grade(False, None, "no_answer"),
                Grade(True, "B")]
    assert grade_many(responses, golds, types) == expected
    assert grade_many(responses, golds, types, grader="verify") == expected
    assert verify_many(responses, golds, types) == expected
    assert all(g.score is None for g in expected)


def test_the_grader_registry_imports_without_torch():
    code = ("import sys; import stages.core.reward.registry as r; "
            "assert 'torch' not in sys.modules and 'sympy' not in sys.modules; print(sorted(r.GRADERS))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "['math_dapo', 'verify']"
