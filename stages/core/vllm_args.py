"""Old path of stages.core.models.vllm_args, kept for this release: the same module object."""
import sys

from stages.core.models import vllm_args

sys.modules[__name__] = vllm_args
