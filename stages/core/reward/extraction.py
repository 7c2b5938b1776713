"""The final answer of a response (METHODS §5): the extraction rules of the "verify" grader.

Extraction rules (:func:`extract_answer`)
-----------------------------------------
- ``math``: the content of the last ``\\boxed{...}`` or ``\\fbox{...}`` (nested braces; also
  ``\\boxed 5``). Only the last one is considered: if it is empty or its braces never close, the
  fallbacks are used: the text after the last "answer:" / "answer is" (to the end of its line),
  then the text after the last ``####``. Of that line the final value is taken: its last
  ``$...$`` (with the formulas before it that only commas, "and" or "or" separate from it), or a
  number stated after it ("The largest $n$ is 34." gives 34), else the line itself. There is
  deliberately no last-number fallback over the whole response: it would reward answers the model
  never committed to.
- ``choice``: one capital letter A–J, from the first rule that gives one: (1) the last boxed
  content, (2) the text after the last "answer:" / "answer is" (``**Answer:** (B)``, "the answer
  is option C"), (3) the last non-empty line when it is a lone option ("B", "(B)", "B.") or
  starts with "B. " / "B) ", (4) the last "(B)" anywhere. Lower-case letters are never taken
  ("a" is a word).
- ``boolean``: "yes"/"no" from the boxed content, then the answer marker, then the last
  standalone yes/no/true/false word of the response; true maps to yes, false to no.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Callable

from stages.core.common.answers import LETTERS
from stages.core.reward.grades import as_text, check_answer_type

MAX_ANSWER_CHARS = 1_000  # no benchmark answer is near this; longer ones are never parsed

BOX_COMMANDS = ("\\boxed", "\\fbox")
_ANSWER_MARKER = re.compile(r"answer\s*(?:is\s*:?|:)", re.IGNORECASE)
# "$...$" (an escaped "\$" inside is a dollar sign, as in "$\$18.90$") or "\(...\)"
_INLINE_MATH = re.compile(r"(?<!\\)\$+((?:\\.|[^$\\])+)\$+|\\\((.+?)\\\)")
_BOOL_WORD = re.compile(r"\b(yes|no|true|false)\b", re.IGNORECASE)
_PAREN_LETTER = re.compile(rf"\(([{LETTERS}])\)")
_LEADING_LETTER = re.compile(
    rf"^(?:(?:option|choice)\s*)?\(?([{LETTERS}])(?:$|[).:,\s])", re.IGNORECASE
)
# a final line that is only an option: "B", "(B)", "B.", or the option written out: "B. bank"
_OPTION_LINE = re.compile(rf"^\(?([{LETTERS}])\)?[.:)]?$|^([{LETTERS}])[.)]\s")
TEXT_WRAPPER = re.compile(
    r"\\(?:text|textbf|textrm|mathrm|mathbf|mbox|operatorname)\s*\{([^{}]*)\}"
)


def braced(text: str, open_index: int) -> str | None:
    """Content of the brace group opening at `open_index`, or None if it never closes."""
    depth = 0
    for match in re.finditer(r"[{}]", text[open_index:]):
        depth += 1 if match.group() == "{" else -1
        if depth == 0:
            return text[open_index + 1 : open_index + match.start()]
    return None


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed``/``\\fbox`` of `text` (None if absent, empty or unclosed)."""
    start, command = max((text.rfind(c), c) for c in BOX_COMMANDS)
    if start < 0:
        return None
    i = start + len(command)
    j = i
    while j < len(text) and text[j].isspace():
        j += 1
    if j < len(text) and text[j] == "{":
        content = braced(text, j)
    elif j > i:  # "\boxed 5": the argument is the next token
        content = re.match(r"[^\s$]*", text[j : j + MAX_ANSWER_CHARS + 1]).group()
    else:  # another macro such as \boxedanswer
        content = None
    return (content.strip() or None) if content is not None else None


def _line_from(text: str, start: int) -> str:
    """The rest of the line from `start`, at most a few answers long (keeps regexes linear)."""
    return text[start : start + 4 * MAX_ANSWER_CHARS].split("\n", 1)[0]


# between two formulas of one answer: "$1$, $2$ and $3$", "$x=1$ or $x=-1$"
_SPAN_JOINER = re.compile(r"\s*(?:[,;]\s*)?(?:(?:and|or)\s+)?", re.IGNORECASE)
# a number stated at the end of a line, maybe with a unit: "is 34.", "= 12 cm", "equals 1,234"
_STATED_NUMBER = (r"([-+]?\d[\d,]*(?:\.\d+)?(?:\s*%|(?:\s+(?!(?:and|or)\b)[A-Za-z]+){0,3}))"
                  r"\s*[.!]?\s*$")
_TAIL_VALUE = re.compile(rf"\s*(?:is|are|was|equals|equal\s+to|=)\s*{_STATED_NUMBER}", re.I)
_PROSE_VALUE = re.compile(rf"\s(?:is|are|was|equals|equal\s+to)\s+{_STATED_NUMBER}", re.I)


def _clean_inline(text: str) -> str:
    """The final value of one line of prose ("Final Answer: The largest $n$ is 34." -> "34").

    With formulas: the last one, together with the formulas before it that only commas, "and"
    or "or" separate from it ("$1$ and $-1$" -> "1, -1"); but a number stated after the last
    formula wins ("$n$ is 34", "$x$ = 5"). Without formulas: a number stated at the line's end
    after "is"/"are"/"equals" ("the largest n is 34"), else the whole line.
    """
    text = text.replace("**", "").strip()
    spans = list(_INLINE_MATH.finditer(text))
    if spans:
        run = [spans[-1]]
        for previous in reversed(spans[:-1]):
            if not _SPAN_JOINER.fullmatch(text, previous.end(), run[0].start()):
                break
            run.insert(0, previous)
        value = ", ".join((m.group(1) or m.group(2)).strip() for m in run)
        if stated := _TAIL_VALUE.match(text, spans[-1].end()):
            value = stated.group(1)
    else:
        stated = _PROSE_VALUE.search(text)
        value = stated.group(1) if stated else text
    return value.strip().rstrip(". ").strip()


def _last_match(pattern: re.Pattern, text: str) -> re.Match | None:
    last = deque(pattern.finditer(text), maxlen=1)  # linear, unlike a greedy ".*" prefix
    return last[0] if last else None


def _after_answer_marker(text: str) -> str | None:
    """The rest of the line after the last "answer:" / "answer is", cleaned."""
    last = _last_match(_ANSWER_MARKER, text)
    if last is None:
        return None
    rest = _line_from(text, last.end()).strip()
    rest = re.sub(r"I hope it is correct\.?$", "", rest)  # the Minerva answer template
    return _clean_inline(rest) or None


def _after_hashes(text: str) -> str | None:
    """The rest of the line after the last ``####`` (GSM8K and our arithmetic data)."""
    start = text.rfind("####")
    if start < 0:
        return None
    return _clean_inline(_line_from(text, start + 4)) or None


def _extract_math(text: str) -> str | None:
    return last_boxed(text) or _after_answer_marker(text) or _after_hashes(text)


def _leading_letter(text: str) -> str | None:
    """The option letter that `text` starts with ("B", "(B)", "B. bank", "option B")."""
    text = TEXT_WRAPPER.sub(r"\1", text).replace("*", "").replace("$", "").strip()
    match = _LEADING_LETTER.match(text)
    if match is None or not match.group(1).isupper():
        return None
    return match.group(1)


def _extract_choice(text: str) -> str | None:
    boxed = last_boxed(text)
    if boxed and (letter := _leading_letter(boxed)):
        return letter
    marker = _after_answer_marker(text)
    if marker and (letter := _leading_letter(marker)):
        return letter
    last_line = text.rstrip().rsplit("\n", 1)[-1][:MAX_ANSWER_CHARS]
    option = _OPTION_LINE.match(last_line.replace("*", "").strip())
    if option:
        return option.group(1) or option.group(2)
    found = _last_match(_PAREN_LETTER, text)
    return found.group(1) if found else None


def yes_no(word: str) -> str:
    return "yes" if word.lower() in ("yes", "true") else "no"


def _extract_boolean(text: str) -> str | None:
    for candidate in (last_boxed(text), _after_answer_marker(text)):
        if candidate:
            match = _BOOL_WORD.search(TEXT_WRAPPER.sub(r"\1", candidate))
            if match:
                return yes_no(match.group(1))
    word = _last_match(_BOOL_WORD, text)
    return yes_no(word.group(1)) if word else None


_EXTRACTORS: dict[str, Callable[[str], str | None]] = {
    "math": _extract_math,
    "choice": _extract_choice,
    "boolean": _extract_boolean,
}


def extract_answer(response: str, answer_type: str) -> str | None:
    """The final answer of `response` by the rules of the module docstring, or None.

    ``math`` gives the raw answer text, ``choice`` a capital letter, ``boolean`` "yes"/"no".
    """
    check_answer_type(answer_type)
    return _EXTRACTORS[answer_type](as_text(response))
