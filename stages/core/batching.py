"""Old path of stages.core.statistics.batching, kept for this release: the same module object."""
import sys

from stages.core.statistics import batching

sys.modules[__name__] = batching
