"""Every evaluation metric in one long CSV, a row per size x method x seed x bench x metric with the
file it came from (eval_long.csv)."""

from __future__ import annotations

from pathlib import Path

from ..config import Config
from ..core.render import Table
from .load import Loaded
from .registry import register_table
from .write import write_csv


@register_table("eval_long", order=80, files=lambda cfg: ["eval_long.csv"])
def write_eval_long(cfg: Config, data: Loaded, folder: Path) -> list[Table]:
    long = data.metrics.sort("size", "method", "seed", "bench", "metric") \
        if not data.metrics.is_empty() else data.metrics
    write_csv(long, folder / "eval_long.csv")
    return []
