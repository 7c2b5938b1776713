"""The public names of the former stages/core/reward/rewards.py, gathered from where they now
live, for the old path stages.core.rewards (an alias of this module, kept for this release; the
docs show stages.core.rewards.dapo_math).

The library imports them from their own modules: registry (the grader registry), scores/ (the
reward functions, one module each) and graders/ (the built-in graders, one module each).
"""

from stages.core.common.answers import ANSWER_TYPES
from stages.core.reward.graders.math_dapo import grade_math_dapo
from stages.core.reward.graders.verify import grade_verify
from stages.core.reward.grades import DEFAULT_REL_TOL, Grade
from stages.core.reward.registry import (
    GRADERS,
    OPTIONS,
    Grader,
    GraderSpec,
    register_grader,
    spec_of,
)
from stages.core.reward.scores.math_dapo import (
    INVALID,
    STRICT_WINDOW,
    WINDOW,
    DapoScore,
    dapo_math,
    normalize_dapo,
)

__all__ = [
    "ANSWER_TYPES", "DEFAULT_REL_TOL", "GRADERS", "INVALID", "OPTIONS", "STRICT_WINDOW", "WINDOW",
    "DapoScore", "Grade", "Grader", "GraderSpec", "dapo_math", "grade_math_dapo", "grade_verify",
    "normalize_dapo", "register_grader", "spec_of",
]
