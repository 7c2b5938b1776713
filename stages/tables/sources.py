"""Every input file read, with its provenance: stage, version, config hash, seed, git commit, and
the processor, CPU settings and threads that computed it (sources.csv; the tables' notes and
CSVs point here), the lock of the environment it was computed in, and the hub commits of the
models and data sets its run read."""

from __future__ import annotations

from pathlib import Path

import polars as pl

from ..config import Config
from ..core.common.io import read_provenance
from ..core.report.render import Table
from .load import Loaded
from .registry import register_table
from .write import write_csv


def numerics_columns(prov: dict) -> dict:
    """The processor, the three CPU settings ('native' where none was set), the threads and the
    environment's lock (name and sha256) of a provenance record (None where the record predates
    them)."""
    num = prov.get("numerics") or {}
    settings = num.get("settings")
    return {"processor": (num.get("processor") or {}).get("model"),
            "cpu_settings": None if settings is None else (
                " ".join(f"{k}={v}" for k, v in settings.items() if v is not None) or "native"),
            "threads": num.get("threads"),
            "lock": None if not prov.get("lock") else f"{prov['lock']['lock']} {prov['lock']['sha256'][:12]}"}


def hub_column(prov: dict) -> str | None:
    """The hub repositories a file's run read, each at its locked commit ('model:Qwen/Qwen2.5-7B@
    <12 hex> dataset:...'), None where it read none (stages.core.common.hub)."""
    repos = prov.get("hub") or {}
    return " ".join(f"{key}@{(facts.get('commit') or 'unlocked')[:12]}"
                    for key, facts in sorted(repos.items())) or None


def sources_frame(paths: list[str]) -> pl.DataFrame:
    rows = []
    for p in sorted(set(paths)):
        prov = read_provenance(p)
        rows.append({"file": p, "stage": prov.get("stage"), "stage_version": prov.get("stage_version"),
                     "config_hash": prov.get("config_hash"), "seed": prov.get("seed"),
                     "git_commit": prov.get("git_commit"), **numerics_columns(prov),
                     "hub": hub_column(prov)})
    return pl.DataFrame(rows, schema={"file": pl.String, "stage": pl.String, "stage_version": pl.String,
                                      "config_hash": pl.String, "seed": pl.Int64, "git_commit": pl.String,
                                      "processor": pl.String, "cpu_settings": pl.String,
                                      "threads": pl.Int64, "lock": pl.String, "hub": pl.String})


@register_table("sources", order=90, files=lambda cfg: ["sources.csv"])
def write_sources(cfg: Config, data: Loaded, folder: Path) -> list[Table]:
    write_csv(sources_frame(data.sources), folder / "sources.csv")
    return []
