"""Yes/no questions: StrategyQA."""

from __future__ import annotations

from collections.abc import Mapping

from stages.core.data.adapters.base import Fields, Keys, register_adapter, yes_no
from stages.core.data.problems import Problem

STRATEGYQA_FIELDS: dict[str, Keys] = {"question": "question", "answer": "answer", "id": "qid"}


@register_adapter("strategyqa")
def strategyqa(record: dict, index: int, fields: Mapping[str, str], source: str) -> Problem:
    """StrategyQA: a boolean gold as "yes"/"no". `facts` and `decomposition` would give the
    reasoning away, so only the question is read."""
    f = Fields(record, fields, STRATEGYQA_FIELDS)
    return Problem(
        problem_id=f.problem_id(index),
        source=source,
        question=f.text("question"),
        answer=yes_no(f.get("answer"), f.key("answer")),
        answer_type="boolean",
    )
