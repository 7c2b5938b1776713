"""The `evaluate` section: the benchmark evaluation and what its tables report."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, model_validator

from .base import FieldError, Name, Strict, engine_kwargs_field
from .checks import check_engine_kwargs


class Evaluate(Strict):
    """Benchmark evaluation (METHODS §6, §8)."""

    backend: Literal["hf", "vllm"] = Field("hf", description="hf: transformers; vllm: vLLM (GPU, or "
                                           "its CPU build)")
    n: int = Field(8, gt=0, description="samples per problem")
    temperature: float = Field(0.6, gt=0)
    top_p: float = Field(0.95, gt=0, le=1)
    max_new_tokens: int = Field(4096, gt=0)
    k: list[int] = Field(default_factory=lambda: [1, 4], description="pass@k reported")
    bootstrap: int = Field(1000, gt=0, description="bootstrap resamples for the 95% interval")
    grade_timeout_s: float = Field(5.0, gt=0, description="hard limit of one grading call")
    batch_size: int = Field(64, gt=0, description="sequences per generation batch (hf)")
    main_methods: list[Name] | None = Field(
        None, min_length=1, description="methods of the main table; other experiment methods form the ablation table (default: all)"
    )
    headline: str = Field(
        "pass@4", description="the main table's metric: pass@k (k in evaluate.k) or avg@n "
        "(n = evaluate.n; the 80/20 paper's Acc@16 is avg@16, never pass@16)")
    graders: list[Name] = Field(
        default_factory=list, description="graders reported beside each benchmark's own "
        "(datasets.<name>.grader), sample by sample (stages.core.reward.registry.GRADERS)")
    curve_benchmarks: list[Name] | None = Field(
        None, description="benchmarks of the checkpoints saved every train.save_every steps "
        "(None: every experiment benchmark)")
    batch_invariant: bool = Field(
        False, description="vLLM: VLLM_BATCH_INVARIANT=1, so a problem's samples do not depend on "
        "the batch it shares (slower kernels; GPU only: refused by the CPU build; see the docs)")
    engine_kwargs: dict[str, Any] = engine_kwargs_field("evaluation stage's")

    @model_validator(mode="after")
    def _k_fits_n(self) -> Evaluate:
        check_engine_kwargs(self.engine_kwargs)
        if not self.k or min(self.k) < 1 or max(self.k) > self.n:
            raise FieldError("k", f"every k must be in [1, n={self.n}]")
        match = re.fullmatch(r"(pass|avg)@(\d+)", self.headline)
        if match is None:
            raise FieldError("headline", f"{self.headline!r} is neither pass@k nor avg@n")
        kind, number = match.group(1), int(match.group(2))
        if kind == "pass" and number not in self.k:
            raise FieldError("headline", f"{self.headline} is not reported (evaluate.k = {self.k})")
        if kind == "avg" and number != self.n:
            raise FieldError("headline", f"{self.headline}: avg@n is the mean over the n = "
                             f"{self.n} samples per problem (evaluate.n)")
        return self
