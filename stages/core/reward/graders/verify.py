"""The "verify" grader, the default (METHODS §5): our extraction (extraction.py), the fast
string and numeric checks (equivalence.py) and math-verify in a worker process under a hard time
limit (workers.py). Nothing about a response makes it raise; only bad arguments do (an unknown
answer type, batch lengths that differ).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from stages.core.common.answers import LETTERS
from stages.core.reward.equivalence import fast_verdict, normalise
from stages.core.reward.extraction import MAX_ANSWER_CHARS, extract_answer, yes_no
from stages.core.reward.grades import (
    DEFAULT_REL_TOL,
    DEFAULT_TIMEOUT_S,
    Grade,
    as_text,
    checked_types,
)
from stages.core.reward.registry import register_grader
from stages.core.reward.workers import compare_in_worker

logger = logging.getLogger(__name__)


def _gold_letter(gold: str) -> str | None:
    s = gold.strip().strip("().").strip().upper()
    return s if len(s) == 1 and s in LETTERS else None


def _gold_boolean(gold: str) -> str | None:
    s = gold.strip().lower()
    return yes_no(s) if s in ("yes", "no", "true", "false") else None


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
        verdict, error = compare_in_worker(pending.extracted, pending.gold, rel_tol, timeout_s)
    except Exception as exc:  # a bug must cost one sample, not a training run
        logger.exception("grading failed")
        verdict, error = False, f"internal_error: {type(exc).__name__}: {exc}"[:200]
    return Grade(bool(verdict) and error is None, pending.extracted, error)


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
    answer_types = checked_types(responses, golds, answer_types, timeout_s)
    results: list[Grade | _Pending] = []
    for response, gold, answer_type in zip(responses, golds, answer_types, strict=True):
        try:
            results.append(_grade_here(as_text(response), as_text(gold), answer_type, rel_tol))
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


@register_grader("verify", scored=False)
def grade_verify(responses: Sequence[str], golds: Sequence[str], answer_types: Sequence[str],
                 timeout_s: float, *, rel_tol: float = DEFAULT_REL_TOL,
                 max_workers: int = 1) -> list[Grade]:
    """Our extraction and math-verify (this module's docstring)."""
    return verify_many(responses, golds, answer_types, timeout_s, rel_tol=rel_tol,
                       max_workers=max_workers)
