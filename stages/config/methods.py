"""The `methods` section: each training method, a registered token selector with its parameters."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from .base import Name, Strict


class MethodEvaluate(Strict):
    """What a method may change in the evaluation of its trained models (not the protocol)."""

    max_new_tokens: int | None = Field(
        None, gt=0, description="generation limit of its evaluations (None: evaluate.max_new_tokens)")


class Method(BaseModel):
    """A training method: a registered token selector, its parameters and a dense warm-up.

    Every key beside the ones below is a parameter of the selector, validated against its
    registered parameter model (stages.core.training.selectors), whose defaults are METHODS §3's."""

    model_config = ConfigDict(extra="allow", strict=True, frozen=True)

    selector: Name = Field(description="a registered selector (stages.core.training.selectors.SELECTORS)")
    label: str | None = Field(None, description="name printed in tables (default: the key)")
    warmup_steps: int = Field(
        0, ge=0, description="dense warm-up: the first N rollout steps train every valid token "
        "(ICT's Θ; must be shorter than train.steps)")
    rescore: bool = Field(
        True, description="score the selector's inputs with the current policy for each "
        "mini-batch once the policy has moved (True), or use the sampling policy's scores of the "
        "rollout step throughout (False, as ICT's paper does)")
    paper_row: str | None = Field(
        None, description="the papers' reported row this method stands for, printed beside ours "
        "(a key of stages.core.report.reported.REPORTED_ROWS; None: no reported numbers)")
    selection_scope: Literal["minibatch", "microbatch"] = Field(
        "minibatch", description="where a selector that ranks positions across a batch ranks them: "
        "minibatch = the whole optimizer mini-batch (every micro-batch and rank), on the scores "
        "`rescore` says; microbatch = the released 80/20 code's: one of verl's micro-batches in "
        "train.virtual_layout (balanced over its ranks, cut by its token budget), scored by the "
        "current policy, its loss the mean over its own selected tokens x its share of its "
        "data-parallel group's mini-batch, averaged over the groups (needs train.virtual_layout, "
        "loss.denominator 'selected' and rescore; per-response selectors such as ICT's rule "
        "refuse it)")
    train: dict[str, Any] = Field(
        default_factory=dict, description="this method's changes to the `train` section, e.g. "
        "{max_response_tokens: 29696} for the 80/20 paper's 29k run (validated as `train` is; the "
        "training job's config hash follows them)")
    evaluate: MethodEvaluate = Field(
        default_factory=lambda: MethodEvaluate(), description="this method's changes to the "
        "evaluation of its trained models")

    def selector_params(self) -> dict:
        """The selector's keyword parameters: the configured ones with the model's defaults."""
        return self.params().model_dump()

    def params(self):
        """The selector's validated parameter model (pydantic.ValidationError if invalid)."""
        from ..core.training.selectors import spec_of

        return spec_of(self.selector).validate(dict(self.model_extra or {}))

    def needs(self) -> frozenset[str]:
        """The selection inputs the selector reads with these parameters."""
        from ..core.training.selectors import spec_of

        return spec_of(self.selector).needs(self.params())
