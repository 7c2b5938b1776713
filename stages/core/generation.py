"""Old path of stages.core.models.generation, kept for this release: the same module object."""
import sys

from stages.core.models import generation

sys.modules[__name__] = generation
