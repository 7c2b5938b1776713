"""Old path of stages.core.reward.rewards, kept for this release: the same module object."""
import sys

from stages.core.reward import rewards

sys.modules[__name__] = rewards
