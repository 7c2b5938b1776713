"""GSM8K: grade-school word problems whose worked solution ends in '#### <number>'."""

from __future__ import annotations

import re
from collections.abc import Mapping

from stages.core.data.adapters.base import AdapterError, EmptyAnswer, Fields, Keys, register_adapter
from stages.core.data.problems import Problem

_NUMBER = re.compile(r"[-+]?(\d+(\.\d*)?|\.\d+)")


def _after_hashes(solution: str, key: str) -> str:
    """GSM8K gold: the number after the last '####', without thousands separators or '$'."""
    if "####" not in solution:
        raise AdapterError(f"no '####' in field {key!r}")
    gold = solution.rsplit("####", 1)[1].strip().replace(",", "").replace("$", "")
    if not gold:
        raise EmptyAnswer(f"empty gold answer after '####' in field {key!r}")
    if not _NUMBER.fullmatch(gold):
        raise AdapterError(f"the text after '####' in field {key!r} is not a number: {gold!r}")
    return gold



GSM8K_FIELDS: dict[str, Keys] = {"question": "question", "answer": "answer", "id": "idx"}


@register_adapter("gsm8k")
def gsm8k(record: dict, index: int, fields: Mapping[str, str], source: str) -> Problem:
    """GSM8K: gold = the number after '####'; the whole worked solution is kept in `solution`."""
    f = Fields(record, fields, GSM8K_FIELDS)
    solution = f.text("answer")
    return Problem(
        problem_id=f.problem_id(index),
        source=source,
        question=f.text("question"),
        answer=_after_hashes(solution, f.key("answer")),
        answer_type="math",
        solution=solution,
    )
