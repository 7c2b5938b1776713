"""Old path of stages.core.models.modeling, kept for this release: the same module object."""
import sys

from stages.core.models import modeling

sys.modules[__name__] = modeling
