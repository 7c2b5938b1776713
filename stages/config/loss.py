"""The `train.loss` section: the policy loss and its aggregation, each a registered name."""

from __future__ import annotations

from pydantic import Field, field_validator

from .base import Strict


class Loss(Strict):
    """The policy loss (by default the clipped surrogate) and its aggregation (METHODS §4)."""

    eps_low: float = Field(0.2, ge=0, lt=1, description="clip ratio below 1 (r ≥ 1 − eps_low)")
    eps_high: float = Field(0.28, ge=0, description="clip ratio above 1 (r ≤ 1 + eps_high; DAPO clip-higher)")
    denominator: str = Field(
        "selected", description="loss normaliser, a registered aggregation mode "
        "(stages.core.training.losses.LOSS_AGG_MODES): selected tokens, all valid tokens, or per sequence"
    )
    kl_beta: float = Field(0.0, ge=0, description="k3 KL to the base model (0 = off)")
    dual_clip: float | None = Field(None, gt=1, description="verl dual-clip c (None = off)")
    policy_loss: str = Field(
        "ppo_clip", description="per-token policy loss, a registered one "
        "(stages.core.training.losses.POLICY_LOSSES); ppo_clip: the clipped surrogate above")

    @field_validator("denominator", "policy_loss")
    @classmethod
    def _registered(cls, value: str, info) -> str:
        from ..core.training.losses import LOSS_AGG_MODES, POLICY_LOSSES

        known = {"denominator": LOSS_AGG_MODES, "policy_loss": POLICY_LOSSES}[info.field_name]
        if value not in known:
            kind = "loss aggregation mode" if info.field_name == "denominator" else "policy loss"
            raise ValueError(f"unknown {kind} {value!r}; registered: {sorted(known)}")
        return value
