"""Whether an extracted answer equals the gold one (METHODS §5): the "verify" grader's
normalisation, its fast string and numeric checks (in the calling process) and its symbolic
comparison with math-verify (in a worker process only: stages/core/reward/workers.py).

Math equivalence (:func:`full_verdict`)
---------------------------------------
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
"""

from __future__ import annotations

import re
from collections.abc import Callable
from fractions import Fraction

from stages.core.reward.extraction import BOX_COMMANDS, TEXT_WRAPPER, last_boxed

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
    boxed = last_boxed(s) if s.startswith(BOX_COMMANDS) else None
    s = boxed if boxed is not None else s
    s = _UNESCAPED_DOLLAR.sub("", s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = _LEFT_RIGHT.sub("", s)
    s = _SPACING.sub(_spacing, s).replace("{,}", ",")  # "11,\\! 111" is 11111
    return s.strip().rstrip(".").strip()


def _canonical(answer: str) -> str:
    """The form for string equality: no spaces, text macros unwrapped, words case-folded."""
    s = re.sub(r"\s+", "", TEXT_WRAPPER.sub(r"\1", normalise(answer)))
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
