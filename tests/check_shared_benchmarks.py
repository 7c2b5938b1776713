"""Dev check, not a test: run every adapter over the full benchmark files in shared/data.

    .venv/bin/python tests/check_shared_benchmarks.py [--root /work/shared/data/benchmarks] [--grade]

Prints one row per file (records, problems, skipped for an empty gold answer, answer summary)
and the error of any file that fails. With --grade, every gold answer is also graded against
itself as a model would state it (boxed, and on a "Final Answer: ... $gold$." line), and every
one that is not graded correct is listed: a grading change must leave that list empty. pytest does not collect it (no test_ prefix), because the
unit tests must not depend on data outside the repository.
"""

from __future__ import annotations

import argparse
import collections
import logging
import sys
from pathlib import Path

from stages.config import LocalSource
from stages.core.data.adapters import AdapterError, load_local, read_records
from stages.core.reward.registry import grade_many

# (folder/file, adapter, fields, what we expect to see, from each PROVENANCE.md)
FILES = [
    ("gsm8k/test.jsonl", "gsm8k", {}, "1,319 problems"),
    ("gsm8k_train/train.jsonl", "gsm8k", {}, "7,473 problems"),
    ("math500/test.jsonl", "math", {}, "500 problems, levels 1-5"),
    ("minerva_math/test.jsonl", "minerva", {}, "272 problems, all boxed"),
    ("olympiadbench/test.jsonl", "olympiadbench", {}, "675 problems"),
    ("aime24/test.jsonl", "aime", {}, "30 problems, 7 zero-padded keys"),
    ("aime25/test.jsonl", "aime", {}, "30 problems"),
    ("amc23/test.jsonl", "amc", {}, "40 problems, float keys"),
    ("commonsenseqa/test.jsonl", "csqa", {}, "1,221; gold A 239 B 255 C 241 D 251 E 235"),
    ("arc_challenge/test.jsonl", "arc", {}, "1,172; 1165 x4, 4 x3, 3 x5 choices"),
    ("mmlu_stem/test.jsonl", "mmlu", {}, "3,018; 4 choices"),
    ("strategyqa/test.jsonl", "strategyqa", {}, "229; True 107 / False 122"),
    ("math_train/train.parquet", "verl", {}, "7,500 rows, 2 with an empty ground truth"),
]


class _Count(logging.Handler):
    """Collects the loaders' warnings so the table can show what was skipped."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def summary(problems: list) -> str:
    types = collections.Counter(p.answer_type for p in problems)
    if set(types) == {"choice"}:
        golds = dict(sorted(collections.Counter(p.answer for p in problems).items()))
        sizes = dict(sorted(collections.Counter(len(p.choices) for p in problems).items()))
        return f"gold {golds}; choices {sizes}"
    if set(types) == {"boolean"}:
        return f"gold {dict(collections.Counter(p.answer for p in problems))}"
    levels = collections.Counter(p.level for p in problems if p.level is not None)
    sample = ", ".join(repr(p.answer) for p in problems[:4])
    level_text = f"; levels {dict(sorted(levels.items()))}" if levels else ""
    return f"answers {sample} ...{level_text}"


def self_grade(problems: list) -> list[str]:
    """Golds that are not graded correct against themselves, stated boxed or on an answer line."""
    stated = {
        "boxed": lambda g: f"So the answer is $\\boxed{{{g}}}$.",
        "answer line": lambda g: f"Final Answer: The final answer is ${g}$. I hope it is correct.",
    }
    failed = []
    for how, state in stated.items():
        responses = [state(p.answer) for p in problems]
        grades = grade_many(responses, [p.answer for p in problems],
                            [p.answer_type for p in problems], 10.0, max_workers=2)
        failed += [f"{how}: {p.problem_id} gold {p.answer!r} -> {g}"
                   for p, g in zip(problems, grades, strict=True) if not g.correct]
    return failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path("/work/shared/data/benchmarks"))
    parser.add_argument("--grade", action="store_true", help="grade every gold against itself")
    args = parser.parse_args(argv)
    handler = _Count()
    logging.getLogger("stages.core.data.adapters").addHandler(handler)
    failures = 0
    print(f"{'file':32} {'adapter':14} {'records':>7} {'problems':>8} {'skipped':>7}  summary")
    for name, adapter, fields, expected in FILES:
        path = args.root / name
        handler.messages.clear()
        try:
            records = sum(1 for _ in read_records(path))
            problems = load_local(LocalSource(path=str(path), adapter=adapter, fields=fields), name)
        except AdapterError as err:
            failures += 1
            print(f"{name:32} {adapter:14} FAILED: {err}")
            continue
        skipped = records - len(problems)
        print(f"{name:32} {adapter:14} {records:7d} {len(problems):8d} {skipped:7d}  "
              f"{summary(problems)}   [expected: {expected}]")
        for message in handler.messages:
            print(f"{'':32} warning: {message}")
        if args.grade:
            failed = self_grade(problems)
            failures += bool(failed)
            print(f"{'':32} self-grade: {len(failed)} of {2 * len(problems)} not correct")
            for line in failed[:20]:
                print(f"{'':32}   {line}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
