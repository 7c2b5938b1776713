"""The cost plan's formulas: counted work (tokens, forward passes, FLOPs) into hours, attempts and
bytes. Pure functions of numbers and model dimensions; stages/cost.py walks a config through them.

Work of one rollout step of a training job (every count per step):

- generation: every generation batch's responses, prompts_per_step x group_size of them
  (dynamic sampling: generation_batch_multiple x the mean generation batches per step of them),
  at the assumed generation throughput of the job's GPUs;
- forward passes over the trained sequences' prompt + response tokens (:func:`step_forwards`):
  the sampling pass (stages.train.sampling_pass, always), the rescoring before every mini-batch
  but the first (methods.<m>.rescore with a selector that reads statistics, after the dense
  warm-up: the 80/20 study's micro-batch scope among them), the reference model's no-gradient
  forward in every epoch when the KL term is on, and training: a forward and a backward (two
  forwards' FLOPs) per epoch, plus the recomputed forward of gradient checkpointing;
- FLOPs per token and forward (:func:`forward_flops`): 2 per multiply-accumulate with every
  parameter that multiplies a token (all but the input embedding, a lookup) and the attention's
  scores and weighted values, 2 x 2 x q_width x context per layer, at the sequence's mean
  context (prompt + response) / 2. Left out: the head products a selector's deviations recompute
  (ICT's u: one more per response token, a few percent of a step at these sizes), and the
  statistics passes of the token-statistics and overlap jobs, counted as one forward (they
  recompute the head per deviation: a few forwards' worth, in jobs of minutes);
- the rest of a step (grading, the optimizer steps, the weights' reload into vLLM) as a fixed
  overhead.

A job is killed at its walltime and resubmitted; training resumes from its last resume state
(stages.train). :func:`attempts` counts the attempts a training needs when each one starts up
again and, at the kill, loses what it computed since that state (the worst case: a whole
checkpoint interval).
"""

from __future__ import annotations

import math
import re
import shutil
import subprocess
from collections.abc import Callable

from stages.core.plans.memory import Arch

TB = 10**12
"""Disk sizes print in decimal units (file systems and quotas count in them)."""

# Bytes per token of the Parquet files the stages write, before compression (an upper bound:
# Parquet's dictionary and zstd encodings shrink them; the tiny 80/20 run's token table measured
# 12 B per token compressed, on arithmetic whose values repeat more than a real model's).
ROLLOUT_BYTES_PER_TOKEN = 8
"""rollouts.parquet: each token's int32 id and about 4 bytes of its text (a prompt per response)."""
SAMPLE_BYTES_PER_TOKEN = 4
"""samples.parquet of an evaluation: the response text, about 4 bytes per token."""
TOKEN_ROW_BYTES = 64
"""tokens.parquet of the token statistics: one row of about 20 numbers and flags per token."""


# ---------------------------------------------------------------------------------------------
# FLOPs
# ---------------------------------------------------------------------------------------------
def matmul_params(arch: Arch) -> int:
    """Parameters that multiply every token: all but the input embedding, whose lookup costs no
    FLOPs (a tied head is the embedding's matrix, so its product is counted once)."""
    return arch.params - (0 if arch.tied else arch.vocab * arch.hidden)


def forward_flops(arch: Arch, context: float) -> float:
    """FLOPs of one token's forward when it attends to `context` positions on average: 2 per
    multiply-accumulate with each matmul parameter, and per layer the scores (q . k) and the
    weighted values over the context, 2 x q_width x context each."""
    return 2 * matmul_params(arch) + 4 * arch.layers * arch.q_width * context


def capped_mean(mean: float, cap: float) -> float:
    """Mean length of responses cut at `cap` tokens whose uncut lengths are exponential with mean
    `mean` (ours: the length model): E[min(X, cap)] = mean x (1 - exp(-cap / mean)). A longer cap
    lets more of the tail through; a cap far above the mean changes little."""
    return mean * -math.expm1(-cap / mean)


def uncapped_mean(capped: float, cap: float) -> float | None:
    """The exponential mean whose cut at `cap` has mean `capped` (the inverse of capped_mean, by
    bisection); None where `capped` is too close to the cap to tell (over 0.9 cap: most responses
    ran into it, and any longer tail fits)."""
    if not 0 < capped < 0.9 * cap:
        return None
    lo, hi = capped, capped
    while capped_mean(hi, cap) < capped:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if capped_mean(mid, cap) < capped else (lo, mid)
    return (lo + hi) / 2


def mean_context(prompt: float, response: float) -> float:
    """Mean positions a token of a prompt + response sequence attends to under a causal mask."""
    return (prompt + response) / 2


def step_forwards(ppo_epochs: int, minibatches: int, *, rescore: bool, reference: bool,
                  checkpointing: bool) -> dict[str, float]:
    """Forward passes over one step's trained tokens, by pass (a backward costs two forwards).

    rescore: the current policy rescores every mini-batch but the first of the first epoch
    (stages.train.train_step), (ppo_epochs x minibatches - 1) / minibatches of the step's tokens.
    reference: the reference model's forward of every micro-batch in every epoch (the KL term)."""
    passes = {"sampling": 1.0}
    if rescore:
        passes["rescoring"] = (ppo_epochs * minibatches - 1) / minibatches
    if reference:
        passes["reference"] = float(ppo_epochs)
    passes["training"] = ppo_epochs * (4.0 if checkpointing else 3.0)
    return passes


def compute_seconds(flops: float, gpus: int, tflops: float, mfu: float) -> float:
    """Seconds `gpus` GPUs of `tflops` peak take for `flops` at utilisation `mfu`."""
    return flops / (gpus * tflops * 1e12 * mfu)


def generation_seconds(tokens: float, gpus: int, tokens_per_s: float) -> float:
    """Seconds `gpus` GPUs generating `tokens_per_s` each take for `tokens`."""
    return tokens / (gpus * tokens_per_s)


# ---------------------------------------------------------------------------------------------
# Attempts of a job killed at its walltime
# ---------------------------------------------------------------------------------------------
def attempts(work: float, attempt: float, startup: float, lost: float) -> int | None:
    """Attempts a resumable job of `work` minutes needs when each attempt runs at most `attempt`
    minutes, spends `startup` of them before it computes, and a kill loses the last `lost`
    minutes of work (since the last resume state). None: an attempt never gets past a state."""
    first = attempt - startup
    if work <= first:
        return 1
    useful = attempt - startup - lost
    if useful <= 0:
        return None
    return 1 + math.ceil((work - first) / useful)


def wall_minutes(work: float, n: int, startup: float, wasted: float) -> float:
    """Minutes of `n` attempts of a job of `work` minutes: each one's start-up, and the work each
    kill throws away (on average; :func:`attempts` counts the worst case)."""
    return work + n * startup + (n - 1) * wasted


# ---------------------------------------------------------------------------------------------
# Disk
# ---------------------------------------------------------------------------------------------
def hf_checkpoint_bytes(arch: Arch, weight_bytes: int) -> float:
    """A Hugging Face checkpoint (save_pretrained): every parameter once in the training dtype."""
    return weight_bytes * arch.params


def resume_state_bytes(arch: Arch, weight_bytes: int, zero_stage: int) -> float:
    """A DeepSpeed resume state (save_checkpoint), summed over ranks: the module's weights, the
    float32 master copy that ZeRO 1-3 keep beside them, and Adam's two float32 moments (bf16:
    2 + 4 + 8 = 14 bytes per parameter; float32 ZeRO-0 keeps no second copy: 12)."""
    return arch.params * (weight_bytes + (4 if zero_stage >= 1 else 0) + 8)


# ---------------------------------------------------------------------------------------------
# The partition's time limit
# ---------------------------------------------------------------------------------------------
_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")


def slurm_minutes(text: str) -> int | None:
    """Minutes of a SLURM time ("minutes", "minutes:seconds", "hours:minutes:seconds",
    "days-hours", "days-hours:minutes", "days-hours:minutes:seconds"), whole minutes rounded down
    (a request must stay within the limit); None for UNLIMITED or INFINITE."""
    text = text.strip()
    if text.upper() in ("UNLIMITED", "INFINITE"):
        return None
    m = _TIME.match(text)
    if m is None:
        raise ValueError(f"not a SLURM time: {text!r}")
    days, a, b, c = m.groups()
    if days is not None:  # days-hours[:minutes[:seconds]]
        seconds = ((int(days) * 24 + int(a)) * 60 + int(b or 0)) * 60 + int(c or 0)
    elif c is not None:  # hours:minutes:seconds
        seconds = (int(a) * 60 + int(b)) * 60 + int(c)
    else:  # minutes[:seconds]
        seconds = int(a) * 60 + int(b or 0)
    return seconds // 60


def partition_max_minutes(partition: str | None,
                          run: Callable[..., subprocess.CompletedProcess] | None = None) -> int | None:
    """The MaxTime of `partition` (None: the cluster's default partition) in minutes, from
    `scontrol show partition`; None when it is unlimited, or scontrol is missing or fails."""
    if shutil.which("scontrol") is None:
        return None
    run = run or subprocess.run
    try:
        proc = run(["scontrol", "show", "partition", "--oneliner", *([partition] if partition else [])],
                   capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if proc.returncode != 0:
        return None
    for line in proc.stdout.splitlines():
        fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
        if partition is not None and fields.get("PartitionName") != partition:
            continue
        if partition is None and fields.get("Default") != "YES":
            continue
        try:
            return slurm_minutes(fields.get("MaxTime", "UNLIMITED"))
        except ValueError:
            return None
    return None


def qos_max_minutes(qos: str | None,
                    run: Callable[..., subprocess.CompletedProcess] | None = None) -> int | None:
    """The MaxWall of QOS `qos` in minutes, from `sacctmgr show qos` (which needs SLURM's
    accounting database, slurmdbd); None where no QOS is named, its MaxWall is unset or unlimited,
    or sacctmgr is missing or fails."""
    if not qos or shutil.which("sacctmgr") is None:
        return None
    run = run or subprocess.run
    try:
        proc = run(["sacctmgr", "--noheader", "--parsable2", "show", "qos", qos,
                    "format=Name,MaxWall"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if proc.returncode != 0:
        return None
    for line in proc.stdout.splitlines():
        name, _, wall = line.partition("|")
        if name.strip() != qos:
            continue
        try:
            return slurm_minutes(wall) if wall.strip() else None
        except ValueError:
            return None
    return None


def site_max_minutes(partition: str | None, qos: str | None,
                     run: Callable[..., subprocess.CompletedProcess] | None = None) -> tuple[int | None, str]:
    """(the longest walltime a job may ask for, minutes, or None; where it comes from): the lower
    of the partition's MaxTime and the QOS's MaxWall."""
    limits = [(m, what) for m, what in (
        (partition_max_minutes(partition, run), f"MaxTime of partition {partition or '(default)'} (scontrol)"),
        (qos_max_minutes(qos, run), f"MaxWall of QOS {qos} (sacctmgr)")) if m is not None]
    return min(limits) if limits else (None, "")


# ---------------------------------------------------------------------------------------------
# Printing
# ---------------------------------------------------------------------------------------------
def approx(x: float) -> str:
    """Two significant digits, thousands separated: estimates, not measurements."""
    if x == 0:
        return "0"
    digits = 1 - int(math.floor(math.log10(abs(x))))
    rounded = round(x, digits)
    if abs(rounded) >= 10 ** (2 - digits):  # 9.96 rounds up to 10: one digit fewer
        digits -= 1
        rounded = round(x, digits)
    return f"{rounded:,.{max(digits, 0)}f}"


def hours(minutes: float) -> str:
    """A duration of `minutes` for a table: minutes below an hour, hours below four days, days."""
    if minutes < 1:
        return f"{approx(minutes * 60)} s"
    if minutes < 60:
        return f"{approx(minutes)} min"
    if minutes < 4 * 24 * 60:
        return f"{approx(minutes / 60)} h"
    return f"{approx(minutes / 60 / 24)} days"


def size_of(nbytes: float) -> str:
    """Bytes for a table, in decimal units."""
    for unit, scale in (("TB", TB), ("GB", 10**9), ("MB", 10**6)):
        if nbytes >= scale:
            return f"{approx(nbytes / scale)} {unit}"
    return f"{approx(nbytes / 1e3)} kB" if nbytes >= 1e3 else f"{nbytes:.0f} B"
