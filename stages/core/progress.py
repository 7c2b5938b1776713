"""Old path of stages.core.common.progress, kept for this release: the same module object."""
import sys

from stages.core.common import progress

sys.modules[__name__] = progress
