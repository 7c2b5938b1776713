"""Old path of stages.core.training.rollouts, kept for this release: the same module object."""
import sys

from stages.core.training import rollouts

sys.modules[__name__] = rollouts
