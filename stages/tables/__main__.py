"""Stage 6: the tables and figures of the run, from every evaluation, training and token-statistics file.

    python -m stages.tables --config CFG \
        --eval results/<run>/eval/size=S/method=M/seed=K/bench=B ... \
        --train results/<run>/train/size=S/method=M/seed=K ... \
        --token-stats results/<run>/token_stats/size=S ... \
        [--eval-steps results/<run>/eval_steps/size=S/method=M/seed=K/step=N/bench=B ...] \
        [--overlap results/<run>/overlap/size=S/method=M/seed=K ...] \
        --tables-dir results/<run>/tables --figures-dir results/<run>/figures

Each folder is named by its hive keys (size=, method=, seed=, step=, bench=), which is all the stage
needs to place its numbers; a cell of the grid without a folder shows "—". Tables are written as
Markdown, LaTeX (booktabs) and CSV (unformatted numbers and the file each came from), plus one
HTML page for the Snakemake report; `sources.csv` lists every file read with its provenance.
The papers' numbers (stages.core.report.reported) stand in their own labelled columns beside ours
(main_total, main_8020, ablation, overlap, ict_readings, the ICT-gain summary), never in our cells.
"""

from __future__ import annotations

from pathlib import Path

from .. import cli
from ..config import Config
from .registry import main, output_names


def _check_outputs(cfg: Config, tables_dir: Path, figures_dir: Path) -> None:
    missing = [str(tables_dir / n) for n in output_names(cfg)["tables"] if not (tables_dir / n).exists()]
    missing += [str(figures_dir / n) for n in output_names(cfg)["figures"] if not (figures_dir / n).exists()]
    if missing:
        raise RuntimeError(f"the stage did not write {missing}")


def _main(args, cfg: Config) -> None:
    main(args, cfg)
    _check_outputs(cfg, Path(args.tables_dir), Path(args.figures_dir))


if __name__ == "__main__":
    p = cli.parser(__doc__.splitlines()[0])
    p.add_argument("--eval", nargs="*", help="evaluation folders (.../size=/method=/seed=/bench=)")
    p.add_argument("--train", nargs="*", help="training folders (.../size=/method=/seed=)")
    p.add_argument("--token-stats", nargs="*", help="token-statistics folders (.../size=), "
                   "with readings.parquet where token_stats.ict_readings")
    p.add_argument("--eval-steps", nargs="*", help="evaluations of the checkpoints saved every "
                   "train.save_every steps (.../size=/method=/seed=/step=/bench=)")
    p.add_argument("--overlap", nargs="*", help="overlap folders of the 80/20 paper's Table 1 "
                   "(.../size=/method=/seed=, each with overlap.parquet)")
    p.add_argument("--tables-dir", required=True)
    p.add_argument("--figures-dir", required=True)
    cli.run(_main, p)
