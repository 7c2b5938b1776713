"""What every grader shares: the :class:`Grade` it gives, the default time limit and tolerance,
reading a response or gold answer as text, and the checks of a batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from stages.core.common.answers import ANSWER_TYPES

DEFAULT_TIMEOUT_S = 5.0
DEFAULT_REL_TOL = 1e-4


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


def as_text(value) -> str:
    """A response or gold answer as text: None is "", bytes are decoded as UTF-8."""
    if value is None:
        return ""
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return value if isinstance(value, str) else str(value)


def check_answer_type(answer_type: str) -> None:
    """ValueError unless `answer_type` is one of ANSWER_TYPES."""
    if answer_type not in ANSWER_TYPES:
        raise ValueError(f"answer_type must be one of {ANSWER_TYPES}, got {answer_type!r}")


def checked_types(
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
        check_answer_type(answer_type)
    return answer_types
