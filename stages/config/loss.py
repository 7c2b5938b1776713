"""The `train.loss` section: the clipped surrogate and its aggregation."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .base import Strict


class Loss(Strict):
    """Clipped surrogate and its aggregation (METHODS §4)."""

    eps_low: float = Field(0.2, ge=0, lt=1, description="clip ratio below 1 (r ≥ 1 − eps_low)")
    eps_high: float = Field(0.28, ge=0, description="clip ratio above 1 (r ≤ 1 + eps_high; DAPO clip-higher)")
    denominator: Literal["selected", "all", "sequence"] = Field(
        "selected", description="loss normaliser: selected tokens, all valid tokens, or per sequence"
    )
    kl_beta: float = Field(0.0, ge=0, description="k3 KL to the base model (0 = off)")
    dual_clip: float | None = Field(None, gt=1, description="verl dual-clip c (None = off)")
