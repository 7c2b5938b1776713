"""Old path of stages.core.models.backends, kept for this release: the same module object."""
import sys

from stages.core.models import backends

sys.modules[__name__] = backends
