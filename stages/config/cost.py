"""The `cost` section: the cost plan's assumptions (python -m stages.plan --cost; stages.cost)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, field_validator

from .base import Name, Strict


class RuleRates(Strict):
    """One rule's own rates, where its jobs run another way than the others (a calibration
    writes them: a training's colocated engine decodes at another rate than an evaluation's, and
    each stage starts up in its own time); an unset field keeps the size's and `cost`'s."""

    generation_tokens_per_s: float | None = Field(None, gt=0, description="this rule's cost.generation_tokens_per_s")
    train_mfu: float | None = Field(None, gt=0, le=1, description="this rule's cost.train_mfu")
    startup_minutes: float | None = Field(None, ge=0, description="this rule's cost.startup_minutes")
    response_tokens: float | None = Field(
        None, gt=0, description="this rule's cost.response_tokens (the base model's rollouts "
        "are not the trained policy's)")


def known_rules(value: dict) -> dict:
    unknown = sorted(set(value) - set(RULES))
    if unknown:
        raise ValueError(f"{', '.join(unknown)}: not a rule the plan estimates ({', '.join(RULES)})")
    return value


class CostRates(Strict):
    """A model size's changes to the cost plan's assumptions; an unset field keeps `cost`'s."""

    generation_tokens_per_s: float | None = Field(None, gt=0, description="this size's cost.generation_tokens_per_s")
    train_mfu: float | None = Field(None, gt=0, le=1, description="this size's cost.train_mfu")
    response_tokens: float | None = Field(None, gt=0, description="this size's cost.response_tokens")
    eval_response_tokens: float | None = Field(None, gt=0, description="this size's cost.eval_response_tokens")
    generation_batches: float | None = Field(None, ge=1, description="this size's cost.generation_batches")
    prompt_tokens: float | None = Field(None, gt=0, description="this size's cost.prompt_tokens")
    step_overhead_s: float | None = Field(None, ge=0, description="this size's cost.step_overhead_s")
    rules: dict[Name, RuleRates] = Field(
        default_factory=dict, description="rule -> this size's own rates for it, over cost.rules")

    _rules = field_validator("rules")(lambda cls, value: known_rules(value))


RULES = ("train", "rollout", "token_stats", "evaluate", "evaluate_checkpoint", "overlap")
"""The rules the cost plan estimates."""


class Cost(Strict):
    """What the cost plan assumes where nothing is counted yet: lengths, throughputs and fixed
    times. Every value is an assumption until a GPU run calibrates it from its metrics.parquet
    (response_length_mean, generation_batches, tokens_per_second, time_s). Read only by the cost
    plan and the training rule's retries: no job's results depend on it."""

    gpu_tflops: float = Field(
        989.0, gt=0, description="peak dense bf16 tensor throughput of one GPU, TFLOP/s (H100 and "
        "H200 SXM: 989 by NVIDIA's datasheets, 1,979 being with sparsity; A100: 312)")
    train_mfu: float = Field(
        0.3, gt=0, le=1, description="share of gpu_tflops that the trainer's forwards and "
        "backwards reach, counted on unpadded tokens with every executed FLOP (the recomputation "
        "of gradient checkpointing included), so padding, ZeRO and sequence-parallel "
        "communication lower it; also the scoring passes' and the token-statistics stage's")
    generation_tokens_per_s: float = Field(
        2000.0, gt=0, description="tokens one GPU's share of a vLLM engine generates per second, "
        "in the training job's colocated engine and the rollout and evaluation jobs alike")
    prompt_tokens: float = Field(200, gt=0, description="mean prompt length, tokens")
    response_tokens: float = Field(
        1000, gt=0, description="mean generated tokens of a training or base-model rollout "
        "response before its limit: the plan cuts exponential lengths of this mean at each job's "
        "limit (ours: stages.core.plans.cost.capped_mean)")
    eval_response_tokens: float | None = Field(
        None, gt=0, description="the same of an evaluation sample, cut at the evaluation's limit "
        "(None: response_tokens)")
    generation_batches: float = Field(
        1.0, ge=1, description="dynamic sampling: mean generation batches per rollout step "
        "(verl's num_gen_batches; at most train.max_sampling_rounds)")
    step_overhead_s: float = Field(
        60.0, ge=0, description="seconds of every rollout step beside generation and the "
        "forwards: grading, the optimizer steps, the weights' reload into vLLM, sleep and wake")
    startup_minutes: float = Field(
        10.0, ge=0, description="minutes each job and each resubmitted training spends before "
        "its first step or sample: loading the model and its state, starting vLLM")
    # ours: the margin and the rounding; a GPU run's calibration narrows the margin
    walltime_margin: float | None = Field(
        None, ge=1, description="walltimes from the plan: each GPU job the plan estimates asks "
        "for its estimate (start-up included; a training's whole work) x this margin, rounded up "
        "to walltime_round_minutes, at most resources.<rule>.runtime (then the longest a job of "
        "the rule asks for: a longer training continues over attempts) and the partition's limit; "
        "a size's own resources.<rule>.sizes.<size>.runtime is a "
        "request set by hand and wins (the plan warns where it is below the estimate). None: every "
        "job asks for its configured runtime")
    walltime_round_minutes: int = Field(
        30, gt=0, description="walltimes from the plan are rounded up to a multiple of this, and "
        "are at least this long")
    problems: dict[Name, Annotated[int, Field(gt=0)]] = Field(
        default_factory=dict, description="benchmark -> its number of problems, where the plan's "
        "table of known sources (stages.cost.KNOWN_PROBLEMS) lacks it")
    sizes: dict[Name, CostRates] = Field(
        default_factory=dict, description="model size -> changes to the throughputs and lengths")
    rules: dict[Name, RuleRates] = Field(
        default_factory=dict, description="rule (train, rollout, token_stats, evaluate, "
        "evaluate_checkpoint, overlap) -> its own rates, over the size's")
    cpu_jobs: bool = Field(
        False, description="ours: estimate the jobs of sizes without GPUs too, each on its CPU "
        "processes (the rates then stand for a CPU's: gpu_tflops its peak, "
        "generation_tokens_per_s a process's); how the plan is checked against the default's "
        "CPU runs (stages.calibrate, docs/performance.md)")

    def of(self, size: str, rule: str | None = None) -> Cost:
        """These assumptions with one size's changes applied, then (given) one rule's."""
        own = self.sizes.get(size)
        changes = own.model_dump(exclude_none=True, exclude={"rules"}) if own else {}
        if rule is not None:
            for rules in (self.rules, own.rules if own else {}):
                if rule in rules:
                    changes |= rules[rule].model_dump(exclude_none=True)
        return self.model_copy(update=changes) if changes else self

    def eval_tokens(self) -> int:
        return self.eval_response_tokens or self.response_tokens

    _rules = field_validator("rules")(lambda cls, value: known_rules(value))
