"""The `experiment` section: the grid of sizes, methods, benchmarks and seeds."""

from __future__ import annotations

from pydantic import Field

from .base import Name, Strict


class Experiment(Strict):
    """The grid: sizes x methods x benchmarks x seeds; everything else follows from it."""

    sizes: list[Name] = Field(min_length=1)
    methods: list[Name] = Field(min_length=1)
    benchmarks: list[Name] = Field(min_length=1)
    seeds: list[int] = Field(default_factory=lambda: [0], min_length=1)
    sft_dataset: Name | None = Field(None, description="SFT data of scratch models")
    train_datasets: list[Name] = Field(
        min_length=1, description="RL training prompts (several: one mixed prompt pool)")
