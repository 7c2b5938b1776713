"""Old path of stages.core.models.policy, kept for this release: the same module object."""
import sys

from stages.core.models import policy

sys.modules[__name__] = policy
