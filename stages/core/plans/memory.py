"""The memory plan: estimated peak GPU memory per GPU and host memory per node of every job.

Pure functions of model dimensions and settings; sizes are bytes, and the tables print GB = 2**30
bytes (DeepSpeed's estimators and nvidia-smi's MiB / 1024 use the same unit). The stage module
stages/plan.py walks a config through these.

Model states (parameters, gradients, float32 master copies, Adam moments) start from DeepSpeed's
estimators, transcribed in :func:`ds_zero2_estimate` / :func:`ds_zero3_estimate` so that the
workflow can check a plan without importing DeepSpeed (tests/test_plan.py asserts they equal
deepspeed.runtime.zero.stage_1_and_2.estimate_zero2_model_states_mem_needs and
deepspeed.runtime.zero.stage3.estimate_zero3_model_states_mem_needs). Those assume 16-bit
parameters and gradients; :func:`model_states` adds what they leave out, each as a named term,
as DeepSpeed 0.19.8 allocates with our ds_config (stages.core.models.engine.ds_config: grad_accum_dtype
and communication_data_type float32, default buckets):

- float32 training keeps 4-byte parameters and, from ZeRO-1, a second float32 master partition;
- bf16 gradients reduce straight into the float32 partition (no 16-bit gradient partition);
- bf16 at ZeRO-1 is DeepSpeed's BF16_Optimizer: bf16 gradients of every parameter and an
  unpartitioned float32 gradient-accumulation buffer, until the step;
- ZeRO-0 is plain data parallelism: parameters, gradients and Adam moments in full;
- ZeRO-3 gathers the largest layer (parameters and gradients) while it computes, keeps whole
  any parameter under stage3_param_persistence_threshold (ours: 0, none), and fp32 ZeRO-3 keeps
  its partitioned parameters and the master partition as two float32 copies;
- buckets: ZeRO-1/2 allocate a reduce bucket of reduce_bucket_size (5e8) elements during each
  backward, in the parameters' dtype (bf16: 1 GB, fp32: 2 GB); ZeRO-3 keeps one of 5e8 float32
  elements for the whole run, plus a prefetch bucket of 5e7 parameters; ZeRO-0 flattens the
  gradients for the all-reduce in buckets of at most 5e8 elements.

Calibration (tests/test_plan.py): on the CPU accelerator torch.cuda.memory_allocated does not
exist and RSS counts the whole interpreter, so the test builds the tiny scratch models of
config/config.yaml and config/test.yaml in a DeepSpeed engine (stages.core.models.engine.build_engine,
gloo, one process), runs two optimizer steps (Adam's moments exist after the first), and sums
the bytes of every distinct storage the engine holds: the module's parameters, gradients and
buffers, and every tensor reachable from engine.optimizer (its torch optimizer's state, DeepSpeed's
float32 partitions and their gradients, gradient buffers). It measures once after the second
backward (gradients alive: the states at the step) and once after the step (the resident states
of the rollout phase); bucket buffers are counted apart. Estimated / measured bytes at the step,
tiny-m of config.yaml (525,824 parameters): float32 ZeRO-0 8,413,184 / 8,413,416, ZeRO-1 and 2
10,516,480 / 10,516,616, ZeRO-3 10,516,480 / 10,516,621; bf16 ZeRO-1 10,516,480 / 10,516,552,
ZeRO-2 9,464,832 / 9,464,904, ZeRO-3 9,464,832 / 9,464,909; every case of the three tiny models,
at the step and resident, agrees within 0.06% (the rest: the rotary inv_freq buffer and
DeepSpeed's scalar norms); ZeRO-3's kept bucket is exactly 5e8 x 4 bytes. On two gloo processes
(a slow test) the 1/N terms agree within 1.1% (docs/plan.md has every figure).

Activations (per token, bytes; w = 2 for bf16, 4 for float32; D hidden, I intermediate, qd and kvd
the query and key/value widths, H and KV their heads), measured on CPU with
torch.autograd.graph.saved_tensors_hooks on transformers' Qwen2 and Qwen3 (sdpa; the saved set of
GPU flash attention is the same: q, k, v, output and log-sum-exp), exact for 6 shapes:

- one decoder layer: w(4I + 2qd + 2kvd + 4D) + 4(2D + H) + 8 (the two RMSNorms keep float32
  copies and their rsqrt); Qwen3's q/k norms add (4 + w)(qd + kvd) + 4(H + KV);
- outside the layers: (4 + w)D (the final norm's float32 copy and the last hidden state);
- gradient checkpointing (non-reentrant) keeps w·D per layer, the layer's input.

The training phase adds one layer recomputed and one layer of activation gradients while it is
back-propagated (2 layers with checkpointing; 1 more without). Ulysses sequence parallelism splits
every token-proportional term by its degree.

Phases of a training job (stages/plan.py adds them up): load (stages.train loads the policy, and
the reference, whole onto each GPU before DeepSpeed partitions them); rollout (resident model
states, the reference, and the colocated vLLM engine's share, gpu_memory_utilization x GPU memory,
which must hold its weights, one max_model_len sequence's KV cache and its workspace); training
(model states at the step, buckets, activations, the chunked head, the reference, and what the
engine keeps asleep at level 2: weights and KV cache are freed); scoring between optimizer steps
(resident model states, the reference, the engine asleep, and a no-gradient forward of one
micro-batch with its statistics: the sampling pass and the rescoring passes, :func:`scoring_terms`).
Rollout, token-statistics and
evaluation jobs have one phase each.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from stages.core.plans.dimensions import (  # noqa: F401 - also read from here
    HUB_ARCHS,
    PERSISTENCE_THRESHOLD,
    PUBLISHED_PARAMS,
    Arch,
    UnknownModel,
    arch_from_hf_config,
    cached_hf_config,
    gguf_arch,
    hub_arch,
    hub_cache_dirs,
    scratch_arch,
)

GB = 2**30
"""Bytes per GB in every figure here (GiB, as DeepSpeed's estimators print)."""

# DeepSpeed 0.19.8 defaults (deepspeed/runtime/zero/config.py); our ds_config sets none of them.
REDUCE_BUCKET = 500_000_000
"""reduce_bucket_size, elements."""
ALLGATHER_BUCKET = 500_000_000
"""allgather_bucket_size, elements."""
PREFETCH_BUCKET = 50_000_000
"""stage3_prefetch_bucket_size, elements (ZeRO-3 gathers ahead of use)."""

# Fixed costs, not measured here (typical values; each is one named term in the tables).
CUDA_RUNTIME_GB = 1.5
"""Per GPU process: CUDA context, cuBLAS/NCCL workspaces and communicator buffers."""
VLLM_ASLEEP_GB = 2.0
"""A vLLM engine asleep at level 2 frees its weights and KV cache (stages.core.models.samplers); what
stays is its CUDA graphs and persistent buffers."""
VLLM_WORKSPACE_GB = 3.0
"""vLLM's own working memory beside weights and KV cache inside its share: the profiled forward
of a token budget, the sampler's float32 logits, CUDA graphs."""
VLLM_DEFAULT_UTILIZATION = 0.92
"""vLLM 0.31's gpu_memory_utilization when the job does not set it (rollout and evaluation jobs,
engine_kwargs; vllm/config/cache.py)."""
PROCESS_HOST_GB = 3.0
"""Host memory of one Python process with torch, CUDA and transformers loaded."""
VLLM_HOST_GB = 4.0
"""Host memory a vLLM engine adds to its process (scheduler, tokenizer, pinned buffers)."""
TOKEN_STATS_BATCH = 32
"""At most this many sequences per teacher-forcing forward of the token-statistics stage
(stages.core.statistics.scoring.response_hidden's batch_size; tests/test_plan.py checks it)."""
TOKEN_STATS_BATCH_TOKENS = 32768
"""Token budget of one teacher-forcing forward: sequences x longest prompt + response
(stages.core.statistics.scoring.response_hidden's batch_tokens; tests/test_plan.py checks it)."""
TOKEN_TABLE_BYTES = 256
"""Host bytes per response token of the token-statistics stage's per-token values, selection
grids and table: stages.token_stats.compute's peak RSS grew by 170-220 B per token between files
of 48k and 145k-193k tokens (tiny model, CPU; writing and figures not measured)."""
HEAD_BLOCKS = 2
"""float32 blocks of chunk_positions x chunk_vocab alive at once in the head with gradient: the
logits and their exponentials in the forward, the logits and d/dz in the recomputing backward."""
STATS_BLOCKS = 6
"""float32 blocks alive at once in the token statistics with JSD (p, q, p+q, ratio, terms, z)."""
DEFAULT_PROMPT_TOKENS = 1024
"""Prompt length assumed when train.max_prompt_tokens is unset (the config bounds only responses)."""


# ---------------------------------------------------------------------------------------------
# Terms
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Term:
    """One named part of an estimate: bytes, and the formula that gave them."""

    name: str
    bytes: float
    formula: str = ""

    @property
    def gb(self) -> float:
        return self.bytes / GB


@dataclass
class Figure:
    """A sum of terms: the memory of one phase on one GPU, or of one node's host."""

    terms: list[Term] = field(default_factory=list)

    @property
    def bytes(self) -> float:
        return sum(t.bytes for t in self.terms)

    @property
    def gb(self) -> float:
        return self.bytes / GB

    def add(self, *terms: Term) -> Figure:
        return Figure([*self.terms, *(t for t in terms if t.bytes)])


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a config dtype name."""
    return {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}[dtype]


# ---------------------------------------------------------------------------------------------
# DeepSpeed's estimators (transcribed; tests/test_plan.py compares them with DeepSpeed's own)
# ---------------------------------------------------------------------------------------------
def ds_zero2_estimate(total_params: int, num_gpus_per_node: int = 1, num_nodes: int = 1,
                      cpu_offload: bool = True, additional_buffer_factor: float = 1.5) -> tuple[int, int]:
    """(host bytes per node, GPU bytes per GPU) of ZeRO-2 model states with 16-bit parameters:
    deepspeed.runtime.zero.stage_1_and_2.estimate_zero2_model_states_mem_needs."""
    total_gpus = num_nodes * num_gpus_per_node
    if cpu_offload:
        gpu_mem = 2 * total_params
        cpu_mem = total_params * max(4 * total_gpus, 16) * additional_buffer_factor
    else:
        gpu_mem = 2 * total_params + int(18 * total_params / total_gpus)
        cpu_mem = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem)


def ds_zero3_estimate(total_params: int, largest_layer_params: int, num_gpus_per_node: int = 1,
                      num_nodes: int = 1, cpu_offload: bool = True, cpu_offload_params: bool = True,
                      zero_init: bool = True,
                      additional_buffer_factor: float = 1.5) -> tuple[int, int, int]:
    """(host bytes per node, GPU bytes per GPU, largest layer's bytes) of ZeRO-3 model states:
    deepspeed.runtime.zero.stage3.estimate_zero3_model_states_mem_needs."""
    total_gpus = num_nodes * num_gpus_per_node
    gpus_factor = 1 / num_nodes
    largest_layer_memory = 4 * largest_layer_params
    if cpu_offload:
        if cpu_offload_params:
            gpu_mem = largest_layer_memory
            if zero_init:
                cpu_mem = total_params * 18 * gpus_factor * additional_buffer_factor
            else:
                cpu_mem = total_params * max(4 * num_gpus_per_node, 18 * gpus_factor) * additional_buffer_factor
        else:
            gpu_mem = largest_layer_memory + int(2 * total_params / total_gpus)
            if zero_init:
                cpu_mem = total_params * 16 * gpus_factor * additional_buffer_factor
            else:
                cpu_mem = total_params * max(4 * num_gpus_per_node, 16 * gpus_factor) * additional_buffer_factor
    else:
        gpu_mem = largest_layer_memory + int(18 * total_params / total_gpus)
        if zero_init:
            cpu_mem = largest_layer_params * 4 * num_gpus_per_node * additional_buffer_factor
        else:
            cpu_mem = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem), largest_layer_memory


# ---------------------------------------------------------------------------------------------
# Model states
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Layout:
    """How a training job holds its model: precision, ZeRO stage, offload and its ranks."""

    dtype: str = "float32"
    zero: int = 0
    offload_params: bool = False
    offload_optimizer: bool = False
    nodes: int = 1
    gpus_per_node: int = 1

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass
class States:
    """Model states of one rank, by phase.

    resident: on the GPU for the whole run (parameters, master copies, optimizer moments, and the
    buffers DeepSpeed keeps); step: what exists only from a backward to its optimizer step
    (gradients); working: ZeRO-3's gathered layer while it computes; buckets: communication
    buffers of the backward; kept: communication buffers kept for the run (ZeRO-3's reduce
    bucket); host: per process. ds_gpu / ds_host: DeepSpeed's estimator's own figures (16-bit,
    per GPU / per node), or None where none applies (ZeRO-0)."""

    resident: list[Term]
    step: list[Term]
    buckets: list[Term]
    host: list[Term]
    ds_gpu: int | None = None
    ds_host: int | None = None
    working: list[Term] = field(default_factory=list)
    kept: list[Term] = field(default_factory=list)

    def gpu_bytes(self, *, with_buckets: bool = False) -> float:
        """Peak model states per GPU (at the optimizer step, ZeRO-3's gathered layer included),
        buckets (transient and kept) optional."""
        extra = self.kept + self.buckets if with_buckets else []
        return sum(t.bytes for t in self.resident + self.step + self.working + extra)

    def measured_at_step(self) -> float:
        """What the calibration measures after a backward: resident + step (no working set)."""
        return sum(t.bytes for t in self.resident + self.step)

    def resident_bytes(self) -> float:
        return sum(t.bytes for t in self.resident)


def model_states(arch: Arch, layout: Layout) -> States:
    """Model states per GPU and per process on the host, DeepSpeed's estimate plus its corrections.

    Bytes per parameter P (N = world, w = 4 for float32 / 2 for bf16):
    ZeRO-0 float32  16P (4 params, 4 grads, 8 Adam).
    ZeRO-1/2 fp32   4P + 16P/N: the estimator's 2P + 18P/N, +2P four-byte parameters, -2P/N no
                    16-bit gradient partition.
    ZeRO-1 bf16     8P + 12P/N (BF16_Optimizer): +2P bf16 gradients, +4P float32 accumulation
                    buffer, -6P/N gradients not partitioned.
    ZeRO-2 bf16     2P + 16P/N: -2P/N.
    ZeRO-3          the estimator's 4 x largest layer + 18P/N; float32: +2P/N partitioned float32
                    parameters beside the master copy and twice the gathered layer; + w x the
                    persistent parameters.
    Offload moves the float32 master, gradient partition and Adam moments (and with
    offload_params the parameter partition) to the host, as the estimator's cpu_offload cases.
    """
    p, n, w = arch.params, layout.world, dtype_bytes(layout.dtype)
    gpn, nodes = layout.gpus_per_node, layout.nodes
    bf16 = layout.dtype != "float32"
    off_opt, off_par = layout.offload_optimizer, layout.offload_params
    resident: list[Term] = []
    step: list[Term] = []
    buckets: list[Term] = []
    host: list[Term] = []
    T = Term

    if layout.zero == 0:
        resident += [T("parameters", w * p, f"{w}P"), T("Adam moments", 8 * p, "8P")]
        step += [T("gradients", w * p, f"{w}P")]
        buckets += [T("all-reduce buckets", w * min(p, ALLGATHER_BUCKET), f"{w} x min(P, 5e8)")]
        return States(resident, step, buckets, host)

    if layout.zero in (1, 2):
        ds_host, ds_gpu = ds_zero2_estimate(p, gpn, nodes, cpu_offload=off_opt)
        resident.append(T("parameters", w * p, f"{w}P"))
        opt = [T("fp32 master", 4 * p / n, "4P/N"), T("Adam moments", 8 * p / n, "8P/N")]
        if bf16 and layout.zero == 1 and not off_opt:
            # DeepSpeed's BF16_Optimizer (engine._do_optimizer_sanity_check): no reduce bucket
            resident += [T("fp32 gradient buffer", 4 * p, "4P, unpartitioned"), *opt]
            step.append(T("bf16 gradients", 2 * p, "2P until the step"))
            return States(resident, step, buckets, host, ds_gpu, ds_host)
        # DeepSpeedZeroOptimizer; its bucket is in the parameters' dtype, or float32 where
        # gradients accumulate in param.grad_accum (bf16 ZeRO-1 with offload)
        accum_attribute = bf16 and layout.zero == 1
        if accum_attribute:
            step += [T("fp32 gradient accumulators", 4 * p, "4P (param.grad_accum)"),
                     T("bf16 gradients", 2 * p, "2P")]
        grads = [T("fp32 gradient partition", 4 * p / n, "4P/N")]
        if off_opt:
            host += [*opt, *grads, T("16-bit staging", w * p / n, f"{w}P/N")]
            buckets.append(T("offload gradient buffer", w * arch.largest_layer, f"{w} x largest layer"))
        else:
            resident += opt
            step += grads
        bucket = 4 if accum_attribute else w
        buckets.append(T("reduce bucket", bucket * REDUCE_BUCKET, f"{bucket} x 5e8"))
        return States(resident, step, buckets, host, ds_gpu, ds_host)

    # ZeRO-3
    ll, pers = arch.largest_layer, arch.persistent()
    ds_host, ds_gpu, _ = ds_zero3_estimate(p, ll, gpn, nodes, cpu_offload=off_opt,
                                           cpu_offload_params=off_par and off_opt)
    part = [T("parameter partition", w * p / n, f"{w}P/N")]
    opt = [T("fp32 master", 4 * p / n, "4P/N"), T("Adam moments", 8 * p / n, "8P/N"),
           T("fp32 gradient partition", 4 * p / n, "4P/N")]
    if pers:
        resident.append(T("persistent parameters", w * pers, f"{w} x {pers:,} whole"))
    (host if off_par else resident).extend(part)
    (host if off_opt else resident).extend(opt)
    working = [T("gathered largest layer", 2 * w * ll, f"{2 * w} x {ll:,} (param + grad)")]
    kept = [T("reduce bucket", 4 * REDUCE_BUCKET, "4 x 5e8, kept")]
    buckets.append(T("prefetch bucket", w * PREFETCH_BUCKET, f"{w} x 5e7"))
    return States(resident, step, buckets, host, ds_gpu, ds_host, working, kept)


# ---------------------------------------------------------------------------------------------
# Activations, head, reference, engines
# ---------------------------------------------------------------------------------------------
def layer_activation_bytes(arch: Arch, w: int) -> float:
    """Bytes per token saved for backward by one decoder layer (module docstring)."""
    d, i, q, kv = arch.hidden, arch.intermediate, arch.q_width, arch.kv_width
    out = w * (4 * i + 2 * q + 2 * kv + 4 * d) + 4 * (2 * d + arch.heads) + 8
    if arch.qk_norm:
        out += (4 + w) * (q + kv) + 4 * (arch.heads + arch.kv_heads)
    return out


def activations(arch: Arch, tokens: float, w: int, checkpointing: bool, sp: int = 1) -> list[Term]:
    """Activations of one micro-batch of `tokens` tokens per GPU during its backward, bytes."""
    t = tokens / sp
    layer = layer_activation_bytes(arch, w)
    outside = Term("final hidden states", t * (4 + w) * arch.hidden, "(4+w)D per token")
    if checkpointing:
        return [Term("checkpointed layer inputs", t * arch.layers * w * arch.hidden,
                     f"{arch.layers} layers x wD per token"),
                Term("one layer recomputed + its gradients", 2 * t * layer,
                     f"2 x {layer:,.0f} B per token"), outside]
    return [Term("layer activations", t * arch.layers * layer,
                 f"{arch.layers} layers x {layer:,.0f} B per token"),
            Term("activation gradients", t * layer, f"{layer:,.0f} B per token"), outside]


def head_terms(arch: Arch, rows: float, w: int, chunk_positions: int, chunk_vocab: int,
               sp: int = 1) -> list[Term]:
    """The chunked head with gradient (stages.core.statistics.scorer.head_logprob) on `rows` selected rows:
    float32 blocks, the rows in float32 with their gradient, the head weight's gradient."""
    r = rows / sp
    cp, cv = min(chunk_positions, max(int(r), 1)), min(chunk_vocab, arch.vocab)
    return [Term("head blocks", HEAD_BLOCKS * cp * cv * 4, f"{HEAD_BLOCKS} x {cp} x {cv} x 4"),
            Term("head rows", r * arch.hidden * (2 * w + 8), "(2w+8)D per selected row"),
            Term("head weight gradient", arch.vocab * arch.hidden * w + cv * arch.hidden * 4,
                 "wVD + 4 x chunk_vocab x D")]


def reference_terms(arch: Arch, layout: Layout) -> list[Term]:
    """The frozen reference model of the KL term: whole on every GPU, partitioned under ZeRO-3."""
    w, p = dtype_bytes(layout.dtype), arch.params
    if layout.zero == 3:
        return [Term("reference partition", w * p / layout.world + w * arch.persistent()
                     + w * arch.largest_layer, f"{w}P/N + persistent + gathered layer")]
    return [Term("reference model", w * p, f"{w}P")]


def kv_bytes_per_token(arch: Arch, w: int, tp: int = 1) -> float:
    """KV cache bytes per token on one GPU of a tensor-parallel group (KV heads split over tp,
    replicated when fewer than tp)."""
    heads = max(arch.kv_heads / tp, 1)
    return 2 * arch.layers * heads * arch.head_dim * w


def vllm_needs(arch: Arch, w: int, tp: int, max_model_len: int) -> list[Term]:
    """What a vLLM engine must hold inside its share on one GPU to start: its weights, the KV
    cache of one max_model_len sequence, its working memory."""
    return [Term("engine weights", w * arch.params / tp, f"{w}P/{tp}"),
            Term("KV of one sequence", max_model_len * kv_bytes_per_token(arch, w, tp),
                 f"{max_model_len:,} tokens"),
            Term("engine workspace", VLLM_WORKSPACE_GB * GB, f"{VLLM_WORKSPACE_GB} GB")]


def hf_generation_terms(arch: Arch, w: int, sequences: int, seq_len: int) -> list[Term]:
    """the hf decode loop (generation.decode): the KV cache of a batch and its float32 logits."""
    return [Term("generation KV cache", sequences * seq_len * kv_bytes_per_token(arch, w),
                 f"{sequences} x {seq_len:,} tokens"),
            Term("generation logits", 2 * sequences * arch.vocab * 4, "2 x batch x V x 4")]


def teacher_forcing_sequences(group: int, seq_len: int, batch_tokens: int = TOKEN_STATS_BATCH_TOKENS) -> int:
    """Sequences of one teacher-forcing forward (stages.core.statistics.scoring.response_hidden): the
    trainer's packing rule within one group of `group` responses, at most TOKEN_STATS_BATCH, while
    sequences x seq_len stays within batch_tokens (a longer sequence goes alone)."""
    return max(1, min(group, TOKEN_STATS_BATCH, batch_tokens // seq_len))


def teacher_forcing_terms(arch: Arch, w: int, sequences: int, seq_len: int, chunk_positions: int,
                          chunk_vocab: int) -> list[Term]:
    """The token-statistics stage on the GPU (stages.core.statistics.scoring.stream_statistics): the
    no-gradient forward of one batch without a KV cache, its hidden states (before they go to the
    host), the statistics blocks, the deviations' float64 per-key sums and the file's Σp (V,)."""
    t = sequences * seq_len
    d, i = arch.hidden, arch.intermediate
    cp, cv = chunk_positions, min(chunk_vocab, arch.vocab)
    c = 8 if w == 8 else 4  # the statistics' compute dtype: float32, float64 for a float64 model
    terms = [Term("forward working set", t * w * (3 * d + 3 * i + arch.q_width + 2 * arch.kv_width),
                  "one layer, no gradient, no KV cache"),
             Term("batch hidden states", 2 * t * d * w,
                  "2wD per token: the last hidden state and its response rows")]
    if sequences > 1:  # one sequence has no padding: sdpa runs causal without a mask
        terms.append(Term("attention mask", sequences * seq_len**2 * (1 + w),
                          f"{sequences} x {seq_len:,}^2 x (1+w): the padding mask, bool and additive"))
    return terms + [
        Term("statistics blocks", STATS_BLOCKS * cp * cv * c, f"{STATS_BLOCKS} x {cp} x {cv} x {c}"),
        Term("deviation key sums", 2 * cp * cv * 8,
             f"2 x {cp} x {cv} x 8: float64 sums of a block's keys, and S - p leaving one out"),
        Term("sum of p over the file", 3 * arch.vocab * 8,
             "3 x V x 8: float64, the file's, a group's and p-bar")]


def scoring_terms(arch: Arch, w: int, tokens: float, sequences: int, seq_len: int,
                  chunk_positions: int, chunk_vocab: int, sp: int = 1,
                  padding_free: bool = False) -> list[Term]:
    """The trainer's no-gradient scoring of one micro-batch of `tokens` tokens (`sequences` rows
    of seq_len; stages.core.statistics.scorer.score_scope): the sampling pass, and the rescoring pass by the
    current policy before every later mini-batch (selection_scope: microbatch, or rescore). A
    forward without activations kept: one layer's working set and the last hidden states (split
    over sequence parallelism), the padded rows' attention mask, the statistics blocks, and the
    deviations' float64 sums when a selector needs them (counted always: an upper bound)."""
    t = tokens / sp
    cp, cv = chunk_positions, min(chunk_vocab, arch.vocab)
    terms = [Term("scoring forward working set",
                  t * w * (3 * arch.hidden + 3 * arch.intermediate + arch.q_width + 2 * arch.kv_width),
                  "one layer, no gradient"),
             Term("scoring hidden states", 2 * t * arch.hidden * w, "2wD per token")]
    if sequences > 1 and not padding_free and sp == 1:
        terms.append(Term("scoring attention mask", sequences * seq_len**2 * (1 + w),
                          f"{sequences} x {seq_len:,}^2 x (1+w)"))
    return terms + [
        Term("scoring statistics blocks", STATS_BLOCKS * cp * cv * 4, f"{STATS_BLOCKS} x {cp} x {cv} x 4"),
        Term("scoring deviation sums", 2 * cp * cv * 8, f"2 x {cp} x {cv} x 8")]


def teacher_forcing_host_terms(arch: Arch, w: int, group_tokens: int, file_tokens: int) -> list[Term]:
    """The token-statistics stage on the host: one group's hidden states (the only ones alive) and
    the per-token values of the whole file."""
    return [Term("group hidden states", group_tokens * arch.hidden * w,
                 f"{group_tokens:,} tokens (n x max_new_tokens) x wD"),
            Term("token table", file_tokens * TOKEN_TABLE_BYTES,
                 f"{file_tokens:,} tokens (prompts x n x max_new_tokens) x {TOKEN_TABLE_BYTES} B")]


def with_layout(layout: Layout, **changes) -> Layout:
    """A copy of `layout` with some fields changed."""
    return replace(layout, **changes)
