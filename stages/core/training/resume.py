"""Resume states of a training job: when one is written, and how one moves to another world size.

When. Every `train.checkpoint_every` steps; also once `train.checkpoint_every_minutes` of wall time
have passed since the last one (the job's rank 0 keeps the clock and every rank follows its
decision, so all of them save together); and at the first step boundary after SIGURG, after which
the job exits with EXIT_RESUBMIT (where the signal arrives during a step's generation and the
lead left would not cover the update, the weights' sync and the save, the job saves the state
before that step at once instead: the weights and the optimizer have not moved yet, and the
step's samples are drawn again from the same seeds on resume); and after
`train.stop_after_steps` steps of an attempt (a pilot's forced resume), exiting the same way (non-zero: Snakemake's `retries` resubmit it, and the next
attempt resumes from that state). The training rule asks SLURM for that signal
`train.save_before_limit_minutes` before the job's time limit (`--signal=URG@<seconds>`,
workflow/rules/common.smk). Why SIGURG and not SLURM's usual SIGUSR1: the signal reaches every
process of the job step (snakemake-executor-plugin-slurm 2.8.0 runs the rule through `srun`,
inside a Snakemake of the job's own, a shell, stages.launch's torchrun agent, the workers); each of
them ignores SIGURG unless it handles it, while SIGUSR1 ends every process that does not, the
job's Snakemake first, so the job fails at once and leaves its workers running unsupervised; and
`B:USR1`, the batch shell alone, ends the plugin's batch shell, which cannot relay it (both
seen on the test suite's SLURM 22.05 cluster). Only the workers handle it here.

Another world size. DeepSpeed's ZeRO-1/2/3 checkpoints hold each rank's partition of the
optimizer states, so a resume state is tied to the world size it was saved on. A job of another
size converts it once into a universal checkpoint (deepspeed.checkpoint.ds_to_universal, one
worker: the job's rank 0, while the other ranks wait for the converted folder) and loads that
with `checkpoint.load_universal` in the DeepSpeed config, which must be set before
deepspeed.initialize. What a read of DeepSpeed 0.19.8 says, each point checked in its source:
- ZeRO-1 and ZeRO-2 save no `universal_checkpoint_info` (the engine saves it only when the module
  has that attribute): the converter runs with inject_missing_state;
- ZeRO-3 states convert without it (data-parallel only: no tensor parallelism here);
- loading a ZeRO-1/2 universal checkpoint asks the `mpu` for its tensor-parallel rank
  (base_optimizer.load_hp_checkpoint_state_from_checkpoint_dir → bwc_tensor_model_parallel_rank),
  which the sequence-parallel state that build_engine passes as `mpu` does not have: refused here
  with sequence parallelism (under ZeRO-3 too, which no test here runs);
- ZeRO-0 has no optimizer partitions: the module and the client optimizer's whole state are in
  one file that any world size loads, so no conversion is needed (only our own check stood).
Bit-for-bit equal metrics across world sizes are not to be had: the ranks' reductions sum in
another order. The restored weights, Adam moments and step are equal to the saved ones
(tests/test_universal.py).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from stages.core.common.errors import ConfigError

if TYPE_CHECKING:  # the config sits above the library: types only
    from stages.config import Train

EXIT_RESUBMIT = 75
"""The exit status of a job that saved a resume state on SIGURG (EX_TEMPFAIL: try again)."""
SAVE_SIGNAL = signal.SIGURG


class SaveTriggers:
    """When to write a resume state besides every checkpoint_every steps: wall time since the
    last one (rank 0's clock) and SIGURG (any rank's). Built as early as the job can (the
    handler is installed then: a signal before it is lost, and the job then ends at its time
    limit and resumes from its last resume state); `poll` is a collective: every rank calls it
    once per step, in the same place."""

    def __init__(self, tcfg: Train) -> None:
        self.minutes = tcfg.checkpoint_every_minutes
        self.lead_s = 60 * (tcfg.save_before_limit_minutes or 0.0)
        self.last = time.monotonic()
        self.signalled = False
        self.signalled_at = 0.0
        signal.signal(SAVE_SIGNAL, self._handle)
        # restart interrupted system calls (gloo's sockets) rather than failing them
        signal.siginterrupt(SAVE_SIGNAL, False)

    def _handle(self, signum, frame) -> None:
        if not self.signalled:
            self.signalled_at = time.monotonic()
        self.signalled = True

    def save_now(self, job, need_s: float) -> bool:
        """Before a step's update (weights and optimizer as the last step left them): whether a
        rank got the signal too late for the update, the weights' sync and a save (`need_s`, from
        the last step's; inf when there was none) to end within the lead; then the job saves the
        state before the step at once and loses only its generation. A collective, as `poll`."""
        left = self.lead_s - (time.monotonic() - self.signalled_at)
        flag = torch.tensor([int(self.signalled and left < need_s)], dtype=torch.long)
        if job.world > 1:
            import torch.distributed as dist

            buf = flag.to(job.device)
            dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=job.group)
            flag = buf.cpu()
        return bool(flag[0])

    def poll(self, job) -> tuple[bool, bool]:
        """(the wall-time interval has passed, a rank got the signal), the same on every rank
        of `job` (a Dist over the whole job)."""
        due = (job.rank == 0 and self.minutes is not None
               and time.monotonic() - self.last >= 60 * self.minutes)
        flags = torch.tensor([int(due), int(self.signalled)], dtype=torch.long)
        if job.world > 1:
            import torch.distributed as dist

            buf = flags.to(job.device)
            dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=job.group)
            flags = buf.cpu()
        return bool(flags[0]), bool(flags[1])

    def saved(self) -> None:
        self.last = time.monotonic()


# ----- another world size ----------------------------------------------------------------------
UNIVERSAL_SUFFIX = "_universal"
DONE_MARK = ".converted"


def check_universal(tcfg: Train, saved_world: int, world: int, folder: Path) -> None:
    """Refuse what DeepSpeed 0.19.8 cannot load on another world size (module docstring)."""
    if tcfg.sequence_parallel > 1 and tcfg.zero_stage > 0:
        raise ConfigError(
            f"train.sequence_parallel: {folder} was saved by {saved_world} process(es) and this job "
            f"has {world}; moving a ZeRO-{tcfg.zero_stage} state to another world size goes through "
            "a universal checkpoint, whose loader in DeepSpeed 0.19.8 fails with sequence "
            "parallelism (it asks the sequence-parallel mpu for a tensor-parallel rank). Resume "
            f"with {saved_world} process(es), or delete the folder to start over")


def universal_tag(tag: str) -> str:
    return tag + UNIVERSAL_SUFFIX


def convert_to_universal(resume_dir: Path, tag: str, zero_stage: int, rank: int,
                         poll_s: float = 1.0) -> str:
    """The tag of `tag`'s universal checkpoint in resume_dir, converted by rank 0 (once: a
    finished conversion is kept, marked by DONE_MARK) while the other ranks wait for it; no
    process group is needed. Returns the tag to load."""
    out = resume_dir / universal_tag(tag)
    done = out / DONE_MARK
    if rank == 0 and not done.exists():
        from deepspeed.checkpoint import ds_to_universal

        tmp = resume_dir / f".{out.name}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)
        # one extract and one merge worker: no process pool (the job's cores are its workers')
        ds_to_universal.main(argparse.Namespace(
            input_folder=str(resume_dir / tag), output_folder=str(tmp), num_extract_workers=1,
            num_merge_workers=1, keep_temp_folder=False, strict=True,
            inject_missing_state=zero_stage in (1, 2)))
        (tmp / DONE_MARK).write_text(tag + "\n")
        os.replace(tmp, out)
    while not done.exists():
        time.sleep(poll_s)
    return out.name
