"""The stage's tables and figures, registered by name, and the driver that writes them.

A table is a function ``f(cfg, data, folder) -> list[Table]`` registered with :func:`register_table`,
which also declares the files it writes:

    @register_table("seed_spread", order=35, files=lambda cfg: table_files("seed_spread"),
                    applies=lambda cfg: len(cfg.experiment.seeds) > 1)
    def write_seed_spread(cfg: Config, data: Loaded, folder: Path) -> list[Table]:
        table, frame = seed_spread_table(cfg, data.metrics)
        write_table([(table, "tab:seed-spread")], frame, folder / "seed_spread")
        return [table]

- ``files(cfg)`` names every file the entry writes into its folder, from the config alone (never
  from the inputs): :func:`output_names` hands them to the workflow (rule tables' outputs, rule
  all's targets), and the CLI fails when one of them is not written.
- ``applies(cfg)`` says whether the entry exists for this config (default: always); when False it
  is not called and declares no files.
- ``order`` places the entry among those of its folder (unique there): entries are written, their
  files declared, and their returned tables shown in tables.md and tables.html in ascending order.
- The function writes its files into ``folder`` and returns the tables to show on those two pages,
  in the order to show them ([] for a file that is not a table, such as a CSV of raw numbers).

A figure is the same, registered with :func:`register_figure`: it writes into the figures folder
and returns None. Add a new entry's module to the imports of stages/tables/__init__.py, which
imports every entry so that it registers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .. import cli
from ..config import Config
from ..core.report import render
from ..core.report.render import Table
from .load import Loaded, check_grid, load

Writer = Callable[[Config, Loaded, Path], list[Table] | None]
FOLDERS = ("tables", "figures")
PAGES = ("tables.md", "tables.html")
"""The driver's own files, after every registered table's: all the tables on one page."""


@dataclass(frozen=True)
class OutputSpec:
    """A registered table or figure: what it writes for a config, whether it applies, and how."""

    name: str
    folder: str  # one of FOLDERS
    order: int
    files: Callable[[Config], list[str]]
    applies: Callable[[Config], bool]
    write: Writer


OUTPUTS: dict[str, OutputSpec] = {}


def _always(cfg: Config) -> bool:
    return True


def _register(folder: str, name: str, order: int, files: Callable[[Config], list[str]],
              applies: Callable[[Config], bool]) -> Callable[[Writer], Writer]:
    def decorate(fn: Writer) -> Writer:
        if name in OUTPUTS:
            raise ValueError(f"table or figure {name!r} is already registered")
        taken = [s.name for s in OUTPUTS.values() if s.folder == folder and s.order == order]
        if taken:
            raise ValueError(f"{name!r}: order {order} of the {folder} is taken by {taken[0]!r}")
        OUTPUTS[name] = OutputSpec(name, folder, order, files, applies, fn)
        return fn

    return decorate


def register_table(name: str, *, order: int, files: Callable[[Config], list[str]],
                   applies: Callable[[Config], bool] = _always) -> Callable[[Writer], Writer]:
    """Decorator: register a table (or a CSV) written into the tables folder."""
    return _register("tables", name, order, files, applies)


def register_figure(name: str, *, order: int, files: Callable[[Config], list[str]],
                    applies: Callable[[Config], bool] = _always) -> Callable[[Writer], Writer]:
    """Decorator: register a figure written into the figures folder."""
    return _register("figures", name, order, files, applies)


def entries(cfg: Config, folder: str) -> list[OutputSpec]:
    """The entries of `folder` that apply to this config, in their order."""
    return sorted((s for s in OUTPUTS.values() if s.folder == folder and s.applies(cfg)),
                  key=lambda s: s.order)


def output_names(cfg: Config) -> dict[str, list[str]]:
    """File names the stage writes, relative to the tables and figures folders (for the rules)."""
    tables = [n for spec in entries(cfg, "tables") for n in spec.files(cfg)] + list(PAGES)
    figures = [n for spec in entries(cfg, "figures") for n in spec.files(cfg)]
    return {"tables": tables, "figures": figures}


def main(args, cfg: Config) -> None:
    data = load(args.eval or [], args.train or [], args.token_stats or [],
                getattr(args, "eval_steps", None) or [], getattr(args, "overlap", None) or [],
                own_graders={b: d.grader for b, d in cfg.datasets.items()})
    check_grid(cfg, data)
    tables_dir, figures_dir = Path(args.tables_dir), Path(args.figures_dir)
    everything: list[Table] = []
    for spec in entries(cfg, "tables"):
        everything += spec.write(cfg, data, tables_dir)
    title = f"ict-rlvr: tables of run '{cfg.run}'"
    render.write_text(tables_dir / "tables.md",
                      f"# {title}\n\n" + "\n".join(render.markdown(t) for t in everything))
    render.write_text(tables_dir / "tables.html", render.html_page(everything, title))
    for spec in entries(cfg, "figures"):
        spec.write(cfg, data, figures_dir)
    cli.log.info("%d evaluations, %d training runs, %d token-statistics summaries -> %s, %s",
                 data.metrics.select("source").n_unique() if not data.metrics.is_empty() else 0,
                 data.train.select("source").n_unique() if not data.train.is_empty() else 0,
                 data.token_stats.height, tables_dir, figures_dir)
