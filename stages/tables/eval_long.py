"""Every evaluation metric in one long CSV, a row per size x method x seed x bench x metric with the
file it came from (eval_long.csv); with evaluate.graders, a row per grader too (column `grader`)."""

from __future__ import annotations

from pathlib import Path

from ..config import Config
from ..core.report.render import Table
from .load import Loaded
from .registry import register_table
from .write import write_csv


@register_table("eval_long", order=80, files=lambda cfg: ["eval_long.csv"])
def write_eval_long(cfg: Config, data: Loaded, folder: Path) -> list[Table]:
    graders = bool(cfg.evaluate.graders) and not data.graded.is_empty()
    long = data.graded if graders else data.metrics
    keys = ["size", "method", "seed", "bench", "metric"] + (["grader"] if graders else [])
    write_csv(long.sort(keys) if not long.is_empty() else long, folder / "eval_long.csv")
    return []
