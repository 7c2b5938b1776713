"""Old path of stages.core.common.answers, kept for this release: the same module object."""
import sys

from stages.core.common import answers

sys.modules[__name__] = answers
