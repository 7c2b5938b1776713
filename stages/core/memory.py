"""Old path of stages.core.plans.memory, kept for this release: the same module object."""
import sys

from stages.core.plans import memory

sys.modules[__name__] = memory
