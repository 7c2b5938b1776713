"""Old path of stages.core.common.metrics, kept for this release: the same module object."""
import sys

from stages.core.common import metrics

sys.modules[__name__] = metrics
