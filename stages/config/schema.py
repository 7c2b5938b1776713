"""The top level of the config: Config, which holds every section, and the helpers the Snakefile and
the stages share (each training job's `train` section, section hashes)."""

from __future__ import annotations

from typing import Any

from pydantic import Field, ValidationError, model_validator

from .base import FieldError, Name, RefError, Strict, digest
from .checks import references_resolve
from .cost import Cost
from .datasets import Dataset
from .evaluate import Evaluate
from .experiment import Experiment
from .hub import Hub
from .methods import Method
from .models import ModelSize
from .numerics import Numerics
from .resources import Resources
from .rollout import Rollout
from .token_stats import TokenStats
from .train import Train


class Config(Strict):
    """The whole workflow configuration."""

    run: Name = Field(description="results go under results/<run>/")
    selector_modules: list[str] = Field(
        default_factory=list, description="modules (dotted names or .py paths) imported before "
        "validation, so that the selectors they register can be used by methods")
    seed: int = Field(0, description="base seed of every random choice")
    experiment: Experiment
    templates: dict[Name, str]
    datasets: dict[Name, Dataset]
    models: dict[Name, ModelSize]
    methods: dict[Name, Method]
    rollout: Rollout = Field(default_factory=Rollout)
    token_stats: TokenStats = Field(default_factory=TokenStats)
    train: Train = Field(default_factory=Train)
    evaluate: Evaluate = Field(default_factory=Evaluate)
    resources: Resources = Field(default_factory=Resources)
    cost: Cost = Field(default_factory=Cost)
    numerics: Numerics = Field(default_factory=Numerics)
    hub: Hub = Field(default_factory=Hub)

    @model_validator(mode="after")
    def _references_resolve(self) -> Config:
        references_resolve(self)
        return self

    # -- helpers shared by the Snakefile and the stages --------------------------------------

    def used_datasets(self) -> list[str]:
        """Datasets the grid needs, in a stable order."""
        names = [*self.experiment.train_datasets, *self.experiment.benchmarks]
        if self.experiment.sft_dataset and any(
            self.models[s].source == "scratch" for s in self.experiment.sizes
        ):
            names.insert(0, self.experiment.sft_dataset)
        return list(dict.fromkeys(names))

    def train_for(self, method: str | None = None, size: str | None = None) -> Train:
        """The `train` section one training job reads: `train`, then `models.<size>.train`,
        then `methods.<method>.train` applied (each a partial section; `loss` merges key by key)."""
        train = self.train
        layers = [(f"models.{size}.train", self.models[size].train if size else {}),
                  (f"methods.{method}.train", self.methods[method].train if method else {})]
        for where, changes in layers:
            if changes:
                train = _apply(train, changes, where)
        return train

    def for_method(self, method: str, size: str | None = None) -> Config:
        """This config as one training job reads it: `train` is train_for(method, size)."""
        train = self.train_for(method, size)
        return self if train is self.train else self.model_copy(update={"train": train})

    def section_hash(self, *keys: str) -> str:
        """Stable hash of the named parts of the config ('datasets/gsm8k', 'models/qwen2.5-7b').

        Paths use '/' because names may contain dots."""
        return digest({k: _lookup(self.model_dump(mode="json"), k) for k in keys})


def _apply(train: Train, changes: dict, where: str) -> Train:
    """`train` with a partial section applied; errors name `where` and the key."""
    merged = {**train.model_dump(), **changes}
    if isinstance(changes.get("loss"), dict):
        merged["loss"] = {**train.loss.model_dump(), **changes["loss"]}
    try:
        return Train.model_validate(merged)
    except ValidationError as err:
        e = err.errors()[0]
        loc = ".".join(str(p) for p in e["loc"])
        ctx = e.get("ctx", {}).get("error")
        if isinstance(ctx, FieldError):
            loc, msg = ctx.field, ctx.message
        else:
            msg = "unknown key" if e["type"] == "extra_forbidden" else e["msg"].removeprefix("Value error, ")
        raise RefError(where + (f".{loc}" if loc else ""), msg) from None


def _lookup(tree: Any, path: str) -> Any:
    for part in path.split("/"):
        tree = tree[part]
    return tree
