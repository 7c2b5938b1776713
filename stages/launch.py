"""Start a stage on the GPUs its job was given: one worker per GPU (torchrun), or one process.

    python -m stages.launch --gpus 8 -- python -m stages.train --config CFG ...

A SLURM job of a multi-GPU rule is one task on one node (workflow/rules/common.smk). This wrapper
first checks that the job sees at least the GPUs the rule requested — a missing `--gpus` on the
sbatch line or a partition without GPUs otherwise shows up much later, as a hang in the process
group or an out-of-memory error — and then replaces itself with `torchrun --standalone`, which
starts one worker per GPU on this node with RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT in its environment (DeepSpeed's init_distributed reads them; no --local_rank argument
to parse). torchrun rather than the DeepSpeed launcher: one interface for every trainer, and
--standalone picks a free rendezvous port, so two jobs on one node do not collide.

With --gpus 0 or 1, or --processes one (vLLM with tensor parallelism starts its own workers),
the command runs as it is, after the same check.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

log = logging.getLogger("stages.launch")


class GpuShortage(RuntimeError):
    """The job sees fewer GPUs than its rule requested."""


def visible_gpus() -> int:
    """GPUs this process can use (torch honours CUDA_VISIBLE_DEVICES, which SLURM sets)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_gpus(requested: int, visible: int, env: dict[str, str] | None = None) -> None:
    """Raise GpuShortage, with what the job was given, when `visible` < `requested`."""
    if requested < 0:
        raise ValueError(f"--gpus must be >= 0, got {requested}")
    if visible >= requested:
        return
    env = os.environ if env is None else env
    seen = ", ".join(
        f"{k}={env[k]!r}"
        for k in ("CUDA_VISIBLE_DEVICES", "SLURM_JOB_ID", "SLURM_JOB_GPUS", "SLURM_GPUS_ON_NODE")
        if k in env
    )
    raise GpuShortage(
        f"this job requested {requested} GPU(s) but sees {visible}"
        + (f" ({seen})" if seen else "")
        + ". Check that the rule's `gpu` resource reached sbatch as --gpus (the SLURM profile"
        " and models.<size>.gpus) and that the partition ($ICT_GPU_PARTITION) has GPU nodes;"
        " to run on fewer GPUs, lower models.<size>.gpus in the config."
    )


def worker_command(gpus: int, command: list[str], processes: str = "per-gpu") -> list[str]:
    """The command to exec: `command` itself, or torchrun starting it once per GPU."""
    if not command:
        raise ValueError("no command to launch")
    if processes == "one" or gpus <= 1:
        return list(command)
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--standalone", "--nnodes=1", f"--nproc-per-node={gpus}",
        "--no-python", *command,
    ]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gpus", type=int, required=True, help="GPUs the job requested (rule resource gpu)")
    p.add_argument(
        "--processes", choices=["per-gpu", "one"], default="per-gpu",
        help="per-gpu: torchrun starts one worker per GPU; one: the command starts its own workers",
    )
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run")
    args = p.parse_args(argv)
    logging.basicConfig(
        level=os.environ.get("ICT_RLVR_LOGLEVEL", "INFO"),
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("give the command to run after --")
    try:
        check_gpus(args.gpus, visible_gpus() if args.gpus else 0)
        final = worker_command(args.gpus, command, args.processes)
    except (GpuShortage, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    log.info("launching on %d GPU(s): %s", args.gpus, " ".join(final))
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvp(final[0], final)


if __name__ == "__main__":
    main()
