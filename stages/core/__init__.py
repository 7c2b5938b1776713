"""The reusable science, by concern: common, data, reward, models, statistics, training, report,
plans (each subpackage's __init__ says what it holds and what it may import).

Every module has one name, its place in a subpackage. The flat paths of before
(stages.core.actor, stages.core.stats, ...) and the two gathering modules stages.core.reward.grading
and stages.core.reward.rewards are gone; importing one raises a ModuleNotFoundError that names
the new home (CHANGELOG.md lists them), so that a user's selector module that still imports one
says at once what to write instead.
"""

from __future__ import annotations

import importlib.abc
import sys

MOVED = {
    "actor": "stages.core.training.actor",
    "adapters": "stages.core.data.adapters",
    "answers": "stages.core.common.answers",
    "backends": "stages.core.models.backends",
    "batching": "stages.core.statistics.batching",
    "cost": "stages.core.plans.cost",
    "engine": "stages.core.models.engine",
    "figures": "stages.core.report.figures",
    "generation": "stages.core.models.generation",
    "grading": "stages.core.reward (registry: grade, grade_many, is_correct; grades: Grade; "
               "extraction, equivalence, workers, graders.verify)",
    "io": "stages.core.common.io",
    "live": "stages.core.training.live",
    "losses": "stages.core.training.losses",
    "memory": "stages.core.plans.memory",
    "metrics": "stages.core.common.metrics",
    "modeling": "stages.core.models.modeling",
    "names": "stages.core.common.names",
    "plots": "stages.core.report.plots",
    "policy": "stages.core.models.policy",
    "problems": "stages.core.data.problems",
    "progress": "stages.core.common.progress",
    "render": "stages.core.report.render",
    "reported": "stages.core.report.reported",
    "resume": "stages.core.training.resume",
    "rewards": "stages.core.reward (registry: GRADERS, register_grader, spec_of; "
               "scores.math_dapo: dapo_math; graders.math_dapo, graders.verify)",
    "rollouts": "stages.core.training.rollouts",
    "samplers": "stages.core.models.samplers",
    "scorer": "stages.core.statistics.scorer",
    "scoring": "stages.core.statistics.scoring",
    "selectors": "stages.core.training.selectors",
    "sft": "stages.core.training.sft",
    "stats": "stages.core.statistics.stats",
    "vllm_args": "stages.core.models.vllm_args",
    "reward.grading": "stages.core.reward (registry: grade, grade_many, is_correct; grades: Grade; "
                      "extraction, equivalence, workers, graders.verify)",
    "reward.rewards": "stages.core.reward (registry: GRADERS, register_grader, spec_of; "
                      "scores.math_dapo: dapo_math; graders.math_dapo, graders.verify)",
}
"""Each removed module, by its name under stages.core, and where its names live now."""


class _Moved(importlib.abc.MetaPathFinder):
    """Refuses the removed paths by name (any other import goes on as usual)."""

    def find_spec(self, fullname, path=None, target=None):
        old = fullname.removeprefix(f"{__name__}.")
        if fullname.startswith(f"{__name__}.") and old in MOVED:
            # no `name=`: `from stages.core import actor` then shows this message too, where
            # Python would swallow an error named after the module it tried
            raise ModuleNotFoundError(
                f"{fullname} was removed: it is now {MOVED[old]} (CHANGELOG.md, 2026-12)")
        return None


if not any(isinstance(finder, _Moved) for finder in sys.meta_path):
    sys.meta_path.insert(0, _Moved())
