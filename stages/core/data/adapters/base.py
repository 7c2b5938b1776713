"""What every adapter shares: the registry, the errors, reading a record's fields, and the small
parsers that turn a gold answer into its canonical string.

A family module imports from here only (never from the package), so the registry is filled by
the package's ``__init__`` importing the families, with no circle.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from typing import Any

from stages.core.data.problems import LETTERS, Problem

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


class Fields:
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


def nonempty(answer: str, key: str) -> str:
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


def number_or_latex(value: Any, key: str) -> str:
    """A gold answer given as a number or a string, stripped; '27.0' and 27.0 become '27'.

    Other strings stay as written (LaTeX, '0.50', '4.5e33'): the grader compares them
    symbolically, and rewriting them here could only lose information.
    """
    if isinstance(value, str):
        text = value.strip()
        if whole := _WHOLE_DECIMAL.fullmatch(text):
            return whole.group(1)
        return nonempty(text, key)
    return _plain_number(value, key)


_INTEGER = re.compile(r"[-+]?\d+")


def integer(value: Any, key: str) -> str:
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



def level(value: Any) -> str | None:
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


def yes_no(value: Any, key: str) -> str:
    """Boolean gold as 'yes'/'no' (JSON bools, or the strings yes/no/true/false)."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, str) and value.strip().lower() in _YES | _NO:
        return "yes" if value.strip().lower() in _YES else "no"
    raise AdapterError(f"field {key!r} must be a boolean or yes/no, got {value!r}")


def labelled_choices(value: Any, key: str) -> tuple[list[str], list[str]]:
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


def choice_letter(gold: Any, labels: list[str], key: str) -> str:
    """The gold label as the letter of its position (label order), as the prompt letters them."""
    if isinstance(gold, bool) or not isinstance(gold, str | int):
        raise AdapterError(f"field {key!r} must be a choice label, got {type(gold).__name__}")
    label = str(gold).strip()
    if not label:
        raise EmptyAnswer(f"empty gold answer in field {key!r}")
    if label not in labels:
        raise AdapterError(f"field {key!r} = {label!r} is not one of the labels {labels}")
    return LETTERS[labels.index(label)]


def indexed_choice(gold: Any, n_choices: int, key: str) -> str:
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


def string_list(value: Any, key: str) -> list[str]:
    if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
        raise AdapterError(f"field {key!r} must be a non-empty list of strings")
    if len(value) > len(LETTERS):
        raise AdapterError(f"field {key!r} has {len(value)} choices; at most {len(LETTERS)} allowed")
    return [c.strip() for c in value]
