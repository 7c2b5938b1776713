"""The cost plan as text and tables: the plan's printout (python -m stages.plan --cost, python -m
stages.calibrate) and the tables the docs print (scripts/regen_plan_docs.py; tests/test_docs.py
checks them against the configs)."""

from __future__ import annotations

from .config import Config, Cost
from .core.plans.cost import approx, hours, size_of
from .cost import CostPlan, cost_plan, runtime_limit


def assumptions(cfg: Config) -> list[str]:
    """The `cost` values the plan used, one line per size that changes them."""
    c = cfg.cost

    def line(r: Cost) -> str:
        return (f"generation {approx(r.generation_tokens_per_s)} tokens/s per GPU, training "
                f"{r.train_mfu:g} of {r.gpu_tflops:g} TFLOP/s, responses {r.response_tokens:,.0f} "
                f"tokens before their limit (evaluation {r.eval_tokens():,.0f}), prompts "
                f"{r.prompt_tokens:,.0f}")

    out = [f"cost: {line(c)}; {c.generation_batches:g} generation batch(es) per step with dynamic "
           f"sampling; {c.step_overhead_s:g} s per step and {c.startup_minutes:g} min per job beside"]
    for size in cfg.experiment.sizes:
        if size in c.sizes:
            r = c.of(size)
            out.append(f"cost.sizes.{size}: {line(r)}"
                       + (f"; {r.generation_batches:g} generation batches per step"
                          if r.generation_batches != c.generation_batches else ""))
    return out


def render(plan: CostPlan, cfg: Config) -> str:
    """The plan as text: one row per kind of job with its breakdown, then the totals."""
    head = (f"{'rule':<20} {'size':<14} {'jobs':>5} {'GPUs':>5} {'work/job':>10} "
            f"{'attempts x walltime':>20} {'wall/job':>10} {'GPU-h':>8} {'disk':>8}")
    lines = [f"## cost of {plan.source or 'the config'} (estimates: counted work at the `cost` "
             f"section's assumed rates)", head, "-" * len(head)]
    for r in plan.rows:
        n = "?" if r.attempts is None else str(r.attempts)
        units = f"{r.gpus}" if r.device == "GPU" else f"{r.gpus} CPU"
        lines.append(f"{r.rule:<20} {r.size:<14} {r.jobs:>5} {units:>5} {hours(r.work_min):>10} "
                     f"{n + ' x ' + hours(r.attempt_min):>20} {hours(r.wall_min):>10} "
                     f"{approx(r.gpu_hours) if r.device == 'GPU' else '-':>8} "
                     f"{size_of(r.jobs * r.kept_bytes):>8}")
        if r.methods:
            lines.append(f"    methods: {', '.join(r.methods)}")
        lines += [f"    {d}" for d in r.detail]
    steps = sorted({cfg.train_for(m, r.size).steps for r in plan.rows if r.rule == "train"
                    for m in r.methods})
    lines += ["", *totals_lines(plan)]
    if steps:
        lines.append(f"the trainings' GPU-hours scale with train.steps: "
                     f"{', '.join(f'{n:,}' for n in steps)} (the config's)")
    lines += [f"assumed: {a}" for a in assumptions(cfg)]
    limit = (f"{hours(plan.limit)} ({plan.limit_source})" if plan.limit is not None
             else "none known (resources.max_runtime, or scontrol where SLURM is installed)")
    lines.append(f"partition limit per attempt: {limit}")
    return "\n".join(lines) + "\n"


def totals_lines(plan: CostPlan) -> list[str]:
    cpu = ([f"CPU jobs: {plan.cpu_jobs:,}, about {hours(plan.cpu_minutes)} of wall time one after "
            "another (every attempt and start-up; cost.cpu_jobs)"] if plan.cpu_jobs else [])
    if not plan.jobs:
        return cpu
    return cpu + [f"total: {plan.jobs:,} GPU jobs, about {approx(plan.gpu_hours)} GPU-hours "
            f"(every attempt of every job at its walltime: {approx(plan.requested_gpu_hours)}); "
            f"longest chain of jobs about {hours(plan.chain_min())} (a GPU for every job, no "
            f"queueing)",
            f"disk: about {size_of(plan.kept_bytes)} kept (Hugging Face checkpoints, rollouts, "
            f"token statistics, samples), and resume states of up to {size_of(plan.transient_bytes)}"
            f" while the trainings run (each removed at its end)",
            *([f"hub snapshots: about {size_of(plan.snapshot_bytes)} of base-model weights in the "
               "fetch's store (python -m stages.fetch; bf16, from the models' dimensions), on the "
               "file system the nodes share"] if plan.snapshot_bytes else [])]


def summary_table(plans: list[CostPlan]) -> str:
    """The reproductions' totals as one Markdown table (README and docs/cluster.md print it)."""
    rows = [["configuration", "GPU jobs", "GPU-hours (est.)", "of them trainings (scale with "
             "train.steps)", "GPU-hours requested (every attempt)", "longest chain (est.)",
             "disk kept (est.)", "resume states (all at once)"]]
    rows.append(["---"] * len(rows[0]))
    for p in plans:  # the requests are the config's own numbers, not estimates: exact
        train = sum(r.gpu_hours for r in p.rows if r.rule == "train")
        rows.append([p.source if " " in p.source else f"`{p.source}`", f"{p.jobs:,}",
                     approx(p.gpu_hours), f"{approx(train)} ({100 * train / p.gpu_hours:.0f}%)",
                     f"{p.requested_gpu_hours:,.0f}", hours(p.chain_min()), size_of(p.kept_bytes),
                     size_of(p.transient_bytes)])
    return "\n".join("| " + " | ".join(r) + " |" for r in rows)


PAPER_ABLATIONS = {
    "config/paper.yaml": ("ict-rho0.2", "ict-rho0.3", "ict-frequent90", "random10-response",
                          "ict-warmup10", "ict-warmup40"),
    "config/beyond-80-20.yaml": ("entropy10", "entropy50", "entropy100", "entropy_bottom80",
                                 "entropy20-29k"),
}
"""The method presets each configuration holds for its paper's own ablations (not our readings):
the totals with them add each to experiment.methods, on every size and seed of the grid."""


def summary_plans(root) -> list[CostPlan]:
    """The README's rows: each reproduction as committed, with its paper's ablations, and its
    pilot (config/pilots/)."""
    from .config import load_configs

    out = []
    for name, plan in zip(("config/paper.yaml", "config/beyond-80-20.yaml"), docs_plans(root),
                          strict=True):
        out.append(plan)
        full = load_configs([root / name])
        grid = full.model_copy(update={"experiment": full.experiment.model_copy(update={
            "methods": [*full.experiment.methods, *PAPER_ABLATIONS[name]]})})
        limit, source = runtime_limit(grid, query=False)
        out.append(cost_plan(grid, f"`{name}` with its paper's {len(PAPER_ABLATIONS[name])} "
                                   "ablations", limit, source))
        pilot_name = name.replace("config/", "config/pilots/")
        pilot = load_configs([root / name, root / pilot_name])
        limit, source = runtime_limit(pilot, query=False)
        out.append(cost_plan(pilot, f"its pilot (`{pilot_name}`)", limit, source))
    return out


def train_table(plans: list[CostPlan]) -> str:
    """Each training's estimate as one Markdown table: its work and the attempts it needs."""
    rows = [["configuration", "size", "methods × seeds", "GPUs", "work per training (est.)",
             "attempts × walltime"], ["---"] * 6]
    for p in plans:
        for r in p.rows:
            if r.rule != "train":
                continue
            n = "never finishes" if r.attempts is None else f"{r.attempts} × {hours(r.attempt_min)}"
            rows.append([f"`{p.source}`", r.size, f"{', '.join(r.methods)} × "
                         f"{r.jobs // len(r.methods)}", str(r.gpus), hours(r.work_min), n])
    return "\n".join("| " + " | ".join(r) + " |" for r in rows)


def docs_plans(root) -> list[CostPlan]:
    """The two reproductions' plans as the docs print them: the committed configs, no partition
    limit but their own (scripts/regen_plan_docs.py; tests/test_docs.py)."""
    from .config import load_config

    out = []
    for name in ("config/paper.yaml", "config/beyond-80-20.yaml"):
        cfg = load_config(root / name)
        limit, source = runtime_limit(cfg, query=False)
        out.append(cost_plan(cfg, name, limit, source))
    return out

