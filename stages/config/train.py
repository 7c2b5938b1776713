"""The `train` section: masked RLVR training (its `loss` in stages.config.loss) and the released
80/20 code's virtual layout."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from stages.core.models.parallel import sequence_parallel_misfit

from .base import FieldError, Strict, engine_kwargs_field
from .checks import TRAIN_ENGINE_SET_BY_US, check_engine_kwargs
from .loss import Loss


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
        if why := sequence_parallel_misfit(self.sequence_parallel, self.world_size,
                                           f"world_size ({self.world_size})"):
            raise FieldError("sequence_parallel", why)
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
    generation_batch_size: int = Field(64, gt=0, description="sequences per batch of the hf backend's decode loop")
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
        "there. Set it above one step's time plus a save and below the job's walltime "
        "(resources.train.runtime, checked: a longer lead would signal the job at its start) "
        "(None: no signal)")
    stop_after_steps: int | None = Field(
        None, gt=0, description="ours: a pilot's forced save and resume: each attempt of a "
        "training stops after this many steps, writes a resume state and exits (status 75) as on "
        "SIGURG, so that the retries resubmit it and the next attempt resumes there (None: "
        "attempts end at the time limit or the last step)")
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
            raise FieldError("overlong_buffer", f"{self.overlong_buffer} is not shorter than "
                            f"max_response_tokens ({self.max_response_tokens})")
        if self.offload_params and self.zero_stage != 3:
            raise FieldError("offload_params", "offloading parameters needs zero_stage 3")
        if self.offload_optimizer and self.zero_stage == 0:
            raise FieldError("offload_optimizer", "offloading optimizer states needs zero_stage 1-3")
        if self.sequence_parallel > 1 and self.attn_implementation == "eager":
            raise FieldError("sequence_parallel", "Ulysses sequence parallelism needs sdpa or "
                            "flash_attention_2 attention, not eager (train.attn_implementation)")
        if self.padding_free and self.attn_implementation == "eager":
            raise FieldError("padding_free", "padding-free packing needs sdpa or flash_attention_2 "
                            "attention, not eager (train.attn_implementation)")
        return self
