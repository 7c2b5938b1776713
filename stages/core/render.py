"""Old path of stages.core.report.render, kept for this release: the same module object."""
import sys

from stages.core.report import render

sys.modules[__name__] = render
