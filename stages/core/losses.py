"""Old path of stages.core.training.losses, kept for this release: the same module object."""
import sys

from stages.core.training import losses

sys.modules[__name__] = losses
