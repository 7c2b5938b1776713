"""Old path of stages.core.training.resume, kept for this release: the same module object."""
import sys

from stages.core.training import resume

sys.modules[__name__] = resume
