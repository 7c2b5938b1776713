"""The cost plan: estimated GPU-hours, wall time and disk of every GPU job and of a reproduction.

    python -m stages.plan --configfile config/beyond-80-20.yaml --cost [--max-runtime MINUTES]

Counted work (stages.core.plans.cost: tokens generated and trained, forward passes, FLOPs at the model's
size) turned into time by the config's `cost` section: mean prompt and response lengths,
generation batches per step, the GPUs' generation throughput and training utilisation, the fixed
time of a step and of a job's start. Those are assumptions (ours) until a GPU run calibrates them
from its metrics.parquet. Each job's attempt is capped at the partition's limit
(`resources.max_runtime`, else SLURM's MaxTime); a training continues across attempts from its
resume state, and the attempts it needs become the training rule's `retries`
(workflow/rules/train.smk, :func:`train_retries`). The plan warns where an estimate exceeds a
job's request, a request exceeds the limit, or a training cannot get past its checkpoint interval
within one attempt.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace

from .config import Config, ConfigError, Cost
from .core.plans import cost as cc
from .core.plans.cost import approx, hours, size_of
from .core.plans.dimensions import model_arch  # a size's dimensions (errors name the key)
from .core.plans.memory import dtype_bytes
from .keys import checkpoint_steps

# Problems of the benchmark sources the shipped configs read, by (dataset, config, split,
# adapter); each count is the one the config's comment or the dataset's card gives.
KNOWN_PROBLEMS = {
    ("HuggingFaceH4/MATH-500", None, "test", "math"): 500,
    ("openai/gsm8k", "main", "test", "gsm8k"): 1319,
    ("TIGER-Lab/MMLU-STEM", "default", "test", "mmlu"): 3153,  # the hub viewer: 3.15k rows
    ("Idavidrein/gpqa", "gpqa_diamond", "train", "gpqa"): 198,
    ("AI-MO/aimo-validation-aime", None, "train", "aimo_aime2023"): 30,  # 2023 of 90 rows
    ("HuggingFaceH4/aime_2024", None, "train", "aime"): 30,
    ("math-ai/aime25", None, "test", "aime"): 30,
    ("math-ai/minervamath", None, "test", "minerva"): 272,
    ("Hothan/OlympiadBench", "OE_TO_maths_en_COMP", "train", "olympiadbench"): 674,
    ("math-ai/amc23", None, "test", "amc"): 40,
    ("tau/commonsense_qa", None, "validation", "csqa"): 1221,
}

GPU_RULES = ("rollout", "token_stats", "train", "evaluate", "evaluate_checkpoint", "overlap")
"""The workflow's GPU rules in its order; an overlap runs as a token-statistics job and a
checkpoint's evaluation as an evaluation (workflow/rules/overlap.smk, curves.smk)."""
REQUEST_OF = {"evaluate_checkpoint": "evaluate", "overlap": "token_stats"}


@dataclass
class JobCost:
    """The estimate of one kind of job (one row: identical jobs of several methods and seeds)."""

    rule: str
    size: str
    methods: list[str]
    jobs: int
    gpus: int
    work_min: float
    wall_min: float
    attempts: int | None
    request_min: int
    attempt_min: int
    kept_bytes: float
    transient_bytes: float = 0.0
    detail: list[str] = field(default_factory=list)
    steps: int = 0
    """A training's rollout steps (0 for other jobs)."""
    device: str = "GPU"
    """GPU, or CPU for a size without GPUs (cost.cpu_jobs): `gpus` are then its processes."""

    @property
    def gpu_hours(self) -> float:
        return self.jobs * self.gpus * self.wall_min / 60 if self.device == "GPU" else 0.0

    @property
    def requested_gpu_hours(self) -> float:
        """Every attempt of every job at its walltime (a training's attempts as the plan counts
        them; another job's one): what the jobs reserve if each runs to its limit."""
        if self.device != "GPU":
            return 0.0
        return self.jobs * self.gpus * (self.attempts or 1) * self.attempt_min / 60

    def key(self) -> tuple:
        """What two rows must share to be printed as one."""
        return (self.rule, self.size, self.gpus, self.work_min, self.wall_min, self.attempts,
                self.request_min, self.attempt_min, self.kept_bytes, self.transient_bytes,
                tuple(self.detail), self.steps)

    def as_dict(self) -> dict:
        return {"rule": self.rule, "size": self.size, "methods": self.methods, "jobs": self.jobs,
                "device": self.device, "gpus": self.gpus, "work_hours": round(self.work_min / 60, 3),
                "wall_hours": round(self.wall_min / 60, 3), "attempts": self.attempts,
                "request_minutes": self.request_min, "attempt_minutes": self.attempt_min,
                "gpu_hours": round(self.gpu_hours, 1),
                "requested_gpu_hours": round(self.requested_gpu_hours, 1),
                "kept_bytes": round(self.kept_bytes), "transient_bytes": round(self.transient_bytes),
                "detail": self.detail}


@dataclass
class CostPlan:
    """Every GPU job's estimate, the reproduction's totals and the warnings."""

    source: str
    rows: list[JobCost]
    limit: int | None
    limit_source: str
    warnings: list[str]
    problems: list[str]
    snapshot_bytes: float = 0.0
    """The hub models' weights in the fetch's snapshot store (bf16, est.; stages.fetch)."""

    @property
    def jobs(self) -> int:
        """GPU jobs."""
        return sum(r.jobs for r in self.rows if r.device == "GPU")

    @property
    def cpu_jobs(self) -> int:
        return sum(r.jobs for r in self.rows if r.device == "CPU")

    @property
    def cpu_minutes(self) -> float:
        """The CPU jobs' wall time one after another (every attempt and start-up)."""
        return sum(r.jobs * r.wall_min for r in self.rows if r.device == "CPU")

    @property
    def gpu_hours(self) -> float:
        return sum(r.gpu_hours for r in self.rows)

    @property
    def requested_gpu_hours(self) -> float:
        return sum(r.requested_gpu_hours for r in self.rows)

    @property
    def kept_bytes(self) -> float:
        return sum(r.jobs * r.kept_bytes for r in self.rows)

    @property
    def transient_bytes(self) -> float:
        """Every training's resume states at once: the peak when all of them run together."""
        return sum(r.jobs * r.transient_bytes for r in self.rows)

    def chain_min(self) -> float:
        """The longest chain of jobs, minutes, with a GPU for every job at once and no queueing:
        per size, the longest training or the base-model rollouts and their statistics, then the
        longest job after it (an evaluation, a checkpoint's evaluation, an overlap)."""
        def most(size: str, *rules: str) -> float:
            return max((r.wall_min for r in self.rows if r.size == size and r.rule in rules),
                       default=0.0)

        longest = 0.0
        for size in dict.fromkeys(r.size for r in self.rows):
            before = max(most(size, "train"), most(size, "rollout") + most(size, "token_stats"))
            after = most(size, "evaluate", "evaluate_checkpoint", "overlap")
            longest = max(longest, before + after)
        return longest

    def as_dict(self) -> dict:
        return {"config": self.source, "jobs": [r.as_dict() for r in self.rows],
                "gpu_jobs": self.jobs, "gpu_hours": round(self.gpu_hours, 1),
                "requested_gpu_hours": round(self.requested_gpu_hours, 1),
                "longest_chain_hours": round(self.chain_min() / 60, 2),
                "kept_bytes": round(self.kept_bytes), "transient_bytes": round(self.transient_bytes),
                "snapshot_bytes": round(self.snapshot_bytes),
                "max_runtime_minutes": self.limit, "max_runtime_source": self.limit_source,
                "warnings": self.warnings, "problems": self.problems}


# ---------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------
def problems_of(cfg: Config, name: str) -> int:
    """Problems of one benchmark: cost.problems, a generated source's n, or the known sources'
    table (a hub source's `limit` caps it); errors name the key to set."""
    if name in cfg.cost.problems:
        return cfg.cost.problems[name]
    src = cfg.datasets[name].source
    if src.kind == "generated":
        return src.n
    known = None
    if src.kind == "hub" and not src.levels:
        known = KNOWN_PROBLEMS.get((src.dataset, src.config, src.split, src.adapter))
    if known is not None:
        return min(known, src.limit) if src.limit else known
    if src.limit and not src.levels:
        return src.limit  # at most that many: an upper bound
    raise ConfigError(f"cost.problems.{name}: the cost plan does not know how many problems "
                      f"datasets.{name} holds; set it")


def runtime_limit(cfg: Config, query: bool = True) -> tuple[int | None, str]:
    """(the longest walltime a GPU job may ask for, minutes, or None; where it comes from):
    resources.max_runtime, else the lower of the MaxTime of the partition GPU jobs go to
    ($ICT_GPU_PARTITION, else $SBATCH_PARTITION, else the cluster's default; common.smk's
    job_partition; `scontrol show partition`) and the MaxWall of the jobs' QOS ($SBATCH_QOS;
    `sacctmgr show qos`), when `query` and the commands exist."""
    if cfg.resources.max_runtime is not None:
        return cfg.resources.max_runtime, "resources.max_runtime"
    if not query:
        return None, ""
    partition = os.environ.get("ICT_GPU_PARTITION") or os.environ.get("SBATCH_PARTITION") or None
    return cc.site_max_minutes(partition, os.environ.get("SBATCH_QOS") or None)


def planned_request(cfg: Config, rule: str, size: str, need_min: float) -> int:
    """What one job of `rule` asks for, minutes: where cost.walltime_margin is set, the plan's
    estimate of its need (start-up included; a training's whole work) x the margin, rounded up to
    cost.walltime_round_minutes, and at most resources.<rule>.runtime (the longest a job of the
    rule asks for: a training longer than that continues over attempts); else, or where the size
    sets the rule's runtime by hand (resources.<rule>.sizes.<size>.runtime), the configured
    request."""
    kind = REQUEST_OF.get(rule, rule)
    own = getattr(cfg.resources, kind).sizes.get(size)
    configured = cfg.resources.of(kind, size).runtime
    margin, step = cfg.cost.walltime_margin, cfg.cost.walltime_round_minutes
    if margin is None or (own is not None and own.runtime is not None):
        return configured
    return min(configured, max(step, math.ceil(need_min * margin / step) * step))


def attempt_minutes(request: int, limit: int | None) -> int:
    """One attempt's walltime: the request, capped at the limit."""
    return request if limit is None else min(request, limit)


def attempt_runtime(rule: str, request: int, attempt: int, limit: int | None) -> int:
    """The walltime Snakemake asks for on a job's `attempt` (1, 2, ...; common.smk's `runtime`):
    a training resumes from its checkpoint, so every attempt asks for its request; a job of
    another rule starts over, so a resubmission asks for request x attempt. Either is capped at
    the partition's limit, which sbatch would refuse or leave pending."""
    return attempt_minutes(request if rule == "train" else request * attempt, limit)


def units(cfg: Config, size: str, kind: str) -> int:
    """What a job of the request kind `kind` runs on: its GPUs, or on a size without GPUs its
    CPU processes (a training's train_processes, any other job's one)."""
    m = cfg.models[size]
    if on_cpu(cfg, size):
        return m.train_processes if kind == "train" else 1
    return getattr(m.gpus, kind)


def unit_name(cfg: Config, size: str) -> str:
    return "CPU process(es)" if on_cpu(cfg, size) else "GPU(s)"


def device(cfg: Config, size: str) -> str:
    return "CPU" if on_cpu(cfg, size) else "GPU"


def on_cpu(cfg: Config, size: str) -> bool:
    g = cfg.models[size].gpus
    return not any((g.rollout, g.token_stats, g.train, g.evaluate))


def _rescores(cfg: Config, method: str) -> bool:
    """Whether the method rescores mini-batches after the first: methods.<m>.rescore with a
    selector that reads statistics (stages.train.train_step's condition, scorer_needs)."""
    from .core.training.selectors import STATISTICS

    m = cfg.methods[method]
    return m.rescore and bool(m.needs() & set(STATISTICS))


# ---------------------------------------------------------------------------------------------
# One estimate per job
# ---------------------------------------------------------------------------------------------
@dataclass
class TrainCounts:
    """What one training's steps count (the part of the plan a run's metrics check exactly)."""

    steps: int
    gpus: int
    responses: float
    """responses sampled per step (every generation batch)"""
    generated: float
    """tokens generated per step"""
    trained: float
    """prompt + response tokens trained per step"""
    token_flops: float
    """one trained token's forward, FLOPs"""
    passes: dict[str, float]
    """forward passes over the trained tokens per step, by pass (stages.core.plans.cost)"""
    rescored_steps: int

    def forward_flops(self) -> float:
        """The whole training's forward-pass FLOPs (rescoring only after the dense warm-up)."""
        fixed = sum(v for k, v in self.passes.items() if k != "rescoring")
        return self.trained * self.token_flops * (
            self.steps * fixed + self.rescored_steps * self.passes.get("rescoring", 0.0))


def train_limit(cfg: Config, size: str, method: str) -> int:
    """The longest training response: the training datasets' limits, else train.max_response_tokens."""
    t = cfg.train_for(method, size)
    return max(cfg.datasets[d].max_response_tokens or t.max_response_tokens
               for d in cfg.experiment.train_datasets)


def train_counts(cfg: Config, size: str, method: str, arch, rates: Cost,
                 response: float | None = None) -> TrainCounts:
    """The counted work of one training at the rates' mean lengths (`response`: the mean response
    as generated, cut at the limit, instead of the length model's)."""
    t, meth = cfg.train_for(method, size), cfg.methods[method]
    prompt = rates.prompt_tokens
    resp = response if response is not None else cc.capped_mean(
        rates.response_tokens, train_limit(cfg, size, method))
    batches = t.generation_batch_multiple * rates.generation_batches if t.dynamic_sampling else 1
    responses = t.prompts_per_step * batches * t.group_size
    rescore = _rescores(cfg, method)
    passes = cc.step_forwards(t.ppo_epochs, t.prompts_per_step // t.mini_batch_prompts,
                              rescore=rescore, reference=t.loss.kl_beta > 0,
                              checkpointing=t.gradient_checkpointing)
    # no rescoring in the dense warm-up: the selector reads nothing there
    rescored = t.steps - min(meth.warmup_steps, t.steps) if rescore else 0
    return TrainCounts(t.steps, units(cfg, size, "train"), responses, responses * resp,
                       t.prompts_per_step * t.group_size * (prompt + resp),
                       cc.forward_flops(arch, cc.mean_context(prompt, resp)), passes, rescored)


def train_cost(cfg: Config, size: str, method: str, limit: int | None, arch=None) -> JobCost:
    """One training job (size x method, any seed): the work of its steps, its attempts and its
    disk. Per step: generation of every generation batch, the forward passes over the trained
    tokens (stages.core.plans.cost.step_forwards) at the FLOPs of a token, and a fixed overhead."""
    t = cfg.train_for(method, size)
    rates = cfg.cost.of(size, "train")
    arch = arch or model_arch(cfg, size)
    c = train_counts(cfg, size, method, arch, rates)
    gpus, passes, generated, trained, fwd = c.gpus, c.passes, c.generated, c.trained, c.token_flops
    rescore, rescored_steps = "rescoring" in passes, c.rescored_steps
    batches = c.responses / (t.prompts_per_step * t.group_size)
    gen_s = cc.generation_seconds(generated, gpus, rates.generation_tokens_per_s)
    pass_s = cc.compute_seconds(trained * fwd, gpus, rates.gpu_tflops, rates.train_mfu)
    rescoring_s = passes.get("rescoring", 0.0) * pass_s
    fixed_s = gen_s + (sum(passes.values()) * pass_s - rescoring_s) + rates.step_overhead_s
    work_min = (t.steps * fixed_s + rescored_steps * rescoring_s) / 60
    step_min = work_min / t.steps
    lead = t.save_before_limit_minutes
    # a walltime shorter than the SIGURG lead (and a step after it) would be signalled at its start
    need = max(work_min, (lead or 0.0) + step_min) + rates.startup_minutes
    request = planned_request(cfg, "train", size, need)
    attempt = attempt_minutes(request, limit)
    resumes = t.checkpoint_every < t.steps or t.stop_after_steps is not None
    # what a time limit costs: with a SIGURG lead of at least a step, the trainer saves at the
    # step's end and exits before the limit, wasting at most the lead; with a shorter one the
    # limit cuts a step and the next attempt starts from the last resume state (at worst a whole
    # checkpoint interval)
    saves = resumes and lead is not None and lead >= step_min
    lost = (lead if saves else t.checkpoint_every * step_min) if resumes else work_min
    n = cc.attempts(work_min, attempt, rates.startup_minutes, lost)
    # the work a kill throws away, on average (the GPU-hours): with the save, at most the step
    # the signal interrupts before its update (half of one on average; the unused lead is neither
    # work nor time the job holds); without it, half a checkpoint interval
    wasted = (0.5 * step_min if saves else 0.5 * t.checkpoint_every * step_min) if resumes else 0.0
    wall = cc.wall_minutes(work_min, n, rates.startup_minutes, wasted) if n else work_min
    forced = math.ceil(t.steps / t.stop_after_steps) if t.stop_after_steps else 1
    if n is not None and forced > n:  # a pilot's resumes: each saves at a step's end, losing none
        n, wall = forced, work_min + forced * rates.startup_minutes
    w = dtype_bytes(t.dtype)
    checkpoints = len(checkpoint_steps(t))
    kept = (1 + checkpoints) * cc.hf_checkpoint_bytes(arch, w)
    # a new state is written before the old one goes (stages.train.save_state): two at the peak
    transient = 2 * cc.resume_state_bytes(arch, w, t.zero_stage) if resumes else 0.0
    shown = " + ".join(f"{k} {v:.3g}" for k, v in passes.items())
    # decoding is bound by memory bandwidth, not FLOPs: the share of the peak that 2 P_mm FLOPs
    # per generated token make at the assumed rate shows how far from compute-bound it is assumed
    decode = 2 * cc.matmul_params(arch) * rates.generation_tokens_per_s / (rates.gpu_tflops * 1e12)
    detail = [
        f"per step: generation {hours(gen_s / 60)} ({approx(generated / 1e6)}M tokens"
        + (f", {approx(batches / t.generation_batch_multiple)} generation batches of "
           f"{t.generation_batch_multiple} x {t.prompts_per_step} prompts" if t.dynamic_sampling else "")
        + f") + forwards {hours((fixed_s - gen_s - rates.step_overhead_s) / 60)}"
        + (f" + rescoring {hours(rescoring_s / 60)}" if rescore else "")
        + f" + overhead {hours(rates.step_overhead_s / 60)}; {t.steps:,} steps"
        + (f" ({rescored_steps:,} rescored)" if rescore and rescored_steps != t.steps else ""),
        f"forwards over {approx(trained / 1e6)}M trained tokens x {approx(fwd / 1e9)} GFLOP: "
        f"{shown}; generation at 2 P_mm FLOPs per token uses {approx(100 * decode)}% of the "
        f"GPUs' peak",
        f"a time limit loses up to {hours(lost)} of an attempt ("
        + ("the SIGURG lead: train.save_before_limit_minutes covers a step)" if saves else
           f"train.checkpoint_every {t.checkpoint_every} steps: the SIGURG lead is shorter than "
           "a step)" if resumes else "no resume state: the whole run)")
        + (f" and about {hours(wasted)} of work" if resumes else ""),
        f"disk: {1 + checkpoints} Hugging Face checkpoint(s) of {size_of(kept / (1 + checkpoints))}"
        + (f"; resume states up to 2 x {size_of(transient / 2)} while it runs" if resumes else ""),
    ]
    return JobCost("train", size, [method], len(cfg.experiment.seeds), gpus, work_min, wall, n,
                   request, attempt, kept, transient, detail, t.steps, device(cfg, size))


def generation_cost(cfg: Config, rule: str, size: str, method: str, limit: int | None,
                    jobs: int) -> JobCost:
    """A rollout, evaluation or checkpoint-evaluation job: its samples' tokens at the engine's
    GPUs' throughput (tensor_parallel_size of them under vLLM, the first under hf), plus start-up."""
    m, rates = cfg.models[size], cfg.cost.of(size, rule)
    kind = REQUEST_OF.get(rule, rule)
    section = getattr(cfg, kind)
    engine_gpus = m.tensor_parallel_size if section.backend == "vllm" else 1
    if rule == "rollout":
        samples = section.prompts * section.n
        tokens = samples * cc.capped_mean(rates.response_tokens, section.max_new_tokens)
        kept = (samples * rates.prompt_tokens + tokens) * cc.ROLLOUT_BYTES_PER_TOKEN
        what = f"{section.prompts:,} prompts x {section.n}"
    else:
        limit_new = section.max_new_tokens
        if method != "base" and cfg.methods[method].evaluate.max_new_tokens:
            limit_new = cfg.methods[method].evaluate.max_new_tokens
        benches = (cfg.evaluate.curve_benchmarks or cfg.experiment.benchmarks
                   if rule == "evaluate_checkpoint" else cfg.experiment.benchmarks)
        problems = sum(problems_of(cfg, b) for b in benches)
        samples = problems * section.n
        tokens = samples * cc.capped_mean(rates.eval_tokens(), limit_new)
        kept = tokens * cc.SAMPLE_BYTES_PER_TOKEN
        what = f"{problems:,} problems of {len(benches)} benchmark(s) x {section.n}"
    gen_s = cc.generation_seconds(tokens, engine_gpus, rates.generation_tokens_per_s)
    work = gen_s / 60
    request = planned_request(cfg, rule, size, work + rates.startup_minutes)
    detail = [f"{what} samples, {approx(tokens / 1e6)}M tokens on {engine_gpus} "
              f"{unit_name(cfg, size)}: {hours(work)}"]
    return JobCost(rule, size, [method] if rule != "rollout" else [], jobs, units(cfg, size, kind),
                   work, work + rates.startup_minutes, 1, request, attempt_minutes(request, limit),
                   kept, 0.0, detail, device=device(cfg, size))


def teacher_forcing_cost(cfg: Config, rule: str, size: str, method: str, limit: int | None,
                         jobs: int, arch=None) -> JobCost:
    """The token statistics of the base model's rollouts, or their overlap under a trained model:
    one no-gradient forward over the rollouts' prompt + response tokens on the first GPU."""
    rates, r = cfg.cost.of(size, rule), cfg.rollout
    arch = arch or model_arch(cfg, size)
    prompt, resp = rates.prompt_tokens, cc.capped_mean(rates.response_tokens, r.max_new_tokens)
    tokens = r.prompts * r.n * (prompt + resp)
    flops = tokens * cc.forward_flops(arch, cc.mean_context(prompt, resp))
    work = cc.compute_seconds(flops, 1, rates.gpu_tflops, rates.train_mfu) / 60
    kept = r.prompts * r.n * resp * cc.TOKEN_ROW_BYTES if rule == "token_stats" else 0.0
    request = planned_request(cfg, rule, size, work + rates.startup_minutes)
    detail = [f"{approx(tokens / 1e6)}M tokens x {approx(flops / tokens / 1e9)} GFLOP on 1 "
              f"{unit_name(cfg, size)}: {hours(work)}"]
    return JobCost(rule, size, [] if rule == "token_stats" else [method], jobs,
                   units(cfg, size, "token_stats"), work, work + rates.startup_minutes, 1, request,
                   attempt_minutes(request, limit), kept, 0.0, detail, device=device(cfg, size))


# ---------------------------------------------------------------------------------------------
# The plan
# ---------------------------------------------------------------------------------------------
def _merge(rows: list[JobCost]) -> list[JobCost]:
    """Rows of equal estimates as one, their methods and jobs together, in first-seen order."""
    out: dict[tuple, JobCost] = {}
    for row in rows:
        if (key := row.key()) in out:
            have = out[key]
            out[key] = replace(have, methods=have.methods + row.methods, jobs=have.jobs + row.jobs)
        else:
            out[key] = row
    return list(out.values())


def cost_plan(cfg: Config, source: str = "", limit: int | None = None,
              limit_source: str = "") -> CostPlan:
    """Every GPU job's estimate in the workflow's order, grouped where equal, with the warnings
    (an estimate over its request, a request over the limit) and the problems (a training that
    cannot get past its checkpoint interval within one attempt)."""
    exp = cfg.experiment
    seeds = len(exp.seeds)
    rows: list[JobCost] = []
    for size in exp.sizes:
        g, cpu = cfg.models[size].gpus, on_cpu(cfg, size)
        if cpu and not cfg.cost.cpu_jobs:
            continue
        arch = model_arch(cfg, size)
        if g.rollout or cpu:
            rows.append(generation_cost(cfg, "rollout", size, "base", limit, 1))
        if g.token_stats or cpu:
            rows.append(teacher_forcing_cost(cfg, "token_stats", size, "base", limit, 1, arch))
        if g.train or cpu:
            rows += _merge([train_cost(cfg, size, m, limit, arch) for m in exp.methods])
        if g.evaluate or cpu:
            rows += _merge([generation_cost(cfg, "evaluate", size, m, limit, seeds)
                            for m in ["base", *exp.methods]])
            steps = {m: len(checkpoint_steps(cfg.train_for(m, size))) for m in exp.methods}
            rows += _merge([generation_cost(cfg, "evaluate_checkpoint", size, m, limit,
                                            seeds * steps[m]) for m in exp.methods if steps[m]])
        if (g.token_stats or cpu) and cfg.token_stats.overlap_top is not None:
            rows += _merge([teacher_forcing_cost(cfg, "overlap", size, m, limit, seeds, arch)
                            for m in exp.methods])
    warnings, problems = [], []
    where = f" ({limit_source})" if limit_source else ""
    for r in rows:
        name = f"{r.rule} {r.size}" + (f" ({', '.join(r.methods)})" if r.methods else "")
        key = f"resources.{REQUEST_OF.get(r.rule, r.rule)}"
        if limit is not None and r.request_min > limit:
            warnings.append(f"{name}: asks for {hours(r.request_min)} ({key}.runtime), more than "
                            f"the partition's {hours(limit)}{where}: each attempt is capped there")
        if r.rule != "train" and r.wall_min > r.attempt_min:
            warnings.append(f"{name}: estimated {hours(r.wall_min)}, more than its walltime of "
                            f"{hours(r.attempt_min)}: raise {key}.runtime (a resubmission doubles "
                            f"it, up to the partition's limit)")
        elif r.rule == "train" and r.attempts is None:
            problems.append(f"{name}: a checkpoint interval (train.checkpoint_every steps of about "
                            f"{hours(r.work_min / r.steps)}) and the start-up do not fit "
                            f"in one attempt of {hours(r.attempt_min)}: it would never get past a "
                            f"resume state; checkpoint more often or ask for more time")
        elif r.rule == "train" and r.attempts > 1 and r.work_min + cfg.cost.of(r.size, "train").startup_minutes <= r.attempt_min:
            t = cfg.train_for(r.methods[0], r.size)
            warnings.append(f"{name}: {r.attempts} attempts: each stops after "
                            f"{t.stop_after_steps} steps (train.stop_after_steps) and is resumed")
        elif r.rule == "train" and r.attempts > 1:
            warnings.append(f"{name}: estimated {hours(r.work_min)} of work, more than its walltime "
                            f"of {hours(r.attempt_min)}: about {r.attempts} attempts, resumed "
                            f"from its checkpoints (the training rule's retries)")
            lead = cfg.train_for(r.methods[0], r.size).save_before_limit_minutes
            step = r.work_min / r.steps
            if lead is None or lead < step:
                warnings.append(
                    f"{name}: train.save_before_limit_minutes ({'unset' if lead is None else hours(lead)})"
                    f" is shorter than a step (about {hours(step)}): each time limit cuts a step and "
                    f"the next attempt falls back to the last resume state; set it (models."
                    f"{r.size}.train) above one step plus a save")
    snapshots = sum(2.0 * model_arch(cfg, s).params for s in exp.sizes  # bf16 on the hub
                    if cfg.models[s].source == "hub")
    return CostPlan(source, rows, limit, limit_source, warnings, problems, snapshots)


def planned_requests(cfg: Config, limit: int | None) -> dict[tuple[str, str, str | None], int]:
    """Each GPU job's request from the plan, by (rule, size, method; None for a rollout or the
    token statistics), for the rules' `runtime` (workflow/rules/common.smk); {} where
    cost.walltime_margin is unset."""
    if cfg.cost.walltime_margin is None:
        return {}
    out = {}
    for row in cost_plan(cfg, limit=limit).rows:
        for method in row.methods or [None]:
            out[(row.rule, row.size, method)] = row.request_min
    return out


def train_retries(cfg: Config, limit: int | None) -> int | None:
    """The training rule's `retries`: the most attempts any training of the run needs (a GPU
    training's from the plan; any training's forced by train.stop_after_steps), less one; None
    where every one fits one attempt: the profile's retries then apply."""
    most = 1
    for size in cfg.experiment.sizes:
        for method in cfg.experiment.methods:  # a pilot's forced resumes, on CPUs too
            t = cfg.train_for(method, size)
            if t.stop_after_steps:
                most = max(most, math.ceil(t.steps / t.stop_after_steps))
        if not cfg.models[size].gpus.train:
            continue
        arch = model_arch(cfg, size)
        for method in cfg.experiment.methods:
            most = max(most, train_cost(cfg, size, method, limit, arch).attempts or 1)
    return most - 1 if most > 1 else None
