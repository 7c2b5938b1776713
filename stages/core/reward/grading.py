"""Rewards and grading (METHODS §5): extract a final answer from a response and judge it.

Public entry points: :func:`is_correct` (a bool), :func:`grade` (a :class:`Grade` with the
extracted answer and the reason for a failure) and :func:`grade_many` (a batch). grade_many runs
the grader named by its ``grader`` argument from the registry of stages/core/reward/rewards.py; the
default, "verify", is the grading this docstring describes (:func:`verify_many`), and the other
built-in, "math_dapo", is verl's DAPO reward.

Extraction rules (:func:`extract_answer`)
-----------------------------------------
- ``math``: the content of the last ``\\boxed{...}`` or ``\\fbox{...}`` (nested braces; also
  ``\\boxed 5``). Only the last one is considered: if it is empty or its braces never close, the
  fallbacks are used: the text after the last "answer:" / "answer is" (to the end of its line),
  then the text after the last ``####``. Of that line the final value is taken: its last
  ``$...$`` (with the formulas before it that only commas, "and" or "or" separate from it), or a
  number stated after it ("The largest $n$ is 34." gives 34), else the line itself. There is
  deliberately no last-number fallback over the whole response: it would reward answers the model
  never committed to.
- ``choice``: one capital letter A–J, from the first rule that gives one: (1) the last boxed
  content, (2) the text after the last "answer:" / "answer is" (``**Answer:** (B)``, "the answer
  is option C"), (3) the last non-empty line when it is a lone option ("B", "(B)", "B.") or
  starts with "B. " / "B) ", (4) the last "(B)" anywhere. Lower-case letters are never taken
  ("a" is a word).
- ``boolean``: "yes"/"no" from the boxed content, then the answer marker, then the last
  standalone yes/no/true/false word of the response; true maps to yes, false to no.

Math equivalence (:func:`grade`)
--------------------------------
Gold and answer are normalised (``$`` signs, ``\\left``/``\\right``, ``\\dfrac``, LaTeX
spacing but never the row break ``\\\\``, a trailing period). A gold with several top-level
comma-separated answers ("1, 2", "(1,2),(3,4)"; but "1,234" is one number) needs a one-to-one,
order-free match with the answer's parts (the answer may use commas, semicolons, "and"/"or",
or wrap them in ``\\{ \\}``). Each pair is then compared by, in order: canonical string
equality; numbers, when both sides read as a number (integers, decimals, ``1,234`` /
``10,\\!080`` thousands separators, ``025``, ``27.0``, ``1.2e-8``, ``1.2\\times10^{-8}``,
``\\frac{a}{b}``, ``a/b``, with ``\\$``, ``\\%``, degree signs, a leading ``x =`` and trailing
units such as ``\\text{ cm}`` or " meters" removed); tuples of numbers; and finally math-verify
(symbolic equality of expressions, intervals, sets, equations). Numbers compare exactly as
rationals, except that when either side is written as a decimal or in scientific notation a
relative tolerance ``rel_tol`` applies (default 1e-4, as in the Qwen2.5-Math grader; Minerva's
rounded decimals need it); so integers never match a neighbouring integer. The symbolic path
applies the same rule to numeric expressions (``\\sqrt{2}`` vs ``1.4142``).

Hard time limit
---------------
math-verify's own timeouts use ``signal.alarm``, which fails outside the main thread, so they are
switched off and the symbolic comparison runs in a persistent worker process (a fresh
interpreter that imports math-verify once). The caller waits at most ``timeout_s`` per
comparison; a worker that overruns is killed and replaced, and the answer is graded incorrect
with ``error="timeout"``. Numeric and string comparisons never leave the calling process. Workers
are shared by all threads (at most one comparison per CPU at once), their address space and CPU
time are capped, and their verdicts are cached. Starting a worker (~2 s: first use, and in the
background after each timeout) is not counted in ``timeout_s``. Work in the calling process is
linear in the response length (only the last box is scanned, answers over MAX_ANSWER_CHARS are
refused, no pattern can backtrack). Nothing about a response makes grading raise; only bad
arguments do (an unknown answer type, batch lengths that differ).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

from stages.core.common.answers import ANSWER_TYPES, LETTERS

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 5.0
DEFAULT_REL_TOL = 1e-4
MAX_ANSWER_CHARS = 1_000  # no benchmark answer is near this; longer ones are never parsed
WORKER_START_TIMEOUT_S = 120.0  # a worker imports sympy (~2 s); not counted in timeout_s
WORKER_MEMORY_HEADROOM = 2 << 30  # bytes of address space a worker may add to its start size
_CACHE_SIZE = 100_000


@dataclass(frozen=True)
class Grade:
    """The verdict on one response.

    ``error`` is None when the answer was compared (right or wrong), else why it could not be:
    "no_answer", "answer_too_long", "timeout", "bad_gold: ...", "parse_error: ...",
    "worker_error: ..." or "internal_error: ...". A response with an error is never correct.
    ``score`` is the grader's own reward when its grader is scored (math_dapo: ±1.0), else None
    (the caller maps ``correct`` to a reward).
    """

    correct: bool
    extracted: str | None
    error: str | None = None
    score: float | None = None


# ---------------------------------------------------------------------------------------------
# Extraction
# ---------------------------------------------------------------------------------------------
_BOX_COMMANDS = ("\\boxed", "\\fbox")
_ANSWER_MARKER = re.compile(r"answer\s*(?:is\s*:?|:)", re.IGNORECASE)
# "$...$" (an escaped "\$" inside is a dollar sign, as in "$\$18.90$") or "\(...\)"
_INLINE_MATH = re.compile(r"(?<!\\)\$+((?:\\.|[^$\\])+)\$+|\\\((.+?)\\\)")
_BOOL_WORD = re.compile(r"\b(yes|no|true|false)\b", re.IGNORECASE)
_PAREN_LETTER = re.compile(rf"\(([{LETTERS}])\)")
_LEADING_LETTER = re.compile(
    rf"^(?:(?:option|choice)\s*)?\(?([{LETTERS}])(?:$|[).:,\s])", re.IGNORECASE
)
# a final line that is only an option: "B", "(B)", "B.", or the option written out: "B. bank"
_OPTION_LINE = re.compile(rf"^\(?([{LETTERS}])\)?[.:)]?$|^([{LETTERS}])[.)]\s")
_TEXT_WRAPPER = re.compile(
    r"\\(?:text|textbf|textrm|mathrm|mathbf|mbox|operatorname)\s*\{([^{}]*)\}"
)


def _braced(text: str, open_index: int) -> str | None:
    """Content of the brace group opening at `open_index`, or None if it never closes."""
    depth = 0
    for match in re.finditer(r"[{}]", text[open_index:]):
        depth += 1 if match.group() == "{" else -1
        if depth == 0:
            return text[open_index + 1 : open_index + match.start()]
    return None


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed``/``\\fbox`` of `text` (None if absent, empty or unclosed)."""
    start, command = max((text.rfind(c), c) for c in _BOX_COMMANDS)
    if start < 0:
        return None
    i = start + len(command)
    j = i
    while j < len(text) and text[j].isspace():
        j += 1
    if j < len(text) and text[j] == "{":
        content = _braced(text, j)
    elif j > i:  # "\boxed 5": the argument is the next token
        content = re.match(r"[^\s$]*", text[j : j + MAX_ANSWER_CHARS + 1]).group()
    else:  # another macro such as \boxedanswer
        content = None
    return (content.strip() or None) if content is not None else None


def _line_from(text: str, start: int) -> str:
    """The rest of the line from `start`, at most a few answers long (keeps regexes linear)."""
    return text[start : start + 4 * MAX_ANSWER_CHARS].split("\n", 1)[0]


# between two formulas of one answer: "$1$, $2$ and $3$", "$x=1$ or $x=-1$"
_SPAN_JOINER = re.compile(r"\s*(?:[,;]\s*)?(?:(?:and|or)\s+)?", re.IGNORECASE)
# a number stated at the end of a line, maybe with a unit: "is 34.", "= 12 cm", "equals 1,234"
_STATED_NUMBER = (r"([-+]?\d[\d,]*(?:\.\d+)?(?:\s*%|(?:\s+(?!(?:and|or)\b)[A-Za-z]+){0,3}))"
                  r"\s*[.!]?\s*$")
_TAIL_VALUE = re.compile(rf"\s*(?:is|are|was|equals|equal\s+to|=)\s*{_STATED_NUMBER}", re.I)
_PROSE_VALUE = re.compile(rf"\s(?:is|are|was|equals|equal\s+to)\s+{_STATED_NUMBER}", re.I)


def _clean_inline(text: str) -> str:
    """The final value of one line of prose ("Final Answer: The largest $n$ is 34." -> "34").

    With formulas: the last one, together with the formulas before it that only commas, "and"
    or "or" separate from it ("$1$ and $-1$" -> "1, -1"); but a number stated after the last
    formula wins ("$n$ is 34", "$x$ = 5"). Without formulas: a number stated at the line's end
    after "is"/"are"/"equals" ("the largest n is 34"), else the whole line.
    """
    text = text.replace("**", "").strip()
    spans = list(_INLINE_MATH.finditer(text))
    if spans:
        run = [spans[-1]]
        for previous in reversed(spans[:-1]):
            if not _SPAN_JOINER.fullmatch(text, previous.end(), run[0].start()):
                break
            run.insert(0, previous)
        value = ", ".join((m.group(1) or m.group(2)).strip() for m in run)
        if stated := _TAIL_VALUE.match(text, spans[-1].end()):
            value = stated.group(1)
    else:
        stated = _PROSE_VALUE.search(text)
        value = stated.group(1) if stated else text
    return value.strip().rstrip(". ").strip()


def _last_match(pattern: re.Pattern, text: str) -> re.Match | None:
    last = deque(pattern.finditer(text), maxlen=1)  # linear, unlike a greedy ".*" prefix
    return last[0] if last else None


def _after_answer_marker(text: str) -> str | None:
    """The rest of the line after the last "answer:" / "answer is", cleaned."""
    last = _last_match(_ANSWER_MARKER, text)
    if last is None:
        return None
    rest = _line_from(text, last.end()).strip()
    rest = re.sub(r"I hope it is correct\.?$", "", rest)  # the Minerva answer template
    return _clean_inline(rest) or None


def _after_hashes(text: str) -> str | None:
    """The rest of the line after the last ``####`` (GSM8K and our arithmetic data)."""
    start = text.rfind("####")
    if start < 0:
        return None
    return _clean_inline(_line_from(text, start + 4)) or None


def _extract_math(text: str) -> str | None:
    return last_boxed(text) or _after_answer_marker(text) or _after_hashes(text)


def _leading_letter(text: str) -> str | None:
    """The option letter that `text` starts with ("B", "(B)", "B. bank", "option B")."""
    text = _TEXT_WRAPPER.sub(r"\1", text).replace("*", "").replace("$", "").strip()
    match = _LEADING_LETTER.match(text)
    if match is None or not match.group(1).isupper():
        return None
    return match.group(1)


def _extract_choice(text: str) -> str | None:
    boxed = last_boxed(text)
    if boxed and (letter := _leading_letter(boxed)):
        return letter
    marker = _after_answer_marker(text)
    if marker and (letter := _leading_letter(marker)):
        return letter
    last_line = text.rstrip().rsplit("\n", 1)[-1][:MAX_ANSWER_CHARS]
    option = _OPTION_LINE.match(last_line.replace("*", "").strip())
    if option:
        return option.group(1) or option.group(2)
    found = _last_match(_PAREN_LETTER, text)
    return found.group(1) if found else None


def _yes_no(word: str) -> str:
    return "yes" if word.lower() in ("yes", "true") else "no"


def _extract_boolean(text: str) -> str | None:
    for candidate in (last_boxed(text), _after_answer_marker(text)):
        if candidate:
            match = _BOOL_WORD.search(_TEXT_WRAPPER.sub(r"\1", candidate))
            if match:
                return _yes_no(match.group(1))
    word = _last_match(_BOOL_WORD, text)
    return _yes_no(word.group(1)) if word else None


_EXTRACTORS: dict[str, Callable[[str], str | None]] = {
    "math": _extract_math,
    "choice": _extract_choice,
    "boolean": _extract_boolean,
}


def extract_answer(response: str, answer_type: str) -> str | None:
    """The final answer of `response` by the rules of the module docstring, or None.

    ``math`` gives the raw answer text, ``choice`` a capital letter, ``boolean`` "yes"/"no".
    """
    _check_answer_type(answer_type)
    return _EXTRACTORS[answer_type](_as_text(response))


# ---------------------------------------------------------------------------------------------
# Normalisation and the fast (in-process) comparisons
# ---------------------------------------------------------------------------------------------
_UNESCAPED_DOLLAR = re.compile(r"(?<!\\)\$")
_LEFT_RIGHT = re.compile(r"\\(?:left|right)(?![A-Za-z])|\\displaystyle")
# LaTeX spacing. The row break \\ is one token, matched first: read character by character,
# the "\\ 3" of a matrix held a control space "\ " and lost its row break (two rows became one)
_SPACING = re.compile(r"\\\\|\\!\s*|\\[,;: ]|~")


def _spacing(match: re.Match) -> str:
    """A row break stays; a negative thin space goes; any other spacing becomes one space."""
    token = match.group()
    return token if token == "\\\\" else "" if token.startswith("\\!") else " "


_NUM = r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)"
_PLAIN = re.compile(rf"{_NUM}(?:[eE][+-]?\d+)?")
_THOUSANDS = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_TIMES_TEN = re.compile(
    rf"({_NUM})\s*(?:\\times|\\cdot|×|\*)\s*10\s*\^\s*(?:\{{\s*([+-]?\d+)\s*\}}|(\d))"
)
_POWER_OF_TEN = re.compile(r"([+-]?)10\s*\^\s*(?:\{\s*([+-]?\d+)\s*\}|(\d))")
_ARG = r"(?:\{\s*([+-]?\d+)\s*\}|(\d))"
_FRAC = re.compile(rf"([+-]?)\\frac\s*{_ARG}\s*{_ARG}")
_SLASH = re.compile(r"([+-]?\d+)\s*/\s*([+-]?\d+)")
_DECORATIONS = re.compile(r"\\\$|\\%|%|\^\s*\{?\s*\\circ\s*\}?|\\circ|°|\\approx")
_LEADING_VARIABLE = re.compile(r"^[A-Za-z](?:_\{?\w+\}?)?\s*=\s*")
_UNIT_GROUP = re.compile(
    r"\s*(?:/\s*)?\\(?:text|textrm|mathrm|mbox|rm)\s*\{[^{}]*\}(?:\s*\^\s*\{?-?\d\}?)?$"
)
# two or more letters after a space, so "2 x" is never read as 2 with a unit; every repetition
# starts with a separator, so the pattern cannot backtrack exponentially
_UNIT_WORDS = re.compile(r"\s+[A-Za-z]{2,}(?:(?:\s+|\s*[/^.]\s*)[A-Za-z0-9]+)*\.?$")
_MAX_UNIT_GROUPS = 4
_MAX_NUMBER_CHARS = 400  # longer answers are not plain numbers; they go to the worker
_MAX_EXPONENT = 400  # 10^400 is far beyond any answer; larger exponents go to the worker


def normalise(answer: str) -> str:
    """LaTeX clean-up that never changes the value: $ signs, \\left/\\right, spacing, \\dfrac."""
    s = answer.strip()
    boxed = last_boxed(s) if s.startswith(_BOX_COMMANDS) else None
    s = boxed if boxed is not None else s
    s = _UNESCAPED_DOLLAR.sub("", s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = _LEFT_RIGHT.sub("", s)
    s = _SPACING.sub(_spacing, s).replace("{,}", ",")  # "11,\\! 111" is 11111
    return s.strip().rstrip(".").strip()


def _canonical(answer: str) -> str:
    """The form for string equality: no spaces, text macros unwrapped, words case-folded."""
    s = re.sub(r"\s+", "", _TEXT_WRAPPER.sub(r"\1", normalise(answer)))
    s = re.sub(r"^\(([A-Za-z])\)$", r"\1", s)  # "(C)" is the option C
    return s.casefold() if s.isalpha() else s


def _strip_units(s: str) -> str:
    """`s` without trailing unit groups ("5\\text{ cm}^2", "5 meters"), if a digit stays."""
    for pattern in (_UNIT_GROUP, _UNIT_WORDS):
        for _ in range(_MAX_UNIT_GROUPS):
            shorter = pattern.sub("", s).rstrip()
            if shorter == s or not shorter or not (shorter[-1].isdigit() or shorter[-1] == "}"):
                break
            s = shorter
    return s


def _exact_number(s: str) -> tuple[Fraction, bool] | None:
    """(value, inexact) if all of `s` is one number; inexact: a decimal or in e-notation."""
    if _PLAIN.fullmatch(s) or _THOUSANDS.fullmatch(s):
        digits = s.replace(",", "")
        inexact = "." in digits or "e" in digits.lower()
        exponent = re.search(r"[eE]([+-]?\d+)", digits)
        if exponent and abs(int(exponent.group(1))) > _MAX_EXPONENT:
            return None
        return Fraction(digits), inexact
    if m := _TIMES_TEN.fullmatch(s):
        exponent = int(m.group(2) or m.group(3))
        if abs(exponent) > _MAX_EXPONENT:
            return None
        return Fraction(m.group(1)) * Fraction(10) ** exponent, True
    if m := _POWER_OF_TEN.fullmatch(s):
        exponent = int(m.group(2) or m.group(3))
        if abs(exponent) > _MAX_EXPONENT:
            return None
        return (-1 if m.group(1) == "-" else 1) * Fraction(10) ** exponent, False
    if m := _FRAC.fullmatch(s):
        numerator, denominator = int(m.group(2) or m.group(3)), int(m.group(4) or m.group(5))
        sign = -1 if m.group(1) == "-" else 1
        return (sign * Fraction(numerator, denominator), False) if denominator else None
    if m := _SLASH.fullmatch(s):
        numerator, denominator = int(m.group(1)), int(m.group(2))
        return (Fraction(numerator, denominator), False) if denominator else None
    return None


def as_number(answer: str) -> tuple[Fraction, bool] | None:
    """The number an answer states, as (exact value, written inexactly), or None if not one.

    Removes ``\\$``, ``\\%``, degree signs, a leading ``x =`` and trailing units first.
    """
    if len(answer) > _MAX_NUMBER_CHARS:
        return None
    s = _DECORATIONS.sub("", normalise(answer)).strip()
    if s.count("=") == 1:
        s = _LEADING_VARIABLE.sub("", s)
    for candidate in (s, _strip_units(s)):
        try:
            number = _exact_number(candidate.strip())
        except (ValueError, ZeroDivisionError, OverflowError):
            number = None
        if number is not None:
            return number
    return None


def numbers_equal(a: tuple[Fraction, bool], b: tuple[Fraction, bool], rel_tol: float) -> bool:
    """Exact rational equality; relative tolerance only when either side was written inexactly."""
    (x, x_inexact), (y, y_inexact) = a, b
    if x == y:
        return True
    if not (x_inexact or y_inexact) or rel_tol <= 0:
        return False
    return abs(x - y) <= Fraction(rel_tol) * max(abs(x), abs(y))


_OPEN, _CLOSE = "([{", ")]}"


def split_top_level(answer: str) -> list[str]:
    """Split at commas and semicolons outside any bracket: "(1,2), 3" -> ["(1,2)", "3"].

    A number with thousands separators ("1,234") stays whole. Brackets of any kind count, so a
    half-open interval "[0, 1)" stays whole too.
    """
    s = normalise(answer)
    if as_number(s) is not None:
        return [s]
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(s):
        if ch in _OPEN:
            depth += 1
        elif ch in _CLOSE:
            depth -= 1
        elif ch in ",;" and depth == 0:
            parts.append(s[start:i])
            start = i + 1
    parts.append(s[start:])
    return [p.strip() for p in parts if p.strip()]


_ANSWER_JOINERS = re.compile(r"\\text\s*\{\s*(?:and|or)\s*\}|\s(?:and|or)\s|\\quad|\\qquad")


def _answer_parts(answer: str) -> list[str]:
    """The parts of an answer to a multi-answer question: joined by ,/;/and/or, maybe in \\{ \\}."""
    s = normalise(answer)
    if s.startswith("\\{") and s.endswith("\\}"):
        s = s[2:-2]
    return split_top_level(_ANSWER_JOINERS.sub(",", s))


def _numeric_tuple(answer: str) -> tuple[str, list[tuple[Fraction, bool]]] | None:
    """("()"-style brackets, numbers) for a bracketed list of plain numbers such as "(1, -2)"."""
    s = normalise(answer)
    if len(s) < 2 or s[0] not in "([" or s[-1] not in ")]":
        return None
    numbers = [as_number(p) for p in s[1:-1].split(",")]
    if any(n is None for n in numbers):
        return None
    return s[0] + s[-1], numbers


def fast_equal(answer: str, gold: str, rel_tol: float) -> bool | None:
    """Verdict on one answer part without math-verify, or None when symbolic work is needed."""
    if _canonical(answer) == _canonical(gold):
        return True
    a, g = as_number(answer), as_number(gold)
    if a is not None and g is not None:
        return numbers_equal(a, g, rel_tol)
    ta, tg = _numeric_tuple(answer), _numeric_tuple(gold)
    if ta is not None and tg is not None:
        if len(ta[1]) != len(tg[1]) or any(
            not numbers_equal(x, y, rel_tol) for x, y in zip(ta[1], tg[1], strict=True)
        ):
            return False
        return True if ta[0] == tg[0] else None
    return None


def _perfect_matching(n: int, edge: Callable[[int, int], bool]) -> bool:
    """Whether n golds can each take a different one of n answers along edges (Kuhn's algorithm)."""
    owner: list[int | None] = [None] * n  # answer j -> gold

    def augment(g: int, seen: set[int]) -> bool:
        for j in range(n):
            if j not in seen and edge(g, j):
                seen.add(j)
                if owner[j] is None or augment(owner[j], seen):
                    owner[j] = g
                    return True
        return False

    return all(augment(g, set()) for g in range(n))


def fast_verdict(answer: str, gold: str, rel_tol: float) -> bool | None:
    """Verdict on a whole answer from string and numeric checks alone, or None to go symbolic."""
    golds = split_top_level(gold)
    if len(golds) == 1:
        return fast_equal(answer, gold, rel_tol)
    answers = _answer_parts(answer)
    if len(answers) != len(golds):
        return None  # "x = \pm 1" for "1, -1": math-verify reads both as sets
    table = [[fast_equal(a, g, rel_tol) for a in answers] for g in golds]
    if _perfect_matching(len(golds), lambda g, j: table[g][j] is True):
        return True
    if not _perfect_matching(len(golds), lambda g, j: table[g][j] is not False):
        return False
    return None


# ---------------------------------------------------------------------------------------------
# Symbolic comparison (runs in the worker process only)
# ---------------------------------------------------------------------------------------------
_E_NOTATION = re.compile(r"(?<![\w\\.])(\d+(?:\.\d+)?)[eE]([+-]?\d+)(?![\w.])")


def _latex_input(answer: str) -> str:
    """An answer as math-verify input; "1.2e-8" rewritten, as math-verify reads e as Euler's e."""
    return "$" + _E_NOTATION.sub(r"\1\\times10^{\2}", normalise(answer)) + "$"


def _has_decimal(expr) -> bool:
    import sympy

    return isinstance(expr, sympy.Basic) and bool(expr.atoms(sympy.Float))


def _close_numbers(gold, answer, rel_tol: float) -> bool:
    """Relative-tolerance check of two parsed numeric expressions when either holds a decimal."""
    import sympy

    if rel_tol <= 0 or not (_has_decimal(gold) or _has_decimal(answer)):
        return False
    if not all(isinstance(e, sympy.Expr) and e.is_number for e in (gold, answer)):
        return False
    try:
        x, y = complex(sympy.N(gold, 20)), complex(sympy.N(answer, 20))
    except (TypeError, ValueError, OverflowError):  # e.g. oo, or a value too large for a float
        return False
    return abs(x - y) <= rel_tol * max(abs(x), abs(y))


def symbolic_equal(answer: str, gold: str, rel_tol: float) -> tuple[bool, str | None]:
    """math-verify equality of one answer part with one gold part, its timeouts switched off."""
    from math_verify import parse, verify

    gold_parsed = parse(_latex_input(gold), parsing_timeout=None)
    if not gold_parsed:
        return False, "parse_error: gold not parsed"
    answer_parsed = parse(_latex_input(answer), parsing_timeout=None)
    if verify(gold_parsed, answer_parsed, timeout_seconds=None):
        return True, None
    if all(isinstance(a, str) for a in answer_parsed):  # only math-verify's raw-text fallback
        return False, "parse_error: answer not parsed"
    return _close_numbers(gold_parsed[0], answer_parsed[0], rel_tol), None


def full_verdict(answer: str, gold: str, rel_tol: float) -> tuple[bool, str | None]:
    """The complete comparison: fast checks first, math-verify for whatever they leave open."""
    fast = fast_verdict(answer, gold, rel_tol)
    if fast is not None:
        return fast, None
    golds, answers = split_top_level(gold), _answer_parts(answer)
    if len(golds) == 1 or len(golds) != len(answers):
        return symbolic_equal(answer, gold, rel_tol)
    cache: dict[tuple[int, int], bool] = {}

    def edge(g: int, j: int) -> bool:
        if (g, j) not in cache:
            quick = fast_equal(answers[j], golds[g], rel_tol)
            if quick is None:
                quick = symbolic_equal(answers[j], golds[g], rel_tol)[0]
            cache[g, j] = quick
        return cache[g, j]

    return _perfect_matching(len(golds), edge), None


# ---------------------------------------------------------------------------------------------
# Worker processes
# ---------------------------------------------------------------------------------------------
class _WorkerDied(RuntimeError):
    pass


class _Overrun(Exception):
    """A comparison passed its deadline (not TimeoutError: that is an OSError)."""


def _limit_resources() -> None:
    """Cap the worker's address space, so a runaway evaluation fails with MemoryError."""
    with contextlib.suppress(ImportError, OSError, StopIteration, ValueError):
        import resource

        with open("/proc/self/status") as status:
            size_kb = next(int(line.split()[1]) for line in status if line.startswith("VmSize"))
        limit = size_kb * 1024 + WORKER_MEMORY_HEADROOM
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        if hard == resource.RLIM_INFINITY or hard > limit:
            resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def _limit_cpu(timeout_s: float) -> None:
    """Let the kernel end this job (SIGXCPU) a second after its deadline.

    The parent kills an overrunning worker itself; this second limit matters when the parent
    died mid-job, so an orphaned worker cannot spin on a huge power forever. Only the soft limit
    moves, because an unprivileged process cannot raise a hard limit again.
    """
    with contextlib.suppress(ImportError, OSError, ValueError):
        import resource

        usage = resource.getrusage(resource.RUSAGE_SELF)
        used = usage.ru_utime + usage.ru_stime
        _, hard = resource.getrlimit(resource.RLIMIT_CPU)
        soft = int(used + timeout_s) + 2
        if hard == resource.RLIM_INFINITY or soft < hard:
            resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))


def _worker_main(fd: int) -> None:
    """Serve (job, answer, gold, rel_tol, timeout_s) requests on socket `fd` until it closes."""
    from multiprocessing.connection import Connection

    logging.getLogger("math_verify").setLevel(logging.CRITICAL)  # "timeout disabled" warnings
    import math_verify  # noqa: F401 - imported before "ready", so no deadline pays for it

    _limit_resources()
    conn = Connection(fd)
    conn.send("ready")
    while True:
        try:
            job, answer, gold, rel_tol, timeout_s = conn.recv()
        except (EOFError, OSError):
            return
        _limit_cpu(timeout_s)
        try:
            verdict, error = full_verdict(answer, gold, rel_tol)
        except BaseException as exc:  # MemoryError, RecursionError, sympy internals
            verdict, error = False, f"worker_error: {type(exc).__name__}: {exc}"[:200]
        conn.send((job, bool(verdict), error))


_WORKER_COMMAND = (
    "import sys; from stages.core.reward.grading import _worker_main; _worker_main(int(sys.argv[1]))"
)


class _Worker:
    """One worker process and its socket.

    A fresh interpreter (``python -c``), not a multiprocessing child: fork is unsafe in the
    threaded callers we serve, and spawn/forkserver re-import the caller's ``__main__``, which
    re-runs any unguarded script. Starting does not block; :meth:`compare` waits for the worker
    to be ready before its deadline starts.
    """

    def __init__(self) -> None:
        from multiprocessing.connection import Connection

        ours, theirs = socket.socketpair()
        package_root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-c", _WORKER_COMMAND, str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,  # the socket is the only channel
                env=env,
                start_new_session=True,  # Ctrl-C goes to the caller, which stops its workers
            )
        finally:
            theirs.close()
        self._conn = Connection(ours.detach())
        self._ready = False
        self._job = 0

    def _wait_ready(self) -> None:
        if not self._conn.poll(WORKER_START_TIMEOUT_S):
            raise _WorkerDied(f"not ready within {WORKER_START_TIMEOUT_S:.0f} s")
        self._conn.recv()
        self._ready = True

    def compare(self, answer: str, gold: str, rel_tol: float, timeout_s: float):
        """(verdict, error) from the worker; raises _Overrun or _WorkerDied."""
        try:
            if not self._ready:
                self._wait_ready()
            self._job += 1
            self._conn.send((self._job, answer, gold, rel_tol, timeout_s))
            deadline = time.monotonic() + timeout_s
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self._conn.poll(remaining):
                    raise _Overrun
                job, verdict, error = self._conn.recv()
                if job == self._job:
                    return verdict, error
        except (EOFError, OSError) as exc:
            raise _WorkerDied(f"exited ({exc!r}, return code {self._process.poll()})") from exc

    def alive(self) -> bool:
        return self._process.poll() is None

    def kill(self) -> None:
        with contextlib.suppress(Exception):
            self._conn.close()
        with contextlib.suppress(Exception):
            self._process.kill()
            self._process.wait(timeout=5)


class _Pool:
    """Workers shared by every thread of one process; at most `size` comparisons at once.

    A worker that overruns is killed and a replacement is started at once, so that the next
    comparison does not wait for a whole interpreter start.
    """

    def __init__(self, size: int) -> None:
        self.pid = os.getpid()
        self._size = size
        self._idle: list[_Worker] = []
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(size)

    def _take(self) -> _Worker:
        with self._lock:
            while self._idle:
                worker = self._idle.pop()
                if worker.alive():
                    return worker
                worker.kill()
        return _Worker()

    def _give(self, worker: _Worker) -> None:
        with self._lock:
            if len(self._idle) < self._size:
                self._idle.append(worker)
                return
        worker.kill()

    def compare(self, answer: str, gold: str, rel_tol: float, timeout_s: float):
        with self._slots:
            try:
                worker = self._take()
            except OSError as exc:
                return False, f"worker_error: cannot start: {exc}"[:200]
            try:
                result = worker.compare(answer, gold, rel_tol, timeout_s)
            except (_Overrun, _WorkerDied) as exc:
                worker.kill()
                with contextlib.suppress(OSError, subprocess.SubprocessError):
                    self._give(_Worker())
                if isinstance(exc, _Overrun):
                    return False, "timeout"
                return False, f"worker_error: {exc}"[:200]
            self._give(worker)
            return result

    def close(self) -> None:
        with self._lock:
            workers, self._idle = self._idle, []
        for worker in workers:
            worker.kill()


_pool: _Pool | None = None
_pool_lock = threading.Lock()
_cache: OrderedDict[tuple[str, str, float], tuple[bool, str | None]] = OrderedDict()
_cache_lock = threading.Lock()


def _shared_pool() -> _Pool:
    global _pool
    with _pool_lock:
        if _pool is None or _pool.pid != os.getpid():  # a forked child must not share pipes
            _pool = _Pool(size=max(1, os.cpu_count() or 1))
        return _pool


def shutdown_workers() -> None:
    """Stop the worker processes (they restart on demand); runs at interpreter exit."""
    with _pool_lock:
        if _pool is not None and _pool.pid == os.getpid():
            _pool.close()


atexit.register(shutdown_workers)


def _compare_in_worker(answer: str, gold: str, rel_tol: float, timeout_s: float):
    key = (answer, gold, rel_tol)
    with _cache_lock:
        if key in _cache:
            _cache.move_to_end(key)
            return _cache[key]
    result = _shared_pool().compare(answer, gold, rel_tol, timeout_s)
    if result[1] is None or result[1].startswith("parse_error"):  # deterministic: keep
        with _cache_lock:
            _cache[key] = result
            if len(_cache) > _CACHE_SIZE:
                _cache.popitem(last=False)
    return result


# ---------------------------------------------------------------------------------------------
# Grading
# ---------------------------------------------------------------------------------------------
def _as_text(value) -> str:
    if value is None:
        return ""
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return value if isinstance(value, str) else str(value)


def _check_answer_type(answer_type: str) -> None:
    if answer_type not in ANSWER_TYPES:
        raise ValueError(f"answer_type must be one of {ANSWER_TYPES}, got {answer_type!r}")


def _gold_letter(gold: str) -> str | None:
    s = gold.strip().strip("().").strip().upper()
    return s if len(s) == 1 and s in LETTERS else None


def _gold_boolean(gold: str) -> str | None:
    s = gold.strip().lower()
    return _yes_no(s) if s in ("yes", "no", "true", "false") else None


@dataclass(frozen=True)
class _Pending:
    """A math answer that the fast checks left open."""

    extracted: str
    gold: str


def _grade_here(response: str, gold: str, answer_type: str, rel_tol: float) -> Grade | _Pending:
    """Everything that can be decided in this process; a _Pending for the worker otherwise."""
    extracted = extract_answer(response, answer_type)
    if answer_type == "choice":
        letter = _gold_letter(gold)
        if letter is None:
            return Grade(False, extracted, f"bad_gold: {gold[:50]!r} is not a letter")
        return Grade(extracted == letter, extracted, None if extracted else "no_answer")
    if answer_type == "boolean":
        truth = _gold_boolean(gold)
        if truth is None:
            return Grade(False, extracted, f"bad_gold: {gold[:50]!r} is not yes/no")
        return Grade(extracted == truth, extracted, None if extracted else "no_answer")
    if not normalise(gold):
        return Grade(False, extracted, "bad_gold: empty")
    if extracted is None:
        return Grade(False, None, "no_answer")
    if len(extracted) > MAX_ANSWER_CHARS:
        return Grade(False, extracted[:MAX_ANSWER_CHARS], "answer_too_long")
    verdict = fast_verdict(extracted, gold, rel_tol)
    if verdict is not None:
        return Grade(verdict, extracted)
    return _Pending(extracted, gold)


def _finish(pending: _Pending, rel_tol: float, timeout_s: float) -> Grade:
    try:
        verdict, error = _compare_in_worker(pending.extracted, pending.gold, rel_tol, timeout_s)
    except Exception as exc:  # a bug must cost one sample, not a training run
        logger.exception("grading failed")
        verdict, error = False, f"internal_error: {type(exc).__name__}: {exc}"[:200]
    return Grade(bool(verdict) and error is None, pending.extracted, error)


def _checked_types(
    responses: Sequence[str], golds: Sequence[str], answer_types: Sequence[str] | str,
    timeout_s: float,
) -> Sequence[str]:
    """`answer_types`, one per response, after checking the batch (ValueError when wrong)."""
    if isinstance(answer_types, str):
        answer_types = [answer_types] * len(responses)
    if not len(responses) == len(golds) == len(answer_types):
        raise ValueError(
            f"lengths differ: {len(responses)} responses, {len(golds)} golds, "
            f"{len(answer_types)} answer types"
        )
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}")
    for answer_type in set(answer_types):
        _check_answer_type(answer_type)
    return answer_types


def verify_many(
    responses: Sequence[str],
    golds: Sequence[str],
    answer_types: Sequence[str] | str,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    *,
    rel_tol: float = DEFAULT_REL_TOL,
    max_workers: int = 1,
) -> list[Grade]:
    """The "verify" grader: grade a batch by this module's rules; `answer_types` may be one type
    for all.

    Each distinct (answer, gold) pair that needs math-verify is compared once, with its own
    `timeout_s`; with `max_workers` > 1 that many comparisons run at once in separate workers.
    """
    answer_types = _checked_types(responses, golds, answer_types, timeout_s)
    results: list[Grade | _Pending] = []
    for response, gold, answer_type in zip(responses, golds, answer_types, strict=True):
        try:
            results.append(_grade_here(_as_text(response), _as_text(gold), answer_type, rel_tol))
        except Exception as exc:  # a bug must cost one sample, not a training run
            logger.exception("grading failed")
            results.append(Grade(False, None, f"internal_error: {type(exc).__name__}: {exc}"[:200]))

    # one comparison per distinct (answer, gold): a group of identical runaway answers must
    # cost one timeout, not one each
    pending = list(dict.fromkeys(r for r in results if isinstance(r, _Pending)))
    if len(pending) > 1 and max_workers > 1:
        with ThreadPoolExecutor(max_workers=max_workers) as executor:
            finished = list(executor.map(lambda p: _finish(p, rel_tol, timeout_s), pending))
    else:
        finished = [_finish(p, rel_tol, timeout_s) for p in pending]
    done = dict(zip(pending, finished, strict=True))
    return [done[r] if isinstance(r, _Pending) else r for r in results]


def grade_many(
    responses: Sequence[str],
    golds: Sequence[str],
    answer_types: Sequence[str] | str,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    *,
    rel_tol: float = DEFAULT_REL_TOL,
    max_workers: int = 1,
    grader: Sequence[str] | str = "verify",
) -> list[Grade]:
    """Grade a batch with the registered `grader` (stages.core.reward.rewards.GRADERS): one name for
    all, or one per response (a pool mixing datasets); `answer_types` may be one type for all.

    `rel_tol` and `max_workers` go to the graders that take them ("verify": see
    :func:`verify_many`). A Grade of a scored grader carries its reward in ``score``. Raises
    ValueError for an unknown grader (naming the registered ones), an answer type the grader
    does not read, batch lengths that differ, or a grader that returns the wrong thing.
    """
    from stages.core.reward.rewards import spec_of  # rewards imports this module at its top

    answer_types = _checked_types(responses, golds, answer_types, timeout_s)
    names = [grader] * len(responses) if isinstance(grader, str) else list(grader)
    if len(names) != len(responses):
        raise ValueError(f"lengths differ: {len(responses)} responses, {len(names)} graders")
    # an unknown name is an error even in an empty batch
    specs = {name: spec_of(name) for name in ([grader] if isinstance(grader, str) else names)}
    batches: dict[str, list[int]] = {}
    for i, name in enumerate(names):
        batches.setdefault(name, []).append(i)
    for name, indices in batches.items():
        if unread := {answer_types[i] for i in indices} - set(specs[name].answer_types):
            raise ValueError(f"grader {name!r} reads answer types {specs[name].answer_types}, "
                             f"got {sorted(unread)}")

    options = {"rel_tol": rel_tol, "max_workers": max_workers}
    grades: list[Grade | None] = [None] * len(responses)
    for name, indices in batches.items():
        spec = specs[name]
        out = spec.fn([responses[i] for i in indices], [golds[i] for i in indices],
                      [answer_types[i] for i in indices], timeout_s,
                      **{key: options[key] for key in spec.options})
        if len(out) != len(indices) or not all(isinstance(g, Grade) for g in out):
            raise ValueError(f"grader {name!r} must return one Grade per response")
        if any((g.score is None) == spec.scored for g in out):
            raise ValueError(f"grader {name!r} is registered with scored={spec.scored}: its "
                             f"Grades must {'all' if spec.scored else 'never'} carry a score")
        for i, g in zip(indices, out, strict=True):
            grades[i] = g
    return grades


def grade(
    response: str,
    gold: str,
    answer_type: str,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    *,
    rel_tol: float = DEFAULT_REL_TOL,
    grader: str = "verify",
) -> Grade:
    """Grade one response against its gold answer with `grader` (by default the rules of the
    module docstring)."""
    return grade_many([response], [gold], [answer_type], timeout_s, rel_tol=rel_tol,
                      grader=grader)[0]


def is_correct(response: str, gold: str, answer_type: str) -> bool:
    """Whether `response` states the gold answer: the reward's public entry point."""
    return grade(response, gold, answer_type).correct
