"""Stage 6, the tables and figures of the run: one module per table or figure, registered by name.

    labels.py      printed names of methods, sizes and benchmarks; the method groups; the headline
    load.py        the input folders, read by their hive keys; cells (means over seeds)
    seeds.py       the spread over seeds and the interval resampling seeds and problems together
    write.py       Markdown, LaTeX and CSV writing; the sources note under each table
    registry.py    register_table / register_figure, output_names() and the driver main()
    __main__.py    the CLI: python -m stages.tables --config ... (rule tables)

and one module per entry, each ending in its registration: main_pass (pass@k and avg@n, with
ICT's gains), main_8020, main_total, base_gains, token_stats, overlap, ict_readings, ablation,
graders, eval_long, curves (curves.csv and the figure), sources; training, pass_at_k,
entropy_hist. A new table is one more such module, imported below (registry.py says what an entry
declares). Importing this package stays light (no torch, no matplotlib): the workflow imports
output_names when it parses the rules.
"""

from __future__ import annotations

from ..keys import STAGE_VERSIONS

# every entry, imported so that it registers; the order of the outputs is each entry's `order`
from . import (  # noqa: F401
    ablation,
    base_gains,
    curves,
    entropy_hist,
    eval_long,
    graders,
    ict_readings,
    main_8020,
    main_pass,
    main_total,
    overlap,
    pass_at_k,
    sources,
    token_stats,
    training,
)
from .ablation import RATIO_LABEL, ablation_table
from .base_gains import base_gain_table, paired_gain, pooled_gain
from .curves import curve_points
from .graders import graders_table
from .ict_readings import readings_table
from .labels import is_ict, is_reading, method_groups, method_label, method_params
from .load import Cell, Loaded, cells, load
from .main_8020 import main_8020_table, qwen3_size
from .main_pass import ict_gains, main_table
from .main_total import TABLE1_LABEL, main_total_table, paper_size
from .overlap import overlap_table
from .pass_at_k import pass_at_k_curves
from .registry import OUTPUTS, main, output_names, register_figure, register_table
from .seeds import pooled_bootstrap_ci
from .token_stats import token_table

STAGE_VERSION = STAGE_VERSIONS["tables"]

__all__ = [
    "OUTPUTS", "RATIO_LABEL", "TABLE1_LABEL", "Cell", "Loaded", "ablation_table", "base_gain_table",
    "cells", "curve_points", "graders_table", "ict_gains", "is_ict", "is_reading", "load", "main",
    "main_8020_table", "main_table", "main_total_table", "method_groups", "method_label",
    "method_params", "output_names", "overlap_table", "paired_gain", "paper_size",
    "pass_at_k_curves", "pooled_bootstrap_ci", "pooled_gain", "qwen3_size", "readings_table",
    "register_figure", "register_table", "token_table",
]
