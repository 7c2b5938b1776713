"""The checks that look across sections, and the config's lookups into stages.core's registries
(the vLLM engine's arguments, the selectors, the graders, the reported rows, the hub models' heads).

Config's validator calls :func:`references_resolve`; the sections that take engine_kwargs call
:func:`check_engine_kwargs`. The section models are imported here only for their types, so every
section may import this module."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from stages.core.models.parallel import sequence_parallel_misfit

from .base import FieldError, RefError
from .cost import CostRates
from .resources import Resources

if TYPE_CHECKING:
    from .methods import Method
    from .models import ModelSize
    from .schema import Config
    from .train import Train


ENGINE_SET_BY_US = {
    "model": "models.<size>", "tokenizer": "models.<size>", "revision": "models.<size>.hub.revision",
    "tokenizer_revision": "models.<size>.hub.revision", "seed": "seed",
    "tensor_parallel_size": "models.<size>.tensor_parallel_size",
    "logprobs_mode": "the stage",
    "distributed_executor_backend": "the stage", "enable_sleep_mode": "the platform",
}
"""vLLM engine arguments the stages set themselves (never in engine_kwargs), and from where."""
TRAIN_ENGINE_SET_BY_US = {
    **ENGINE_SET_BY_US, "gpu_memory_utilization": "train.vllm_gpu_memory_utilization",
    "max_model_len": "the longest prompt and datasets' response limits",
    "hf_overrides": "train.vllm_float32_head",
    "tensor_parallel_size": "models.<size>.train_tensor_parallel_size", "dtype": "train.dtype",
}
"""... and those the training job's engine sets too."""


def check_engine_kwargs(kwargs: dict[str, Any], reserved: dict[str, str] = ENGINE_SET_BY_US) -> None:
    """Every key is a field of the pinned vLLM's EngineArgs that the stages do not set themselves."""
    from ..core.models.vllm_args import ENGINE_ARGS, VLLM_VERSION

    for key in kwargs:
        if key in reserved:
            raise FieldError(f"engine_kwargs.{key}", f"set by the stage itself, from {reserved[key]}")
        if key not in ENGINE_ARGS:
            raise FieldError(f"engine_kwargs.{key}", f"not an argument of vLLM {VLLM_VERSION}'s "
                             "engine (vllm.engine.arg_utils.EngineArgs)")


def references_resolve(cfg: Config) -> None:
    """Every name the config refers to is defined, and every training job's section validates."""
    exp = cfg.experiment

    def check(key: str, names: list[str], pool: dict, role: str | None = None) -> None:
        for i, name in enumerate(names):
            if name not in pool:
                raise RefError(f"{key}.{i}", f"unknown name {name!r}; defined: {sorted(pool)}")
            if role and pool[name].role != role:
                raise RefError(f"{key}.{i}", f"dataset {name!r} has role {pool[name].role!r}, not {role!r}")

    check("experiment.sizes", exp.sizes, cfg.models)
    check("experiment.methods", exp.methods, cfg.methods)
    check("experiment.benchmarks", exp.benchmarks, cfg.datasets, "benchmark")
    check("experiment.train_datasets", exp.train_datasets, cfg.datasets, "train")
    for i, name in enumerate(cfg.evaluate.main_methods or []):
        if name not in exp.methods:
            raise RefError(f"evaluate.main_methods.{i}", f"{name!r} is not in experiment.methods")
    if any(cfg.models[s].source == "scratch" for s in exp.sizes):
        if exp.sft_dataset is None:
            raise RefError("experiment.sft_dataset", "scratch models need an SFT dataset")
        check("experiment.sft_dataset", [exp.sft_dataset], cfg.datasets, "sft")
    for size in exp.sizes:  # a vLLM engine spans tensor_parallel_size GPUs of its job
        m = cfg.models[size]
        for rule, backend in (("rollout", cfg.rollout.backend), ("evaluate", cfg.evaluate.backend)):
            have = getattr(m.gpus, rule)
            # no GPUs: vLLM's CPU build, one engine in the job's process
            if backend == "vllm" and have < m.tensor_parallel_size and (have or m.tensor_parallel_size > 1):
                raise RefError(f"models.{size}.tensor_parallel_size",
                               f"{m.tensor_parallel_size} GPUs of tensor parallelism, but "
                               f"gpus.{rule} gives the {rule} job {have} ({rule}.backend is vllm"
                               + ("; on CPUs, vLLM's CPU build runs tensor_parallel_size 1"
                                   if not have else "") + ")")
    for name, method in cfg.methods.items():
        _check_method(name, method, cfg.train_for(name), name in exp.methods)
    for size in exp.sizes:
        for name in exp.methods:  # every training job's section validates
            job = cfg.train_for(name, size)
            _check_method(name, cfg.methods[name], job, True)
            _check_layout(size, cfg.models[size], job)
            if cfg.methods[name].selection_scope == "microbatch":
                _check_virtual(size, cfg.models[size], job, f"methods.{name}.train"
                               if "virtual_layout" in cfg.methods[name].train else "train")
            _check_overlong(cfg, job, "train" if job is cfg.train else f"methods.{name}.train")
            _check_save_signal(cfg, size, name, job)
    for i, name in enumerate(cfg.evaluate.curve_benchmarks or []):
        if name not in exp.benchmarks:
            raise RefError(f"evaluate.curve_benchmarks.{i}", f"{name!r} is not in experiment.benchmarks")
    for rule in Resources.model_fields:
        spec = getattr(cfg.resources, rule)
        for size in getattr(spec, "sizes", {}):
            if size not in cfg.models:
                raise RefError(f"resources.{rule}.sizes.{size}", f"unknown model size {size!r}; defined: {sorted(cfg.models)}")
    _check_cost(cfg)
    for name, ds in cfg.datasets.items():
        if ds.template not in cfg.templates:
            raise RefError(f"datasets.{name}.template", f"unknown template {ds.template!r}")
    _check_graders(cfg)
    for name, template in cfg.templates.items():
        if "{question}" not in template:
            raise RefError(f"templates.{name}", "a template must contain '{question}'")


def _check_cost(cfg: Config) -> None:
    """The cost plan's sizes and benchmarks exist; its generation batches per step are possible."""
    for size in cfg.cost.sizes:
        if size not in cfg.models:
            raise RefError(f"cost.sizes.{size}", f"unknown model size {size!r}; defined: {sorted(cfg.models)}")
    for name in cfg.cost.problems:
        if name not in cfg.datasets:
            raise RefError(f"cost.problems.{name}", f"unknown dataset {name!r}; defined: {sorted(cfg.datasets)}")
    for size in cfg.experiment.sizes:
        batches = cfg.cost.of(size).generation_batches
        for method in cfg.experiment.methods:
            train = cfg.train_for(method, size)
            if train.dynamic_sampling and batches > train.max_sampling_rounds:
                key = (f"cost.sizes.{size}.generation_batches"
                       if cfg.cost.sizes.get(size, CostRates()).generation_batches is not None
                       else "cost.generation_batches")
                raise RefError(key, f"{batches:g} generation batches per step on average, but a "
                               f"step stops after {train.max_sampling_rounds} (train.max_sampling_rounds "
                               f"of {size}/{method})")


def _check_method(name: str, method: Method, train: Train, in_run: bool) -> None:
    """The selector exists and its parameters validate; a run's warm-up is shorter than the run."""
    from ..core.training.selectors import SELECTORS

    if method.selector not in SELECTORS:
        raise RefError(f"methods.{name}.selector",
                       f"unknown selector {method.selector!r}; registered: {sorted(SELECTORS)}")
    try:
        method.params()
    except ValidationError as err:
        e = err.errors()[0]
        key = ".".join(str(p) for p in e["loc"])
        msg = "unknown key" if e["type"] == "extra_forbidden" else e["msg"].removeprefix("Value error, ")
        raise RefError(f"methods.{name}.{key}", msg) from None
    if method.selection_scope == "microbatch":
        from ..core.training.selectors import spec_of

        if spec_of(method.selector).per_response(method.params()):
            raise RefError(f"methods.{name}.selection_scope",
                           f"'microbatch' ranks positions across one micro-batch; selector "
                           f"{method.selector!r} with these parameters ranks each response's own "
                           "positions (against its group), which a micro-batch may split: use "
                           "'minibatch'")
        def where(key: str) -> str:  # the section that set the key: the method's, else train
            return f"methods.{name}.train.{key}" if key in method.train else f"train.{key}"

        if train.virtual_layout is None:
            raise RefError(where("virtual_layout"), f"methods.{name} has selection_scope "
                           "'microbatch': set the layout whose micro-batches it ranks in (verl's "
                           "world_size, sequence_parallel, max_token_len_per_gpu)")
        if train.loss.denominator != "selected":
            raise RefError(where("loss") + ".denominator", f"methods.{name} has selection_scope "
                           "'microbatch', whose loss is verl's token-mean over each micro-batch's "
                           f"selected tokens: use 'selected', not {train.loss.denominator!r}")
        if not method.rescore:
            raise RefError(f"methods.{name}.rescore", "selection_scope 'microbatch' ranks by the "
                           "current policy's scores (the released code's forward pass): use true")
        if train.dynamic_sampling and train.dynamic_sampling_pool == "rank":
            raise RefError(where("dynamic_sampling_pool"), f"methods.{name} has selection_scope "
                           "'microbatch', whose layout balances a full step of prompts_per_step "
                           "groups: use 'ranks' (verl's pool; 'rank' may train a short step)")
    if in_run and method.warmup_steps >= train.steps:
        raise RefError(f"methods.{name}.warmup_steps",
                       f"a dense warm-up of {method.warmup_steps} steps is not shorter than the "
                       f"run (train.steps = {train.steps})")
    if method.paper_row is not None:
        from ..core.report.reported import REPORTED_ROWS

        if method.paper_row not in REPORTED_ROWS:
            raise RefError(f"methods.{name}.paper_row",
                           f"unknown reported row {method.paper_row!r}; known: {sorted(REPORTED_ROWS)}")


def _check_overlong(cfg: Config, train: Train, where: str) -> None:
    """DAPO's overlong buffer is shorter than every training dataset's response limit."""
    if train.overlong_buffer is None:
        return
    for name in cfg.experiment.train_datasets:
        limit = cfg.datasets[name].max_response_tokens
        if limit is not None and train.overlong_buffer >= limit:
            raise RefError(f"{where}.overlong_buffer", f"{train.overlong_buffer} is not shorter than "
                           f"datasets.{name}.max_response_tokens ({limit})")


def _check_save_signal(cfg: Config, size: str, method: str, train: Train) -> None:
    """SLURM's save signal comes before the training job's time limit, not at its start: with a
    lead of the whole walltime or more, slurmctld signals the job at its first check (every 30 s)
    and each attempt saves after a step and asks to be resubmitted."""
    lead = train.save_before_limit_minutes
    if lead is None:
        return
    res = cfg.resources
    limit, limit_key = res.of("train", size).runtime, (
        f"resources.train.sizes.{size}.runtime"
        if res.train.sizes.get(size) and res.train.sizes[size].runtime is not None
        else "resources.train.runtime")
    if res.max_runtime is not None and res.max_runtime < limit:
        limit, limit_key = res.max_runtime, "resources.max_runtime"
    if lead < limit:
        return
    where = next((w for w, section in ((f"methods.{method}.train", cfg.methods[method].train),
                                      (f"models.{size}.train", cfg.models[size].train))
                  if "save_before_limit_minutes" in section), "train")
    raise RefError(f"{where}.save_before_limit_minutes",
                   f"{lead:g} minutes before the time limit is not within the {size}/{method} "
                   f"training job's walltime ({limit_key}: {limit} minutes): SLURM would signal "
                   "it at its start, and every attempt would save and exit after a step. Make it "
                   "shorter than the walltime by more than a few steps (None: no signal)")


def _check_graders(cfg: Config) -> None:
    """Graders exist; a training dataset's scored grader gives the reward, so the config's own
    reward values (train.reward_correct / reward_incorrect) must be left unset."""
    from ..core.reward.registry import GRADERS

    def known(key: str, name: str) -> None:
        if name not in GRADERS:
            raise RefError(key, f"unknown grader {name!r}; registered: {sorted(GRADERS)}")

    for name, ds in cfg.datasets.items():
        known(f"datasets.{name}.grader", ds.grader)
    for i, name in enumerate(cfg.evaluate.graders):
        known(f"evaluate.graders.{i}", name)
    scored = [d for d in cfg.experiment.train_datasets if GRADERS[cfg.datasets[d].grader].scored]
    if not scored:
        return
    grader = cfg.datasets[scored[0]].grader
    sections = [("train", cfg.train.model_dump())] + [
        (f"models.{s}.train", cfg.models[s].train) for s in cfg.experiment.sizes] + [
        (f"methods.{m}.train", cfg.methods[m].train) for m in cfg.experiment.methods]
    for where, section in sections:
        for key in ("reward_correct", "reward_incorrect"):
            if section.get(key) is not None:
                raise RefError(f"{where}.{key}", f"grader {grader!r} of datasets.{scored[0]} gives "
                               "its own reward (a scored grader); leave train.reward_correct and "
                               "train.reward_incorrect unset")


def _check_layout(size: str, model: ModelSize, train: Train) -> None:
    """A training job's GPUs split over its nodes, its engine groups and its sequence groups."""
    gpus = model.gpus.train
    key = f"models.{size}"
    if gpus and model.train_processes != 1:
        raise RefError(f"{key}.train_processes", "CPU processes apply when gpus.train is 0; on "
                       "GPUs the job runs one process per GPU")
    if model.gpus_per_node is not None and model.gpus_per_node * model.train_nodes != gpus:
        raise RefError(f"{key}.gpus_per_node",
                       f"{model.gpus_per_node} GPUs per node x {model.train_nodes} nodes "
                       f"(train_nodes) does not add up to gpus.train ({gpus})")
    world = model.train_world()
    if world % model.train_nodes:
        raise RefError(f"{key}.train_nodes", f"the training job's {world} "
                       f"{'GPUs (gpus.train)' if gpus else 'processes (train_processes)'} do not "
                       f"split evenly over {model.train_nodes} nodes")
    if world % model.train_tensor_parallel_size:
        raise RefError(f"{key}.train_tensor_parallel_size",
                       f"{model.train_tensor_parallel_size} does not divide the training job's "
                       f"{world} GPU(s) (gpus.train)")
    if why := sequence_parallel_misfit(train.sequence_parallel, world,
                                       f"the {world} GPU(s) of models.{size}.gpus.train"):
        raise RefError("train.sequence_parallel", why)
    sp = train.sequence_parallel
    if sp > 1 and (heads := _attention_heads(model)) is not None:
        q, kv = heads  # Ulysses splits the heads over the group: every rank needs whole heads
        if q % sp or (kv % sp and sp % kv):
            raise RefError("train.sequence_parallel",
                           f"{sp} does not split models.{size}'s {q} attention heads and {kv} "
                           "key/value heads (the heads must divide by it, the key/value heads "
                           "divide by it or divide it)")


def _check_virtual(size: str, model: ModelSize, train: Train, where: str) -> None:
    """verl's layout (train.virtual_layout) holds a full step in equal chunks and mini-batches,
    its micro-batch budget holds the longest sequence, and this job's data-parallel ranks can
    each compute whole virtual data-parallel groups."""
    v = train.virtual_layout
    key = f"{where}.virtual_layout"
    sequences = train.prompts_per_step * train.group_size
    if sequences % v.world_size:
        raise RefError(f"{key}.world_size", f"a step's {sequences} sequences (prompts_per_step x "
                       f"group_size) do not split into {v.world_size} equal chunks (verl's "
                       "balance_batch)")
    if train.mini_batch_prompts * train.group_size % v.groups:
        raise RefError(f"{key}.world_size", f"a mini-batch's {train.mini_batch_prompts * train.group_size}"
                       f" sequences (mini_batch_prompts x group_size) do not split over its "
                       f"{v.groups} data-parallel groups (world_size {v.world_size} / "
                       f"sequence_parallel {v.sequence_parallel})")
    longest = (train.max_prompt_tokens or 0) + train.max_response_tokens
    if train.max_prompt_tokens is not None and longest > v.budget:
        raise RefError(f"{key}.max_token_len_per_gpu",
                       f"a micro-batch of {v.max_token_len_per_gpu} x {v.sequence_parallel} = "
                       f"{v.budget} tokens cannot hold the longest sequence ({longest}: "
                       "max_prompt_tokens + max_response_tokens), as verl requires")
    dp = model.train_world() // train.sequence_parallel
    if v.groups % dp:
        raise RefError(f"{key}.world_size",
                       f"its {v.groups} data-parallel groups (world_size {v.world_size} / "
                       f"sequence_parallel {v.sequence_parallel}) do not split over the "
                       f"{dp} data-parallel ranks of models.{size}'s training job (each rank "
                       "computes whole groups)")


def _attention_heads(model: ModelSize) -> tuple[int, int] | None:
    """(attention heads, key/value heads) of a size where the config or the memory plan's table of
    hub models knows them; None otherwise."""
    if model.scratch is not None:
        return model.scratch.num_attention_heads, model.scratch.num_key_value_heads
    if model.hub is not None:
        from ..core.plans.memory import HUB_ARCHS

        arch = HUB_ARCHS.get(model.hub.model_id)
        return None if arch is None else (arch.heads, arch.kv_heads)
    return None
