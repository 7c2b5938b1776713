r"""Graders (METHODS §5, §9): the registry behind ``grading.grade_many``, and verl's ``math_dapo``.

Graders
-------
A grader is one function ``f(responses, golds, answer_types, timeout_s) -> list[Grade]``
registered by name with :func:`register_grader`, which also declares what it gives:

    @register_grader("my_grader", scored=True, answer_types=("math",))
    def grade_mine(responses, golds, answer_types, timeout_s): ...

- ``scored=True``: the grader gives its own reward, ``Grade.score`` (on every Grade it returns),
  which replaces the config's reward_correct / reward_incorrect. ``scored=False``: it gives
  correctness only (``Grade.score`` is None) and the caller maps correctness to a reward.
- ``answer_types`` are the answer types it reads (default: all of ``answers.ANSWER_TYPES``); a
  batch holding another type is a ValueError naming the grader.
- A grader may also take the keyword-only options ``rel_tol`` and ``max_workers``; grade_many
  passes its own values of those it declares, and nothing else.

Call a grader through ``grading.grade_many(..., grader=name)`` (one name, or one per response):
it checks the batch, dispatches, and checks that one Grade per response came back with a score
exactly when the grader is scored. The grader is chosen per dataset (``datasets.<name>.grader``),
for training rewards and evaluation alike. Built in: ``verify`` (grading.py's extraction and
math-verify; scored=False) and ``math_dapo`` (below; scored=True; math answers only).

This module imports grading (for Grade and the verify grader); grading imports this module only
inside grade_many, so neither import is circular. Neither pulls in torch.

verl's ``math_dapo`` reward
---------------------------
:func:`dapo_math` gives what ``verl.utils.reward_score.math_dapo.compute_score(response, gold)``
gives with the defaults DAPO trains with (strict_box_verify=False, pause_tokens_index=None);
the 80/20 study's fork of verl carries the same file unchanged. Every quirk is kept, because the
reproduction must train on the same reward. Its steps, in order:

1. Window. Only the last 300 characters (code points) of the response are read. An "Answer:"
   line that starts before them is not seen; a window that starts inside the label ("swer: 5")
   finds nothing there.
2. Extraction. Every match of ``(?i)Answer\s*:\s*([^\n]+)`` in the window, scanned left to right
   without overlap; the last match's group is the prediction. No match: "[INVALID]", which is
   then normalised like any prediction (and stays "[INVALID]"). So:
   - no word boundary, any case (Unicode case folding: "ANSWER", "Final answer:", even the long
     s of "Anſwer:"), but the colon is required ("the answer is 5", "Answers: 5" do not match);
   - the group runs to the end of its line, so everything after the label stays ("Answer: 5
     apples", a trailing period, "Answer: 3. Answer: 4" gives "3.Answer:4": on one line only
     the first label counts, across lines the last line does);
   - ``\s*`` crosses line breaks: "Answer:\n42" gives "42"; an "Answer:" with only spaces after
     it keeps its last space (the group needs one character), which normalises to "";
   - a ``\boxed{}`` answer without an "Answer:" line is "[INVALID]".
3. Normalisation, the same for the prediction and the gold answer (Minerva's normaliser):
   a. keep the text after the last "=" ("x = 5" -> "5"; "x=" -> "").
   b. these substitutions, in this order, each everywhere (inside words too):
      "an " -> "", "a " -> "", ".$" -> "$", "\$" -> "", "\ " -> "", " " -> "" (the ASCII space
      only: tabs and no-break spaces stay), "mbox" -> "text", ",\text{and}" -> ",",
      "\text{and}" -> ",", "\text{m}" -> "\text{}".
   c. the strings of _REMOVED deleted, in that order, each in one pass ("ccmm" -> "cm") and
      inside words too: unit words ("meters" turns "parameters" into "para", "sue" "issue"
      into "is", "gm" "\sigma" into "\sia") and LaTeX debris (\ldots, \dots, \text{s},
      ^\circ, \;, ",\!", "{,}", '"', \mathrm{th}, ...).
   d. a line (the gold may have several) with two or more "$" becomes the text between its
      first two "$" ("$1$ or $2$" -> "1").
   e. ``\text{...}`` is unwrapped up to its first "}" (so ``\text{\text{a}}`` -> ``\text{a}``),
      then ``\textbf{...}``, then ``\overline{...}``, each in one pass.
   f. ``\boxed{`` is unwrapped up to the LAST "}" of its line, once per line (``\boxed{1},
      \boxed{2}`` -> ``1},\boxed{2``); ``\boxed 5`` and ``\fbox{5}`` stay.
   g. "frac", a character other than "{" and one more character (not a line break) become
      "frac{x}{y}": ``\frac12`` and ``\dfrac12`` -> ``\frac{1}{2}``, but ``\frac1{2}`` ->
      ``\frac{1}{{}2}`` and "fraction" -> "frac{t}{i}on".
   h. "sqrt" and a character other than "{" become "sqrt{c}": ``\sqrt2`` -> ``\sqrt{2}``,
      ``\sqrt[3]{8}`` -> ``\sqrt{[}3]{8}``.
   i. every "$" is removed.
   j. commas are removed only when what is left is all digits (``str.isdigit``, so "²" and
      other Unicode digits count): "1,000" -> "1000", but "-1,000", "1,000.5" and "(1,2)" keep
      theirs.
   k. surrounding whitespace is stripped, after j, so "1,000\t" keeps its comma.
4. Comparison. The two normalised strings must be equal: no numeric or symbolic equivalence
   ("0.5" vs "\frac{1}{2}", "05" vs "5", "5.0" vs "5" differ). The score is +1.0 when they are
   equal, else -1.0. So a gold that normalises to "" matches "Answer: x=", and a gold
   "[INVALID]" matches a response without an answer. The gold is normalised whole (never cut or
   searched for "Answer:").

verl's DAPO reward manager calls it with the response decoded with skip_special_tokens=True,
less one trailing EOS-token string, and the record's ``reward_model.ground_truth``. It adds the
overlong penalty to the score outside this function, never to the correctness (``acc``).

``strict_box=True`` gives upstream's other path (strict_box_verify=True): the last ``\boxed{...}``
(brace-matched; ``\boxed {`` is not one) of the last 100 characters, compared unnormalised with
the unnormalised gold; ``extracted`` is None when there is none. Its ``pause_tokens_index``
argument is left out: DAPO never passes it.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from stages.core.common.answers import ANSWER_TYPES
from stages.core.reward import grading
from stages.core.reward.grading import DEFAULT_REL_TOL, Grade

Grader = Callable[..., list[Grade]]

OPTIONS = ("rel_tol", "max_workers")
"""Keyword-only options a grader may declare; grade_many passes them to it."""


@dataclass(frozen=True)
class GraderSpec:
    """A registered grader: the function, whether it gives its own reward, what it reads."""

    name: str
    fn: Grader
    scored: bool
    answer_types: tuple[str, ...]
    options: tuple[str, ...]


GRADERS: dict[str, GraderSpec] = {}


def register_grader(name: str, *, scored: bool, answer_types: Sequence[str] = ANSWER_TYPES,
                    ) -> Callable[[Grader], Grader]:
    """Decorator: register a grader under `name`, with whether it gives its own reward
    (``Grade.score``) and the answer types it reads."""
    answer_types = tuple(answer_types)
    if unknown := set(answer_types) - set(ANSWER_TYPES):
        raise ValueError(f"grader {name!r} reads unknown answer types {sorted(unknown)}; "
                         f"known: {ANSWER_TYPES}")

    def decorate(fn: Grader) -> Grader:
        if name in GRADERS:
            raise ValueError(f"grader {name!r} is already registered")
        kwonly = [p.name for p in inspect.signature(fn).parameters.values()
                  if p.kind is inspect.Parameter.KEYWORD_ONLY]
        if unknown := set(kwonly) - set(OPTIONS):
            raise ValueError(f"grader {name!r} takes unknown options {sorted(unknown)}; "
                             f"known: {OPTIONS}")
        GRADERS[name] = GraderSpec(name, fn, bool(scored), answer_types, tuple(kwonly))
        return fn

    return decorate


def spec_of(name: str) -> GraderSpec:
    """The registered grader `name` (ValueError naming the registered ones otherwise)."""
    if name not in GRADERS:
        raise ValueError(f"unknown grader {name!r}; registered: {sorted(GRADERS)}")
    return GRADERS[name]


# ---------------------------------------------------------------------------------------------
# verl's math_dapo
# ---------------------------------------------------------------------------------------------
INVALID = "[INVALID]"
WINDOW = 300  # characters of the response read
STRICT_WINDOW = 100  # characters searched for a box by the strict path
_ANSWER_LINE = re.compile(r"Answer\s*:\s*([^\n]+)", re.IGNORECASE)
_SUBSTITUTIONS = (
    ("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""),
    ("mbox", "text"), (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"),
)
_REMOVED = (
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots",
    "sue", "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds",
    "meters", "meals", "edges", "students", "childrentickets", "multiples", "\\text{s}",
    "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}",
    "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;", ",\\!", "{,}", '"', "\\dots",
)
# "\cmd{" up to the first "}" of the line (step e)
_UNWRAP_FIRST = tuple(re.compile(re.escape(f"\\{cmd}{{") + r"([^}\n]*)\}")
                      for cmd in ("text", "textbf", "overline"))
_BOXED_TO_LAST = re.compile(r"\\boxed\{([^\n]*)\}")  # greedy: the line's last "}" (step f)
_FRAC_SHORT = re.compile(r"frac([^{])([^\n])")
_SQRT_SHORT = re.compile(r"sqrt([^{])")


@dataclass(frozen=True)
class DapoScore:
    """verl's math_dapo verdict: ``score`` ±1.0, ``correct`` (its ``acc``), and ``extracted``,
    the normalised prediction (its ``pred``: "[INVALID]" without an "Answer:" line; with
    ``strict_box`` the raw box content, None without a box)."""

    score: float
    correct: bool
    extracted: str | None


def _first_formula(line: str) -> str:
    """Step d: a line with two or more "$" becomes its first formula, still in "$"."""
    parts = line.split("$", 2)
    return f"${parts[1]}$" if len(parts) == 3 else line


def normalize_dapo(text: str) -> str:
    """Minerva's normaliser as math_dapo applies it (steps a-k of the module docstring)."""
    text = text.rsplit("=", 1)[-1]
    for old, new in _SUBSTITUTIONS:
        text = text.replace(old, new)
    for junk in _REMOVED:
        text = text.replace(junk, "")
    text = "\n".join(_first_formula(line) for line in text.split("\n"))
    for wrapper in _UNWRAP_FIRST:
        text = wrapper.sub(r"\1", text)
    text = _BOXED_TO_LAST.sub(r"\1", text)
    text = _FRAC_SHORT.sub(r"frac{\1}{\2}", text)
    text = _SQRT_SHORT.sub(r"sqrt{\1}", text)
    text = text.replace("$", "")
    if text.replace(",", "").isdigit():
        text = text.replace(",", "")
    return text.strip()


def _strict_box(response: str, gold: str) -> DapoScore:
    window = response[-STRICT_WINDOW:]  # of the 300-character window: its last 100
    start = window.rfind("\\boxed{")
    content = grading._braced(window, start + len("\\boxed")) if start >= 0 else None
    correct = content == gold
    return DapoScore(1.0 if correct else -1.0, correct, content)


def dapo_math(response: str, gold: str, *, strict_box: bool = False) -> DapoScore:
    """verl's ``math_dapo.compute_score(response, gold)``, quirks included (module docstring)."""
    if strict_box:
        return _strict_box(response, gold)
    matches = _ANSWER_LINE.findall(response[-WINDOW:])
    extracted = normalize_dapo(matches[-1] if matches else INVALID)
    correct = extracted == normalize_dapo(gold)
    return DapoScore(1.0 if correct else -1.0, correct, extracted)


# ---------------------------------------------------------------------------------------------
# Built-in graders
# ---------------------------------------------------------------------------------------------
@register_grader("verify", scored=False)
def grade_verify(responses: Sequence[str], golds: Sequence[str], answer_types: Sequence[str],
                 timeout_s: float, *, rel_tol: float = DEFAULT_REL_TOL,
                 max_workers: int = 1) -> list[Grade]:
    """Our extraction and math-verify (grading.py's module docstring)."""
    return grading.verify_many(responses, golds, answer_types, timeout_s, rel_tol=rel_tol,
                               max_workers=max_workers)


@register_grader("math_dapo", scored=True, answer_types=("math",))
def grade_math_dapo(responses: Sequence[str], golds: Sequence[str], answer_types: Sequence[str],
                    timeout_s: float) -> list[Grade]:
    """verl's math_dapo: ``Grade(correct, extracted, None, score=±1.0)`` (no time limit is
    needed: the work is a few string passes over 300 characters and the gold)."""
    grades = []
    for response, gold in zip(responses, golds, strict=True):
        result = dapo_math(grading._as_text(response), grading._as_text(gold))
        grades.append(Grade(result.correct, result.extracted, None, result.score))
    return grades
