"""Old path of stages.core.report.plots, kept for this release: the same module object."""
import sys

from stages.core.report import plots

sys.modules[__name__] = plots
