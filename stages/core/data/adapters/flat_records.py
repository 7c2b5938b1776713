"""Any flat dataset described by `fields` alone: the `generic` adapter."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from stages.core.data.adapters.base import (
    AdapterError,
    Fields,
    Keys,
    choice_letter,
    indexed_choice,
    labelled_choices,
    level,
    number_or_latex,
    register_adapter,
    string_list,
    yes_no,
)
from stages.core.data.problems import ANSWER_TYPES, Problem

GENERIC_FIELDS: dict[str, Keys] = {
    "question": "question",
    "answer": "answer",
    "answer_type": (),
    "choices": "choices",
    "solution": "solution",
    "level": "level",
    "subject": "subject",
    "id": "id",
}


def _answer_type(f: Fields) -> str:
    """`fields['answer_type']` names the type itself (math, choice, boolean) or a record key."""
    named = f.fields.get("answer_type", "math")
    kind = named if named in ANSWER_TYPES else f.get("answer_type")
    if kind not in ANSWER_TYPES:
        raise AdapterError(f"answer type {kind!r} is not one of {list(ANSWER_TYPES)}")
    return kind


def _generic_choices(value: Any, key: str) -> tuple[list[str] | None, list[str] | None]:
    """(labels, texts): labels only for a {label, text} block; a plain list is lettered A, B, ..."""
    if value is None:
        return None, None
    if isinstance(value, list) and all(isinstance(c, str) for c in value):
        return None, string_list(value, key)
    return labelled_choices(value, key)


@register_adapter("generic")
def generic(record: dict, index: int, fields: Mapping[str, str], source: str) -> Problem:
    """Any flat dataset described by `fields` alone: question, answer, answer_type, choices, id.

    `answer_type` defaults to math (gold kept as written, numbers canonical); for choice the gold
    may be a label of a {label, text} block, an index or a letter; for boolean a bool or yes/no.
    """
    f = Fields(record, fields, GENERIC_FIELDS)
    kind = _answer_type(f)
    gold, key = f.get("answer"), f.key("answer")
    labels, choices = _generic_choices(f.get("choices", required=False), f.key("choices"))
    if kind == "choice":
        if choices is None:
            raise AdapterError(f"a choice answer needs field {f.key('choices')!r}")
        answer = choice_letter(gold, labels, key) if labels else indexed_choice(gold, len(choices), key)
    elif kind == "boolean":
        answer = yes_no(gold, key)
    else:
        answer = number_or_latex(gold, key)
    subject = f.get("subject", required=False)
    return Problem(
        problem_id=f.problem_id(index),
        source=source,
        question=f.text("question"),
        answer=answer,
        answer_type=kind,
        choices=choices,
        solution=f.text("solution", required=False),
        level=level(f.get("level", required=False)),
        subject=None if subject is None else str(subject),
    )
