"""Stage 4: masked RLVR training of one size × method × seed (METHODS §3–§4), on DeepSpeed.

    python -m stages.train --config CFG --size S --method M --seed K \
        --model results/<run>/models/size=S/base.json \
        --prompts results/<run>/data/dataset=<train>/problems.parquet [more prompt files] \
        --out-dir results/<run>/train/size=S/method=M/seed=K \
        [--resume-dir results/<run>/resume/size=S/method=M/seed=K] [--threads N]

Several processes (one per GPU, or CPU processes with gloo): put
`python -m stages.launch --gpus G [--nodes N] [--procs-per-node P] --` (torchrun) in front of
`python -m` and the same arguments; `models.S.gpus.train` says how many GPUs the job must see.

The loop of one rollout step, each part in its own module:

1. stages.core.training.rollouts: sample `group_size` responses for each of the step's prompts from the
   current policy, grade them, group-relative advantages (DAPO filtering and overlong penalty
   when configured);
2. stages.core.statistics.scorer: the sampling pass — every response token scored once, without gradient,
   by the policy that sampled (entropy, Rényi-2, log-prob, and the deviations the method's
   selector needs, per mini-batch scope);
3. stages.core.training.actor: per mini-batch (`ppo_epochs` passes), one optimizer step on the selected
   tokens. The first mini-batch of the first epoch is on-policy and selects on the sampling
   pass's scores; later ones select on them too unless `methods.<m>.rescore` asks for the
   current policy's (a rescoring pass, only for selectors that need statistics);
4. stages.core.models.engine / samplers: DeepSpeed reduces float32 gradients across ranks, clips and
   steps; the sampler picks up the new weights (vLLM: woken, weights loaded group by group).

The module is in train mode (dropout must be 0, checked), so `train.gradient_checkpointing` can
recompute the trunk's activations; the same config gives the same metrics.
DeepSpeed runs ZeRO stage 0-3 (`train.zero_stage`) around one module, stages.core.models.policy.Policy
(trunk and head). Under ZeRO-3 every parameter is a shard, gathered collectively in every
forward, so every rank runs equally many forwards on every path (generation in step, as
transformers' synced_gpus, and equally many generation batches; scoring, the actor and the reference padded to the most
micro-batches of any rank); the reference model is partitioned too (when KL is on); the vLLM
engine receives the weights one gathered group at a time; `final/` and the checkpoints are
gathered from the shards the same way (`train.offload_params` / `offload_optimizer`: DeepSpeed's
CPU offload); the policy and the reference are partitioned as they load, so no rank holds a whole
model.
`train.sequence_parallel` k (DeepSpeed Ulysses): groups of k consecutive ranks hold the same
sequences, each running a slice of their positions; prompts split over the world / k
data-parallel ranks, the ranks of a group sample a share of their prompts each and exchange the
graded groups (stages.core.training.rollouts), and the scorer and the actor gather what spans positions
within the group. `train.padding_free`: a micro-batch is one row of its sequences back to back
(position ids from 0 in each), costing its tokens against `micro_batch_tokens`.
Outputs in --out-dir: `final/` (Hugging Face layout, tokenizer, resolved config), `metrics.parquet`
(one row per step), `summary.json`, and `model.json` last ({"kind": "scratch", "path": "final"}).
While it runs: `metrics.jsonl`, each step's row as the step ends, and train.loggers' TensorBoard
and W&B runs (stages.core.training.live); a log line per step.
Resume states go to --resume-dir, a folder Snakemake does not delete: every `checkpoint_every`
steps, every `checkpoint_every_minutes`, on SIGURG (SLURM's signal before the time limit; before
the step's update where the lead left would not cover it) and after `stop_after_steps` steps of an
attempt, after which the job exits with status 75 to be resubmitted (stages.core.training.resume). The same command
continues from the last one and reaches the same final metrics, also after operational edits of
the config (stages.keys), and on another number of processes through a universal checkpoint; a
changed result key is refused by name. The `save_every` checkpoints wait there too, and move to
--out-dir at the end; the folder is removed once the outputs are written.

Over 600 lines: this is the training stage's whole process, in the order it runs: its arguments,
the resume state it saves and checks, the step loop, the per-step metrics and the outputs. The
pieces the loop composes (rollouts, selectors, losses, the actor, the engine) live in
stages.core.training and stages.core.models; splitting what is left would separate the loop from
the state it saves.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import polars as pl
import pyarrow as pa
import torch
import torch.distributed

from . import cli
from .config import Config, ConfigError, Method, Train
from .core.common import timing
from .core.common.io import (
    ArtifactError,
    atomic_dir,
    provenance,
    read_parquet,
    write_json,
    write_parquet,
)
from .core.data.problems import PROBLEM_SCHEMA
from .core.models.engine import (
    Dist,
    build_engine,
    build_reference,
    float32_rotary,
    init_distributed,
    partitioned_loading,
    resolve_launch,
)
from .core.models.parallel import parallel_groups
from .core.models.policy import full_state_dict
from .core.statistics.batching import VirtualStep
from .core.statistics.scorer import Chunks, score_scope
from .core.training.actor import Update, actor_step
from .core.training.live import LiveMetrics
from .core.training.resume import EXIT_RESUBMIT, SaveTriggers, check_universal, convert_to_universal
from .core.training.rollouts import (
    PromptPool,
    Rollouts,
    Sampled,
    collect,
    concat_rollouts,
    seed_of,
    split_minibatches,
    virtual_minibatches,
)
from .core.training.selectors import STATISTICS
from .keys import (  # noqa: F401  (re-exported)
    RESOLVED_CONFIG,
    STAGE_VERSIONS,
    checkpoint_name,
    checkpoint_steps,
    config_key_name,
    differences,
    train_config_hash,
    train_result_config,
)

__all__ = ["main"]

STAGE_VERSION = STAGE_VERSIONS["train"]
STATE_FILE = "state.json"

SEQLEN_STATS = ("min", "max", "minmax_diff", "balanced_min", "balanced_max", "mean")
"""verl's global_seqlen/* (stages.core.statistics.batching.balance_stats)."""
PHASES = ("generation", "reward", "scoring", "training", "weight_sync")
"""The parts of a step timed (verl's timing_s/gen, reward, old_log_prob, update_actor,
update_weights): the time_<phase>_s columns."""

METRICS_SCHEMA = pa.schema(
    [
        pa.field("step", pa.int64(), nullable=False),
        pa.field("reward_mean", pa.float64(), nullable=False),
        pa.field("accuracy", pa.float64(), nullable=False),
        pa.field("entropy_mean", pa.float64(), nullable=False),
        pa.field("renyi2_mean", pa.float64(), nullable=False),
        pa.field("entropy_selected_mean", pa.float64(), nullable=True),
        pa.field("renyi2_selected_mean", pa.float64(), nullable=True),
        pa.field("selected_fraction", pa.float64(), nullable=False),
        pa.field("clip_fraction", pa.float64(), nullable=True),
        pa.field("kl", pa.float64(), nullable=True),
        pa.field("grad_norm", pa.float64(), nullable=False),
        pa.field("loss", pa.float64(), nullable=False),
        pa.field("response_length_mean", pa.float64(), nullable=False),
        pa.field("length_limit_fraction", pa.float64(), nullable=False),
        pa.field("rollout_logprob_diff_mean", pa.float64(), nullable=True),
        pa.field("rollout_logprob_diff_max", pa.float64(), nullable=True),
        pa.field("rollout_kl", pa.float64(), nullable=True),
        pa.field("tis_truncated_fraction", pa.float64(), nullable=True),
        pa.field("generation_batches", pa.int64(), nullable=False),
        pa.field("micro_batches", pa.int64(), nullable=False),
        pa.field("skipped_steps", pa.int64(), nullable=False),
        pa.field("virtual_micro_batches", pa.int64(), nullable=True),
        *(pa.field(f"global_seqlen_{k}", pa.float64(), nullable=True) for k in SEQLEN_STATS),
        pa.field("tokens_per_second", pa.float64(), nullable=False),
        pa.field("time_s", pa.float64(), nullable=False),
        *(pa.field(f"time_{phase}_s", pa.float64(), nullable=False) for phase in PHASES),
    ]
)
"""Per step. Means over the sampled responses / tokens of the step (the sampling policy's H, H2);
`*_selected_mean`, `selected_fraction`, `clip_fraction` and `kl` (k3 to the base model, null when
β = 0) over the tokens the selector picked in the step's mini-batches (null when none);
`grad_norm` (before clipping) and `loss` are means over the step's optimizer steps;
`rollout_logprob_diff_mean` / `_max`: |log p_sampler − log p_trainer| in nats over the step's
trained tokens, the trainer's from the sampling pass (the policy that sampled) and the sampler's
as the sampler returned it at the sampling temperature; `rollout_kl`: the k3 estimate of
KL(sampler ‖ trainer) on those tokens, e^δ − 1 − δ with δ = log p_trainer − log p_sampler, unclamped
(all three null when the sampler gave no log-probs); `tis_truncated_fraction`: the share of
selected tokens whose importance weight was cut at train.tis_cap (null when off);
`generation_batches`: generation batches sampled (dynamic sampling samples more than one);
`micro_batches`: forward/backward calls per optimizer step on every rank (the most of any rank);
`skipped_steps`: optimizer steps of the rollout step skipped for a non-finite gradient norm (verl's
rule); `virtual_micro_batches`: with train.virtual_layout (selection_scope: microbatch), the
micro-batches one of verl's data-parallel groups makes over the step's mini-batches, and
`global_seqlen_*` verl's balance statistics of the step (prompt + response tokens of the
world_size chunks before balancing: min, max, minmax_diff; of the balanced partitions:
balanced_min, balanced_max; their mean) (null without it);
`length_limit_fraction`: the share of the step's sampled responses that reached their generation
limit (finish reason "length"; verl's response_length/clip_ratio);
`tokens_per_second` is sampled response tokens per second of the step's wall time `time_s`;
`time_<phase>_s`: seconds of the step in each part, the slowest rank's: `generation` in the sampler
(every generation batch), `reward` grading the responses, `scoring` the sampling pass and the
rescoring passes, `training` the optimizer steps (forwards, backwards, DeepSpeed's step),
`weight_sync` handing the new weights to the sampler (vLLM; about 0 for hf); the rest of time_s is
the exchanges between ranks, the metrics and the checkpoints."""

TIME_COLUMNS = ("tokens_per_second", "time_s", *(f"time_{phase}_s" for phase in PHASES))


def lr_at(step: int, tcfg: Train, lr: float | None = None) -> float:
    """Linear warm-up over `warmup_steps` rollout steps, then constant (METHODS §8); `lr` is the
    size's own rate (models.<size>.lr), else train.lr. Rollout step s < warmup_steps trains at
    (s + 1) / warmup_steps × lr, or with train.warmup_from_zero at s / warmup_steps × lr: verl's
    constant schedule with warm-up (lambda s: s / warmup) is stepped after each update, so its
    step 0 trains at lr 0 (Adam's moments still take that gradient) and full lr starts at
    step warmup_steps."""
    peak = lr if lr is not None else tcfg.lr
    if step < tcfg.warmup_steps:
        return peak * (step if tcfg.warmup_from_zero else step + 1) / tcfg.warmup_steps
    return peak


def prompt_pool(cfg: Config, paths: list[str]) -> PromptPool:
    """The training prompts of experiment.train_datasets (one file each, in that order), each
    with its dataset's generation limit (datasets.<name>.max_response_tokens, else train's)."""
    names = cfg.experiment.train_datasets
    if len(paths) != len(names):
        raise ConfigError(f"experiment.train_datasets: {len(names)} datasets but {len(paths)} "
                          f"--prompts files")
    frames, limits, graders = [], [], []
    for name, path in zip(names, paths, strict=True):
        frame = read_parquet(path, PROBLEM_SCHEMA)
        frames.append(frame)
        limits += [cfg.datasets[name].max_response_tokens or cfg.train.max_response_tokens] * frame.height
        graders += [cfg.datasets[name].grader] * frame.height
    problems = pl.concat(frames, how="vertical")
    if cfg.train.prompt_pool is not None:
        keep = cfg.train.prompt_pool
        problems, limits, graders = problems.head(keep), limits[:keep], graders[:keep]
    if problems.height == 0:
        raise ArtifactError(f"{', '.join(paths)}: the training prompt files are empty")
    return PromptPool(problems["prompt"].to_list(), problems["answer"].to_list(),
                      problems["answer_type"].to_list(), limits, graders)


def check_dropout(model, path: str) -> None:
    """Training runs in train mode (for gradient checkpointing): refuse a model with dropout,
    which would make the old and new log-probs of the same parameters differ."""
    rates = {k: getattr(model.config, k) for k in ("attention_dropout", "hidden_dropout",
                                                   "resid_pdrop", "embd_pdrop")
             if isinstance(getattr(model.config, k, None), float)}
    rates.update({name: m.p for name, m in model.named_modules() if isinstance(m, torch.nn.Dropout)})
    if active := {k: v for k, v in rates.items() if v > 0}:
        raise ArtifactError(f"{path}: the model has dropout {active}; RL training needs it off "
                            "(set it to 0 in its config.json)")


def scorer_needs(method: Method, dense_only: bool) -> frozenset[str]:
    """What the sampling pass must compute: the metrics' statistics and the selector's."""
    return frozenset() if dense_only else method.needs() & set(STATISTICS)


def sampling_pass(model, minibatches: list[Rollouts], needs: frozenset[str], cfg: Config,
                  pad_id: int, dist: Dist) -> None:
    """Score every token of the step once, without gradient, with the policy that sampled it;
    each mini-batch is its own scope (the selectors' scope). Fills mb.stats."""
    for mb in minibatches:
        mb.stats = rescore(model, mb, needs, cfg, pad_id, dist)


def rescore(model, mb: Rollouts, needs: frozenset[str], cfg: Config, pad_id: int,
            dist: Dist) -> dict[str, torch.Tensor]:
    t, ts = cfg.train, cfg.token_stats
    several = dist.world > 1
    return score_scope(model, mb.scope(), pad_id, t.temperature, needs, device=dist.device,
                       max_sequences=t.micro_batch_size, max_tokens=t.micro_batch_tokens,
                       chunks=Chunks(ts.chunk_positions, ts.chunk_vocab),
                       all_reduce=dist.sum if several else None,
                       rank_max=dist.max if several else None)


def train_step(step: int, engine, roll: Rollouts, method: Method, cfg: Config, dist: Dist,
               run_seed: int, pad_id: int, ref_model,
               timer: dict | None = None) -> tuple[list[Update], Rollouts, VirtualStep | None]:
    """The sampling pass and the step's optimizer steps. Returns the updates, this rank's trained
    sequences with their sampling-pass scores (for the metrics) and, with selection_scope
    microbatch, verl's layout of the step (its mini-batches: stages.core.training.rollouts.virtual_minibatches;
    the selection needs the current policy's scores, so every mini-batch after the first is
    rescored: the config requires methods.<m>.rescore there). timer: seconds of the scoring
    passes and of the optimizer steps are added to its "scoring" and "training"."""
    tcfg = cfg.train
    timer = {} if timer is None else timer
    timer.setdefault("scoring", 0.0)
    timer.setdefault("training", 0.0)
    clock = time.perf_counter()
    dense = step < method.warmup_steps
    needs = scorer_needs(method, dense)
    model = engine.module
    layout, scopes = None, None
    if method.selection_scope == "microbatch":
        minibatches, scopes, layout = virtual_minibatches(roll, cfg, dist)
    else:
        minibatches = split_minibatches(roll, tcfg.mini_batch_prompts // dist.world, tcfg.group_size)
    model.eval()  # the sampling pass needs no activations for a backward pass
    sampling_pass(model, minibatches, needs, cfg, pad_id, dist)
    model.train()
    timer["scoring"] += time.perf_counter() - clock
    updates = []
    for epoch in range(tcfg.ppo_epochs):
        for k, mb in enumerate(minibatches):
            on_policy = epoch == 0 and k == 0  # nothing has changed the policy since sampling
            stats = mb.stats
            if not on_policy and method.rescore and needs:
                clock = time.perf_counter()
                model.eval()
                stats = rescore(model, mb, needs, cfg, pad_id, dist)
                model.train()
                timer["scoring"] += time.perf_counter() - clock
            clock = time.perf_counter()
            gen = torch.Generator().manual_seed(seed_of(run_seed, step, epoch, k))
            updates.append(actor_step(engine, mb, method, cfg, dist, gen, pad_id, stats=stats,
                                      on_policy=on_policy, dense=dense, ref_model=ref_model,
                                      scope=None if scopes is None else scopes[k]))
            timer["training"] += time.perf_counter() - clock
    trained = concat_rollouts(minibatches)
    if not minibatches:
        trained.stats = {key: torch.zeros(0) for key in ("entropy", "renyi2", "logprob")}
    return updates, trained, layout


def mismatch_sums(roll: Rollouts) -> list[float]:
    """[Σ |Δ|, max |Δ|, Σ k3, tokens] of Δ = log p_trainer − log p_sampler over this rank's trained
    tokens (the trainer's from the sampling pass); NaN when the sampler gave no log-probs."""
    if roll.sampler_logprobs is None:
        return [float("nan")] * 3 + [0.0]
    delta = roll.stats["logprob"].double() - roll.sampler_logprobs.double()
    if delta.numel() == 0:
        return [0.0, 0.0, 0.0, 0.0]
    k3 = torch.expm1(delta) - delta  # e^δ − 1 − δ ≥ 0: unbiased for KL(sampler ‖ trainer)
    return [float(delta.abs().sum()), float(delta.abs().max()), float(k3.sum()), float(delta.numel())]


# ---------------------------------------------------------------------------------------------
# Resume state
# ---------------------------------------------------------------------------------------------
def resume_record(cfg: Config, args) -> dict:
    """What a resume folder must have been made by: the stage version, the result keys of the
    config (stages.keys.train_result_config: operational keys such as memory shares, checkpoint
    cadence, labels and the world size are not among them), the job and its inputs."""
    inputs = {}
    for name, path in [("model", args.model)] + [(f"prompts{i}", p) for i, p in enumerate(args.prompts)]:
        st = Path(path).stat()
        inputs[name] = [st.st_size, st.st_mtime_ns]
    return {"stage_version": STAGE_VERSION,
            "config": train_result_config(cfg, args.size, args.method),
            "job": [args.size, args.method, args.seed], "inputs": inputs}


def fingerprint(cfg: Config, args) -> str:
    """The hash of resume_record: a resume state is used only by a job of the same one."""
    blob = json.dumps(resume_record(cfg, args), sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def mismatch(saved: dict | None, current: dict, args) -> str:
    """Why a resume state's record differs from this job's, naming each key."""
    if not saved:
        return "it was saved by an older version of the trainer, which kept no record of its keys"
    lines = []
    for diff in differences(saved.get("config"), current["config"]):
        key, _, rest = diff.partition(":")
        lines.append(f"{config_key_name(key, args.size, args.method)}:{rest}")
    if saved.get("stage_version") != current["stage_version"]:
        lines.append(f"the trainer's stage version: {saved.get('stage_version')!r} in the resume "
                     f"state, {current['stage_version']!r} now")
    if saved.get("job") != current["job"]:
        lines.append(f"the job (size, method, seed): {saved.get('job')} in the resume state, "
                     f"{current['job']} now")
    for name, value in current["inputs"].items():
        if (saved.get("inputs") or {}).get(name) != value:
            flag = "--model" if name == "model" else f"--prompts file {int(name[7:]) + 1}"
            lines.append(f"the {flag} input changed since the resume state was saved (size or "
                         "modification time)")
    return "; ".join(lines) or "its fingerprint differs"


def read_state(resume_dir: Path, expected: str, record: dict | None = None,
               args=None) -> dict | None:
    """The last complete checkpoint of this job in resume_dir, or None; refuses a foreign one,
    naming the result keys (or inputs) that differ from this job's (record: resume_record). A
    state saved by another number of processes is this job's too (resume_tag moves it)."""
    path = resume_dir / STATE_FILE
    if not path.exists():
        if resume_dir.exists() and any(resume_dir.iterdir()):
            cli.log.warning("%s: no %s (killed before its first checkpoint); starting over",
                            resume_dir, STATE_FILE)
        return None
    try:
        state = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ArtifactError(f"{path}: not valid JSON ({err}); delete {resume_dir} to start over") from None
    if state.get("fingerprint") != expected:
        why = mismatch(state.get("record"), record, args) if record is not None else (
            f"fingerprint {state.get('fingerprint')!r}, this job {expected!r}")
        raise ArtifactError(
            f"{resume_dir}: resume state of a different config or inputs ({why}); delete the "
            "folder to start over, or set those keys back to resume")
    return state


def resume_tag(state: dict, resume_dir: Path, tcfg: Train, launch) -> tuple[str, bool]:
    """(the DeepSpeed tag to load, whether it is a universal checkpoint): the state's own on its
    world size, else (ZeRO 1-3) its universal conversion, made once by rank 0
    (stages.core.training.resume); ZeRO-0's single state file loads on any world size."""
    saved = state["world_size"]
    if saved == launch.world:
        return state["tag"], False
    check_universal(tcfg, saved, launch.world, resume_dir)
    if tcfg.zero_stage == 0:
        cli.log.info("%s: saved by %d process(es), resumed by %d (ZeRO-0: one state for all)",
                     resume_dir, saved, launch.world)
        return state["tag"], False
    cli.log.info("%s: saved by %d process(es), resumed by %d: converting step %d's ZeRO-%d state "
                 "to a universal checkpoint", resume_dir, saved, launch.world, state["step"],
                 tcfg.zero_stage)
    return convert_to_universal(resume_dir, state["tag"], tcfg.zero_stage, launch.rank), True


def save_state(engine, resume_dir: Path, state: dict, dist: Dist) -> None:
    """A DeepSpeed checkpoint, then (rank 0) the state file pointing at it, then old ones removed."""
    tag = f"step{state['step']:06d}"
    engine.save_checkpoint(str(resume_dir), tag=tag, save_latest=False)
    job = dist.job  # the job's rank 0 writes (every sequence-parallel rank has data-parallel rank 0)
    job.barrier()
    if job.rank == 0:
        write_json(resume_dir / STATE_FILE, {**state, "tag": tag})
        for old in resume_dir.glob("step*"):
            if old.is_dir() and old.name != tag:
                shutil.rmtree(old, ignore_errors=True)
    job.barrier()


# ---------------------------------------------------------------------------------------------
# The stage
# ---------------------------------------------------------------------------------------------
# ---------------------------------------------------------------------------------------------
def check_args(args, cfg: Config) -> Method:
    if args.size not in cfg.models:
        raise ConfigError(f"--size {args.size!r}: not a key of 'models' ({sorted(cfg.models)})")
    if args.method not in cfg.methods:
        raise ConfigError(f"--method {args.method!r}: not a key of 'methods' ({sorted(cfg.methods)})")
    for name, path in [("model", args.model)] + [("prompts", p) for p in args.prompts]:
        if not Path(path).exists():
            raise ArtifactError(f"{path}: --{name} file not found")
    return cfg.methods[args.method]


def check_layout(cfg: Config, method: Method, method_name: str, world: int) -> None:
    """The job's `world` processes form groups of train.sequence_parallel ranks that hold the same
    sequences; a mini-batch's prompts split over the world / sequence_parallel data-parallel
    ranks."""
    t = cfg.train
    parallel_groups(world, t.sequence_parallel)  # ConfigError when the groups do not come out whole
    dp = world // t.sequence_parallel
    if t.mini_batch_prompts % dp:
        where = f"{world} processes" if dp == world else (
            f"the {dp} data-parallel ranks of {world} processes (train.sequence_parallel "
            f"{t.sequence_parallel})")
        raise ConfigError(f"train.mini_batch_prompts: {t.mini_batch_prompts} does not split over "
                          f"{where}")


def main(args, cfg: Config) -> None:
    method = check_args(args, cfg)
    cfg = cfg.for_method(args.method, args.size)  # models.<size>.train, methods.<m>.train applied
    tcfg = cfg.train
    out_dir = Path(args.out_dir)
    resume_dir = Path(args.resume_dir) if args.resume_dir else out_dir.parent / f".{out_dir.name}.resume"
    launch = resolve_launch(cfg, args.size)
    check_layout(cfg, method, args.method, launch.world)
    triggers = SaveTriggers(tcfg)  # SIGURG: save at the next step boundary, from now on
    record = resume_record(cfg, args)
    expected = fingerprint(cfg, args)
    state = read_state(resume_dir, expected, record, args)  # before anything is written
    load_tag, universal = resume_tag(state, resume_dir, tcfg, launch) if state else (None, False)

    from .core.models.modeling import load_model_and_tokenizer
    from .core.models.samplers import HfPolicySampler, VllmPolicySampler

    # ZeRO-3 partitions the models as they load, in the process group; other stages start it
    # once the models have loaded (one that does not load then leaves no process group behind)
    zero3 = tcfg.zero_stage == 3
    dist = init_distributed(launch, tcfg.sequence_parallel) if zero3 else None
    dtype = torch.bfloat16 if tcfg.dtype == "bfloat16" else torch.float32
    with partitioned_loading(tcfg):  # ZeRO-3: no rank ever holds a whole model
        model, tokenizer = load_model_and_tokenizer(args.model, dtype=dtype, device=str(launch.device))
        ref_model = None
        if tcfg.loss.kl_beta > 0:
            ref_model, _ = load_model_and_tokenizer(args.model, dtype=dtype,
                                                    device=str(launch.device))
            float32_rotary(ref_model).set_attn_implementation(tcfg.attn_implementation)
    float32_rotary(model).set_attn_implementation(tcfg.attn_implementation)
    check_dropout(model, args.model)
    if tcfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    pool = prompt_pool(cfg, args.prompts)
    sizes = [len(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in pool.prompts]
    longest = max(sizes)
    if tcfg.max_prompt_tokens is not None and longest > tcfg.max_prompt_tokens:
        raise ConfigError(f"train.max_prompt_tokens: training prompt {sizes.index(longest)} of "
                          f"{', '.join(args.prompts)} has {longest} tokens, more than "
                          f"{tcfg.max_prompt_tokens}")
    limit = model.config.max_position_embeddings
    if longest + max(pool.limits) > limit:
        raise ConfigError(f"train.max_response_tokens: {max(pool.limits)} + the longest "
                          f"prompt ({longest} tokens) exceed the model's {limit} positions")
    virtual = tcfg.virtual_layout
    if method.selection_scope == "microbatch" and longest + max(pool.limits) > virtual.budget:
        raise ConfigError(f"train.virtual_layout.max_token_len_per_gpu: a micro-batch of "
                          f"{virtual.budget} tokens (x sequence_parallel) cannot hold the longest "
                          f"prompt ({longest} tokens) with a {max(pool.limits)}-token response, "
                          "as verl requires")
    pad_id = tokenizer.pad_token_id
    run_seed = seed_of(cfg.seed, args.seed)
    torch.manual_seed(run_seed)

    if dist is None:
        dist = init_distributed(launch, tcfg.sequence_parallel)  # the data-parallel group
    engine = build_engine(model, tcfg, dist.world, sp=dist.sp, load_universal=universal)
    engine.train()
    policy = engine.module  # the Policy: trunk and head of the causal LM
    if ref_model is not None:
        ref_model = build_reference(ref_model, tcfg, sp=dist.sp)
    start, consumed, rows = 0, 0, []
    if state is not None:
        path, _ = engine.load_checkpoint(str(resume_dir), tag=load_tag, load_optimizer_states=True,
                                         load_lr_scheduler_states=False)
        if path is None:
            raise ArtifactError(f"{resume_dir / load_tag}: DeepSpeed checkpoint missing or unreadable")
        start, consumed, rows = state["step"], state["consumed"], state["metrics"]
        cli.log.info("resuming %s/%s seed %d at step %d from %s", args.size, args.method,
                     args.seed, start, resume_dir)
    elif dist.job.rank == 0:  # checkpoints of an attempt that saved no resume state are not ours
        shutil.rmtree(resume_dir / "checkpoints", ignore_errors=True)
    live = LiveMetrics(out_dir, tcfg.loggers, rows=rows, ids=(state or {}).get("loggers"),
                       name=f"{cfg.run}/{args.size}/{args.method}/seed={args.seed}",
                       config=cfg.model_dump(mode="json"), active=dist.job.rank == 0)
    if tcfg.backend == "vllm":
        sampler = VllmPolicySampler(
            args.model, policy.lm, tokenizer, world_size=dist.job.world, seed=run_seed,
            gpu_memory_utilization=tcfg.vllm_gpu_memory_utilization,
            max_model_len=longest + max(pool.limits),
            dtype="bfloat16" if tcfg.dtype == "bfloat16" else "float32",
            batch_invariant=tcfg.batch_invariant,
            tensor_parallel_size=cfg.models[args.size].train_tensor_parallel_size,
            float32_head=tcfg.vllm_float32_head, engine_kwargs=tcfg.engine_kwargs,
            stop_tokens=cfg.models[args.size].stop_tokens)
        # an engine built in this process sets torch to one thread on GPUs (where OMP_NUM_THREADS
        # is unset); vLLM's CPU build instead makes torch.set_num_threads a no-op from here on
        if args.threads and torch.get_num_threads() != args.threads:
            torch.set_num_threads(args.threads)
    else:  # the decode loop on the engine's own module; under ZeRO-3 every rank generates in step
        sampler = HfPolicySampler(policy.lm, tokenizer, tcfg.generation_batch_size,
                                  dist=dist.job if zero3 and dist.job.world > 1 else None,
                                  stop_tokens=cfg.models[args.size].stop_tokens)

    peak_lr = cfg.models[args.size].lr
    began = time.perf_counter()
    bar = cli_progress(start, tcfg.steps, f"train {args.size}/{args.method}", dist.job.rank)

    def resubmit(why: str, done: int) -> None:
        """Stop here, to be resubmitted: the same command resumes from the last resume state."""
        timing.note(attempts=attempted(done))
        bar.close()
        live.close()
        if dist.job.rank == 0:
            cli.log.warning("%s in %s; exiting with status %d so that the job is resubmitted (the "
                            "same command continues from there)", why, resume_dir, EXIT_RESUBMIT)
        dist.job.barrier()
        shutdown(sampler)
        raise SystemExit(EXIT_RESUBMIT)

    # this job's attempts so far, for the cost plan's calibration (stages.core.common.timing)
    attempts = list((state or {}).get("attempts", []))
    startup_s = timing.process_seconds()

    def attempted(done: int) -> list[dict]:
        """The attempts with this one, which has reached step `done`."""
        return attempts + [{"first_step": start, "last_step": done, "startup_s": round(startup_s, 3),
                            "wall_s": round(timing.process_seconds(), 3),
                            "steps_s": round(sum(r["time_s"] for r in rows[start:done]), 3)}]

    def save(done: int, consumed: int) -> float:
        clock = time.perf_counter()
        save_state(engine, resume_dir, {"fingerprint": expected, "record": record,
                                        "world_size": dist.job.world, "step": done,
                                        "consumed": consumed, "metrics": rows,
                                        "loggers": live.ids, "attempts": attempted(done)}, dist)
        triggers.saved()
        return time.perf_counter() - clock

    # what a step needs after its generation: the last step's update and sync and the last save,
    # with a margin; a signal that leaves less saves before the update (no update measured yet:
    # at once; no save yet: counted as none, within the margin)
    update_s, save_s = float("inf"), 0.0
    for step in range(start, tcfg.steps):
        t0 = time.perf_counter()
        for group in engine.optimizer.param_groups:
            group["lr"] = lr_at(step, tcfg, peak_lr)
        sampled = Sampled()
        before = consumed
        roll, consumed = collect(step, consumed, cfg, run_seed, sampler, pool, dist, sampled)
        timer = {"generation": sampled.generation_s, "reward": sampled.reward_s}
        sampler.release()  # every generation batch of the step is sampled: the engine may sleep
        if triggers.save_now(dist.job, 1.5 * (update_s + save_s)):
            # the weights and optimizer are the last step's: keep them and lose the generation
            # (drawn again from the same seeds on resume), not the step, to the time limit
            if step > start:  # else the state this attempt began from is the one to keep
                save(step, before)
            resubmit(f"SIGURG (time limit near) during the generation of step {step + 1}: resume "
                     f"state at step {step} of {tcfg.steps}, before its update", step)
        clock = time.perf_counter()
        updates, trained, layout = train_step(step, engine, roll, method, cfg, dist, run_seed,
                                              pad_id, ref_model, timer)
        synced = time.perf_counter()
        sampler.sync()
        timer["weight_sync"] = time.perf_counter() - synced
        update_s = time.perf_counter() - clock
        row = step_metrics(step, sampled, trained, updates, dist, time.perf_counter() - t0,
                           kl_on=ref_model is not None, tis_on=tcfg.tis_cap is not None,
                           layout=layout, phases=timer)
        rows.append(row)
        live.log(row)
        bar.update(1)
        bar.set_postfix(reward=f"{row['reward_mean']:.3f}", H=f"{row['entropy_mean']:.3f}")
        if dist.job.rank == 0:
            cli.log.info("step %d/%d: reward %.3f, entropy %.3f, selected %.3f, %.1f s", step + 1,
                         tcfg.steps, row["reward_mean"], row["entropy_mean"],
                         row["selected_fraction"], row["time_s"])
        done = step + 1
        if tcfg.save_every and done % tcfg.save_every == 0 and done < tcfg.steps:
            # kept with the resume state until the job ends: Snakemake deletes the outputs
            # (checkpoints/ is one) of a job that failed, a walltime kill among them
            save_model(policy, tokenizer, cfg, args, resume_dir / checkpoint_name(done), dist)
        timed, signalled = triggers.poll(dist.job)
        forced = tcfg.stop_after_steps is not None and done - start >= tcfg.stop_after_steps
        if (done % tcfg.checkpoint_every == 0 or timed or signalled or forced) and done < tcfg.steps:
            save_s = save(done, consumed)
            if signalled:  # the time limit is near
                resubmit(f"SIGURG (time limit near): resume state saved after step {done} of "
                         f"{tcfg.steps}", done)
            if forced:
                resubmit(f"train.stop_after_steps ({tcfg.stop_after_steps} steps an attempt): "
                         f"resume state saved after step {done} of {tcfg.steps}", done)
    bar.close()
    live.close()
    seconds = time.perf_counter() - began
    finish(engine, tokenizer, cfg, args, rows, out_dir, resume_dir, dist, seconds, start)
    timing.note(attempts=attempted(tcfg.steps))
    shutdown(sampler)


def shutdown(sampler) -> None:
    """The end of a training process, finished or stopped for a time limit: the sampler first (a
    vLLM engine's teardown destroys its own groups and then the default one, which it shares with
    DeepSpeed; after the group was destroyed, vLLM's exit hook would fail on every rank), then the
    default group, where the sampler left it."""
    import torch

    sampler.close()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def cli_progress(start: int, total: int, desc: str, rank: int):
    from .core.common.progress import progress

    return progress(total=total, initial=start, desc=desc, unit="step", disable=rank != 0)


def save_model(policy, tokenizer, cfg: Config, args, folder: Path, dist: Dist) -> None:
    """A Hugging Face copy of the policy (rank 0) with a model.json pointing at it, for evaluation."""
    job = dist.job
    state = full_state_dict(policy.lm, keep=job.rank == 0)  # every rank: gathered under ZeRO-3
    if job.rank == 0:
        with atomic_dir(folder) as tmp:
            policy.lm.save_pretrained(tmp / "model", state_dict=state)
            tokenizer.save_pretrained(tmp / "model")
            write_json(tmp / "model.json", {"kind": "scratch", "path": "model"})
    job.barrier()


def step_metrics(step: int, sampled: Sampled, roll: Rollouts, updates: list[Update], dist: Dist,
                 seconds: float, kl_on: bool, tis_on: bool = False,
                 layout: VirtualStep | None = None, phases: dict | None = None) -> dict:
    """One row of metrics.parquet, the same on every rank; roll: this rank's trained sequences
    with their sampling-pass scores; phases: this rank's seconds of each of PHASES (the row
    has the slowest rank's)."""
    old = roll.stats
    s = dist.sum(torch.tensor([
        sampled.responses, sampled.correct, sampled.reward, sampled.tokens,
        float(old["entropy"].double().sum()), float(old["renyi2"].double().sum()),
        float(old["entropy"].numel()), sampled.cut,
    ], dtype=torch.float64)).tolist()
    phases = phases or {}
    mine = torch.tensor([phases.get(p, 0.0) for p in PHASES], dtype=torch.float64)
    slowest = dist.job.cat(mine).reshape(-1, len(PHASES)).max(0).values.tolist()
    n_sel = sum(u.n_selected for u in updates)
    n_valid = sum(u.n_valid for u in updates)
    kl = sum(u.kl_sum for u in updates)
    diff_sum, diff_max, k3_sum, n_tok = mismatch_sums(roll)
    diff_sum, k3_sum, n_tok = dist.sum(torch.tensor([diff_sum, k3_sum, n_tok], dtype=torch.float64)).tolist()
    diff_max = float(dist.cat(torch.tensor([diff_max], dtype=torch.float64)).max())

    def ratio(a: float, b: float) -> float | None:
        return a / b if b else None

    def finite(value: float | None) -> float | None:
        return None if value is None or value != value else value  # NaN: no sampler log-probs

    return {
        "step": step,
        "reward_mean": s[2] / s[0],
        "accuracy": s[1] / s[0],
        "entropy_mean": ratio(s[4], s[6]) or 0.0,
        "renyi2_mean": ratio(s[5], s[6]) or 0.0,
        "entropy_selected_mean": ratio(sum(u.entropy_selected_sum for u in updates), n_sel),
        "renyi2_selected_mean": ratio(sum(u.renyi2_selected_sum for u in updates), n_sel),
        "selected_fraction": n_sel / n_valid if n_valid else 0.0,
        "clip_fraction": ratio(sum(u.n_clipped for u in updates), n_sel),
        "kl": ratio(kl, n_sel) if kl_on else None,
        "grad_norm": sum(u.grad_norm for u in updates) / len(updates) if updates else 0.0,
        "loss": sum(u.loss for u in updates) / len(updates) if updates else 0.0,
        "response_length_mean": s[3] / s[0],
        "length_limit_fraction": s[7] / s[0],
        "rollout_logprob_diff_mean": finite(ratio(diff_sum, n_tok)),
        "rollout_logprob_diff_max": finite(diff_max) if n_tok else None,
        "rollout_kl": finite(ratio(k3_sum, n_tok)),
        "tis_truncated_fraction": ratio(sum(u.n_truncated for u in updates), n_sel) if tis_on else None,
        "generation_batches": sampled.generation_batches,
        "micro_batches": max((u.micro_batches for u in updates), default=0),
        "skipped_steps": sum(u.skipped for u in updates),
        "virtual_micro_batches": None if layout is None else sum(layout.counts),
        **{f"global_seqlen_{k}": None if layout is None or layout.stats is None else layout.stats[k]
           for k in SEQLEN_STATS},
        "tokens_per_second": s[3] / seconds,
        "time_s": seconds,
        **{f"time_{phase}_s": value for phase, value in zip(PHASES, slowest, strict=True)},
    }


def finish(engine, tokenizer, cfg: Config, args, rows: list[dict], out_dir: Path, resume_dir: Path,
           dist: Dist, seconds: float, start: int) -> None:
    """Write final/ (the full weights, gathered from the shards under ZeRO-3), metrics.parquet,
    summary.json, move the save_every checkpoints from the resume folder, and write model.json
    last; drop the resume state."""
    lm = engine.module.lm
    job = dist.job  # its rank 0 writes
    state = full_state_dict(lm, keep=job.rank == 0)
    prov = provenance("train", STAGE_VERSION, train_config_hash(cfg, args.size, args.method),
                      cfg.seed, size=args.size, method=args.method, run_seed=args.seed,
                      world_size=job.world)
    last = rows[-1]
    summary = {
        "size": args.size, "method": args.method, "seed": args.seed,
        "steps": cfg.train.steps, "resumed_at_step": start, "world_size": job.world,
        "torch_threads": torch.get_num_threads(), "train_seconds": round(seconds, 1),
        "final_reward_mean": last["reward_mean"], "final_accuracy": last["accuracy"],
    }
    if job.rank == 0:
        with atomic_dir(out_dir / "final") as tmp:
            lm.save_pretrained(tmp, state_dict=state)
            tokenizer.save_pretrained(tmp)
            write_json(tmp / RESOLVED_CONFIG, {"config": cfg.model_dump(mode="json"),
                                               "method": args.method, "provenance": prov,
                                               "summary": summary})
        write_parquet(rows, out_dir / "metrics.parquet", METRICS_SCHEMA, prov)
        write_json(out_dir / "summary.json", summary)
        if (resume_dir / "checkpoints").exists():  # the save_every checkpoints, now outputs
            shutil.rmtree(out_dir / "checkpoints", ignore_errors=True)
            os.replace(resume_dir / "checkpoints", out_dir / "checkpoints")
        write_json(out_dir / "model.json", {"kind": "scratch", "path": "final"})
        shutil.rmtree(resume_dir, ignore_errors=True)
        cli.log.info("%s/%s seed %d: %d steps in %.0f s, last reward %.3f -> %s", args.size,
                     args.method, args.seed, cfg.train.steps, seconds, last["reward_mean"], out_dir)
    job.barrier()


def build_parser():
    p = cli.parser(__doc__.splitlines()[0])
    p.add_argument("--size", required=True, help="a key of 'models'")
    p.add_argument("--method", required=True, help="a key of 'methods'")
    p.add_argument("--seed", required=True, type=int, help="the run's seed (experiment.seeds)")
    p.add_argument("--model", required=True, help="base.json of that size")
    p.add_argument("--prompts", required=True, nargs="+",
                   help="prepared training prompts (Parquet), one per experiment.train_datasets")
    p.add_argument("--out-dir", required=True, help="folder for model.json, final/, metrics.parquet")
    p.add_argument("--resume-dir", default=None,
                   help="checkpoints to resume from (default: .<out-dir name>.resume beside it)")
    # the deepspeed launcher passes --local_rank; the rank is read from the environment
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return p


if __name__ == "__main__":
    cli.run(main, build_parser())
