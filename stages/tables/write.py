"""Writing a table as Markdown, LaTeX (booktabs) and CSV, and the note that names its input files."""

from __future__ import annotations

from pathlib import Path

import polars as pl

from ..core.common.io import atomic_path
from ..core.report import render
from ..core.report.render import Table, glob_of

TABLE_EXTS = ("md", "tex", "csv")


def table_files(stem: str) -> list[str]:
    """The files write_table writes for `stem`."""
    return [f"{stem}.{ext}" for ext in TABLE_EXTS]


def write_csv(frame: pl.DataFrame, path: Path) -> None:
    frame = frame.with_columns(pl.col(c).cast(pl.List(pl.String)).list.join(";")
                               for c, t in frame.schema.items()
                               if isinstance(t, pl.List))
    with atomic_path(path, ".csv") as tmp:
        frame.write_csv(tmp)


def write_table(tables: list[tuple[Table, str]], frame: pl.DataFrame, stem: Path) -> None:
    """`tables` (each with its LaTeX label) into one .md and one .tex; `frame` into the .csv."""
    render.write_text(stem.with_suffix(".md"), "\n".join(render.markdown(t) for t, _ in tables))
    render.write_text(stem.with_suffix(".tex"), "\n".join(render.latex(t, label) for t, label in tables))
    write_csv(frame, stem.with_suffix(".csv"))


def sources_note(paths: list[str], csv_name: str) -> str:
    files = sorted(set(paths))
    if not files:
        return "Sources: none yet (no input files)."
    return (f"Sources: {glob_of(files)} ({len(files)} file{'s' if len(files) > 1 else ''}; the file "
            f"of each number is in {csv_name}, their provenance in sources.csv).")
