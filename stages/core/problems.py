"""Old path of stages.core.data.problems, kept for this release: the same module object."""
import sys

from stages.core.data import problems

sys.modules[__name__] = problems
