"""Artifacts: one Parquet writer for every stage, with a declared schema and provenance.

Every Parquet file is written to a temporary file beside its destination and renamed into
place, so a crash never leaves a partial artifact. The provenance (stage, stage version, config
hash, seed, git commit, package versions) sits in the file's key-value metadata under
``ict_rlvr.provenance`` and is read back with :func:`read_provenance`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator, Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from stages.core.common import environment, numerics

PROVENANCE_KEY = b"ict_rlvr.provenance"
TRACKED_PACKAGES = (
    "ict-rlvr", "torch", "transformers", "tokenizers", "datasets", "polars", "pyarrow",
    "math-verify", "snakemake", "deepspeed", "vllm",
)


class ArtifactError(ValueError):
    """An artifact that is missing, corrupt or of the wrong shape; the message names the file."""


def package_versions() -> dict[str, str]:
    versions = {}
    for name in TRACKED_PACKAGES:
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[name] = metadata.version(name)
    return versions


def git_commit() -> str:
    """Commit of the checkout the package runs from ('unknown' outside git), '+dirty' if edited."""
    root = Path(__file__).resolve().parents[3]
    try:
        sha = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"],
            capture_output=True, text=True, check=True, timeout=10,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, check=True, timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return sha + ("+dirty" if dirty else "")


HUB_SOURCES: dict[str, dict] = {}
"""The hub repositories of the run this process computes for, each with its requested revision
and locked commit (stages.cli fills it from the config: stages.core.common.hub.sources)."""


def provenance(stage: str, stage_version: str, config_hash: str, seed: int, **extra: Any) -> dict:
    """The provenance record stored with every artifact. No timestamps: same inputs, same bytes
    (on the same processor: `numerics` names it, the settings and the threads), from the
    environment's lock (`lock`: its name and sha256), and the hub commits of the run's models and
    data sets (`hub`, where it reads any)."""
    return {
        "stage": stage,
        "stage_version": stage_version,
        "config_hash": config_hash,
        "seed": seed,
        "git_commit": git_commit(),
        "packages": package_versions(),
        "numerics": numerics.record(),
        "lock": environment.record(),
        **({"hub": dict(HUB_SOURCES)} if HUB_SOURCES else {}),
        **extra,
    }


@contextlib.contextmanager
def atomic_path(path: str | Path, suffix: str = "") -> Iterator[Path]:
    """Yield a temporary path in the destination folder; rename it onto `path` on success."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix + ".tmp", dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        os.replace(tmp_path, path)
    finally:
        tmp_path.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_dir(path: str | Path) -> Iterator[Path]:
    """Yield an empty temporary folder beside `path`; it replaces `path` on success."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        yield tmp
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def sha256_file(path: str | Path, block: int = 1 << 20) -> str:
    """The sha256 of a file's bytes, read `block` bytes at a time."""
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(block):
            h.update(chunk)
    return h.hexdigest()


def write_json(path: str | Path, obj: Any) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def write_parquet(
    frame: pl.DataFrame | pa.Table | list[Mapping[str, Any]],
    path: str | Path,
    schema: pa.Schema,
    prov: Mapping[str, Any],
) -> Path:
    """Write `frame` with exactly `schema` (same columns, castable types) and provenance."""
    path = Path(path)
    if isinstance(frame, list):
        table = pa.Table.from_pylist(frame, schema=schema)
    else:
        table = frame.to_arrow() if isinstance(frame, pl.DataFrame) else frame
        if table.column_names != schema.names:
            raise ArtifactError(
                f"{path}: columns {table.column_names} do not match the declared schema {schema.names}"
            )
        try:
            table = table.cast(schema)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as err:
            raise ArtifactError(f"{path}: data does not fit the declared schema: {err}") from None
    for field in schema:
        if not field.nullable and table.column(field.name).null_count:
            raise ArtifactError(f"{path}: column {field.name!r} has nulls but is declared non-null")
    meta = dict(schema.metadata or {})
    meta[PROVENANCE_KEY] = json.dumps(prov, sort_keys=True).encode()
    table = table.replace_schema_metadata(meta)
    with atomic_path(path, ".parquet") as tmp:
        pq.write_table(table, tmp, compression="zstd")
    return path


def read_provenance(path: str | Path) -> dict:
    path = Path(path)
    try:
        meta = pq.read_schema(path).metadata or {}
    except (OSError, pa.ArrowInvalid) as err:
        raise ArtifactError(f"{path}: not a readable Parquet file: {err}") from None
    if PROVENANCE_KEY not in meta:
        raise ArtifactError(f"{path}: no provenance metadata (not written by ict-rlvr?)")
    return json.loads(meta[PROVENANCE_KEY])


def read_parquet(path: str | Path, schema: pa.Schema | None = None) -> pl.DataFrame:
    """Read an artifact; with `schema`, check that its columns are the declared ones."""
    path = Path(path)
    if not path.exists():
        raise ArtifactError(f"{path}: file not found")
    try:
        frame = pl.read_parquet(path)
    except Exception as err:  # polars raises several exception types for corrupt files
        raise ArtifactError(f"{path}: not a readable Parquet file: {err}") from None
    if schema is not None:
        missing = [n for n in schema.names if n not in frame.columns]
        if missing:
            raise ArtifactError(f"{path}: missing columns {missing}")
    return frame
