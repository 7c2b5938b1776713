"""The public names of the former stages/core/reward/grading.py, gathered from where they now
live, for the old path stages.core.grading (an alias of this module, kept for this release).

The library imports them from their own modules: grades (Grade, the defaults), extraction,
equivalence, workers, graders/verify.py (the "verify" grader) and registry (grade_many, grade,
is_correct).
"""

from stages.core.common.answers import ANSWER_TYPES, LETTERS
from stages.core.reward.equivalence import (
    as_number,
    fast_equal,
    fast_verdict,
    full_verdict,
    normalise,
    numbers_equal,
    split_top_level,
    symbolic_equal,
)
from stages.core.reward.extraction import MAX_ANSWER_CHARS, extract_answer, last_boxed
from stages.core.reward.graders.verify import verify_many
from stages.core.reward.grades import DEFAULT_REL_TOL, DEFAULT_TIMEOUT_S, Grade
from stages.core.reward.registry import grade, grade_many, is_correct
from stages.core.reward.workers import (
    WORKER_MEMORY_HEADROOM,
    WORKER_START_TIMEOUT_S,
    shutdown_workers,
)

__all__ = [
    "ANSWER_TYPES", "DEFAULT_REL_TOL", "DEFAULT_TIMEOUT_S", "Grade", "LETTERS", "MAX_ANSWER_CHARS",
    "WORKER_MEMORY_HEADROOM", "WORKER_START_TIMEOUT_S", "as_number", "extract_answer",
    "fast_equal", "fast_verdict", "full_verdict", "grade", "grade_many", "is_correct",
    "last_boxed", "normalise", "numbers_equal", "shutdown_workers", "split_top_level",
    "symbolic_equal", "verify_many",
]
