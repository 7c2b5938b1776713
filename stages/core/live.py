"""Old path of stages.core.training.live, kept for this release: the same module object."""
import sys

from stages.core.training import live

sys.modules[__name__] = live
