"""MATH-like competition problems with LaTeX answers: MATH, Minerva Math and OlympiadBench."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from stages.core.data.adapters.base import (
    AdapterError,
    Fields,
    Keys,
    last_boxed,
    level,
    nonempty,
    number_or_latex,
    register_adapter,
)
from stages.core.data.problems import Problem

_UNESCAPED_DOLLAR = re.compile(r"(?<!\\)\$")


def _strip_math_delimiters(answer: str) -> str:
    """'$2^{1009}$' -> '2^{1009}'; '$69$,$84$' -> '69,84'; a trailing full stop goes too."""
    return _UNESCAPED_DOLLAR.sub("", answer).strip().rstrip(".").strip()



MATH_FIELDS: dict[str, Keys] = {
    "question": ("problem", "question"),
    "answer": "answer",
    "solution": "solution",
    "level": "level",
    "subject": ("subject", "type"),
    "id": "unique_id",
}
MINERVA_FIELDS: dict[str, Keys] = {
    "question": ("problem", "question"),
    "answer": "answer",
    "solution": "solution",
    "subject": "type",
    "id": "idx",
}


def _math_gold(f: Fields) -> str:
    """The `answer` field if the record has a non-empty one, else the solution's last box."""
    answer = f.get("answer", required=False)
    if answer is not None and not (isinstance(answer, str) and not answer.strip()):
        return number_or_latex(answer, f.key("answer"))
    solution = f.text("solution", required=False)
    if solution is None:
        raise AdapterError(
            f"missing field {f.key('answer')!r} and field {f.key('solution')!r} to take a "
            "\\boxed{} answer from"
        )
    boxed = last_boxed(solution)
    if boxed is None:
        raise AdapterError(f"no \\boxed{{...}} in field {f.key('solution')!r} (and no answer field)")
    # a "$ $" inside the box is typesetting left in the source (one Minerva answer has it)
    return nonempty(_UNESCAPED_DOLLAR.sub("", boxed).strip(), f.key("solution"))


def _math_like(record: dict, index: int, fields: Mapping[str, str], source: str,
               defaults: Mapping[str, Keys]) -> Problem:
    f = Fields(record, fields, defaults)
    subject = f.get("subject", required=False)
    return Problem(
        problem_id=f.problem_id(index),
        source=source,
        question=f.text("question"),
        answer=_math_gold(f),
        answer_type="math",
        solution=f.text("solution", required=False),
        level=level(f.get("level", required=False)),
        subject=None if subject is None else str(subject),
    )


@register_adapter("math")
def math_problem(record: dict, index: int, fields: Mapping[str, str], source: str) -> Problem:
    """MATH (MATH-500, MATH train): gold from `answer`, else the last \\boxed{} of `solution`.

    `level` 3 or "Level 3" becomes "3" ("Level ?" becomes "?"); `subject` falls back to `type`.
    """
    return _math_like(record, index, fields, source, MATH_FIELDS)


@register_adapter("minerva")
def minerva(record: dict, index: int, fields: Mapping[str, str], source: str) -> Problem:
    """Minerva Math (OCW): gold = the last \\boxed{} of `solution` (or `answer` where a copy has it).

    Units after the box ("\\boxed{1.6} \\mathrm{~cm}") stay out of the gold answer.
    """
    return _math_like(record, index, fields, source, MINERVA_FIELDS)


OLYMPIAD_FIELDS: dict[str, Keys] = {
    "question": "question",
    "context": "context",
    "answer": "final_answer",
    "solution": "solution",
    "subject": "subfield",
    "id": "id",
}


def _olympiad_gold(value: Any, key: str) -> str:
    """`final_answer` (a list of '$...$' strings, or one string) -> '$' stripped, joined by ', '."""
    answers = value if isinstance(value, list) else [value]
    if not all(isinstance(a, str | int | float) and not isinstance(a, bool) for a in answers):
        raise AdapterError(f"field {key!r} must be a list of strings")
    parts = [_strip_math_delimiters(str(a)) for a in answers]
    return nonempty(", ".join(p for p in parts if p), key)


@register_adapter("olympiadbench")
def olympiadbench(record: dict, index: int, fields: Mapping[str, str], source: str) -> Problem:
    """OlympiadBench (open-ended, text-only): gold = `final_answer` without '$', joined by ', '.

    The `unit` stays out of both the gold answer and the question: OlympiadBench's own prompt asks
    for the answer without its unit in the box, and Qwen2.5-Math's evaluation compares the bare
    value; the question text states the unit where it matters. A non-empty `context` (shared set-up
    text of some problems) is put before the question.
    """
    f = Fields(record, fields, OLYMPIAD_FIELDS)
    question = f.text("question")
    if context := f.text("context", required=False):
        question = f"{context}\n{question}"
    solution = f.get("solution", required=False)
    if isinstance(solution, list):
        solution = "\n\n".join(str(s) for s in solution)
    subject = f.get("subject", required=False)
    return Problem(
        problem_id=f.problem_id(index),
        source=source,
        question=question,
        answer=_olympiad_gold(f.get("answer"), f.key("answer")),
        answer_type="math",
        solution=solution or None,
        subject=None if subject is None else str(subject),
    )
