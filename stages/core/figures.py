"""Old path of stages.core.report.figures, kept for this release: the same module object."""
import sys

from stages.core.report import figures

sys.modules[__name__] = figures
