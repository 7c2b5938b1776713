"""Old path of stages.core.common.io, kept for this release: the same module object."""
import sys

from stages.core.common import io

sys.modules[__name__] = io
