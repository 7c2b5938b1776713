"""Old path of stages.core.statistics.scorer, kept for this release: the same module object."""
import sys

from stages.core.statistics import scorer

sys.modules[__name__] = scorer
