"""Every input file read, with its provenance: stage, version, config hash, seed and git commit
(sources.csv; the tables' notes and CSVs point here)."""

from __future__ import annotations

from pathlib import Path

import polars as pl

from ..config import Config
from ..core.common.io import read_provenance
from ..core.report.render import Table
from .load import Loaded
from .registry import register_table
from .write import write_csv


def sources_frame(paths: list[str]) -> pl.DataFrame:
    rows = []
    for p in sorted(set(paths)):
        prov = read_provenance(p)
        rows.append({"file": p, "stage": prov.get("stage"), "stage_version": prov.get("stage_version"),
                     "config_hash": prov.get("config_hash"), "seed": prov.get("seed"),
                     "git_commit": prov.get("git_commit")})
    return pl.DataFrame(rows, schema={"file": pl.String, "stage": pl.String, "stage_version": pl.String,
                                      "config_hash": pl.String, "seed": pl.Int64, "git_commit": pl.String})


@register_table("sources", order=90, files=lambda cfg: ["sources.csv"])
def write_sources(cfg: Config, data: Loaded, folder: Path) -> list[Table]:
    write_csv(sources_frame(data.sources), folder / "sources.csv")
    return []
