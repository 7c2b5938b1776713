r"""The grader registry (METHODS §5, §9) and its entry points :func:`grade_many`, :func:`grade`
and :func:`is_correct`.

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

Call a grader through ``grade_many(..., grader=name)`` (one name, or one per response):
it checks the batch, dispatches, and checks that one Grade per response came back with a score
exactly when the grader is scored. The grader is chosen per dataset (``datasets.<name>.grader``),
for training rewards and evaluation alike. The built-in graders are one module each in
stages/core/reward/graders/, registered when stages.core.reward is imported: ``verify`` (our
extraction and math-verify; scored=False) and ``math_dapo`` (verl's DAPO reward,
stages/core/reward/scores/math_dapo.py; scored=True; math answers only). This module imports
only the Grade and the batch checks (grades.py), so a grader imports it without a circle; none
of them pulls in torch.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from stages.core.common.answers import ANSWER_TYPES
from stages.core.reward.grades import DEFAULT_REL_TOL, DEFAULT_TIMEOUT_S, Grade, checked_types

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


def grade_many(
    responses: Sequence[str],
    golds: Sequence[str],
    answer_types: Sequence[str] | str,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    *,
    rel_tol: float = DEFAULT_REL_TOL,
    max_workers: int = 1,
    grader: Sequence[str] | str = "verify",
) -> list[Grade]:
    """Grade a batch with the registered `grader` (GRADERS): one name for
    all, or one per response (a pool mixing datasets); `answer_types` may be one type for all.

    `rel_tol` and `max_workers` go to the graders that take them ("verify": see
    stages.core.reward.graders.verify.verify_many). A Grade of a scored grader carries its reward in ``score``. Raises
    ValueError for an unknown grader (naming the registered ones), an answer type the grader
    does not read, batch lengths that differ, or a grader that returns the wrong thing.
    """
    answer_types = checked_types(responses, golds, answer_types, timeout_s)
    names = [grader] * len(responses) if isinstance(grader, str) else list(grader)
    if len(names) != len(responses):
        raise ValueError(f"lengths differ: {len(responses)} responses, {len(names)} graders")
    # an unknown name is an error even in an empty batch
    specs = {name: spec_of(name) for name in ([grader] if isinstance(grader, str) else names)}
    batches: dict[str, list[int]] = {}
    for i, name in enumerate(names):
        batches.setdefault(name, []).append(i)
    for name, indices in batches.items():
        if unread := {answer_types[i] for i in indices} - set(specs[name].answer_types):
            raise ValueError(f"grader {name!r} reads answer types {specs[name].answer_types}, "
                             f"got {sorted(unread)}")

    options = {"rel_tol": rel_tol, "max_workers": max_workers}
    grades: list[Grade | None] = [None] * len(responses)
    for name, indices in batches.items():
        spec = specs[name]
        out = spec.fn([responses[i] for i in indices], [golds[i] for i in indices],
                      [answer_types[i] for i in indices], timeout_s,
                      **{key: options[key] for key in spec.options})
        if len(out) != len(indices) or not all(isinstance(g, Grade) for g in out):
            raise ValueError(f"grader {name!r} must return one Grade per response")
        if any((g.score is None) == spec.scored for g in out):
            raise ValueError(f"grader {name!r} is registered with scored={spec.scored}: its "
                             f"Grades must {'all' if spec.scored else 'never'} carry a score")
        for i, g in zip(indices, out, strict=True):
            grades[i] = g
    return grades


def grade(
    response: str,
    gold: str,
    answer_type: str,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    *,
    rel_tol: float = DEFAULT_REL_TOL,
    grader: str = "verify",
) -> Grade:
    """Grade one response against its gold answer with `grader` (by default "verify": the rules
    of stages/core/reward/graders/verify.py)."""
    return grade_many([response], [gold], [answer_type], timeout_s, rel_tol=rel_tol,
                      grader=grader)[0]


def is_correct(response: str, gold: str, answer_type: str) -> bool:
    """Whether `response` states the gold answer: the reward's public entry point."""
    return grade(response, gold, answer_type).correct
