r"""verl's ``math_dapo`` reward (METHODS §5): :func:`dapo_math`, which the "math_dapo" grader
(stages/core/reward/graders/math_dapo.py) gives as its Grades.

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

import re
from dataclasses import dataclass

from stages.core.reward.extraction import braced

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
    content = braced(window, start + len("\\boxed")) if start >= 0 else None
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
