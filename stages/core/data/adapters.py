"""Record adapters: turn one raw benchmark record into a normalised :class:`Problem`.

An adapter is a pure function ``(record, index, fields, source) -> Problem`` registered by name
with :func:`register_adapter`; a dataset's config names it (``source.adapter``). The prompt is left
empty: the prepare stage renders it from the dataset's template.

``fields`` maps the adapter's logical field names to the record's keys where a copy of a dataset
names a column differently (the Qwen2.5-Math copy of Minerva has ``problem``, the hub copy has
``question``). Each adapter declares its default keys; where real copies differ the default is a
tuple of keys tried in order, and a ``fields`` entry replaces the tuple with one key. A key may be
a dotted path into nested records (``reward_model.ground_truth``). Naming a logical field the
adapter does not have is an error, so a typo in the config does not pass silently.

``problem_id`` is the record's own id where the adapter knows one (``unique_id``, ``id``,
``qid``, ``idx``) and the record has it; otherwise it is ``str(index)``, the 0-based position of the
record in its file or split *before* any filtering. Positions rather than question hashes because
the Qwen2.5-Math copies carry ``idx`` = that same position (GSM8K, Minerva), so a hub copy and a
local copy of one benchmark get the same ids, and because ids then survive ``levels``/``limit``.

Errors: an adapter raises :class:`AdapterError` with a short reason ("missing field 'answer'");
the loaders add where (``data/x.jsonl:17``, ``x.parquet: row 17`` or
``hub:openai/gsm8k/main/test: row index 16``) and the adapter's name. A record whose gold answer
is present but empty raises :class:`EmptyAnswer`; the loaders skip those with a warning, because
the canonical MATH train set has two problems whose solutions box nothing. A record outside the
subset an adapter stands for (another year of a multi-year AIME file) raises :class:`NotInSubset`;
the loaders skip those silently and count them. One exception: `dapo_math` makes an empty gold
an AdapterError, since every record of its training set has one (see its docstring).

Deduplication: with ``deduplicate: true`` on the source, the loaders keep the first record of
each distinct adapted question, with its id, and drop the later copies, logging how many.
DAPO-Math-17k's common copy repeats every prompt 100 times under one id, which is otherwise a
duplicate-id error.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.parquet as pq

from stages.core.data.problems import ANSWER_TYPES, LETTERS, Problem

if TYPE_CHECKING:
    from stages.config import HubSource, LocalSource

logger = logging.getLogger(__name__)

Adapter = Callable[[dict, int, Mapping[str, str], str], Problem]
Keys = str | tuple[str, ...]

ADAPTERS: dict[str, Adapter] = {}
"""Adapter name -> adapter; filled by :func:`register_adapter`."""


class AdapterError(ValueError):
    """A record or data file that cannot be normalised; loaders name the file and line or row."""


class EmptyAnswer(AdapterError):
    """The gold answer is present but empty; loaders skip such records with a warning."""


class NotInSubset(AdapterError):
    """The record is not part of the subset the adapter reads; loaders skip it and count it."""


def register_adapter(name: str) -> Callable[[Adapter], Adapter]:
    """Decorator: register an adapter under `name` (each name once)."""

    def register(fn: Adapter) -> Adapter:
        if name in ADAPTERS:
            raise ValueError(f"adapter {name!r} is registered twice")
        ADAPTERS[name] = fn
        return fn

    return register


def get_adapter(name: str) -> Adapter:
    """The adapter called `name`; AdapterError lists the known names otherwise."""
    try:
        return ADAPTERS[name]
    except KeyError:
        raise AdapterError(f"unknown adapter {name!r}; known: {', '.join(sorted(ADAPTERS))}") from None


# ---------------------------------------------------------------------------------------------
# Reading fields
# ---------------------------------------------------------------------------------------------

_MISSING = object()


def _lookup(record: Mapping, key: str) -> Any:
    """The value at `key`: a top-level key first, else a dotted path; _MISSING if absent."""
    if key in record:
        return record[key]
    node: Any = record
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return _MISSING
        node = node[part]
    return node


class _Fields:
    """One record's logical fields, read through the adapter's defaults and the `fields` overrides."""

    def __init__(self, record: Mapping, fields: Mapping[str, str], defaults: Mapping[str, Keys]):
        if not isinstance(record, Mapping):
            raise AdapterError(f"expected a record (mapping), got {type(record).__name__}")
        if unknown := sorted(set(fields) - set(defaults)):
            raise AdapterError(
                f"unknown field(s) {unknown} in `fields`; this adapter reads {sorted(defaults)}"
            )
        self.record = record
        self.fields = fields
        self.defaults = defaults

    def keys(self, name: str) -> tuple[str, ...]:
        if name in self.fields:
            return (self.fields[name],)
        default = self.defaults.get(name, ())
        return (default,) if isinstance(default, str) else default

    def key(self, name: str) -> str:
        """The record key named in messages about `name`."""
        keys = self.keys(name)
        return keys[0] if keys else name

    def get(self, name: str, required: bool = True) -> Any:
        """The first present, non-null value among the keys of `name` (None if optional and absent)."""
        keys = self.keys(name)
        null = False
        for key in keys:
            value = _lookup(self.record, key)
            if value is None:
                null = True
            elif value is not _MISSING:
                return value
        if not required:
            return None
        alternatives = " or ".join(repr(k) for k in keys)
        raise AdapterError(f"{'null' if null else 'missing'} field {alternatives}")

    def text(self, name: str, required: bool = True) -> str | None:
        """A string field, stripped; an empty required string is an error."""
        value = self.get(name, required)
        if value is None:
            return None
        if not isinstance(value, str):
            raise AdapterError(f"field {self.key(name)!r} must be a string, got {type(value).__name__}")
        value = value.strip()
        if required and not value:
            raise AdapterError(f"field {self.key(name)!r} is empty")
        return value or None

    def problem_id(self, index: int) -> str:
        value = self.get("id", required=False)
        return str(index) if value is None else str(value)


def _nonempty(answer: str, key: str) -> str:
    if not answer:
        raise EmptyAnswer(f"empty gold answer in field {key!r}")
    return answer


# ---------------------------------------------------------------------------------------------
# Answer normalisation (pure helpers, shared by the adapters and usable by graders)
# ---------------------------------------------------------------------------------------------

_BOX_COMMANDS = ("\\boxed", "\\fbox")


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``, ``\\boxed 5``) in `text`.

    Nested braces are matched; escaped braces (``\\{``, ``\\}``) are content, not structure.
    None if there is no box or its braces never close.

    >>> last_boxed(r"so $x = \\boxed{\\frac{1}{2}}$ and")
    '\\\\frac{1}{2}'
    """
    start, command = max((text.rfind(c), c) for c in _BOX_COMMANDS)
    if start < 0:
        return None
    rest = text[start + len(command):]
    if not rest.startswith("{"):
        # "$\boxed 5$": the answer runs to the closing "$" or the line's end (a few MATH solutions)
        spaced = re.match(r" +([^$\n]*)", rest)
        if spaced is None:
            return None
        return spaced.group(1).strip() or None
    depth = 0
    i = 0
    while i < len(rest):
        ch = rest[i]
        if ch == "\\":
            i += 2
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return rest[1:i].strip()
        i += 1
    return None


def _plain_number(value: Any, key: str) -> str:
    """A JSON number as a canonical decimal string: 27.0 -> '27', 0.5 -> '0.5'."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise AdapterError(f"field {key!r} must be a number, got {type(value).__name__}")
    if isinstance(value, float):
        if not math.isfinite(value):
            raise AdapterError(f"field {key!r} is not a finite number: {value!r}")
        if value.is_integer():
            return str(int(value))
        return repr(value)
    return str(value)


_WHOLE_DECIMAL = re.compile(r"([-+]?\d+)\.0*")


def _number_or_latex(value: Any, key: str) -> str:
    """A gold answer given as a number or a string, stripped; '27.0' and 27.0 become '27'.

    Other strings stay as written (LaTeX, '0.50', '4.5e33'): the grader compares them
    symbolically, and rewriting them here could only lose information.
    """
    if isinstance(value, str):
        text = value.strip()
        if whole := _WHOLE_DECIMAL.fullmatch(text):
            return whole.group(1)
        return _nonempty(text, key)
    return _plain_number(value, key)


_INTEGER = re.compile(r"[-+]?\d+")


def _integer(value: Any, key: str) -> str:
    """An integer answer as its canonical string: '025' -> '25', 25.0 -> '25'."""
    if isinstance(value, str):
        text = value.strip()
        if not text:
            raise EmptyAnswer(f"empty gold answer in field {key!r}")
        if not _INTEGER.fullmatch(text):
            raise AdapterError(f"field {key!r} is not an integer: {value!r}")
        return str(int(text))
    text = _plain_number(value, key)
    if not _INTEGER.fullmatch(text):
        raise AdapterError(f"field {key!r} is not an integer: {value!r}")
    return text


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


_UNESCAPED_DOLLAR = re.compile(r"(?<!\\)\$")


def _strip_math_delimiters(answer: str) -> str:
    """'$2^{1009}$' -> '2^{1009}'; '$69$,$84$' -> '69,84'; a trailing full stop goes too."""
    return _UNESCAPED_DOLLAR.sub("", answer).strip().rstrip(".").strip()


def _level(value: Any) -> str | None:
    """MATH difficulty as a bare string: 3 -> '3', 'Level 3' -> '3', 'Level ?' -> '?'."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    text = str(value).strip()
    text = re.sub(r"^level\s*", "", text, flags=re.IGNORECASE)
    return text or None


def level_number(level: str | None) -> int | None:
    """The integer a normalised level stands for, None if it has none ('?', None)."""
    return int(level) if level is not None and level.isdigit() else None


_YES = {"yes", "true"}
_NO = {"no", "false"}


def _yes_no(value: Any, key: str) -> str:
    """Boolean gold as 'yes'/'no' (JSON bools, or the strings yes/no/true/false)."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, str) and value.strip().lower() in _YES | _NO:
        return "yes" if value.strip().lower() in _YES else "no"
    raise AdapterError(f"field {key!r} must be a boolean or yes/no, got {value!r}")


def _labelled_choices(value: Any, key: str) -> tuple[list[str], list[str]]:
    """(labels, texts) of a ``{label: [...], text: [...]}`` choice block, in label order.

    Labels sort numerically when they are digits (ARC's "1".."4") and alphabetically otherwise;
    a list of ``{label, text}`` objects is accepted too.
    """
    if isinstance(value, Mapping):
        labels, texts = value.get("label"), value.get("text")
    elif isinstance(value, list) and all(isinstance(c, Mapping) for c in value):
        labels = [c.get("label") for c in value]
        texts = [c.get("text") for c in value]
    else:
        raise AdapterError(f"field {key!r} must be a {{label, text}} block, got {type(value).__name__}")
    if not isinstance(labels, list) or not isinstance(texts, list) or len(labels) != len(texts):
        raise AdapterError(f"field {key!r} needs equally long 'label' and 'text' lists")
    if not labels or len(labels) > len(LETTERS):
        raise AdapterError(f"field {key!r} has {len(labels)} choices; 1 to {len(LETTERS)} allowed")
    pairs = [(str(label).strip(), text) for label, text in zip(labels, texts, strict=True)]
    if any(not isinstance(text, str) for _, text in pairs):
        raise AdapterError(f"field {key!r}: every choice text must be a string")
    if len({label for label, _ in pairs}) != len(pairs):
        raise AdapterError(f"field {key!r} has repeated labels {[label for label, _ in pairs]}")
    pairs.sort(key=lambda p: (0, int(p[0]), "") if p[0].isdigit() else (1, 0, p[0]))
    return [label for label, _ in pairs], [text.strip() for _, text in pairs]


def _choice_letter(gold: Any, labels: list[str], key: str) -> str:
    """The gold label as the letter of its position (label order), as the prompt letters them."""
    if isinstance(gold, bool) or not isinstance(gold, str | int):
        raise AdapterError(f"field {key!r} must be a choice label, got {type(gold).__name__}")
    label = str(gold).strip()
    if not label:
        raise EmptyAnswer(f"empty gold answer in field {key!r}")
    if label not in labels:
        raise AdapterError(f"field {key!r} = {label!r} is not one of the labels {labels}")
    return LETTERS[labels.index(label)]


def _indexed_choice(gold: Any, n_choices: int, key: str) -> str:
    """MMLU gold: an index 0..n-1 (int or digit string) or already a letter -> the letter."""
    if isinstance(gold, str) and gold.strip().isdigit():
        gold = int(gold.strip())
    if isinstance(gold, int) and not isinstance(gold, bool):
        if not 0 <= gold < n_choices:
            raise AdapterError(f"field {key!r} = {gold} is not an index into {n_choices} choices")
        return LETTERS[gold]
    if isinstance(gold, str) and gold.strip().upper() in LETTERS[:n_choices]:
        return gold.strip().upper()
    raise AdapterError(f"field {key!r} must be a choice index or letter, got {gold!r}")


def _string_list(value: Any, key: str) -> list[str]:
    if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
        raise AdapterError(f"field {key!r} must be a non-empty list of strings")
    if len(value) > len(LETTERS):
        raise AdapterError(f"field {key!r} has {len(value)} choices; at most {len(LETTERS)} allowed")
    return [c.strip() for c in value]


# ---------------------------------------------------------------------------------------------
# Adapters
# ---------------------------------------------------------------------------------------------


GSM8K_FIELDS: dict[str, Keys] = {"question": "question", "answer": "answer", "id": "idx"}


@register_adapter("gsm8k")
def gsm8k(record: dict, index: int, fields: Mapping[str, str], source: str) -> Problem:
    """GSM8K: gold = the number after '####'; the whole worked solution is kept in `solution`."""
    f = _Fields(record, fields, GSM8K_FIELDS)
    solution = f.text("answer")
    return Problem(
        problem_id=f.problem_id(index),
        source=source,
        question=f.text("question"),
        answer=_after_hashes(solution, f.key("answer")),
        answer_type="math",
        solution=solution,
    )


MATH_FIELDS: dict[str, Keys] = {
    "question": ("problem", "question"),
    "answer": "answer",
    "solution": "solution",
    "level": "level",
    "subject": ("subject", "type"),
    "id": "unique_id",
}
MINERVA_FIELDS: dict[str, Keys] = {
    "question": ("problem", "question"),
    "answer": "answer",
    "solution": "solution",
    "subject": "type",
    "id": "idx",
}


def _math_gold(f: _Fields) -> str:
    """The `answer` field if the record has a non-empty one, else the solution's last box."""
    answer = f.get("answer", required=False)
    if answer is not None and not (isinstance(answer, str) and not answer.strip()):
        return _number_or_latex(answer, f.key("answer"))
    solution = f.text("solution", required=False)
    if solution is None:
        raise AdapterError(
            f"missing field {f.key('answer')!r} and field {f.key('solution')!r} to take a "
            "\\boxed{} answer from"
        )
    boxed = last_boxed(solution)
    if boxed is None:
        raise AdapterError(f"no \\boxed{{...}} in field {f.key('solution')!r} (and no answer field)")
    # a "$ $" inside the box is typesetting left in the source (one Minerva answer has it)
    return _nonempty(_UNESCAPED_DOLLAR.sub("", boxed).strip(), f.key("solution"))


def _math_like(record: dict, index: int, fields: Mapping[str, str], source: str,
               defaults: Mapping[str, Keys]) -> Problem:
    f = _Fields(record, fields, defaults)
    subject = f.get("subject", required=False)
    return Problem(
        problem_id=f.problem_id(index),
        source=source,
        question=f.text("question"),
        answer=_math_gold(f),
        answer_type="math",
        solution=f.text("solution", required=False),
        level=_level(f.get("level", required=False)),
        subject=None if subject is None else str(subject),
    )


@register_adapter("math")
def math_problem(record: dict, index: int, fields: Mapping[str, str], source: str) -> Problem:
    """MATH (MATH-500, MATH train): gold from `answer`, else the last \\boxed{} of `solution`.

    `level` 3 or "Level 3" becomes "3" ("Level ?" becomes "?"); `subject` falls back to `type`.
    """
    return _math_like(record, index, fields, source, MATH_FIELDS)


@register_adapter("minerva")
def minerva(record: dict, index: int, fields: Mapping[str, str], source: str) -> Problem:
    """Minerva Math (OCW): gold = the last \\boxed{} of `solution` (or `answer` where a copy has it).

    Units after the box ("\\boxed{1.6} \\mathrm{~cm}") stay out of the gold answer.
    """
    return _math_like(record, index, fields, source, MINERVA_FIELDS)


OLYMPIAD_FIELDS: dict[str, Keys] = {
    "question": "question",
    "context": "context",
    "answer": "final_answer",
    "solution": "solution",
    "subject": "subfield",
    "id": "id",
}


def _olympiad_gold(value: Any, key: str) -> str:
    """`final_answer` (a list of '$...$' strings, or one string) -> '$' stripped, joined by ', '."""
    answers = value if isinstance(value, list) else [value]
    if not all(isinstance(a, str | int | float) and not isinstance(a, bool) for a in answers):
        raise AdapterError(f"field {key!r} must be a list of strings")
    parts = [_strip_math_delimiters(str(a)) for a in answers]
    return _nonempty(", ".join(p for p in parts if p), key)


@register_adapter("olympiadbench")
def olympiadbench(record: dict, index: int, fields: Mapping[str, str], source: str) -> Problem:
    """OlympiadBench (open-ended, text-only): gold = `final_answer` without '$', joined by ', '.

    The `unit` stays out of both the gold answer and the question: OlympiadBench's own prompt asks
    for the answer without its unit in the box, and Qwen2.5-Math's evaluation compares the bare
    value; the question text states the unit where it matters. A non-empty `context` (shared set-up
    text of some problems) is put before the question.
    """
    f = _Fields(record, fields, OLYMPIAD_FIELDS)
    question = f.text("question")
    if context := f.text("context", required=False):
        question = f"{context}\n{question}"
    solution = f.get("solution", required=False)
    if isinstance(solution, list):
        solution = "\n\n".join(str(s) for s in solution)
    subject = f.get("subject", required=False)
    return Problem(
        problem_id=f.problem_id(index),
        source=source,
        question=question,
        answer=_olympiad_gold(f.get("answer"), f.key("answer")),
        answer_type="math",
        solution=solution or None,
        subject=None if subject is None else str(subject),
    )


AIME_FIELDS: dict[str, Keys] = {
    "question": ("problem", "question"),
    "answer": "answer",
    "solution": "solution",
    "id": "id",
}


@register_adapter("aime")
def aime(record: dict, index: int, fields: Mapping[str, str], source: str) -> Problem:
    """AIME: gold is an integer 0-999 as its canonical string ("025" -> "25")."""
    f = _Fields(record, fields, AIME_FIELDS)
    return Problem(
        problem_id=f.problem_id(index),
        source=source,
        question=f.text("question"),
        answer=_integer(f.get("answer"), f.key("answer")),
        answer_type="math",
        solution=f.text("solution", required=False),
    )


AIMO_AIME_FIELDS: dict[str, Keys] = {**AIME_FIELDS, "url": "url"}
_YEAR = re.compile(r"(?<!\d)(19|20)\d\d(?!\d)")


def _aime_of_year(year: int):
    """An AIME adapter that keeps one year of a multi-year file, by the year in the record's url."""

    def adapter(record: dict, index: int, fields: Mapping[str, str], source: str) -> Problem:
        f = _Fields(record, fields, AIMO_AIME_FIELDS)
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
    f = _Fields(record, fields, AMC_FIELDS)
    return Problem(
        problem_id=f.problem_id(index),
        source=source,
        question=f.text("question"),
        answer=_number_or_latex(f.get("answer"), f.key("answer")),
        answer_type="math",
    )


CHOICE_FIELDS: dict[str, Keys] = {
    "question": "question",
    "choices": "choices",
    "answer": "answerKey",
    "id": "id",
}


@register_adapter("csqa")
@register_adapter("arc")
def labelled_choice(record: dict, index: int, fields: Mapping[str, str], source: str) -> Problem:
    """CommonsenseQA and ARC: ``choices {label, text}`` and an `answerKey` label.

    Choices are the texts in label order and the gold is the letter of the keyed choice's position,
    so ARC's numeric labels "1".."4" become "A".."D". The copies in icml_kd carry a teacher model's
    `response`; it is never read.
    """
    f = _Fields(record, fields, CHOICE_FIELDS)
    labels, texts = _labelled_choices(f.get("choices"), f.key("choices"))
    return Problem(
        problem_id=f.problem_id(index),
        source=source,
        question=f.text("question"),
        answer=_choice_letter(f.get("answer"), labels, f.key("answer")),
        answer_type="choice",
        choices=texts,
    )


MMLU_FIELDS: dict[str, Keys] = {
    "question": "question",
    "choices": "choices",
    "answer": "answer",
    "subject": ("subject", "type"),
    "id": "id",
}


@register_adapter("mmlu")
def mmlu(record: dict, index: int, fields: Mapping[str, str], source: str) -> Problem:
    """MMLU: a list of choices and an integer index into it; gold is the index's letter."""
    f = _Fields(record, fields, MMLU_FIELDS)
    choices = _string_list(f.get("choices"), f.key("choices"))
    subject = f.get("subject", required=False)
    return Problem(
        problem_id=f.problem_id(index),
        source=source,
        question=f.text("question"),
        answer=_indexed_choice(f.get("answer"), len(choices), f.key("answer")),
        answer_type="choice",
        choices=choices,
        subject=None if subject is None else str(subject),
    )


GPQA_FIELDS: dict[str, Keys] = {
    "question": "Question",
    "answer": "Correct Answer",
    "incorrect_1": "Incorrect Answer 1",
    "incorrect_2": "Incorrect Answer 2",
    "incorrect_3": "Incorrect Answer 3",
    "solution": "Explanation",
    "subject": "High-level domain",
    "id": "Record ID",
}
GPQA_SHUFFLE_SEED = 0
"""Seed of GPQA's option order (ours: the paper does not give its order)."""


def option_order(problem_id: str, n: int, seed: int = GPQA_SHUFFLE_SEED) -> list[int]:
    """A fixed shuffle of options 0..n-1 for one problem: sorted by sha256("seed:id:k").

    It depends on the problem id and the seed only (not on the file's order or the Python
    version), so every run, rank and machine letters a record's options the same way.
    """
    def key(k: int) -> str:
        return hashlib.sha256(f"{seed}:{problem_id}:{k}".encode()).hexdigest()

    return sorted(range(n), key=key)


@register_adapter("gpqa")
def gpqa(record: dict, index: int, fields: Mapping[str, str], source: str) -> Problem:
    """GPQA (Idavidrein/gpqa): the correct answer and three incorrect ones, shuffled per record.

    The record keeps the correct answer in a column of its own, so the four options (correct
    first, then incorrect 1-3) are put in the order of :func:`option_order` (by the record's
    `Record ID`, else its position) and the gold is the letter the correct answer lands on.
    """
    f = _Fields(record, fields, GPQA_FIELDS)
    problem_id = f.problem_id(index)
    correct = f.get("answer")
    if not isinstance(correct, str):
        raise AdapterError(f"field {f.key('answer')!r} must be a string, got {type(correct).__name__}")
    correct = _nonempty(correct.strip(), f.key("answer"))
    options = [correct] + [f.text(f"incorrect_{i}") for i in (1, 2, 3)]
    if correct in options[1:]:
        raise AdapterError(f"field {f.key('answer')!r} repeats an incorrect answer: {correct!r}")
    order = option_order(problem_id, len(options))
    subject = f.get("subject", required=False)
    return Problem(
        problem_id=problem_id,
        source=source,
        question=f.text("question"),
        answer=LETTERS[order.index(0)],
        answer_type="choice",
        choices=[options[k] for k in order],
        solution=f.text("solution", required=False),
        subject=None if subject is None else str(subject),
    )


STRATEGYQA_FIELDS: dict[str, Keys] = {"question": "question", "answer": "answer", "id": "qid"}


@register_adapter("strategyqa")
def strategyqa(record: dict, index: int, fields: Mapping[str, str], source: str) -> Problem:
    """StrategyQA: a boolean gold as "yes"/"no". `facts` and `decomposition` would give the
    reasoning away, so only the question is read."""
    f = _Fields(record, fields, STRATEGYQA_FIELDS)
    return Problem(
        problem_id=f.problem_id(index),
        source=source,
        question=f.text("question"),
        answer=_yes_no(f.get("answer"), f.key("answer")),
        answer_type="boolean",
    )


VERL_FIELDS: dict[str, Keys] = {
    "question": "prompt",
    "answer": "reward_model.ground_truth",
    "id": "extra_info.index",
}
VERL_SUFFIX = "Let's think step by step and output the final answer within \\boxed{}."
"""The instruction verl's math preprocessing appends; our templates give their own."""


def _chat_question(value: Any, key: str) -> str:
    """The last user message of a chat prompt (or the prompt itself), without verl's suffix."""
    if isinstance(value, list):
        users = [m.get("content") for m in value if isinstance(m, Mapping) and m.get("role") == "user"]
        if not users or not isinstance(users[-1], str):
            raise AdapterError(f"field {key!r} has no user message")
        value = users[-1]
    if not isinstance(value, str):
        raise AdapterError(f"field {key!r} must be a chat message list or a string")
    question = value.strip().removesuffix(VERL_SUFFIX).strip()
    if not question:
        raise AdapterError(f"field {key!r} is empty")
    return question


@register_adapter("verl")
def verl(record: dict, index: int, fields: Mapping[str, str], source: str) -> Problem:
    """verl RLVR parquet rows (``prompt`` chat list, ``reward_model.ground_truth``)."""
    f = _Fields(record, fields, VERL_FIELDS)
    answer = f.get("answer")
    return Problem(
        problem_id=f.problem_id(index),
        source=source,
        question=_chat_question(f.get("question"), f.key("question")),
        answer=_number_or_latex(answer, f.key("answer")),
        answer_type="math",
    )


DAPO_FIELDS: dict[str, Keys] = {
    "question": "prompt",
    "answer": "reward_model.ground_truth",
    "id": "extra_info.index",
}
DAPO_INSTRUCTION = "The last line of your response should be of the form Answer:"
"""The sentence of DAPO-Math-17k's instruction that every prompt must carry exactly once."""
DAPO_PREFIX = (
    "Solve the following math problem step by step. The last line of your response should be of "
    "the form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
)
DAPO_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'
"""DAPO-Math-17k's prompt is DAPO_PREFIX + problem + DAPO_SUFFIX, one user message."""


def _single_user_message(value: Any, key: str) -> str:
    """The content of a chat prompt that is one user message (or a plain string), unchanged."""
    if isinstance(value, list):
        roles = [m.get("role") if isinstance(m, Mapping) else type(m).__name__ for m in value]
        if roles != ["user"]:
            # a system turn or an earlier exchange would be lost: our templates wrap one message
            raise AdapterError(f"field {key!r} must hold one user message, got roles {roles}")
        value = value[0].get("content")
    if not isinstance(value, str):
        raise AdapterError(f"field {key!r} must be a chat message list or a string, got "
                           f"{type(value).__name__}")
    if not value.strip():
        raise AdapterError(f"field {key!r} is empty")
    return value


@register_adapter("dapo_math")
def dapo_math(record: dict, index: int, fields: Mapping[str, str], source: str) -> Problem:
    """DAPO-Math-17k (BytedTsinghua-SIA/DAPO-Math-17k): verl rows whose prompt is the whole task.

    The question is the user message's content as it is, the "Answer:" instruction included
    (verl only applies the chat template to it), so the dataset's template must be the chat
    wrapping alone. The gold is ``reward_model.ground_truth`` exactly as written, not even
    stripped: verl hands that string to ``math_dapo`` unchanged, and its normaliser is not blind
    to surrounding whitespace (its thousands-comma rule skips "1,000\\n"). A missing, null, empty
    or non-string gold is an error, not a skipped record: every row of the data set has one, so
    its absence means a wrong column or a broken copy, and training on a silently smaller set is
    worse than stopping. The id is ``extra_info.index`` (a UUID; the common copy repeats each
    prompt 100 times under one UUID: load it with ``deduplicate: true``).
    """
    f = _Fields(record, fields, DAPO_FIELDS)
    key = f.key("answer")
    gold = f.get("answer")
    if not isinstance(gold, str):
        raise AdapterError(f"field {key!r} must be a string, got {type(gold).__name__}")
    if not gold.strip():
        raise AdapterError(f"empty field {key!r}: every DAPO-Math-17k record has a gold answer")
    return Problem(
        problem_id=f.problem_id(index),
        source=source,
        question=_single_user_message(f.get("question"), f.key("question")),
        answer=gold,
        answer_type="math",
    )


GENERIC_FIELDS: dict[str, Keys] = {
    "question": "question",
    "answer": "answer",
    "answer_type": (),
    "choices": "choices",
    "solution": "solution",
    "level": "level",
    "subject": "subject",
    "id": "id",
}


def _answer_type(f: _Fields) -> str:
    """`fields['answer_type']` names the type itself (math, choice, boolean) or a record key."""
    named = f.fields.get("answer_type", "math")
    kind = named if named in ANSWER_TYPES else f.get("answer_type")
    if kind not in ANSWER_TYPES:
        raise AdapterError(f"answer type {kind!r} is not one of {list(ANSWER_TYPES)}")
    return kind


def _generic_choices(value: Any, key: str) -> tuple[list[str] | None, list[str] | None]:
    """(labels, texts): labels only for a {label, text} block; a plain list is lettered A, B, ..."""
    if value is None:
        return None, None
    if isinstance(value, list) and all(isinstance(c, str) for c in value):
        return None, _string_list(value, key)
    return _labelled_choices(value, key)


@register_adapter("generic")
def generic(record: dict, index: int, fields: Mapping[str, str], source: str) -> Problem:
    """Any flat dataset described by `fields` alone: question, answer, answer_type, choices, id.

    `answer_type` defaults to math (gold kept as written, numbers canonical); for choice the gold
    may be a label of a {label, text} block, an index or a letter; for boolean a bool or yes/no.
    """
    f = _Fields(record, fields, GENERIC_FIELDS)
    kind = _answer_type(f)
    gold, key = f.get("answer"), f.key("answer")
    labels, choices = _generic_choices(f.get("choices", required=False), f.key("choices"))
    if kind == "choice":
        if choices is None:
            raise AdapterError(f"a choice answer needs field {f.key('choices')!r}")
        answer = _choice_letter(gold, labels, key) if labels else _indexed_choice(gold, len(choices), key)
    elif kind == "boolean":
        answer = _yes_no(gold, key)
    else:
        answer = _number_or_latex(gold, key)
    subject = f.get("subject", required=False)
    return Problem(
        problem_id=f.problem_id(index),
        source=source,
        question=f.text("question"),
        answer=answer,
        answer_type=kind,
        choices=choices,
        solution=f.text("solution", required=False),
        level=_level(f.get("level", required=False)),
        subject=None if subject is None else str(subject),
    )


# ---------------------------------------------------------------------------------------------
# Reading files and loading sources
# ---------------------------------------------------------------------------------------------


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


def load_hub(src: HubSource, source_label: str) -> list[Problem]:
    """Problems of a Hugging Face dataset split (or a local dataset folder), via `src.adapter`."""
    get_adapter(src.adapter)  # fail before a download
    import datasets  # lazily: a slow import that only hub sources need

    label = hub_label(src)
    split = datasets.load_dataset(src.dataset, src.config, split=src.split, revision=src.revision)
    rows = ((f"{label}: row index {i}", dict(row)) for i, row in enumerate(split))
    return normalise(rows, src.adapter, src.fields, source_label, levels=src.levels,
                     limit=src.limit, deduplicate=getattr(src, "deduplicate", False),
                     label=label)
