"""Reading data files and loading sources: the records of a JSON Lines or Parquet file or a hub
split, adapted in order, with the empty, out-of-subset and (with ``deduplicate``) repeated
records skipped and the ids checked for uniqueness.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.parquet as pq

from stages.core.data.adapters.base import (
    AdapterError,
    EmptyAnswer,
    NotInSubset,
    get_adapter,
    level_number,
)
from stages.core.data.problems import Problem

if TYPE_CHECKING:
    from stages.config import HubSource, LocalSource

# the name the adapters had as one module, so log lines and the loggers users set stay as they were
logger = logging.getLogger("stages.core.data.adapters")


def read_records(path: str | Path) -> Iterator[tuple[int, dict]]:
    """(1-based line or row, record) of a JSON Lines (.jsonl/.json) or Parquet file.

    Blank lines are skipped; a line that is not a JSON object is an AdapterError naming the line.
    """
    path = Path(path)
    if not path.is_file():
        raise AdapterError(f"{path}: file not found")
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        yield from _json_lines(path)
    elif suffix == ".parquet":
        yield from _parquet_rows(path)
    else:
        raise AdapterError(f"{path}: unsupported file type {suffix!r} (.jsonl, .json or .parquet)")


def _json_lines(path: Path) -> Iterator[tuple[int, dict]]:
    with path.open(encoding="utf-8") as fh:
        for number, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                hint = " (a JSON array? expected one object per line)" if line.lstrip()[:1] == "[" else ""
                raise AdapterError(f"{path}:{number}: invalid JSON: {err.msg}{hint}") from None
            if not isinstance(record, dict):
                raise AdapterError(
                    f"{path}:{number}: expected a JSON object, got {type(record).__name__}"
                )
            yield number, record


def _parquet_rows(path: Path) -> Iterator[tuple[int, dict]]:
    try:
        batches = pq.ParquetFile(path).iter_batches()
    except (pa.ArrowException, OSError) as err:
        raise AdapterError(f"{path}: not a readable Parquet file: {err}") from None
    number = 0
    for batch in batches:
        for record in batch.to_pylist():
            number += 1
            yield number, record


def _question_key(problem: Problem) -> tuple:
    """What makes two records the same problem for `deduplicate`: the adapted question text (and
    the options: one stem with other options is another problem)."""
    return (problem.question, tuple(problem.choices or ()))


def normalise(
    rows: Iterable[tuple[str, dict]],
    adapter: str,
    fields: Mapping[str, str],
    source: str,
    *,
    levels: list[int] | None = None,
    limit: int | None = None,
    deduplicate: bool = False,
    label: str = "",
) -> list[Problem]:
    """Adapt `rows` of (location, record) in order; keep `levels`, then the first `limit`.

    Errors name the record's location and the adapter; records with an empty gold answer are
    skipped with a warning; problem ids must be unique across the whole source. With
    `deduplicate`, a record whose adapted question (:func:`_question_key`) was seen before is
    dropped before ids are checked, so the first copy is kept with its id and position; copies
    whose gold answer differs from the kept one are named in a warning.
    """
    adapt = get_adapter(adapter)
    problems: list[Problem] = []
    first_seen: dict[str, tuple[str, tuple]] = {}  # problem_id -> (location, question key)
    first_question: dict[tuple, tuple[str, str]] = {}  # question key -> (location, answer)
    empty: list[str] = []
    disagreeing: list[str] = []
    outside = excluded = dropped = 0
    for index, (where, record) in enumerate(rows):
        try:
            problem = adapt(record, index, fields, source)
        except EmptyAnswer:
            empty.append(where)
            continue
        except NotInSubset:
            excluded += 1
            continue
        except ValueError as err:  # AdapterError, or Problem's own checks
            raise AdapterError(f"{where}: {err} (adapter {adapter!r})") from None
        key = _question_key(problem)
        if deduplicate:
            if key in first_question:
                dropped += 1
                kept_at, kept_answer = first_question[key]
                if problem.answer != kept_answer:
                    disagreeing.append(f"{where} ({problem.answer!r}; kept {kept_answer!r} of "
                                       f"{kept_at})")
                continue
            first_question[key] = (where, problem.answer)
        if problem.problem_id in first_seen:
            first_at, first_key = first_seen[problem.problem_id]
            hint = ("; the record repeats that one's question: `deduplicate: true` on the source "
                    "keeps the first copy") if first_key == key else ""
            raise AdapterError(
                f"{where}: duplicate problem_id {problem.problem_id!r} (first at "
                f"{first_at}; adapter {adapter!r}){hint}"
            )
        first_seen[problem.problem_id] = (where, key)
        if levels is not None and level_number(problem.level) not in levels:
            outside += 1
            continue
        problems.append(problem)
    if empty:
        logger.warning(
            "%s: skipped %d record(s) with an empty gold answer: %s%s",
            label, len(empty), ", ".join(empty[:5]), " ..." if len(empty) > 5 else "",
        )
    if deduplicate:
        logger.info("%s: dropped %d duplicate record(s), keeping the first of each question",
                    label, dropped)
    if disagreeing:
        logger.warning(
            "%s: %d dropped duplicate(s) had another gold answer than the copy kept: %s%s",
            label, len(disagreeing), ", ".join(disagreeing[:5]),
            " ..." if len(disagreeing) > 5 else "",
        )
    if not problems:
        raise AdapterError(
            f"{label}: no problems left of {len(first_seen) + len(empty) + excluded + dropped} "
            f"records ({len(empty)} with an empty answer, {outside} outside levels {levels}, "
            f"{excluded} outside the adapter's subset, {dropped} duplicates)"
        )
    kept = problems[:limit] if limit is not None else problems
    logger.info("%s: %d problems (%d outside levels, %d empty answers, %d outside the subset, "
                "%d duplicates dropped)", label, len(kept), outside, len(empty), excluded, dropped)
    return kept


def load_local(src: LocalSource, source_label: str) -> list[Problem]:
    """Problems of a local .jsonl/.json/.parquet file, normalised by `src.adapter`."""
    path = Path(src.path)
    get_adapter(src.adapter)  # an unknown adapter fails before the file is read
    parquet = path.suffix.lower() == ".parquet"
    rows = (
        (f"{path}: row {number}" if parquet else f"{path}:{number}", record)
        for number, record in read_records(path)
    )
    return normalise(rows, src.adapter, src.fields, source_label, levels=src.levels,
                     limit=src.limit, deduplicate=getattr(src, "deduplicate", False),
                     label=str(path))


def hub_label(src: HubSource) -> str:
    """How messages name a hub source: ``hub:<dataset>/<config>/<split>``."""
    return f"hub:{src.dataset}/{src.config or 'default'}/{src.split}"


def load_hub(src: HubSource, source_label: str, snapshot: Path | None = None) -> list[Problem]:
    """Problems of a Hugging Face dataset split, via `src.adapter`, read from `snapshot` (the
    fetched commit's folder in the store: python -m stages.fetch), or from `src.dataset` where it
    is a local dataset folder; never from the network."""
    get_adapter(src.adapter)  # fail before reading
    import datasets  # lazily: a slow import that only hub sources need

    from stages.core.common import hub

    label = hub_label(src)
    where = str(snapshot) if snapshot is not None else str(Path(src.dataset).expanduser())
    try:
        files = None
        if snapshot is not None:  # the fetched files of this config and split, and no others
            use = hub.Repo("dataset", src.dataset, src.revision or "main", (), src.config, src.split)
            files = hub.data_files_of(Path(snapshot), use)
        if files is not None:
            kinds = {hub.BUILDERS[Path(f).suffix] for f in files[src.split]}
            if len(kinds) != 1:
                raise AdapterError(f"{label}: data files of several kinds ({sorted(kinds)}) in "
                                   f"{where}")
            split = datasets.load_dataset(kinds.pop(), data_files=files, split=src.split)
        else:
            split = datasets.load_dataset(where, src.config, split=src.split)
    except (ValueError, FileNotFoundError, hub.FetchError) as err:
        if isinstance(err, AdapterError):
            raise
        raise AdapterError(f"{label}: cannot read config {src.config!r}, split {src.split!r} from "
                           f"{where}: {err}") from None
    rows = ((f"{label}: row index {i}", dict(row)) for i, row in enumerate(split))
    return normalise(rows, src.adapter, src.fields, source_label, levels=src.levels,
                     limit=src.limit, deduplicate=getattr(src, "deduplicate", False),
                     label=label)
