"""The "math_dapo" grader: verl's DAPO reward (stages/core/reward/scores/math_dapo.py), scored
±1.0, math answers only."""

from __future__ import annotations

from collections.abc import Sequence

from stages.core.reward.grades import Grade, as_text
from stages.core.reward.registry import register_grader
from stages.core.reward.scores.math_dapo import dapo_math


@register_grader("math_dapo", scored=True, answer_types=("math",))
def grade_math_dapo(responses: Sequence[str], golds: Sequence[str], answer_types: Sequence[str],
                    timeout_s: float) -> list[Grade]:
    """verl's math_dapo: ``Grade(correct, extracted, None, score=±1.0)`` (no time limit is
    needed: the work is a few string passes over 300 characters and the gold)."""
    grades = []
    for response, gold in zip(responses, golds, strict=True):
        result = dapo_math(as_text(response), as_text(gold))
        grades.append(Grade(result.correct, result.extracted, None, result.score))
    return grades
