"""Old path of stages.core.statistics.scoring, kept for this release: the same module object."""
import sys

from stages.core.statistics import scoring

sys.modules[__name__] = scoring
