"""Progress bars that stay readable in a terminal and in a SLURM or Snakemake log file."""

from __future__ import annotations

import sys

from tqdm.auto import tqdm


def progress(iterable=None, **kwargs):
    """tqdm that redraws freely on a terminal and writes a line at most every 10 s to a log."""
    if not sys.stderr.isatty():
        kwargs.setdefault("mininterval", 10.0)
    kwargs.setdefault("dynamic_ncols", True)
    return tqdm(iterable, **kwargs)
