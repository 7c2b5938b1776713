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

The package, one module per source family, each a file to read top to bottom:

- ``base``: the registry, the errors, :class:`~stages.core.data.adapters.base.Fields` and the
  answer parsers every family shares (``last_boxed``, ``level_number``, ...);
- ``word_problems``: GSM8K;
- ``math_like``: MATH, Minerva Math, OlympiadBench;
- ``competitions``: AIME (and ``aimo_aime2023``), AMC;
- ``choice``: CommonsenseQA and ARC, MMLU, GPQA (with :func:`option_order`);
- ``yes_no``: StrategyQA;
- ``verl_format``: verl's math rows and DAPO-Math-17k;
- ``flat_records``: ``generic``, any flat file described by ``fields``;
- ``loading``: reading files and hub splits into problems (:func:`load_local`, :func:`load_hub`).

A new adapter is one file: a function decorated with ``@register_adapter("name")`` (from this
package or its ``base``) returning a ``Problem``. A built-in family is imported below, which fills
the registry; a user's module is listed in ``selector_modules``. Every name the adapters had as one
module is re-exported here, so ``stages.core.data.adapters.<name>`` keeps working.
"""

from __future__ import annotations

from stages.core.data.adapters.base import (
    ADAPTERS,
    Adapter,
    AdapterError,
    EmptyAnswer,
    Keys,
    NotInSubset,
    get_adapter,
    last_boxed,
    level_number,
    register_adapter,
)

# the built-in families, in the order they registered as one module
# isort: off
from stages.core.data.adapters.word_problems import GSM8K_FIELDS, gsm8k
from stages.core.data.adapters.math_like import (
    MATH_FIELDS,
    MINERVA_FIELDS,
    OLYMPIAD_FIELDS,
    math_problem,
    minerva,
    olympiadbench,
)
from stages.core.data.adapters.competitions import (
    AIME_FIELDS,
    AIMO_AIME_FIELDS,
    AMC_FIELDS,
    aime,
    amc,
)
from stages.core.data.adapters.choice import (
    CHOICE_FIELDS,
    GPQA_FIELDS,
    MMLU_FIELDS,
    gpqa,
    labelled_choice,
    mmlu,
    option_order,
)
from stages.core.data.adapters.yes_no import STRATEGYQA_FIELDS, strategyqa
from stages.core.data.adapters.verl_format import (
    DAPO_FIELDS,
    DAPO_INSTRUCTION,
    DAPO_PREFIX,
    DAPO_SUFFIX,
    VERL_FIELDS,
    VERL_SUFFIX,
    dapo_math,
    verl,
)
from stages.core.data.adapters.flat_records import GENERIC_FIELDS, generic
from stages.core.data.adapters.loading import (
    hub_label,
    load_hub,
    load_local,
    normalise,
    read_records,
)
# isort: on

__all__ = [
    "ADAPTERS", "Adapter", "AdapterError", "EmptyAnswer", "Keys", "NotInSubset", "get_adapter",
    "last_boxed", "level_number", "register_adapter",
    "GSM8K_FIELDS", "gsm8k",
    "MATH_FIELDS", "MINERVA_FIELDS", "OLYMPIAD_FIELDS", "math_problem", "minerva", "olympiadbench",
    "AIME_FIELDS", "AIMO_AIME_FIELDS", "AMC_FIELDS", "aime", "amc",
    "CHOICE_FIELDS", "GPQA_FIELDS", "MMLU_FIELDS", "gpqa", "labelled_choice",
    "mmlu", "option_order",
    "STRATEGYQA_FIELDS", "strategyqa",
    "DAPO_FIELDS", "DAPO_INSTRUCTION", "DAPO_PREFIX", "DAPO_SUFFIX", "VERL_FIELDS", "VERL_SUFFIX",
    "dapo_math", "verl",
    "GENERIC_FIELDS", "generic",
    "hub_label", "load_hub", "load_local", "normalise", "read_records",
]
