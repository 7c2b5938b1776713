"""Old path of stages.core.training.selectors, kept for this release: the same module object."""
import sys

from stages.core.training import selectors

sys.modules[__name__] = selectors
