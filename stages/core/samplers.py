"""Old path of stages.core.models.samplers, kept for this release: the same module object."""
import sys

from stages.core.models import samplers

sys.modules[__name__] = samplers
