"""Old path of stages.core.statistics.stats, kept for this release: the same module object."""
import sys

from stages.core.statistics import stats

sys.modules[__name__] = stats
