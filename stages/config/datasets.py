"""The `datasets` section: where each dataset's records come from, its template and its grader.

`templates` is a plain mapping of names to prompt strings; the cross-section checks
(stages.config.checks) make sure each dataset's template exists and holds '{question}'."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from .base import Name, Strict


class GeneratedSource(Strict):
    """Arithmetic problems with worked solutions from our deterministic generator."""

    kind: Literal["generated"] = "generated"
    n: int = Field(gt=0, description="number of problems")
    min_terms: int = Field(2, ge=2, description="fewest operands in an expression")
    max_terms: int = Field(4, ge=2, description="most operands in an expression")
    max_add: int = Field(19, ge=1, description="largest operand of + and -")
    max_mul: int = Field(9, ge=1, description="largest operand of *")
    split: Literal["train", "test"] = Field(
        "train", description="hash bucket of the question: train and test never share a question"
    )
    seed: int = Field(0, description="generator seed (added to the run seed)")
    style: Literal["expression", "word"] = Field(
        "expression", description="expression: '1+2*3=?'; word: the same arithmetic told as a short "
        "story ('Tom has 3 apples and buys 4 more. ...'; stages.core.data.problems.WORD_TEMPLATES)")

    @model_validator(mode="after")
    def _terms_ordered(self) -> GeneratedSource:
        if self.max_terms < self.min_terms:
            raise ValueError("max_terms must be >= min_terms")
        if self.style == "word" and self.max_terms > 3:
            raise ValueError("style 'word' tells one or two operations: max_terms must be <= 3")
        return self


class AdaptedSource(Strict):
    """What a hub dataset and a local file share: the adapter that turns a record into a problem,
    and which records to keep."""

    adapter: str = Field(description="record adapter (stages.core.data.adapters.ADAPTERS)")
    fields: dict[str, str] = Field(
        default_factory=dict, description="adapter field -> record field, where names differ"
    )
    levels: list[int] | None = Field(None, description="keep only these difficulty levels")
    limit: int | None = Field(None, gt=0, description="keep only the first `limit` records")
    deduplicate: bool = Field(
        False, description="keep the first record of each distinct question (DAPO-Math-17k's "
        "common copy repeats every prompt 100 times)")


class HubSource(AdaptedSource):
    """A Hugging Face dataset, read with datasets.load_dataset and normalised by an adapter."""

    kind: Literal["hub"] = "hub"
    dataset: str = Field(description="dataset id on the hub (or a local dataset folder)")
    config: str | None = Field(None, description="dataset configuration name")
    split: str = Field("test", description="split to read")
    revision: str | None = Field(None, description="branch, tag or commit of the dataset "
                                 "repository to fetch (None: main); the lock keeps its commit")
    commit: str | None = Field(None, description="the commit the run's hub.lock.yaml resolved "
                               "`revision` to: set by the workflow from the lock (leave it unset); "
                               "a result key")


class LocalSource(AdaptedSource):
    """A JSONL or Parquet file, normalised by an adapter."""

    kind: Literal["local"] = "local"
    path: str = Field(description="path of a .jsonl or .parquet file")


Source = Annotated[GeneratedSource | HubSource | LocalSource, Field(discriminator="kind")]


class Dataset(Strict):
    """One dataset of the run: SFT data, RL training prompts or a benchmark."""

    role: Literal["sft", "train", "benchmark"] = Field(description="what the dataset is used for")
    template: Name = Field(description="prompt template (a key of `templates`)")
    source: Source
    label: str | None = Field(None, description="name printed in tables (default: the key)")
    max_response_tokens: int | None = Field(
        None, gt=0, description="training: generation limit of this dataset's prompts "
        "(default train.max_response_tokens)")
    grader: Name = Field(
        "verify", description="how its responses are graded, for training rewards and evaluation "
        "alike (a registered grader, stages.core.reward.registry.GRADERS): verify = our extraction and "
        "math-verify; math_dapo = verl's DAPO reward (+1/-1 on the 'Answer:' line)")
    reported_as: str | None = Field(
        None, description="benchmark: the papers' name for it (e.g. AIME'24), whose reported "
        "numbers the tables print beside ours (stages.core.report.reported); None: none")
