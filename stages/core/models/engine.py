"""Engine glue: the processes of a training job and DeepSpeed around the policy.

:class:`Dist` is the data-parallel group (every collective is the identity for one process);
:func:`resolve_launch` reads the launcher's environment and checks the GPUs the config asks for;
:func:`build_engine` wraps the policy (stages.core.models.policy.Policy: trunk and head in one module) in
DeepSpeed with a client torch AdamW, ZeRO 0-3, and :func:`build_reference` partitions the frozen
reference under ZeRO-3 (:func:`partitioned_loading`: both are partitioned while they load).

Sequence parallelism (train.sequence_parallel = k): the job's ranks form groups of k consecutive
ranks that hold the same sequences, each running a slice of their positions (DeepSpeed's Ulysses
attention, stages.core.models.policy); the data-parallel group of a rank is the ranks at its place in
every group (stages.core.models.parallel.parallel_groups). :class:`Dist` is that data-parallel
group, with its sequence-parallel group and the whole job beside it. The vLLM engine that shares
the GPU with training (weight sync, sleep and wake) is in stages.core.models.samplers.
"""

from __future__ import annotations

import logging
import os
import socket
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from stages.core.common.errors import ConfigError
from stages.core.models.parallel import parallel_groups
from stages.core.models.policy import Layout, as_policy, install_ulysses

if TYPE_CHECKING:  # the config sits above the library: types only
    from stages.config import Config, Train


class Dist:
    """A group of the job's ranks: by default its data-parallel group (the ranks that hold
    different sequences); with one rank every collective is the identity.

    `group`: the torch process group (None: every rank of the job). `sp`: this rank's
    sequence-parallel group (ranks that hold the same sequences, each running a slice of their
    positions; a group of one without sequence parallelism). `job`: every rank of the job.
    Without sequence parallelism the data-parallel group is the job."""

    def __init__(self, rank: int, world: int, device: torch.device, group=None, *,
                 sp: Dist | None = None, job: Dist | None = None) -> None:
        self.rank, self.world, self.device, self.group = rank, world, device, group
        self.sp = sp if sp is not None else (self if world == 1 else Dist(0, 1, device))
        self.job = job if job is not None else self

    def sum(self, t: Tensor) -> Tensor:
        if self.world == 1:
            return t
        import torch.distributed as dist

        buf = t.to(self.device).clone()
        dist.all_reduce(buf, group=self.group)
        return buf.to(t.device)

    def min(self, value: int) -> int:
        return self._reduce(value, "MIN")

    def max(self, value: int) -> int:
        return self._reduce(value, "MAX")

    def _reduce(self, value: int, op: str) -> int:
        if self.world == 1:
            return value
        import torch.distributed as dist

        buf = torch.tensor([value], dtype=torch.long, device=self.device)
        dist.all_reduce(buf, op=getattr(dist.ReduceOp, op), group=self.group)
        return int(buf.item())

    def gather(self, t: Tensor) -> list[Tensor]:
        """Every rank's 1-D tensor (lengths may differ), in rank order."""
        if self.world == 1:
            return [t]
        import torch.distributed as dist

        n = torch.tensor([t.numel()], dtype=torch.long, device=self.device)
        sizes = [torch.zeros_like(n) for _ in range(self.world)]
        dist.all_gather(sizes, n, group=self.group)
        sizes = [int(s.item()) for s in sizes]
        padded = torch.zeros(max(sizes), dtype=t.dtype, device=self.device)
        padded[: t.numel()] = t.to(self.device)
        parts = [torch.empty_like(padded) for _ in range(self.world)]
        dist.all_gather(parts, padded, group=self.group)
        return [p[:k].to(t.device) for p, k in zip(parts, sizes, strict=True)]

    def cat(self, t: Tensor) -> Tensor:
        return torch.cat(self.gather(t))

    def objects(self, obj) -> list:
        """Every rank's picklable `obj`, in rank order."""
        if self.world == 1:
            return [obj]
        import torch.distributed as dist

        out = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def exchange(self, outgoing: list[list]) -> list:
        """Send the objects outgoing[r] to rank r (every rank calls this); returns what this rank
        received, in the order of the sending ranks."""
        if self.world == 1:
            return list(outgoing[0])
        import torch.distributed as dist

        received: list = []
        for src in range(self.world):
            box = [None]
            dist.scatter_object_list(box, outgoing if self.rank == src else None,
                                     group=self.group, group_src=src)
            received += box[0]
        return received

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier(group=self.group)


@dataclass(frozen=True)
class Launch:
    """Where this process sits: read from the launcher's environment (none: a group of one)."""

    rank: int
    world: int
    local: int
    device: torch.device
    backend: str


def resolve_launch(cfg: Config, size: str) -> Launch:
    """This process's rank and device; checks the GPUs the config asks for before anything runs.

    A GPU job runs one process per GPU over all its nodes (models.<size>.gpus.train in all,
    train_gpus_per_node() on each); each process takes the GPU of its LOCAL_RANK on its node.
    A CPU job runs on gloo with however many processes it was started as."""
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_RANK", rank))
    model = cfg.models[size]
    gpus = model.gpus.train
    if gpus == 0:
        return Launch(rank, world, local, torch.device("cpu"), "gloo")
    per_node, nodes = model.train_gpus_per_node(), model.train_nodes
    layout = f"{gpus} GPUs" if nodes == 1 else f"{gpus} GPUs, {per_node} on each of {nodes} nodes"
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if visible < per_node:
        raise ConfigError(
            f"models.{size}.gpus.train: {layout} requested but {visible} visible on "
            f"{socket.gethostname()} (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})"
        )
    if world != gpus:
        raise ConfigError(
            f"models.{size}.gpus.train: {layout} requested but started as {world} process(es); "
            f"launch with python -m stages.launch --gpus {gpus} --nodes {nodes} (torchrun "
            f"--nnodes {nodes} --nproc-per-node {per_node})"
        )
    if not 0 <= local < per_node:
        raise ConfigError(
            f"models.{size}.gpus_per_node: LOCAL_RANK {local} but {per_node} GPU(s) per node; "
            f"launch with torchrun --nproc-per-node {per_node} on each of the {nodes} node(s)"
        )
    return Launch(rank, world, local, torch.device("cuda", local), "nccl")


def init_distributed(launch: Launch, sequence_parallel: int = 1) -> Dist:
    """Start (or join) the process group through DeepSpeed; returns the data-parallel group.

    With sequence parallelism (k > 1 ranks per sequence) DeepSpeed's sequence-parallel groups are
    made here (parallel_state_sp, the `mpu` that build_engine hands to DeepSpeed: ZeRO partitions
    and reduces over every rank, and averages gradients over the world / k data-parallel ranks),
    and the data-parallel groups beside them."""
    import torch.distributed as tdist

    os.environ.setdefault("DS_ACCELERATOR", launch.device.type)
    if launch.device.type == "cuda":
        torch.cuda.set_device(launch.device)
    if "RANK" not in os.environ and not tdist.is_initialized():
        # A plain `python -m stages.train`: a group of one on an in-process store, which DeepSpeed
        # adopts. No port is opened and no launcher variable (RANK, MASTER_PORT) is written to
        # os.environ, where jobs started from this process would inherit it and take themselves
        # for ranks of this group. ZeRO-3 reads LOCAL_RANK.
        os.environ.setdefault("LOCAL_RANK", "0")
        tdist.init_process_group(launch.backend, store=tdist.HashStore(), rank=0, world_size=1)
    import deepspeed

    if launch.device.type == "cpu":
        # On its CPU accelerator DeepSpeed would probe every op with compiler subprocesses and
        # JIT-compile a shared-memory all-reduce (minutes on 2 cores); gloo is all CPU ranks need.
        # An explicit "not compatible" for every op is what it reads when no compiler exists.
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__ = {}
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend=launch.backend, verbose=False)
    job = Dist(launch.rank, launch.world, launch.device)
    if sequence_parallel == 1:
        return job
    from deepspeed.runtime.sequence_parallel import parallel_state_sp as mpu

    sp_ranks, dp_ranks = parallel_groups(launch.world, sequence_parallel)
    mpu.initialize_sequence_parallel(sequence_parallel)
    sp = Dist(launch.rank % sequence_parallel, sequence_parallel, launch.device,
              mpu.get_sequence_parallel_group())
    dp_group = None
    for ranks in dp_ranks:  # every rank makes every group
        group = tdist.new_group(ranks)
        if launch.rank in ranks:
            dp_group = group
    return Dist(launch.rank // sequence_parallel, len(sp_ranks), launch.device, dp_group, sp=sp,
                job=job)


def build_engine(model, tcfg: Train, world: int | None = None, sp: Dist | None = None,
                 load_universal: bool = False):
    """DeepSpeed around the policy (a Policy: the causal LM's trunk and head in one module) with a
    client torch AdamW (DeepSpeed's own would JIT-compile). Under ZeRO-3 the head's parameters
    are registered as external parameters of the Policy, which is where the scorer reads them.
    `sp`: the sequence-parallel group (Dist.sp) when train.sequence_parallel > 1.
    load_universal: the engine's load_checkpoint will read a universal checkpoint (a resume
    state saved on another world size, stages.core.training.resume); DeepSpeed reads the flag when the
    engine is built, so it cannot be set later."""
    import deepspeed

    policy = as_policy(model)
    policy.layout = layout(policy, tcfg, sp)
    if tcfg.zero_stage == 3:
        policy.register_head()
    optimizer = torch.optim.AdamW(policy.parameters(), lr=tcfg.lr, weight_decay=tcfg.weight_decay)
    config = ds_config(tcfg)
    if load_universal:
        config["checkpoint"] = {"load_universal": True}
    engine, *_ = deepspeed.initialize(model=policy, optimizer=optimizer, config=config,
                                      mpu=_mpu(tcfg))
    return engine


def build_reference(model, tcfg: Train, sp: Dist | None = None):
    """The frozen reference policy (a Policy, fed as the policy is): under ZeRO-3 partitioned like
    the policy, by a DeepSpeed engine without an optimizer (as TRL prepares its reference), whose
    forwards gather collectively too; otherwise the model itself, whole on every rank."""
    policy = as_policy(model)
    policy.layout = layout(policy, tcfg, sp)
    policy.requires_grad_(False)
    policy.eval()
    if tcfg.zero_stage != 3:
        return policy
    import deepspeed

    policy.register_head()
    config = ds_config(tcfg)
    config["zero_optimization"].pop("offload_optimizer", None)
    config.pop("zero_force_ds_cpu_optimizer", None)
    engine, *_ = deepspeed.initialize(model=policy, config=config, mpu=_mpu(tcfg))
    engine.eval()
    return engine.module


@contextmanager
def partitioned_loading(tcfg: Train):
    """Under ZeRO-3, a model loaded inside is partitioned as it loads (transformers'
    HfDeepSpeedConfig: from_pretrained builds it in deepspeed.zero.Init and gives each rank its
    shards of the checkpoint), so no rank ever holds the whole model; build_engine and
    build_reference then take the shards as they are. zero.Init makes every floating tensor in
    the training dtype, buffers too: pass each model loaded inside through
    :func:`float32_rotary`. The process group must exist (init_distributed). Otherwise
    nothing."""
    if tcfg.zero_stage != 3:
        yield
        return
    from transformers.integrations import HfDeepSpeedConfig

    config = HfDeepSpeedConfig(ds_config(tcfg))  # transformers keeps a weak reference to it
    try:
        yield
    finally:
        del config  # later from_pretrained and generate() calls see no ZeRO-3 config


def float32_rotary(model: torch.nn.Module) -> torch.nn.Module:
    """`model` with its rotary embeddings' inverse frequencies recomputed in float32, as
    transformers makes them outside deepspeed.zero.Init (which makes them bf16 in a bf16 job:
    angles off by up to ~1e-3 × position radians), on the device they were on."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for module in model.modules():
        if not (hasattr(module, "original_inv_freq") and hasattr(module, "rope_type")):
            continue
        init = {"axial": getattr(module, "compute_axial_rope_parameters", None),
                "default": getattr(module, "compute_default_rope_parameters", None),
                **ROPE_INIT_FUNCTIONS}[module.rope_type]
        inv_freq, _ = init(module.config)
        device = module.inv_freq.device
        module.inv_freq = inv_freq.float().to(device)
        module.original_inv_freq = inv_freq.float().to(device).clone()
    return model


def gradient_world(tcfg: Train, dist: Dist) -> int:
    """What DeepSpeed (0.19.8) divides the gradients summed over every rank by: the data-parallel
    world (the job's ranks / train.sequence_parallel) under ZeRO 0-2, which correct their average
    for sequence parallelism, and every rank under ZeRO-3, whose reduce-scatter averages over the
    whole partition group without that correction (deepspeedai/DeepSpeed#5248 and #6841 report
    the same). A loss term multiplied by it gives gradients of the sum over the ranks' terms
    (tests/test_sequence_parallel.py compares them with one rank's)."""
    return dist.job.world if tcfg.zero_stage == 3 else dist.world


def layout(policy, tcfg: Train, sp: Dist | None) -> Layout:
    """How the scorer feeds `policy`'s trunk under `tcfg` (train.padding_free,
    train.sequence_parallel: Ulysses attention installed in front of the model's kernel)."""
    if tcfg.sequence_parallel == 1:
        return Layout(tcfg.padding_free)
    if sp is None or sp.world != tcfg.sequence_parallel:
        raise ValueError(f"train.sequence_parallel {tcfg.sequence_parallel}: build the engine with "
                         "the sequence-parallel group of init_distributed (Dist.sp)")
    install_ulysses(policy.lm, sp.group)
    return Layout(tcfg.padding_free, sp)


def _mpu(tcfg: Train):
    """DeepSpeed's sequence-parallel state (made by init_distributed), or None."""
    if tcfg.sequence_parallel == 1:
        return None
    from deepspeed.runtime.sequence_parallel import parallel_state_sp

    return parallel_state_sp


def ds_config(tcfg: Train) -> dict:
    """DeepSpeed's settings: one optimizer step per mini-batch (the trainer marks the boundary),
    gradients accumulated and all-reduced in float32 even when the model is bf16 (DeepSpeed's
    default would reduce them in the model's dtype, losing the small per-token terms).

    ZeRO-3 partitions every parameter, however small (DeepSpeed would keep those under 1e5
    elements whole on every rank), so the memory of a rank is what the plan says and the tiny
    models of the tests are partitioned as the large ones are, and keeps torch's own linear, so
    its forwards are the same computation as ZeRO-2's. Offloading (train.offload_params,
    ZeRO-3; train.offload_optimizer) keeps them in CPU memory; the client AdamW then steps on the
    CPU (zero_force_ds_cpu_optimizer off: DeepSpeed would refuse a client optimizer there)."""
    zero: dict = {"stage": tcfg.zero_stage}
    if tcfg.zero_stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
        # DeepSpeed would replace torch.nn.functional.linear for the whole process by its own
        # (other bf16 rounding: ZeRO-3's forwards would differ from ZeRO-2's and the bare model's)
        zero["memory_efficient_linear"] = False
    if tcfg.offload_params:
        zero["offload_param"] = {"device": "cpu"}
    if tcfg.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu"}
    config = {
        "train_micro_batch_size_per_gpu": tcfg.micro_batch_size,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": tcfg.grad_clip,
        "zero_optimization": zero,
        "bf16": {"enabled": tcfg.dtype == "bfloat16"},
        "data_types": {"grad_accum_dtype": "fp32"},
        "communication_data_type": "fp32",
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    if tcfg.offload_optimizer:
        config["zero_force_ds_cpu_optimizer"] = False
    return config
