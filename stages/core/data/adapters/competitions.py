"""Competitions with numeric answers: AIME (and one year of AI-MO's multi-year AIME file), AMC."""

from __future__ import annotations

import re
from collections.abc import Mapping

from stages.core.data.adapters.base import (
    AdapterError,
    Fields,
    Keys,
    NotInSubset,
    integer,
    number_or_latex,
    register_adapter,
)
from stages.core.data.problems import Problem

AIME_FIELDS: dict[str, Keys] = {
    "question": ("problem", "question"),
    "answer": "answer",
    "solution": "solution",
    "id": "id",
}


@register_adapter("aime")
def aime(record: dict, index: int, fields: Mapping[str, str], source: str) -> Problem:
    """AIME: gold is an integer 0-999 as its canonical string ("025" -> "25")."""
    f = Fields(record, fields, AIME_FIELDS)
    return Problem(
        problem_id=f.problem_id(index),
        source=source,
        question=f.text("question"),
        answer=integer(f.get("answer"), f.key("answer")),
        answer_type="math",
        solution=f.text("solution", required=False),
    )


AIMO_AIME_FIELDS: dict[str, Keys] = {**AIME_FIELDS, "url": "url"}
_YEAR = re.compile(r"(?<!\d)(19|20)\d\d(?!\d)")


def _aime_of_year(year: int):
    """An AIME adapter that keeps one year of a multi-year file, by the year in the record's url."""

    def adapter(record: dict, index: int, fields: Mapping[str, str], source: str) -> Problem:
        f = Fields(record, fields, AIMO_AIME_FIELDS)
        url = f.text("url")
        years = {int(m.group()) for m in _YEAR.finditer(url)}
        if not years:
            raise AdapterError(f"no year in field {f.key('url')!r}: {url!r}")
        if year not in years:
            raise NotInSubset(f"AIME {sorted(years)}, not {year}")
        return aime(record, index, {k: v for k, v in fields.items() if k != "url"}, source)

    adapter.__doc__ = (f"AIME {year} from AI-MO/aimo-validation-aime (AIME 2022-2024, 90 rows: "
                       f"id, problem, solution, answer, url): the rows whose url names {year}; "
                       "gold as for `aime`.")
    return adapter


register_adapter("aimo_aime2023")(_aime_of_year(2023))


AMC_FIELDS: dict[str, Keys] = {"question": ("problem", "question"), "answer": "answer", "id": "id"}


@register_adapter("amc")
def amc(record: dict, index: int, fields: Mapping[str, str], source: str) -> Problem:
    """AMC (open-answer form): gold is a JSON float; 27.0 -> "27", non-integers keep their decimals."""
    f = Fields(record, fields, AMC_FIELDS)
    return Problem(
        problem_id=f.problem_id(index),
        source=source,
        question=f.text("question"),
        answer=number_or_latex(f.get("answer"), f.key("answer")),
        answer_type="math",
    )
