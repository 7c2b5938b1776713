"""Old path of stages.core.common.names, kept for this release: the same module object."""
import sys

from stages.core.common import names

sys.modules[__name__] = names
