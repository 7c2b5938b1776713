"""The `rollout` section: the base model's rollouts on training prompts."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from .base import Strict, engine_kwargs_field
from .checks import check_engine_kwargs


class Rollout(Strict):
    """Base-model rollouts on training prompts (input of the token-statistics stage)."""

    backend: Literal["hf", "vllm"] = Field("hf", description="hf: transformers; vllm: vLLM (GPU, or "
                                           "its CPU build)")
    prompts: int = Field(64, gt=0, description="training prompts sampled")
    n: int = Field(8, gt=0, description="responses per prompt")
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_new_tokens: int = Field(64, gt=0)
    batch_size: int = Field(64, gt=0, description="sequences per generation batch (hf)")
    engine_kwargs: dict[str, Any] = engine_kwargs_field("rollout stage's")

    @model_validator(mode="after")
    def _engine_kwargs(self) -> Rollout:
        check_engine_kwargs(self.engine_kwargs)
        return self
