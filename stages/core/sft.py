"""Old path of stages.core.training.sft, kept for this release: the same module object."""
import sys

from stages.core.training import sft

sys.modules[__name__] = sft
