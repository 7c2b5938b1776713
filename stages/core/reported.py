"""Old path of stages.core.report.reported, kept for this release: the same module object."""
import sys

from stages.core.report import reported

sys.modules[__name__] = reported
