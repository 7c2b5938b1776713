"""Old path of stages.core.plans.cost, kept for this release: the same module object."""
import sys

from stages.core.plans import cost

sys.modules[__name__] = cost
