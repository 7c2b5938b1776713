"""Engine glue: the processes of a training job and DeepSpeed around the policy.

:class:`Dist` is the data-parallel group (every collective is the identity for one process);
:func:`resolve_launch` reads the launcher's environment and checks the GPUs the config asks for;
:func:`build_engine` wraps the policy (stages.core.policy.Policy: trunk and head in one module) in
DeepSpeed with a client torch AdamW, ZeRO 0-3, and :func:`build_reference` partitions the frozen
reference under ZeRO-3. The vLLM engine that shares the GPU with training (weight sync, sleep
and wake) is in stages.core.samplers.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass

import torch
from torch import Tensor

from ..config import Config, ConfigError, Train
from .policy import as_policy


class Dist:
    """The data-parallel ranks of this job; with one process every collective is the identity."""

    def __init__(self, rank: int, world: int, device: torch.device) -> None:
        self.rank, self.world, self.device = rank, world, device

    def sum(self, t: Tensor) -> Tensor:
        if self.world == 1:
            return t
        import torch.distributed as dist

        buf = t.to(self.device).clone()
        dist.all_reduce(buf)
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
        dist.all_reduce(buf, op=getattr(dist.ReduceOp, op))
        return int(buf.item())

    def gather(self, t: Tensor) -> list[Tensor]:
        """Every rank's 1-D tensor (lengths may differ), in rank order."""
        if self.world == 1:
            return [t]
        import torch.distributed as dist

        n = torch.tensor([t.numel()], dtype=torch.long, device=self.device)
        sizes = [torch.zeros_like(n) for _ in range(self.world)]
        dist.all_gather(sizes, n)
        sizes = [int(s.item()) for s in sizes]
        padded = torch.zeros(max(sizes), dtype=t.dtype, device=self.device)
        padded[: t.numel()] = t.to(self.device)
        parts = [torch.empty_like(padded) for _ in range(self.world)]
        dist.all_gather(parts, padded)
        return [p[:k].to(t.device) for p, k in zip(parts, sizes, strict=True)]

    def cat(self, t: Tensor) -> Tensor:
        return torch.cat(self.gather(t))

    def exchange(self, outgoing: list[list]) -> list:
        """Send the objects outgoing[r] to rank r (every rank calls this); returns what this rank
        received, in the order of the sending ranks."""
        if self.world == 1:
            return list(outgoing[0])
        import torch.distributed as dist

        received: list = []
        for src in range(self.world):
            box = [None]
            dist.scatter_object_list(box, outgoing if self.rank == src else None, src=src)
            received += box[0]
        return received

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()



def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def init_distributed(launch: Launch) -> Dist:
    """Start (or join) the process group through DeepSpeed."""
    if "RANK" not in os.environ:  # a plain `python -m stages.train`
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    os.environ.setdefault("DS_ACCELERATOR", launch.device.type)
    if launch.device.type == "cuda":
        torch.cuda.set_device(launch.device)
    import deepspeed

    if launch.device.type == "cpu":
        # On its CPU accelerator DeepSpeed would probe every op with compiler subprocesses and
        # JIT-compile a shared-memory all-reduce (minutes on 2 cores); gloo is all CPU ranks need.
        # An explicit "not compatible" for every op is what it reads when no compiler exists.
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__ = {}
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend=launch.backend, verbose=False)
    return Dist(launch.rank, launch.world, launch.device)


def build_engine(model, tcfg: Train, world: int):
    """DeepSpeed around the policy (a Policy: the causal LM's trunk and head in one module) with a
    client torch AdamW (DeepSpeed's own would JIT-compile). Under ZeRO-3 the head's parameters
    are registered as external parameters of the Policy, which is where the scorer reads them."""
    import deepspeed

    policy = as_policy(model)
    if tcfg.zero_stage == 3:
        policy.register_head()
    optimizer = torch.optim.AdamW(policy.parameters(), lr=tcfg.lr, weight_decay=tcfg.weight_decay)
    engine, *_ = deepspeed.initialize(model=policy, optimizer=optimizer, config=ds_config(tcfg))
    return engine


def build_reference(model, tcfg: Train):
    """The frozen reference policy (a Policy): under ZeRO-3 partitioned like the policy, by a
    DeepSpeed engine without an optimizer (as TRL prepares its reference), whose forwards gather
    collectively too; otherwise the model itself, whole on every rank."""
    policy = as_policy(model)
    policy.requires_grad_(False)
    policy.eval()
    if tcfg.zero_stage != 3:
        return policy
    import deepspeed

    policy.register_head()
    config = ds_config(tcfg)
    config["zero_optimization"].pop("offload_optimizer", None)
    config.pop("zero_force_ds_cpu_optimizer", None)
    engine, *_ = deepspeed.initialize(model=policy, config=config)
    engine.eval()
    return engine.module


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
