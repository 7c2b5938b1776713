"""The normalised problem schema and our deterministic arithmetic generators.

Every prepared dataset (SFT data, RL prompts, benchmarks) has the columns of
:data:`PROBLEM_SCHEMA`, whatever its source, so one polars scan reads them all.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import asdict, dataclass, field

import pyarrow as pa

from stages.core.common.answers import ANSWER_TYPES, LETTERS

PROBLEM_SCHEMA = pa.schema(
    [
        pa.field("problem_id", pa.string(), nullable=False),
        pa.field("source", pa.string(), nullable=False),
        pa.field("question", pa.string(), nullable=False),
        pa.field("prompt", pa.string(), nullable=False),
        pa.field("answer", pa.string(), nullable=False),
        pa.field("answer_type", pa.string(), nullable=False),
        pa.field("choices", pa.list_(pa.string()), nullable=True),
        pa.field("solution", pa.string(), nullable=True),
        pa.field("level", pa.string(), nullable=True),
        pa.field("subject", pa.string(), nullable=True),
    ]
)


@dataclass(frozen=True)
class Problem:
    """One normalised record; `prompt` is filled in by :func:`render_prompt`."""

    problem_id: str
    source: str
    question: str
    answer: str
    answer_type: str
    choices: list[str] | None = None
    solution: str | None = None
    level: str | None = None
    subject: str | None = None
    prompt: str = field(default="")

    def __post_init__(self) -> None:
        if self.answer_type not in ANSWER_TYPES:
            raise ValueError(f"answer_type must be one of {ANSWER_TYPES}, got {self.answer_type!r}")
        if self.answer_type == "choice" and not self.choices:
            raise ValueError("a choice problem needs its choices")

    def row(self) -> dict:
        return asdict(self)


def render_prompt(template: str, problem: Problem) -> str:
    """Fill a template. `{question}` is the question, with lettered options for choice problems."""
    question = problem.question
    if problem.choices:
        options = "\n".join(f"{LETTERS[i]}. {c}" for i, c in enumerate(problem.choices))
        question = f"{question}\n{options}"
    return template.replace("{question}", question)


# ---------------------------------------------------------------------------------------------
# Generated arithmetic with worked solutions
# ---------------------------------------------------------------------------------------------


def split_of(question: str) -> str:
    """Stable train/test bucket of a question (10% test), so the splits never share one."""
    bucket = hashlib.sha256(question.encode()).digest()[0] % 10
    return "test" if bucket == 0 else "train"


def _expression(rng: random.Random, terms: int, max_add: int, max_mul: int) -> str:
    parts = [str(rng.randint(0, max_add))]
    for _ in range(terms - 1):
        # no chained products: a*b*c leaves the times table
        op = rng.choice("+-" if parts[-2:-1] == ["*"] else "+-*")
        operand = rng.randint(0, max_mul) if op == "*" else rng.randint(0, max_add)
        if op == "*" and int(parts[-1]) > max_mul:
            # keep products within the times table: a*b needs both factors <= max_mul
            parts[-1] = str(rng.randint(0, max_mul))
        parts += [op, str(operand)]
    return "".join(parts)


def worked_solution(expression: str) -> tuple[str, int]:
    """Steps for `expression` (+, -, * on non-negative integers): products first, then left to right.

    >>> worked_solution("61+82-82*1")
    ('82*1=82, 61+82=143, 143-82=61. #### 61', 61)
    """
    tokens: list[str] = []
    number = ""
    for ch in expression:
        if ch.isdigit():
            number += ch
        else:
            tokens += [number, ch]
            number = ""
    tokens.append(number)
    steps = []
    # products, left to right, each step one multiplication
    i = 1
    while i < len(tokens):
        if tokens[i] == "*":
            a, b = int(tokens[i - 1]), int(tokens[i + 1])
            steps.append(f"{a}*{b}={a * b}")
            tokens[i - 1 : i + 2] = [str(a * b)]
        else:
            i += 2
    value = int(tokens[0])
    for j in range(1, len(tokens), 2):
        b = int(tokens[j + 1])
        new = value + b if tokens[j] == "+" else value - b
        steps.append(f"{value}{tokens[j]}{b}={new}")
        value = new
    return f"{', '.join(steps)}. #### {value}", value


def generate_arithmetic(
    n: int,
    *,
    seed: int,
    min_terms: int = 2,
    max_terms: int = 4,
    max_add: int = 19,
    max_mul: int = 9,
    split: str = "train",
    source: str = "generated",
    style: str = "expression",
) -> list[Problem]:
    """`n` distinct problems of the given split; the same arguments give the same list.

    style "word" tells the arithmetic as stories (:func:`generate_word_problems`)."""
    if style == "word":
        return generate_word_problems(n, seed=seed, min_terms=min_terms, max_terms=max_terms,
                                      max_add=max_add, max_mul=max_mul, split=split, source=source)
    if style != "expression":
        raise ValueError(f"style must be 'expression' or 'word', got {style!r}")
    rng = random.Random(f"arith:{seed}:{min_terms}:{max_terms}:{max_add}:{max_mul}")

    def draw():
        expression = _expression(rng, rng.randint(min_terms, max_terms), max_add, max_mul)
        question = f"{expression}=?"

        def make() -> Problem:
            solution, value = worked_solution(expression)
            return Problem(
                problem_id=hashlib.sha256(question.encode()).hexdigest()[:12],
                source=source,
                question=question,
                answer=str(value),
                answer_type="math",
                solution=solution,
                level=str(expression.count("+") + expression.count("-") + expression.count("*") + 1),
            )

        return question, question, make

    return _draw_distinct(n, split, f"problems with terms {min_terms}-{max_terms}, max_add "
                          f"{max_add}, max_mul {max_mul}", draw)


def _draw_distinct(n: int, split: str, what: str, draw) -> list[Problem]:
    """`n` problems from draw() -> (key, question that decides the split, make), keeping the
    first of each key whose question falls in `split`; make() builds the Problem."""
    seen: set[str] = set()
    problems: list[Problem] = []
    attempts = 0
    while len(problems) < n:
        attempts += 1
        if attempts > 50 * n + 1000:
            raise ValueError(f"cannot draw {n} distinct {split} {what}: the space is too small")
        key, question, make = draw()
        if key in seen or split_of(question) != split:
            continue
        seen.add(key)
        problems.append(make())
    return problems


# ---------------------------------------------------------------------------------------------
# The same arithmetic as short word problems
# ---------------------------------------------------------------------------------------------

NAMES = ("Tom", "Anna", "Sam", "Lily", "Ben", "Mia", "Leo", "Zoe", "Max", "Emma", "Noah", "Ava")
ITEMS = ("apples", "pencils", "marbles", "stickers", "cookies", "books", "cards", "shells",
         "stamps", "balloons", "coins", "flowers")
CONTAINERS = ("boxes", "bags", "baskets", "jars", "packs", "plates")

# One entry per arithmetic pattern: the operators of the expression, and the stories that tell
# it. {a}, {b}, {c} are the operands in order; {name}, {item}, {box} are drawn per problem.
WORD_TEMPLATES: dict[str, tuple[str, ...]] = {
    "+": (
        "{name} has {a} {item} and buys {b} more. How many {item} does {name} have now?",
        "{name} picked {a} {item} in the morning and {b} in the afternoon. How many {item} did "
        "{name} pick in all?",
        "There are {a} {item} on the table and {name} puts {b} more on it. How many {item} are "
        "on the table now?",
    ),
    "-": (
        "{name} has {a} {item} and gives {b} to a friend. How many {item} does {name} have left?",
        "{name} had {a} {item} and lost {b} of them. How many {item} does {name} have now?",
        "There are {a} {item} in a basket. {name} takes {b} out. How many {item} are left in the "
        "basket?",
    ),
    "*": (
        "There are {a} {box} with {b} {item} in each. How many {item} are there in total?",
        "{name} buys {a} {box} of {item}, and each has {b} {item}. How many {item} does {name} buy?",
    ),
    "++": (
        "{name} has {a} {item}, buys {b} more and then finds {c} more. How many {item} does "
        "{name} have now?",
    ),
    "+-": (
        "{name} has {a} {item}, gets {b} more and then gives away {c}. How many {item} does "
        "{name} have now?",
        "There are {a} {item} in a jar. {name} adds {b} and later takes out {c}. How many {item} "
        "are in the jar?",
    ),
    "-+": (
        "{name} has {a} {item}, gives away {b} and then buys {c} more. How many {item} does "
        "{name} have now?",
    ),
    "*+": (
        "{name} buys {a} {box} with {b} {item} in each and already had {c} {item}. How many "
        "{item} does {name} have now?",
    ),
    "*-": (
        "There are {a} {box} with {b} {item} in each. {name} gives away {c} {item}. How many "
        "{item} are left?",
    ),
}


def _word_expression(rng: random.Random, terms: int, max_add: int, max_mul: int) -> str:
    """An expression of one of WORD_TEMPLATES' patterns whose every partial count is >= 0 and
    whose operands are >= 2 (a story has neither 0 boxes, nor "1 apples", nor a negative count)."""
    pattern = rng.choice([k for k in WORD_TEMPLATES if len(k) == terms - 1])
    while True:
        operands = [rng.randint(2, max_mul if (i < 2 and pattern[0] == "*") else max_add)
                    for i in range(terms)]
        expression = str(operands[0]) + "".join(
            op + str(v) for op, v in zip(pattern, operands[1:], strict=True))
        if all(v >= 0 for v in _partials(expression)):
            return expression


def _partials(expression: str) -> list[int]:
    steps = worked_solution(expression)[0].split(". ####")[0].split(", ")
    return [int(step.rsplit("=", 1)[1]) for step in steps]


def _pattern(expression: str) -> str:
    return "".join(ch for ch in expression if ch in "+-*")


def word_problem(rng: random.Random, expression: str) -> str:
    """A story for `expression` (a pattern of WORD_TEMPLATES), names and items drawn from `rng`."""
    template = rng.choice(WORD_TEMPLATES[_pattern(expression)])
    operands = [int(x) for x in expression.replace("+", " ").replace("-", " ").replace("*", " ").split()]
    return template.format(name=rng.choice(NAMES), item=rng.choice(ITEMS), box=rng.choice(CONTAINERS),
                           **dict(zip("abc"[: len(operands)], operands, strict=True)))


def generate_word_problems(
    n: int,
    *,
    seed: int,
    min_terms: int = 2,
    max_terms: int = 3,
    max_add: int = 19,
    max_mul: int = 9,
    split: str = "train",
    source: str = "generated",
) -> list[Problem]:
    """`n` word problems of one or two operations (2 or 3 terms) of the given split, distinct in
    their arithmetic; the same arguments give the same list.

    The split is that of the expression ('3+4=?' by :func:`split_of`), not of the story, so a test
    story never tells the arithmetic of a training story, or of a training expression problem.
    The worked solution is the expression's (:func:`worked_solution`)."""
    if not 2 <= min_terms <= max_terms <= 3:
        raise ValueError(f"word problems have 2 or 3 terms (one or two operations), got "
                         f"min_terms {min_terms}, max_terms {max_terms}")
    rng = random.Random(f"word:{seed}:{min_terms}:{max_terms}:{max_add}:{max_mul}")

    def draw():
        expression = _word_expression(rng, rng.randint(min_terms, max_terms), max_add, max_mul)
        story = word_problem(rng, expression)  # drawn before the checks: one rng stream

        def make() -> Problem:
            solution, value = worked_solution(expression)
            return Problem(
                problem_id=hashlib.sha256(story.encode()).hexdigest()[:12],
                source=source,
                question=story,
                answer=str(value),
                answer_type="math",
                solution=solution,
                level=str(len(_pattern(expression)) + 1),
            )

        return expression, f"{expression}=?", make

    return _draw_distinct(n, split, f"word problems with terms {min_terms}-{max_terms}, max_add "
                          f"{max_add}, max_mul {max_mul}", draw)
