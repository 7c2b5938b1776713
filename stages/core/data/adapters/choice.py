"""Multiple choice, the gold a letter: CommonsenseQA and ARC, MMLU, and GPQA with its fixed
option order."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

from stages.core.data.adapters.base import (
    AdapterError,
    Fields,
    Keys,
    choice_letter,
    indexed_choice,
    labelled_choices,
    nonempty,
    register_adapter,
    string_list,
)
from stages.core.data.problems import LETTERS, Problem

CHOICE_FIELDS: dict[str, Keys] = {
    "question": "question",
    "choices": "choices",
    "answer": "answerKey",
    "id": "id",
}


@register_adapter("csqa")
@register_adapter("arc")
def labelled_choice(record: dict, index: int, fields: Mapping[str, str], source: str) -> Problem:
    """CommonsenseQA and ARC: ``choices {label, text}`` and an `answerKey` label.

    Choices are the texts in label order and the gold is the letter of the keyed choice's position,
    so ARC's numeric labels "1".."4" become "A".."D". The copies in icml_kd carry a teacher model's
    `response`; it is never read.
    """
    f = Fields(record, fields, CHOICE_FIELDS)
    labels, texts = labelled_choices(f.get("choices"), f.key("choices"))
    return Problem(
        problem_id=f.problem_id(index),
        source=source,
        question=f.text("question"),
        answer=choice_letter(f.get("answer"), labels, f.key("answer")),
        answer_type="choice",
        choices=texts,
    )


MMLU_FIELDS: dict[str, Keys] = {
    "question": "question",
    "choices": "choices",
    "answer": "answer",
    "subject": ("subject", "type"),
    "id": "id",
}


@register_adapter("mmlu")
def mmlu(record: dict, index: int, fields: Mapping[str, str], source: str) -> Problem:
    """MMLU: a list of choices and an integer index into it; gold is the index's letter."""
    f = Fields(record, fields, MMLU_FIELDS)
    choices = string_list(f.get("choices"), f.key("choices"))
    subject = f.get("subject", required=False)
    return Problem(
        problem_id=f.problem_id(index),
        source=source,
        question=f.text("question"),
        answer=indexed_choice(f.get("answer"), len(choices), f.key("answer")),
        answer_type="choice",
        choices=choices,
        subject=None if subject is None else str(subject),
    )


GPQA_FIELDS: dict[str, Keys] = {
    "question": "Question",
    "answer": "Correct Answer",
    "incorrect_1": "Incorrect Answer 1",
    "incorrect_2": "Incorrect Answer 2",
    "incorrect_3": "Incorrect Answer 3",
    "solution": "Explanation",
    "subject": "High-level domain",
    "id": "Record ID",
}
GPQA_SHUFFLE_SEED = 0
"""Seed of GPQA's option order (ours: the paper does not give its order)."""


def option_order(problem_id: str, n: int, seed: int = GPQA_SHUFFLE_SEED) -> list[int]:
    """A fixed shuffle of options 0..n-1 for one problem: sorted by sha256("seed:id:k").

    It depends on the problem id and the seed only (not on the file's order or the Python
    version), so every run, rank and machine letters a record's options the same way.
    """
    def key(k: int) -> str:
        return hashlib.sha256(f"{seed}:{problem_id}:{k}".encode()).hexdigest()

    return sorted(range(n), key=key)


@register_adapter("gpqa")
def gpqa(record: dict, index: int, fields: Mapping[str, str], source: str) -> Problem:
    """GPQA (Idavidrein/gpqa): the correct answer and three incorrect ones, shuffled per record.

    The record keeps the correct answer in a column of its own, so the four options (correct
    first, then incorrect 1-3) are put in the order of :func:`option_order` (by the record's
    `Record ID`, else its position) and the gold is the letter the correct answer lands on.
    """
    f = Fields(record, fields, GPQA_FIELDS)
    problem_id = f.problem_id(index)
    correct = f.get("answer")
    if not isinstance(correct, str):
        raise AdapterError(f"field {f.key('answer')!r} must be a string, got {type(correct).__name__}")
    correct = nonempty(correct.strip(), f.key("answer"))
    options = [correct] + [f.text(f"incorrect_{i}") for i in (1, 2, 3)]
    if correct in options[1:]:
        raise AdapterError(f"field {f.key('answer')!r} repeats an incorrect answer: {correct!r}")
    order = option_order(problem_id, len(options))
    subject = f.get("subject", required=False)
    return Problem(
        problem_id=problem_id,
        source=source,
        question=f.text("question"),
        answer=LETTERS[order.index(0)],
        answer_type="choice",
        choices=[options[k] for k in order],
        solution=f.text("solution", required=False),
        subject=None if subject is None else str(subject),
    )
