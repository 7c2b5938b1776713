"""Old path of stages.core.models.engine, kept for this release: the same module object."""
import sys

from stages.core.models import engine

sys.modules[__name__] = engine
