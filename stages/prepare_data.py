"""Stage 1: prepare one dataset as normalised Parquet (PROBLEM_SCHEMA).

    python -m stages.prepare_data --config CFG --dataset NAME --out results/<run>/data/dataset=NAME/problems.parquet
"""

from __future__ import annotations

import collections

from . import cli
from .config import Config, ConfigError, GeneratedSource
from .core.common.io import provenance, write_parquet
from .core.data.adapters import DAPO_INSTRUCTION
from .core.data.problems import PROBLEM_SCHEMA, Problem, generate_arithmetic, render_prompt
from .keys import STAGE_VERSIONS

STAGE_VERSION = STAGE_VERSIONS["prepare_data"]


def hub_snapshot(cfg: Config, name: str):
    """The checked snapshot folder of a hub data set's locked commit (None: a local folder)."""
    from .core.common import hub

    src = cfg.datasets[name].source
    if hub.is_local(src.dataset):
        return None
    return hub.locked_folder(cfg, "dataset", src.dataset, src.commit, f"datasets.{name}.source")


def load_problems(cfg: Config, name: str) -> list[Problem]:
    """The records of dataset `name`, from its source, before prompts are rendered."""
    src = cfg.datasets[name].source
    if isinstance(src, GeneratedSource):
        return generate_arithmetic(
            src.n,
            seed=cfg.seed + src.seed,
            min_terms=src.min_terms,
            max_terms=src.max_terms,
            max_add=src.max_add,
            max_mul=src.max_mul,
            split=src.split,
            source=f"generated:{name}",
            style=src.style,
        )
    from .core.data import adapters  # imports datasets only when a real source is read

    if src.kind == "hub":
        return adapters.load_hub(src, f"hub:{src.dataset}", hub_snapshot(cfg, name))
    return adapters.load_local(src, f"local:{src.path}")


def prepare(cfg: Config, name: str) -> list[dict]:
    """Normalised rows of dataset `name` with rendered prompts; problem ids must be unique."""
    if name not in cfg.datasets:
        raise ConfigError(f"--dataset {name!r}: not a key of 'datasets' ({sorted(cfg.datasets)})")
    ds = cfg.datasets[name]
    template = cfg.templates[ds.template]
    rows = []
    for p in load_problems(cfg, name):
        row = p.row()
        row["prompt"] = render_prompt(template, p)
        rows.append(row)
    if not rows:
        raise ConfigError(f"datasets/{name}: the source produced no problems")
    check_instruction_once(rows, name, ds.template)
    dupes = [k for k, v in collections.Counter(r["problem_id"] for r in rows).items() if v > 1]
    if dupes:
        raise ConfigError(f"datasets/{name}: duplicate problem_id values, e.g. {dupes[:3]}")
    return [{f: r[f] for f in PROBLEM_SCHEMA.names} for r in rows]


def check_instruction_once(rows: list[dict], name: str, template: str) -> None:
    """Refuse prompts that carry DAPO's "Answer:" instruction twice: a template that adds it around
    records that already hold it (DAPO-Math-17k's) would train on a prompt nobody else uses."""
    for row in rows:
        if row["prompt"].count(DAPO_INSTRUCTION) > 1:
            raise ConfigError(
                f"datasets.{name}.template: the prompt carries the \"Answer:\" instruction twice "
                f"(template {template!r}, problem {row['problem_id']!r}; the records already carry "
                "it; use a template without it)"
            )


def main(args, cfg: Config) -> None:
    rows = prepare(cfg, args.dataset)
    ds = cfg.datasets[args.dataset]
    seed = cfg.seed + (ds.source.seed if isinstance(ds.source, GeneratedSource) else 0)
    prov = provenance(
        "prepare_data", STAGE_VERSION,
        cfg.section_hash(f"datasets/{args.dataset}", f"templates/{ds.template}", "seed"),
        seed, dataset=args.dataset, role=ds.role,
    )
    write_parquet(rows, args.out, PROBLEM_SCHEMA, prov)
    cli.log.info("%s: %d problems -> %s", args.dataset, len(rows), args.out)


if __name__ == "__main__":
    p = cli.parser(__doc__.splitlines()[0])
    p.add_argument("--dataset", required=True, help="a key of 'datasets'")
    p.add_argument("--out", required=True, help="output Parquet path")
    cli.run(main, p)
