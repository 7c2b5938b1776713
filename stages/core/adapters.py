"""Old path of stages.core.data.adapters, kept for this release: the same module object."""
import sys

from stages.core.data import adapters

sys.modules[__name__] = adapters
