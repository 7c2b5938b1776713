"""Old path of stages.core.training.actor, kept for this release: the same module object."""
import sys

from stages.core.training import actor

sys.modules[__name__] = actor
