"""verl-format parquet rows (a chat ``prompt``, ``reward_model.ground_truth``): verl's own math
rows, and DAPO-Math-17k, whose prompt is the whole task."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from stages.core.data.adapters.base import (
    AdapterError,
    Fields,
    Keys,
    number_or_latex,
    register_adapter,
)
from stages.core.data.problems import Problem

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
    f = Fields(record, fields, VERL_FIELDS)
    answer = f.get("answer")
    return Problem(
        problem_id=f.problem_id(index),
        source=source,
        question=_chat_question(f.get("question"), f.key("question")),
        answer=number_or_latex(answer, f.key("answer")),
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
    f = Fields(record, fields, DAPO_FIELDS)
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
