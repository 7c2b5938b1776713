"""Memory plan: estimated peak GPU memory per GPU and host memory per node of every GPU job.

    python -m stages.plan --configfile config/paper.yaml [--gpu-memory-gb 80] [--json]
    python -m stages.plan --configfile config/paper.yaml --cost     # the cost plan (stages.cost)

For every GPU job kind (rollout, token_stats, train, evaluate) and model size: nodes x GPUs per
node, the peak per GPU in the rollout phase and in the training phase with their main terms, and
host memory per node against the job's `resources.<rule>.mem_mb`. A job does not fit when a phase
exceeds the size's `models.<size>.gpu_memory_gb` (or --gpu-memory-gb), when a vLLM engine's
share cannot hold its weights and one sequence, or when its host memory exceeds its request;
the plan then exits 1 naming each such job and its figure in GB (GB = 2**30 bytes). The
formulas and their calibration are in stages.core.plans.memory; the workflow runs :func:`check_plan`
before scheduling.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field

from .config import Config, ConfigError, Gpus, load_configs, source_of
from .core.plans import memory as mem
from .core.plans.dimensions import model_arch
from .core.plans.memory import GB, Arch, Figure, Layout, Term

KINDS = ("rollout", "token_stats", "train", "evaluate")


@dataclass
class JobPlan:
    """The plan of one GPU job kind for one size (training: one train section and its methods)."""

    kind: str
    size: str
    methods: list[str]
    nodes: int
    gpus_per_node: int
    settings: str
    phases: dict[str, Figure]
    host: Figure
    mem_gb: float
    mem_key: str
    gpu_memory_gb: float | None
    gpu_key: str
    ds_estimate: str = ""
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        what = f"{self.kind} {self.size}"
        return what + (f" ({', '.join(self.methods)})" if self.methods else "")

    @property
    def peak_gb(self) -> float:
        return max((f.gb for f in self.phases.values()), default=0.0)

    @property
    def fits(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict:
        def fig(f: Figure) -> dict:
            return {"gb": round(f.gb, 3), "terms": [
                {"name": t.name, "gb": round(t.gb, 3), "formula": t.formula} for t in f.terms]}

        return {"kind": self.kind, "size": self.size, "methods": self.methods, "nodes": self.nodes,
                "gpus_per_node": self.gpus_per_node, "settings": self.settings,
                "phases": {k: fig(v) for k, v in self.phases.items()},
                "peak_gb": round(self.peak_gb, 3), "gpu_memory_gb": self.gpu_memory_gb,
                "gpu_key": self.gpu_key, "host": fig(self.host), "mem_gb": round(self.mem_gb, 3),
                "mem_key": self.mem_key, "deepspeed_estimate": self.ds_estimate,
                "fits": self.fits, "problems": self.problems, "notes": self.notes}


def _engine_bytes(cfg: Config, size: str) -> int:
    """Bytes per weight of a standalone vLLM engine (dtype "auto": the checkpoint's dtype; our
    scratch and GGUF conversions are float32, hub checkpoints bf16)."""
    return 2 if cfg.models[size].source == "hub" else 4


def _mem(cfg: Config, rule: str, size: str) -> tuple[float, str]:
    """(the job's host memory request per node in GB, the key that sets it)."""
    spec = getattr(cfg.resources, rule)
    override = spec.sizes.get(size)
    key = (f"resources.{rule}.sizes.{size}.mem_mb" if override is not None and override.mem_mb
           else f"resources.{rule}.mem_mb")
    return cfg.resources.of(rule, size).mem_mb * 2**20 / GB, key


def _gb(x: float) -> str:
    return f"{x:,.1f}"


# ---------------------------------------------------------------------------------------------
# One plan per job kind
# ---------------------------------------------------------------------------------------------
def _prompt_tokens(cfg: Config, override: int | None) -> int:
    return cfg.train.max_prompt_tokens or override or mem.DEFAULT_PROMPT_TOKENS


def _micro_batch(cfg: Config, t, arch: Arch, prompt_tokens: int | None) -> tuple[int, int, int, list[str]]:
    """(sequence length, tokens of one micro-batch, its response tokens, notes) of a training
    section: micro_batch_size sequences of prompt + the longest response limit, within the token
    budget (a sequence longer than the budget goes alone)."""
    response = max(cfg.datasets[d].max_response_tokens or t.max_response_tokens
                   for d in cfg.experiment.train_datasets)
    prompt = t.max_prompt_tokens or prompt_tokens or mem.DEFAULT_PROMPT_TOKENS
    seq, notes = prompt + response, []
    if seq > arch.max_positions:
        notes.append(f"prompt {prompt:,} + response {response:,} tokens exceed the model's "
                     f"{arch.max_positions:,} positions: planned at {arch.max_positions:,}")
        seq = arch.max_positions
    tokens = t.micro_batch_size * seq
    if t.micro_batch_tokens is not None:
        tokens = min(tokens, max(t.micro_batch_tokens, seq))
    return seq, tokens, tokens * response // seq, notes


def _train_host(t, arch: Arch, layout: Layout, states: mem.States, per_node: int) -> Figure:
    """Host memory of one node of a training job: its processes, their vLLM engines, what they
    offload, the largest tensor a DeepSpeed checkpoint passes through the host, and under ZeRO-3
    the whole model gathered on the first node to save it."""
    w = mem.dtype_bytes(t.dtype)
    saved = 4 * arch.largest_layer if t.zero_stage == 0 else 4 * arch.params / layout.world
    per_process = [Term("process", mem.PROCESS_HOST_GB * GB, f"{mem.PROCESS_HOST_GB} GB")]
    if t.backend == "vllm":
        per_process.append(Term("vLLM engine", mem.VLLM_HOST_GB * GB, f"{mem.VLLM_HOST_GB} GB"))
    per_process += [*states.host, Term("checkpoint save", saved, "largest saved tensor")]
    host = Figure([Term(f"{x.name} x {per_node}", x.bytes * per_node, x.formula) for x in per_process])
    if t.zero_stage == 3:
        host = host.add(Term("model gathered to save it (first node)", w * arch.params, f"{w}P"))
    return host


def _train_plans(cfg: Config, size: str, arch: Arch, gpu_gb: float | None, gpu_key: str,
                 prompt_tokens: int | None) -> list[JobPlan]:
    """One plan per distinct training section (methods.<m>.train applied) of a size."""
    m = cfg.models[size]
    if m.gpus.train == 0:
        return []
    sections: dict[str, list[str]] = {}
    for method in cfg.experiment.methods:
        key = json.dumps(cfg.train_for(method, size).model_dump(mode="json"), sort_keys=True)
        sections.setdefault(key, []).append(method)
    plans = []
    for methods in sections.values():
        t = cfg.train_for(methods[0], size)
        layout = Layout(t.dtype, t.zero_stage, t.offload_params, t.offload_optimizer,
                        m.train_nodes, m.train_gpus_per_node())
        w, sp, tp = mem.dtype_bytes(t.dtype), t.sequence_parallel, m.train_tensor_parallel_size
        states = mem.model_states(arch, layout)
        seq, tokens, rows, notes = _micro_batch(cfg, t, arch, prompt_tokens)
        runtime = Term("CUDA runtime", mem.CUDA_RUNTIME_GB * GB, f"{mem.CUDA_RUNTIME_GB} GB")
        reference = mem.reference_terms(arch, layout) if t.loss.kl_beta > 0 else []
        # stages.train loads the policy (and the reference) whole onto every GPU before DeepSpeed
        # partitions them, except under ZeRO-3, where they are partitioned while they load
        # (transformers' HfDeepSpeedConfig): a shard and the largest layer being gathered
        world = m.train_nodes * m.train_gpus_per_node()
        if t.zero_stage == 3:
            one = [Term("policy loaded as a shard", w * arch.params / world, f"{w}P/{world}"),
                   Term("largest layer gathered", w * arch.largest_layer, f"{w}L")]
            load = Figure(one + (one if reference else []) + [runtime])
        else:
            load = Figure([Term("policy loaded whole", w * arch.params, f"{w}P"),
                           *([Term("reference loaded whole", w * arch.params, f"{w}P")] if reference else []),
                           runtime])
        rollout = Figure(states.resident + states.kept + reference + [runtime])
        training = Figure(states.resident + states.step + states.working + states.kept
                          + states.buckets
                          + mem.activations(arch, tokens, w, t.gradient_checkpointing, sp)
                          + mem.head_terms(arch, rows, w, cfg.token_stats.chunk_positions,
                                           cfg.token_stats.chunk_vocab, sp)
                          + reference + [runtime])
        # the sampling pass and the rescoring passes between optimizer steps: no activations kept
        sequences = max(1, min(t.micro_batch_size, tokens // seq))
        gathered = [] if t.zero_stage != 3 else [  # ZeRO-3 gathers each layer's parameters
            Term("gathered largest layer", w * arch.largest_layer, f"{w} x {arch.largest_layer:,}"),
            *(b for b in states.buckets if b.name == "prefetch bucket")]
        scoring = Figure(states.resident + gathered + states.kept + reference + [runtime]
                         + mem.scoring_terms(arch, w, tokens, sequences, seq,
                                             cfg.token_stats.chunk_positions,
                                             cfg.token_stats.chunk_vocab, sp, t.padding_free))
        problems = []
        if t.backend == "vllm":
            # a bf16 policy's engine computes its head in float32 (stages.core.models.samplers): vLLM
            # 0.31 accumulates the bf16 product into float32 logits on CUDA, with no float32 copy
            # of the head's weight (its logits are in the workspace)
            needs = mem.vllm_needs(arch, w, tp, seq)
            need = sum(x.bytes for x in needs)
            notes.append("the vLLM engine needs " + " + ".join(f"{x.name} {_gb(x.gb)}" for x in needs)
                         + f" = {_gb(need / GB)} GB per GPU")
            if gpu_gb is not None:
                share = t.vllm_gpu_memory_utilization * gpu_gb * GB
                rollout = rollout.add(Term("vLLM share", share,
                                           f"{t.vllm_gpu_memory_utilization} x {gpu_gb:g} GB"))
                if need > share:
                    problems.append(
                        f"{{name}}: the training job's vLLM engine needs {_gb(need / GB)} GB per GPU "
                        f"(weights, one {seq:,}-token sequence's KV cache, workspace) but its share "
                        f"is {_gb(share / GB)} GB (train.vllm_gpu_memory_utilization = "
                        f"{t.vllm_gpu_memory_utilization} x {gpu_gb:g} GB)")
            else:
                rollout = rollout.add(*needs)
                notes.append("no GPU memory given: the rollout phase counts the vLLM engine's "
                             "needs, not its share")
            asleep = Term("vLLM engine asleep", mem.VLLM_ASLEEP_GB * GB,
                          f"{mem.VLLM_ASLEEP_GB} GB (level 2)")
            training, scoring = training.add(asleep), scoring.add(asleep)
        else:
            rollout = rollout.add(*mem.hf_generation_terms(arch, w, t.generation_batch_size, seq))
        host = _train_host(t, arch, layout, states, m.train_processes_per_node())
        mem_gb, mem_key = _mem(cfg, "train", size)
        ds = ""
        if states.ds_gpu is not None:
            ds = (f"DeepSpeed's estimator (16-bit parameters and gradients): "
                  f"{_gb(states.ds_gpu / GB)} GB per GPU"
                  + (f", {_gb(states.ds_host / GB)} GB host per node"
                     if t.offload_optimizer or t.offload_params else ""))
        settings = (f"ZeRO-{t.zero_stage} {t.dtype}"
                    + (" offload-opt" if t.offload_optimizer else "")
                    + (" offload-params" if t.offload_params else "")
                    + (" ckpt" if t.gradient_checkpointing else "")
                    + (f" sp{sp}" if sp > 1 else "")
                    + f" mb {tokens:,} tok" + (f" tp{tp}" if t.backend == "vllm" and tp > 1 else ""))
        plans.append(JobPlan("train", size, methods, m.train_nodes, m.train_gpus_per_node(), settings,
                             {"load": load, "rollout": rollout, "scoring": scoring,
                              "training": training}, host,
                             mem_gb, mem_key, gpu_gb, gpu_key, ds, problems, notes))
    return plans


def _generation_plan(cfg: Config, kind: str, size: str, arch: Arch, gpu_gb: float | None,
                     gpu_key: str, prompt_tokens: int | None) -> JobPlan | None:
    """A rollout or evaluation job: one vLLM engine over tensor_parallel_size GPUs, or the hf
    model on the first GPU."""
    m = cfg.models[size]
    gpus = getattr(m.gpus, kind)
    if gpus == 0:
        return None
    section = getattr(cfg, kind)
    prompt = _prompt_tokens(cfg, prompt_tokens)
    runtime = Term("CUDA runtime", mem.CUDA_RUNTIME_GB * GB, f"{mem.CUDA_RUNTIME_GB} GB")
    notes, problems = [], []
    host = Figure([Term("process", mem.PROCESS_HOST_GB * GB, f"{mem.PROCESS_HOST_GB} GB")])
    if section.backend == "vllm":
        tp, w = m.tensor_parallel_size, _engine_bytes(cfg, size)
        needs = mem.vllm_needs(arch, w, tp, arch.max_positions)
        need = sum(x.bytes for x in needs)
        figure = Figure([*needs])
        notes.append("vLLM needs " + " + ".join(f"{x.name} {_gb(x.gb)}" for x in needs)
                     + f" = {_gb(need / GB)} GB per GPU")
        if gpu_gb is not None:
            utilization = section.engine_kwargs.get("gpu_memory_utilization",
                                                    mem.VLLM_DEFAULT_UTILIZATION)
            share = utilization * gpu_gb * GB
            figure = Figure([Term("vLLM share", share, f"{utilization} x {gpu_gb:g} GB")])
            if need > share:
                problems.append(f"{{name}}: vLLM needs {_gb(need / GB)} GB per GPU (weights over "
                                f"tensor_parallel_size {tp}, one {arch.max_positions:,}-token "
                                f"sequence's KV cache, workspace) but its share is "
                                f"{_gb(share / GB)} GB ({utilization} x {gpu_gb:g} GB; "
                                f"{kind}.engine_kwargs.gpu_memory_utilization)")
        host = host.add(Term("vLLM engine", mem.VLLM_HOST_GB * GB, f"{mem.VLLM_HOST_GB} GB"))
        settings = f"vLLM tp{tp}, max_model_len {arch.max_positions:,}"
        if gpus > tp:
            notes.append(f"gpus.{kind} = {gpus} but the engine spans tensor_parallel_size = {tp}")
        if kind == "rollout":
            samples = section.prompts * section.n * section.max_new_tokens * 12
            host = host.add(Term("samples", samples, "prompts x n x max_new_tokens x 12"))
    else:
        seq = prompt + section.max_new_tokens
        figure = Figure([Term("weights", 4 * arch.params, "4P (float32)"),
                         *mem.hf_generation_terms(arch, 4, section.batch_size, seq), runtime])
        settings = f"hf float32, batch {section.batch_size}"
        if gpus > 1:
            notes.append(f"gpus.{kind} = {gpus} but the hf backend uses the first GPU only")
    mem_gb, mem_key = _mem(cfg, kind, size)
    return JobPlan(kind, size, [], 1, gpus, settings, {"generation": figure}, host, mem_gb,
                   mem_key, gpu_gb, gpu_key, "", problems, notes)


def _token_stats_plan(cfg: Config, size: str, arch: Arch, gpu_gb: float | None, gpu_key: str,
                      prompt_tokens: int | None) -> JobPlan | None:
    """The token-statistics stage: the whole model on the first GPU, teacher forcing group by
    group in batches of a token budget, one group's hidden states kept on the host."""
    m = cfg.models[size]
    if m.gpus.token_stats == 0:
        return None
    ts, r = cfg.token_stats, cfg.rollout
    w = mem.dtype_bytes(ts.dtype)
    seq = _prompt_tokens(cfg, prompt_tokens) + r.max_new_tokens
    sequences = mem.teacher_forcing_sequences(r.n, seq, ts.batch_tokens)
    runtime = Term("CUDA runtime", mem.CUDA_RUNTIME_GB * GB, f"{mem.CUDA_RUNTIME_GB} GB")
    figure = Figure([Term("weights", w * arch.params, f"{w}P"),
                     *mem.teacher_forcing_terms(arch, w, sequences, seq, ts.chunk_positions,
                                                ts.chunk_vocab), runtime])
    host = Figure([Term("process", mem.PROCESS_HOST_GB * GB, f"{mem.PROCESS_HOST_GB} GB"),
                   *mem.teacher_forcing_host_terms(arch, w, r.n * r.max_new_tokens,
                                                   r.prompts * r.n * r.max_new_tokens)])
    notes = ["the model is loaded on the first GPU only"] if m.gpus.token_stats > 1 else []
    mem_gb, mem_key = _mem(cfg, "token_stats", size)
    return JobPlan("token_stats", size, [], 1, m.gpus.token_stats,
                   f"{ts.dtype}, batch {sequences} x {seq:,} tok",
                   {"teacher forcing": figure}, host, mem_gb, mem_key, gpu_gb, gpu_key, "", [],
                   notes)


def plan(cfg: Config, gpu_memory_gb: float | None = None,
         prompt_tokens: int | None = None) -> list[JobPlan]:
    """Every GPU job's plan; gpu_memory_gb overrides each size's models.<size>.gpu_memory_gb."""
    out: list[JobPlan] = []
    for size in cfg.experiment.sizes:
        m = cfg.models[size]
        if not any(getattr(m.gpus, k) for k in KINDS):
            continue
        arch = model_arch(cfg, size)
        gpu_gb = gpu_memory_gb if gpu_memory_gb is not None else m.gpu_memory_gb
        gpu_key = "--gpu-memory-gb" if gpu_memory_gb is not None else f"models.{size}.gpu_memory_gb"
        jobs = [_generation_plan(cfg, "rollout", size, arch, gpu_gb, gpu_key, prompt_tokens),
                _token_stats_plan(cfg, size, arch, gpu_gb, gpu_key, prompt_tokens),
                *_train_plans(cfg, size, arch, gpu_gb, gpu_key, prompt_tokens),
                _generation_plan(cfg, "evaluate", size, arch, gpu_gb, gpu_key, prompt_tokens)]
        for job in (j for j in jobs if j is not None):
            job.problems = [p.format(name=job.name) for p in job.problems]
            if gpu_gb is not None:
                for phase, fig in job.phases.items():
                    if fig.gb > gpu_gb:
                        job.problems.append(
                            f"{job.name}: the {phase} phase needs {_gb(fig.gb)} GB per GPU, more "
                            f"than {gpu_key} = {gpu_gb:g}")
                if job.host.gb > job.mem_gb:
                    job.problems.append(f"{job.name}: needs {_gb(job.host.gb)} GB of host memory "
                                        f"per node, more than {job.mem_key} "
                                        f"({_gb(job.mem_gb)} GB)")
            out.append(job)
    return out


def check_plan(cfg: Config) -> list[str]:
    """Every GPU job that does not fit, one line each with its figure in GB and the key; empty when
    all fit or no size sets models.<size>.gpu_memory_gb. The workflow runs this before scheduling."""
    if not any(cfg.models[s].gpu_memory_gb for s in cfg.experiment.sizes):
        return []
    sized = cfg.model_copy(update={"experiment": cfg.experiment.model_copy(update={
        "sizes": [s for s in cfg.experiment.sizes if cfg.models[s].gpu_memory_gb]})})
    return [p for job in plan(sized) for p in job.problems]


# ---------------------------------------------------------------------------------------------
# Printing
# ---------------------------------------------------------------------------------------------
GROUPS = {
    "model states": ("parameters", "fp32", "Adam", "gradients", "bf16 gradients", "persistent",
                     "parameter partition", "gathered", "16-bit"),
    "buckets": ("reduce bucket", "prefetch bucket", "all-reduce", "offload gradient"),
    "activations": ("checkpointed", "one layer", "layer activations", "activation gradients",
                    "final hidden"),
    "head": ("head",),
    "scoring": ("scoring",),
    "loaded model": ("policy loaded", "reference loaded", "largest layer gathered"),
    "reference": ("reference",),
    "engine": ("vLLM", "engine", "KV", "generation"),
}


def _group(term: Term) -> str:
    for group, prefixes in GROUPS.items():
        if any(term.name.startswith(p) for p in prefixes):
            return group
    return term.name


def breakdown(fig: Figure) -> str:
    """'total = group a (its largest terms) + group b ...' of one figure."""
    groups: dict[str, list[Term]] = {}
    for t in fig.terms:
        groups.setdefault(_group(t), []).append(t)
    parts = []
    for group, terms in groups.items():
        total = sum(t.bytes for t in terms) / GB
        if len(terms) == 1 and terms[0].name == group:
            parts.append(f"{group} {_gb(total)}")
            continue
        inner = ", ".join(f"{t.name} {_gb(t.gb)}" for t in sorted(terms, key=lambda t: -t.bytes))
        parts.append(f"{group} {_gb(total)} ({inner})")
    return f"{_gb(fig.gb)} = " + " + ".join(parts)


def render(jobs: list[JobPlan]) -> str:
    """The plan as text: one table per job kind, each row followed by its breakdown."""
    lines = []
    for kind in KINDS:
        rows = [j for j in jobs if j.kind == kind]
        if not rows:
            continue
        phases = list(rows[0].phases)
        lines.append(f"## {kind}: GB per GPU (GB = 2^30 bytes), host GB per node")
        cols = "".join(f" {p if len(phases) > 1 else 'peak':>9}" for p in phases)
        head = (f"{'size':<16} {'nodes x GPUs':>12}  {'settings':<46}{cols} {'GPU':>6} "
                f"{'host':>7} {'mem':>7}  fits")
        lines += [head, "-" * len(head)]
        split = {j.size for j in rows if sum(x.size == j.size for x in rows) > 1}
        for j in rows:
            limit = "-" if j.gpu_memory_gb is None else f"{j.gpu_memory_gb:g}"
            verdict = "NO" if j.problems else ("?" if j.gpu_memory_gb is None else "yes")
            name = j.size + (f" [{','.join(j.methods)}]" if j.size in split else "")
            figures = "".join(f" {_gb(j.phases[p].gb):>9}" for p in phases)
            lines.append(f"{name:<16} {f'{j.nodes} x {j.gpus_per_node}':>12}  {j.settings:<46}"
                         f"{figures} {limit:>6} {_gb(j.host.gb):>7} {_gb(j.mem_gb):>7}  {verdict}")
            for phase, fig in j.phases.items():
                lines.append(f"    {phase}: {breakdown(fig)}")
            lines.append(f"    host per node: {breakdown(j.host)}")
            if j.ds_estimate:
                lines.append(f"    {j.ds_estimate}")
            lines += [f"    note: {n}" for n in j.notes]
        lines.append("")
    return "\n".join(lines)


REQUEST_RULES = ("prepare_data", "base_model", "rollout", "token_stats", "train", "evaluate",
                 "tables")
"""The workflow's rules, in its order, with the job each one runs (workflow/rules/*.smk)."""
ONE_JOB = {"prepare_data": "dataset", "base_model": "size", "rollout": "size",
           "token_stats": "size", "train": "size × method × seed", "evaluate": "model",
           "tables": "run"}


def requests_table(cfg: Config) -> str:
    """What each job asks the scheduler for, per rule and size, as a Markdown table: GPUs (nodes ×
    GPUs per node for a multi-node training job; vLLM tensor parallelism noted) / CPU cores /
    memory / walltime, from `models.<size>.gpus`, `train_nodes`, `gpus_per_node` and `resources`:
    the table the docs print, generated from the config so that the two cannot disagree."""
    from .cost import planned_requests

    def span(minutes: list[int]) -> str:
        def one(m: int) -> str:
            return f"{m / 60:g} h" if m >= 60 else f"{m} min"
        lo, hi = min(minutes), max(minutes)
        return one(lo) if lo == hi else f"{one(lo)}–{one(hi)}"

    sizes = cfg.experiment.sizes
    try:  # walltimes from the plan (cost.walltime_margin): the GPU jobs' own
        planned = planned_requests(cfg, None)
    except ConfigError:
        planned = {}
    head = ["rule (one job per)", *(cfg.models[s].label or s for s in sizes)]
    rows = [head, ["---"] * len(head)]
    for rule in REQUEST_RULES:
        cells = []
        for size in sizes:
            m = cfg.models[size]
            r = cfg.resources.of(rule, size)
            gpus = getattr(m.gpus, rule) if rule in Gpus.model_fields else 0
            if rule == "train" and m.train_nodes > 1:
                what = f"{m.train_nodes} nodes × {m.train_gpus_per_node()}"
            else:
                what = str(gpus)
            if rule in ("rollout", "evaluate") and m.tensor_parallel_size > 1:
                what += f" (vLLM TP {m.tensor_parallel_size})"
            if rule == "train" and m.train_tensor_parallel_size > 1:
                what += f" (vLLM TP {m.train_tensor_parallel_size})"
            mem_gb = f"{r.mem_mb / 1000:g} GB" + (" per node" if rule == "train" and m.train_nodes > 1 else "")
            mine = [v for (rl, sz, _), v in planned.items() if rl == rule and sz == size]
            hours = f"{span(mine)} (plan)" if mine else span([r.runtime])
            cells.append(f"{what} / {r.cpus} / {mem_gb} / {hours}")
        if rule in ("prepare_data", "tables"):
            cells = [cells[0]] + ["same"] * (len(cells) - 1)
        rows.append([f"`{rule}` ({ONE_JOB[rule]})", *cells])
    return "\n".join("| " + " | ".join(r) + " |" for r in rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configfile", required=True, nargs="+", metavar="FILE",
                   help="workflow config YAML; several are laid on each other in order, as Snakemake's\n                   flag does (a pilot or a calibration on a configuration)")
    p.add_argument("--gpu-memory-gb", type=float, default=None,
                   help="GPU memory of every size, GB (overrides models.<size>.gpu_memory_gb)")
    p.add_argument("--prompt-tokens", type=int, default=None,
                   help="prompt length assumed where train.max_prompt_tokens is unset "
                        f"(default {mem.DEFAULT_PROMPT_TOKENS})")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--requests", action="store_true",
                   help="print what each job asks the scheduler for (a Markdown table) and stop")
    p.add_argument("--cost", action="store_true",
                   help="print the cost plan instead (stages.cost): estimated GPU-hours, wall time "
                        "and disk of every GPU job and of the whole run")
    p.add_argument("--max-runtime", type=int, default=None, metavar="MINUTES",
                   help="--cost: the partition's time limit (default: resources.max_runtime, else "
                        "scontrol's MaxTime of the GPU jobs' partition)")
    args = p.parse_args(argv)
    try:
        cfg = load_configs(args.configfile)
        if args.requests:
            print(requests_table(cfg))
            return 0
        if args.cost:
            return _cost_main(cfg, args)
        jobs = plan(cfg, args.gpu_memory_gb, args.prompt_tokens)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([j.as_dict() for j in jobs], indent=1))
    else:
        print(render(jobs) if jobs else "no GPU jobs: every size runs on the CPU")
    problems = [p for j in jobs for p in j.problems]
    if problems:
        print("does not fit:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 1
    return 0


def _cost_main(cfg: Config, args) -> int:
    """--cost: the plan, its warnings on stderr; exit 1 where a training can never finish."""
    from . import cost, cost_report

    if args.max_runtime is not None:
        limit, source = args.max_runtime, "--max-runtime"
    else:
        limit, source = cost.runtime_limit(cfg)
    plan_ = cost.cost_plan(cfg, source_of(args.configfile), limit, source)
    if args.json:
        print(json.dumps(plan_.as_dict(), indent=1))
    elif plan_.rows:
        print(cost_report.render(plan_, cfg), end="")
    else:
        print("no GPU jobs: every size runs on the CPU (the cost plan estimates GPU jobs)")
    if plan_.warnings:
        print("warnings:\n  " + "\n  ".join(plan_.warnings), file=sys.stderr)
    if plan_.problems:
        print("cannot finish:\n  " + "\n  ".join(plan_.problems), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
