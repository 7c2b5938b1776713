"""The built-in graders, one module each; importing this package registers them (a new grader
is one module here, decorated with registry.register_grader, and imported below)."""

from stages.core.reward.graders import math_dapo, verify  # noqa: F401 - registers them
