"""What each stage's job reads of the config, split into what its results depend on and how it
runs, and where training saves its checkpoints.

The workflow parses its rules with these (each rule hashes the result keys its stage reads, and a
changed hash reruns the job), and the stages record the same hash in their outputs' provenance
and, for training, in the resume state: so an operational edit — a memory share after an
out-of-memory error, a checkpoint cadence, more sampling rounds, a label, a logger, the physical
micro-batch size, the GPUs of a job — neither reruns a finished job nor throws away a resume
state. This module imports nothing heavier than the config (no torch): a dry run and every SLURM
job's own Snakemake parse stay fast. The stage modules re-export them under their old names.
"""

from __future__ import annotations

import contextvars
import functools
import typing
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, TypeAdapter

from .config import (
    Config,
    Cost,
    CostRates,
    Hub,
    HubModel,
    HubSource,
    Loss,
    Method,
    ModelSize,
    Numerics,
    RuleRates,
    Train,
    digest,
)

STAGE_VERSIONS: dict[str, str] = {
    "prepare_data": "1",
    "base_model": "1",
    "rollout": "2",
    "token_stats": "5",
    "train": "5",  # 5: phase times, the length-limit share, the resume record (states of 4 lack them)
    "evaluate": "2",
    "overlap": "1",
    "tables": "2",
}
"""The version of each stage's code. It enters the hash of every job that runs the stage
(job_hash, each rule's `job_hash` parameter), so bumping it reruns that stage's jobs and what
depends on them, and nothing else. Bump it in the commit whose code change changes what the stage
computes (its numbers, columns or files); not for speed, memory, logging or messages, which
rerun nothing. Say what changed in a comment beside the new number, and rewrite
tests/fixtures/job_hashes.json (python -m tests.test_job_hashes --write): its diff lists the jobs
that will rerun. A new config key follows UNHASHED_AT_DEFAULT instead."""

RULE_STAGES = {"evaluate_checkpoint": "evaluate"}
"""Rules whose stage has another name (every other rule runs the stage of its own name)."""

RESOLVED_CONFIG = "ict_rlvr_config.json"
"""The record inside every checkpoint folder: the resolved config, provenance and summary."""


def stage_of(rule: str) -> str:
    """The stage module a rule runs."""
    return RULE_STAGES.get(rule, rule)

EVALUATE_KEYS = ("backend", "n", "temperature", "top_p", "max_new_tokens", "k", "bootstrap",
                 "grade_timeout_s", "batch_size", "graders", "batch_invariant", "engine_kwargs")

# ----- operational keys: how a job runs, not what it computes ------------------------------------
TRAIN_OPERATIONAL: dict[str, str] = {
    "vllm_gpu_memory_utilization": "the memory share of the training job's vLLM engine",
    "checkpoint_every": "how often a resume state is written (steps)",
    "checkpoint_every_minutes": "how often a resume state is written (wall time)",
    "save_before_limit_minutes": "when SLURM signals the job to save before its time limit",
    "stop_after_steps": "where an attempt stops to be resubmitted (a pilot's forced resume)",
    "loggers": "where the per-step metrics are sent besides metrics.jsonl",
    "max_sampling_rounds": "the generation batches a step may sample before dynamic sampling "
                           "stops the run (with dynamic_sampling_pool 'rank' it decides a short "
                           "step's groups: a result key there)",
    "micro_batch_size": "the physical forwards: selection and loss weights are made over the "
                        "whole mini-batch (or train.virtual_layout's micro-batches), so only the "
                        "float rounding of the summed gradients changes (tests/test_resume.py)",
    "micro_batch_tokens": "the physical forwards, as micro_batch_size",
    "gradient_checkpointing": "recomputes activations in the backward pass: the same gradients",
    "generation_batch_size": "the hf backend's decode batches: each sequence has its own "
                             "seeded stream, so the samples stay as they are (the sampler's own "
                             "log-probs move by float rounding)",
}
"""Keys of the training section (train, models.<size>.train, methods.<m>.train) that no trained
result depends on, with why."""

MODEL_OPERATIONAL: dict[str, str] = {
    "gpus": "resources (GPUs per job)",
    "gpu_memory_gb": "the memory plan's check",
    "label": "names in tables (the tables job hashes it)",
    "train_nodes": "resources (nodes of the training job)",
    "gpus_per_node": "resources",
    "train_processes": "resources (CPU processes of the training job)",
    "train_tensor_parallel_size": "the layout of the training job's vLLM engines",
}
"""Keys of models.<size> that no stage's result depends on (the world size of a training job
included: its mini-batches, prompts and seeds do not depend on it, only the float rounding of its
reductions; a resume state moves to another world size through a universal checkpoint), with
why. Under dynamic_sampling_pool 'rank' each rank fills its own slots, so the world size then is
a result key of training (train_result_config)."""

METHOD_OPERATIONAL: dict[str, str] = {
    "label": "names in tables (the tables job hashes it)",
    "paper_row": "the reported numbers printed beside ours (tables)",
    "evaluate": "the evaluation of its models (the evaluation jobs hash it)",
}
"""Keys of methods.<m> that the training does not read, with why."""

ENGINE_OPERATIONAL: dict[str, str] = {
    **dict.fromkeys(("gpu_memory_utilization", "kv_cache_memory_bytes", "cpu_offload_gb",
                     "num_gpu_blocks_override"), "memory of the engine"),
    **dict.fromkeys(("max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill",
                     "enable_prefix_caching"), "scheduling of the engine's batches"),
    **dict.fromkeys(("enforce_eager", "cudagraph_capture_sizes", "max_cudagraph_capture_size"),
                    "eager kernels or CUDA graphs of the same kernels"),
    "disable_log_stats": "logging",
}
"""vLLM engine arguments (engine_kwargs of every stage) that leave the distribution the engine
samples from as it is. Without batch_invariant a vLLM sample already depends on which requests
share its batch (docs/cluster.md), so these change nothing that was reproducible; with it, they
change none of a request's outputs."""


def _without(section: dict, keys) -> dict:
    return {k: v for k, v in section.items() if k not in keys}


def engine_result(kwargs: dict) -> dict:
    """engine_kwargs without the operational engine arguments."""
    return _without(kwargs, ENGINE_OPERATIONAL)


UNHASHED_AT_DEFAULT: dict[tuple[type, str], str] = {
    (Loss, "policy_loss"): "2026-11: its default, ppo_clip, is the clipped surrogate that every "
                           "training before it computed",
    (HubModel, "commit"): "2026-12: set from results/<run>/hub.lock.yaml; unset, a hub model "
                          "resolves its revision as before the lock",
    (HubSource, "commit"): "2026-12: as HubModel.commit",
    (Config, "hub"): "2026-12: where snapshots and caches live; no job's result keys read it",
    (Cost, "walltime_margin"): "2026-12: a job's walltime; the cost plan is no job's result key",
    (Cost, "walltime_round_minutes"): "2026-12: as walltime_margin",
    (Cost, "rules"): "2026-12: the cost plan's per-rule rates; no job's result key",
    (Cost, "cpu_jobs"): "2026-12: whether the cost plan estimates CPU jobs; no job's result key",
    (RuleRates, "generation_tokens_per_s"): "2026-12: as Cost.rules",
    (RuleRates, "train_mfu"): "2026-12: as Cost.rules",
    (RuleRates, "startup_minutes"): "2026-12: as Cost.rules",
    (RuleRates, "response_tokens"): "2026-12: as Cost.rules",
    (CostRates, "prompt_tokens"): "2026-12: as Cost.rules",
    (CostRates, "step_overhead_s"): "2026-12: as Cost.rules",
    (CostRates, "rules"): "2026-12: as Cost.rules",
    (Hub, "cache_dir"): "2026-12: as `hub`",
}
"""The rule for a new result key: each key that came after results existed, by (the config model
that holds it, its name), enters a hash only where it differs from its default, and its default
computes exactly what the results made before it did. So adding a key keeps every finished job's
hash (and resume state), and a config that sets it reruns what reads it. Every key added to the
config from now on is listed here, with the date and why its default reproduces the old results
(tests/test_keys.py fails for a key that is neither here nor in tests/fixtures/config_keys.txt,
the keys that existed before this rule). A key whose default changes results instead needs the
reading stages' versions bumped (STAGE_VERSIONS)."""

HASHED_ON_ARRIVAL: dict[tuple[type, str], str] = {
    (Config, "numerics"): "2026-12: CPU jobs computed natively before; pinned to AVX2 (the "
                          "default) they compute other bits on processors with AVX-512 or AMX, "
                          "so the jobs that compute on CPUs run once more (numerics_keys)",
    (Numerics, "cpu_isa"): "2026-12: as `numerics`",
}
"""The exception to UNHASHED_AT_DEFAULT: keys whose default does change results, and which enter
the hashes of the jobs that read them from the day they came, with why."""

PARTIAL_SECTIONS: dict[tuple[type, str], type] = {(ModelSize, "train"): Train, (Method, "train"): Train}
"""Free-form fields that hold a partial section of another model (a size's or a method's changes
to `train`)."""


def field_model(annotation: Any) -> tuple[type | None, bool]:
    """(the config model a field holds, whether it holds a dict of them) for X, X | None and
    dict[str, X]; (None, False) for anything else."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, False
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is dict and len(args) == 2:
        return field_model(args[1])[0], True
    for arg in args:  # a union
        model, many = field_model(arg)
        if model is not None:
            return model, many
    return None, False


@functools.cache
def default_json(model: type, key: str) -> Any:
    """The default of `model`'s field `key` as the config's JSON dump writes it."""
    field = model.model_fields[key]
    return TypeAdapter(field.annotation).dump_python(field.get_default(call_default_factory=True),
                                                     mode="json")


def union_member(annotation: Any, kind: str) -> type | None:
    """The config model of a tagged union (a data set's `source`) whose `kind` is `kind`."""
    for arg in typing.get_args(annotation):
        member = union_member(arg, kind) if typing.get_args(arg) else arg
        if isinstance(member, type) and issubclass(member, BaseModel) \
                and "kind" in member.model_fields and member.model_fields["kind"].default == kind:
            return member
    return None


def without_unhashed(model: type | None, value: Any) -> Any:
    """`value`, a JSON dump of `model` (whole or partial), without the UNHASHED_AT_DEFAULT keys
    that are at their defaults, at any depth."""
    if model is None or not isinstance(value, dict):
        return value
    out = {}
    for key, item in value.items():
        field = model.model_fields.get(key)
        if field is None:  # a method's selector parameters, a free-form mapping's entries
            out[key] = item
            continue
        if (model, key) in UNHASHED_AT_DEFAULT and item == default_json(model, key):
            continue
        partial = PARTIAL_SECTIONS.get((model, key))
        inner, many = (partial, False) if partial else field_model(field.annotation)
        if not many and isinstance(item, dict) and "kind" in item:  # a member of a tagged union
            inner = union_member(field.annotation, item["kind"]) or inner
        kept = ({k: without_unhashed(inner, v) for k, v in item.items()}
                if many and isinstance(item, dict) else without_unhashed(inner, item))
        if kept == {} and item != {} and default_json(model, key) != {}:
            continue  # a partial section that held only such keys says nothing
        out[key] = kept
    return out


def model_at(parts: list[str]) -> tuple[type | None, bool]:
    """(the config model of the config at a path, whether it is a dict of them): for
    ['models', 'tiny-s', 'train'] (Train, False), for ['models'] (ModelSize, True); (None, False)
    where no model holds it."""
    model: type | None = Config
    many = False
    for part in parts:
        if model is None:
            return None, False
        if many:  # a key of a dict of models
            many = False
            continue
        field = model.model_fields.get(part)
        if field is None:
            return None, False
        partial = PARTIAL_SECTIONS.get((model, part))
        model, many = (partial, False) if partial else field_model(field.annotation)
    return model, many


def train_section_result(section: dict) -> dict:
    """A training section (whole or partial) without its operational keys; its engine_kwargs
    without the operational engine arguments; without the UNHASHED_AT_DEFAULT keys at their
    defaults."""
    out = _without(section, TRAIN_OPERATIONAL)
    if "engine_kwargs" in out:
        out["engine_kwargs"] = engine_result(out["engine_kwargs"])
    return without_unhashed(Train, out)


def model_result(model: dict) -> dict:
    """models.<size> without its operational keys (its `train` changes without theirs)."""
    out = _without(model, MODEL_OPERATIONAL)
    if "train" in out:
        out["train"] = train_section_result(out["train"])
    return out


def result_value(cfg: Config, path: str) -> Any:
    """The config at `path` ('models/qwen2.5-7b', 'rollout', 'evaluate/engine_kwargs') as a job's
    results see it: operational keys of a model, a training section and engine arguments left
    out (a path to a single value is kept as it is)."""
    value: Any = cfg.model_dump(mode="json")
    for part in path.split("/"):
        value = value[part]
    parts = path.split("/")
    if parts[0] == "models" and len(parts) == 2:
        value = model_result(value)
    elif parts[-1] == "engine_kwargs":
        value = engine_result(value)
    elif parts in (["rollout"], ["evaluate"]):
        value = {**value, "engine_kwargs": engine_result(value["engine_kwargs"])}
    elif parts == ["train"] or (len(parts) == 3 and parts[0] in ("models", "methods")
                                and parts[2] == "train"):
        value = train_section_result(value)
    model, many = model_at(parts)
    if many and isinstance(value, dict):
        return {k: without_unhashed(model, v) for k, v in value.items()}
    return without_unhashed(model, value)


def result_hash(cfg: Config, *paths: str) -> str:
    """The hash of the result keys under `paths` (each rule's config_hash, each output's
    provenance)."""
    return digest({p: result_value(cfg, p) for p in paths})


# ----- the stages --------------------------------------------------------------------------------
BASE_MODEL_KEYS = ("source", "scratch", "sft", "hub", "gguf")
"""The keys of models.<size> the base-model stage reads: what the model is and, for a scratch
model, how its SFT trains. Its GPUs, engines, training section and labels are the later stages'."""


_NUMERICS_HASHED: contextvars.ContextVar[bool] = contextvars.ContextVar("numerics_hashed", default=True)
"""False while legacy_config_hash computes the hashes of before `numerics` existed."""

GPU_OF_RULE = {"overlap": "token_stats", "evaluate_checkpoint": "evaluate"}
"""Rules whose GPUs are another rule's (models.<size>.gpus.<rule>)."""


def numerics_keys(cfg: Config, rule: str, size: str) -> tuple[str, ...]:
    """("numerics",) where a job of `rule` for `size` computes with torch on CPUs, whose code
    paths `numerics` pins (a scratch or GGUF base model; a rollout, token-statistics, training,
    evaluation or overlap job without GPUs); () elsewhere: a GPU job's numbers are its GPU's, and
    a hub base model only names its weights."""
    model = cfg.models[size]
    if not _NUMERICS_HASHED.get():
        return ()
    if rule == "base_model":
        return ("numerics",) if model.source in ("scratch", "gguf") else ()
    return () if getattr(model.gpus, GPU_OF_RULE.get(rule, rule)) else ("numerics",)


def base_model_config_keys(cfg: Config, size: str) -> tuple[str, ...]:
    """The parts of the config the base-model stage reads (its rule hashes the same ones)."""
    return (*(f"models/{size}/{key}" for key in BASE_MODEL_KEYS), "seed",
            *numerics_keys(cfg, "base_model", size))


def rollout_config_keys(cfg: Config, size: str) -> tuple[str, ...]:
    """The parts of the config this stage reads (its rule hashes the same ones)."""
    return ("rollout", f"models/{size}", "seed", "train/reward_correct", "train/reward_incorrect",
            "experiment/train_datasets",
            *(f"datasets/{d}/grader" for d in cfg.experiment.train_datasets),
            *numerics_keys(cfg, "rollout", size))


REPORTED = {"entropy20": "entropy_top", "stapo": "stapo", "ict": "ict"}
"""The three selectors the token-statistics stage reports, by the column they fill."""


def selector_params(cfg: Config, selector: str) -> dict:
    """Parameters of the first experiment method that uses `selector`, else the defaults of the
    selector's registered parameter model (METHODS §3)."""
    from .core.training.selectors import spec_of

    for name in cfg.experiment.methods:
        if cfg.methods[name].selector == selector:
            return cfg.methods[name].selector_params()
    return spec_of(selector).validate({}).model_dump()


def reported_params(cfg: Config) -> dict[str, dict]:
    """The parameters of each reported selector, by column."""
    return {col: selector_params(cfg, sel) for col, sel in REPORTED.items()}


def token_stats_config_hash(cfg: Config, size: str) -> str:
    """What the token-statistics stage's results depend on: the rollouts' settings, its own
    section, the size's model and the seed, and of the methods only the parameters of the three
    selectors it reports (reported_params): a method added to the run reruns it only when it is
    the first of its selector with other parameters than the one it replaces."""
    return digest({**{p: result_value(cfg, p) for p in ("rollout", "token_stats",
                                                        f"models/{size}", "seed",
                                                        *numerics_keys(cfg, "token_stats", size))},
                   "reported_params": reported_params(cfg)})


def train_result_config(cfg: Config, size: str, method: str) -> dict:
    """What a training job's results depend on: its training section (train, then
    models.<size>.train, then methods.<m>.train applied) without the operational keys, the
    method's selector, parameters and warm-up, the size's model but for its resources, the seed,
    the scorer's chunking, the grader's timeout and the training datasets' limits and graders.

    The training job's rule hashes it, its outputs' provenance records the hash, and a resume
    state keeps it whole, so a refused resume names the keys that differ."""
    job = cfg.train_for(method, size)
    section = train_section_result(job.model_dump(mode="json"))
    model = cfg.models[size]
    if job.dynamic_sampling and job.dynamic_sampling_pool == "rank":
        # each rank fills its own slots and a short step trains as many groups as the rank with
        # fewest: which groups train depends on the ranks and on the rounds allowed
        section["max_sampling_rounds"] = job.max_sampling_rounds
        section["data_parallel_ranks"] = model.train_world() // job.sequence_parallel
    return {
        **{key: result_value(cfg, key) for key in numerics_keys(cfg, "train", size)},
        "train": section,
        "method": _without(cfg.methods[method].model_dump(mode="json"),
                           {*METHOD_OPERATIONAL, "train"}),  # its train changes are in `train`
        "model": without_unhashed(ModelSize, _without(model_result(model.model_dump(mode="json")),
                                                       {"train", "tensor_parallel_size"})),  # engines'
        "seed": cfg.seed,
        "token_stats": {"chunk_positions": cfg.token_stats.chunk_positions,
                        "chunk_vocab": cfg.token_stats.chunk_vocab},
        "grade_timeout_s": cfg.evaluate.grade_timeout_s,
        "train_datasets": {d: {"max_response_tokens": cfg.datasets[d].max_response_tokens,
                               "grader": cfg.datasets[d].grader}
                           for d in cfg.experiment.train_datasets},
    }


def train_config_hash(cfg: Config, size: str, method: str) -> str:
    """The hash of train_result_config: rule train's config_hash and the outputs' provenance."""
    return digest(train_result_config(cfg, size, method))


def differences(saved: Any, current: Any, where: str = "", then: str = "in the resume state") -> list[str]:
    """The dotted keys at which two JSON values differ, with both values ('train.lr: 0.001 in
    the resume state, 0.003 now'; `then` says where the saved value is)."""
    if isinstance(saved, dict) and isinstance(current, dict):
        out = []
        for key in sorted(set(saved) | set(current), key=str):
            name = f"{where}.{key}" if where else str(key)
            if key not in saved:
                out.append(f"{name}: absent {then}, {current[key]!r} now")
            elif key not in current:
                out.append(f"{name}: {saved[key]!r} {then}, absent now")
            else:
                out += differences(saved[key], current[key], name, then)
        return out
    return [] if saved == current else [f"{where}: {saved!r} {then}, {current!r} now"]


def config_key_name(key: str, size: str, method: str) -> str:
    """A dotted key of train_result_config as the config spells it ('model.lr' ->
    'models.<size>.lr')."""
    head, _, rest = key.partition(".")
    where = {"train": "train", "method": f"methods.{method}", "model": f"models.{size}",
             "grade_timeout_s": "evaluate.grade_timeout_s", "train_datasets": "datasets"}.get(head, head)
    return f"{where}.{rest}" if rest else where


def evaluate_config_keys(cfg: Config, size: str, bench: str, method: str = "base") -> tuple[str, ...]:
    """The parts of the config one evaluation reads (its rule hashes the same ones). The method
    and its training reach an evaluation only through the model file and its evaluation changes
    (methods.<m>.evaluate), the benchmark's source and template only through the problems file:
    when those change, the files do."""
    own = () if method == "base" else (f"methods/{method}/evaluate",)
    return (*(f"evaluate/{k}" for k in EVALUATE_KEYS), f"datasets/{bench}/role",
            f"datasets/{bench}/grader", f"models/{size}/tensor_parallel_size",
            f"models/{size}/stop_tokens", "seed", *own, *numerics_keys(cfg, "evaluate", size))


def overlap_config_keys(cfg: Config, size: str) -> tuple[str, ...]:
    """The parts of the config this stage reads (its rule hashes the same ones)."""
    return ("rollout/temperature", "token_stats", "seed", *numerics_keys(cfg, "overlap", size))


def curve_benchmarks(cfg: Config) -> list[str]:
    """The benchmarks of the checkpoints' evaluations (evaluate.curve_benchmarks, else all)."""
    return list(cfg.evaluate.curve_benchmarks or cfg.experiment.benchmarks)


def tables_config_keys(cfg: Config) -> tuple[str, ...]:
    """The parts of the config the tables stage reads (its rule hashes the same ones)."""
    return ("experiment", "evaluate", "methods", "rollout/temperature", "train/steps",
            "train/save_every", "token_stats/overlap_top", "token_stats/ict_readings",
            "token_stats/early_positions",
            *(f"models/{s}/{key}" for s in cfg.experiment.sizes for key in ("label", "source", "hub")),
            *(f"datasets/{b}/{key}" for b in cfg.experiment.benchmarks
              for key in ("label", "reported_as", "grader")))


def config_hash_of(cfg: Config, rule: str, w: Mapping[str, str]) -> str:
    """The hash of the result keys one job of `rule` reads, for its wildcards `w`: what its
    outputs' provenance records as `config_hash` (an evaluation's records each benchmark's own)."""
    if rule == "prepare_data":
        ds = w["dataset"]
        return result_hash(cfg, f"datasets/{ds}", f"templates/{cfg.datasets[ds].template}", "seed")
    if rule == "base_model":
        return result_hash(cfg, *base_model_config_keys(cfg, w["size"]))
    if rule == "rollout":
        return result_hash(cfg, *rollout_config_keys(cfg, w["size"]))
    if rule == "token_stats":
        return token_stats_config_hash(cfg, w["size"])
    if rule == "train":
        return train_config_hash(cfg, w["size"], w["method"])
    if rule in ("evaluate", "evaluate_checkpoint"):
        benches = cfg.experiment.benchmarks if rule == "evaluate" else curve_benchmarks(cfg)
        return result_hash(cfg, *dict.fromkeys(key for bench in benches for key in
                                               evaluate_config_keys(cfg, w["size"], bench, w["method"])))
    if rule == "overlap":
        return result_hash(cfg, *overlap_config_keys(cfg, w["size"]))
    if rule == "tables":
        return result_hash(cfg, *tables_config_keys(cfg))
    raise KeyError(f"no config hash for rule {rule!r}")


def job_hash(stage: str, config_hash: str, version: str | None = None) -> str:
    """What a job's results are a function of, besides its inputs: its stage, the stage's
    version (STAGE_VERSIONS, unless `version` names a recorded one) and the hash of the result
    keys it reads. Each rule's one parameter that is no path: a change reruns the job."""
    return digest({"stage": stage, "version": STAGE_VERSIONS[stage] if version is None else version,
                   "config": config_hash})


def job_hash_of(cfg: Config, rule: str, w: Mapping[str, str]) -> str:
    """job_hash of one job of `rule` under `cfg`."""
    return job_hash(stage_of(rule), config_hash_of(cfg, rule, w))


def legacy_config_hash(cfg: Config, rule: str, w: Mapping[str, str]) -> str:
    """The `config_hash` parameter a job of `rule` had before job_hash replaced it (and before
    the base model hashed only BASE_MODEL_KEYS, and before `numerics`): what a run finished then
    recorded, which `snakemake --touch` compares when it brings that run's records up to date
    (stages.reruns; a CPU job of then computed natively, so only numerics.cpu_isa 'native' may
    take it over)."""
    if rule == "base_model":
        return result_hash(cfg, f"models/{w['size']}", "seed")
    token = _NUMERICS_HASHED.set(False)  # those runs computed natively: `numerics` came later
    try:
        return config_hash_of(cfg, rule, w)
    finally:
        _NUMERICS_HASHED.reset(token)


def checkpoint_name(step: int) -> str:
    """The folder, inside the training's output folder, of the checkpoint saved after `step` steps."""
    return f"checkpoints/step={step}"


def checkpoint_steps(tcfg: Train) -> list[int]:
    """The steps after which a checkpoint is saved (train.save_every; the final model is not one)."""
    if not tcfg.save_every:
        return []
    return list(range(tcfg.save_every, tcfg.steps, tcfg.save_every))


def save_signal_option(tcfg: Train) -> str | None:
    """The sbatch option of a training job that asks SLURM for SIGURG
    train.save_before_limit_minutes before its time limit (whole seconds, at most 65535): the
    trainer then writes a resume state at the next step boundary and exits, to be resubmitted
    (stages.core.training.resume says why this signal). None when the key is None."""
    if tcfg.save_before_limit_minutes is None:
        return None
    return f"--signal=URG@{min(65535, round(60 * tcfg.save_before_limit_minutes))}"
