"""The `resources` section: what each rule's jobs ask the scheduler (SLURM) for. GPUs are per
model size: models.<size>.gpus."""

from __future__ import annotations

from pydantic import Field

from .base import Name, Strict


class ResourceOverride(Strict):
    """A model size's changes to a rule's request; an unset field keeps the rule's value."""

    cpus: int | None = Field(None, gt=0, description="CPU cores")
    mem_mb: int | None = Field(None, gt=0, description="memory in MB")
    runtime: int | None = Field(None, gt=0, description="walltime in minutes")


class RuleResources(Strict):
    """What each job of one rule asks the scheduler for."""

    cpus: int = Field(1, gt=0, description="CPU cores: the stage's threads and SLURM cpus-per-task")
    mem_mb: int = Field(4000, gt=0, description="memory of the job in MB (SLURM --mem)")
    runtime: int = Field(60, gt=0, description="walltime in minutes (SLURM --time)")


class SizedRuleResources(RuleResources):
    """A rule that runs once per model size; `sizes` overrides its request for some sizes."""

    sizes: dict[Name, ResourceOverride] = Field(
        default_factory=dict, description="model size -> changes to this rule's request"
    )

    def for_size(self, size: str) -> RuleResources:
        """The request of this rule's jobs for one model size."""
        base = {k: getattr(self, k) for k in RuleResources.model_fields}
        if size in self.sizes:
            base.update(self.sizes[size].model_dump(exclude_none=True))
        return RuleResources(**base)


class Resources(Strict):
    """CPUs, memory and walltime per rule, read by the rules' `resources:` (workflow/rules/common.smk).

    The defaults fit the embedded CPU default; config/paper.yaml sets cluster-sized values."""

    prepare_data: RuleResources = Field(default_factory=RuleResources)
    base_model: SizedRuleResources = Field(default_factory=SizedRuleResources)
    rollout: SizedRuleResources = Field(default_factory=SizedRuleResources)
    token_stats: SizedRuleResources = Field(default_factory=SizedRuleResources)
    train: SizedRuleResources = Field(default_factory=SizedRuleResources)
    evaluate: SizedRuleResources = Field(default_factory=SizedRuleResources)
    tables: RuleResources = Field(default_factory=RuleResources)
    max_runtime: int | None = Field(
        None, gt=0, description="the longest walltime the site's partitions allow, minutes (their "
        "MaxTime): every job's request, resubmissions included, is capped at it, and the cost plan "
        "counts a training's attempts of at most this long (None: ask SLURM, `scontrol show "
        "partition` for the partition each job goes to and `sacctmgr show qos` for the MaxWall of "
        "$SBATCH_QOS, where they exist, and take the lower; no cap without either)")

    def of(self, rule: str, size: str | None = None) -> RuleResources:
        """The request of one rule's jobs (for one model size where the rule runs per size)."""
        spec = getattr(self, rule)
        return spec.for_size(size) if isinstance(spec, SizedRuleResources) and size else spec
