"""What a rerun may do to finished work, decided before Snakemake deletes anything.

Snakemake removes a job's outputs just before it runs the job again, and a training is hours of
GPUs. So the workflow (workflow/rules/common.smk) asks this module three things:

- When it is parsed, in the main Snakemake process (real and dry runs, never a job's own parse):
  which finished trainings of the grid the config now gives another result. Their own result keys
  or stage version changed, or an upstream job's: their base model's, or the data it and they
  were made from. The keys are named (`replaced_trainings`), and printed apart from the jobs, so
  a dry run shows what a real run would replace.
- In the onstart handler of a real run (after Snakemake has decided what to run, before any job
  starts or any output is removed): which finished trainings Snakemake will run again, whatever
  the reason (the above, a forced rerun, an incomplete record, an updated input). Without the
  user's consent the run stops there, naming them. With it (`--config replace_trainings=all`, or a
  list of size/method/seed), each is moved aside whole, with its evaluations and log, under
  `results/<run>/replaced/<UTC time>/` (`guard_run`).
- Under `snakemake --touch`, which marks jobs up to date without running them: that each job it
  would mark has all its outputs and was made from the result keys and stage version the config
  gives now (`guard_touch`). It refuses otherwise, touching nothing. This is how a run finished
  before the jobs' parameters changed is brought up to date without running anything again.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .config import Config, ConfigError, validate
from .keys import (
    RESOLVED_CONFIG,
    STAGE_VERSIONS,
    config_key_name,
    differences,
    job_hash_of,
    legacy_config_hash,
    numerics_keys,
    result_value,
    stage_of,
    train_result_config,
)
from .paths import RunPaths

CONSENT_KEY = "replace_trainings"
"""The `--config` key by which a user consents to replacing finished trainings."""

Training = tuple[str, str, int]
"""(size, method, seed)."""


# ----- consent ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Consent:
    """Which finished trainings the user agreed to have replaced: all, or some by name."""

    everything: bool = False
    named: frozenset[Training] = field(default_factory=frozenset)

    def covers(self, training: Training) -> bool:
        return self.everything or training in self.named


def parse_consent(value: Any, source: str) -> Consent:
    """`--config replace_trainings=...`: `all` (or true), or `size/method/seed` names joined by
    commas (or a YAML list of them); a bad value is a ConfigError naming the key."""
    if value is None or value is False:
        return Consent()
    if value is True or value == "all":
        return Consent(everything=True)
    items = value if isinstance(value, list) else str(value).split(",")
    named = set()
    for item in items:
        parts = str(item).strip().split("/")
        if len(parts) != 3 or not parts[2].isdigit():
            raise ConfigError(f"{source}: {CONSENT_KEY}: {item!r} is not 'all' nor size/method/seed "
                              "(e.g. qwen2.5-0.5b/ict/0; several joined by commas)")
        named.add((parts[0], parts[1], int(parts[2])))
    return Consent(named=frozenset(named))


def consent_hint(trainings: Iterable[Training]) -> str:
    names = ",".join(f"{s}/{m}/{k}" for s, m, k in trainings)
    return (f"--config {CONSENT_KEY}=all (or {CONSENT_KEY}={names}) on the command line replaces "
            "them, keeping each old training, its evaluations and log under "
            "results/<run>/replaced/")


# ----- what the config now changes -------------------------------------------------------------
def read_json(path: str | Path) -> dict | None:
    """A JSON record, or None where it is missing or unreadable."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def recorded_version(paths: Iterable[str | Path]) -> str | None:
    """The stage version in the first readable provenance among `paths` (Parquet metadata, or a
    JSON record's `provenance`); None where none has one."""
    for path in map(Path, paths):
        if not path.exists():
            continue
        if path.suffix == ".parquet":
            from .core.common.io import ArtifactError, read_provenance

            try:
                return read_provenance(path).get("stage_version")
            except ArtifactError:
                continue
        record = read_json(path)
        if record and isinstance(record.get("provenance"), dict):
            return record["provenance"].get("stage_version")
    return None


def _version_change(stage: str, recorded: str | None, what: str) -> list[str]:
    if recorded is None or recorded == STAGE_VERSIONS[stage]:
        return []
    return [f"{what}: the {stage} stage's version {recorded!r} then, {STAGE_VERSIONS[stage]!r} now"]


def _key_changes(saved: Config, cfg: Config, keys: Iterable[str], what: str) -> list[str]:
    out = []
    for key in keys:
        then, now = result_value(saved, key), result_value(cfg, key)
        out += [f"{what}: {d}" for d in differences(then, now, key.replace("/", "."), "then")]
    return out


def _data_changes(saved: Config, cfg: Config, paths: RunPaths, dataset: str) -> list[str]:
    what = f"its data {dataset!r}"
    if not os.path.exists(paths.data(dataset)):
        return [f"{what}: {paths.data(dataset)} is missing and will be made again"]
    if dataset not in saved.datasets:
        return []
    keys = [f"datasets/{dataset}", f"templates/{cfg.datasets[dataset].template}"]
    if saved.datasets[dataset].template != cfg.datasets[dataset].template:
        keys = [f"datasets/{dataset}"]  # the template's name is the change itself
    return (_key_changes(saved, cfg, keys, what)
            + _version_change("prepare_data", recorded_version([paths.data(dataset)]), what))


def _base_model_changes(paths: RunPaths, size: str) -> list[str]:
    """Its keys (BASE_MODEL_KEYS) are among the training's own (train_result_config's model)."""
    what = "its base model"
    if not os.path.exists(paths.base_ref(size)):
        return [f"{what}: {paths.base_ref(size)} is missing and will be made again"]
    record = [f"{paths.model_dir(size)}/summary.json", f"{paths.model_dir(size)}/checkpoint/{RESOLVED_CONFIG}"]
    return _version_change("base_model", recorded_version(record), what)


def training_changes(cfg: Config, paths: RunPaths, size: str, method: str, seed: int,
                     validated: dict[str, Config] | None = None) -> list[str]:
    """Why the config now gives the finished training `size/method/seed` another result, each
    key by name ('train.lr: 0.0001 then, 0.0002 now'); [] where nothing changed, or where its
    record (final/ict_rlvr_config.json) cannot be read (the onstart guard still sees a rerun).
    `validated` caches the recorded configs already validated, by their text."""
    record_path = Path(paths.train_dir(size, method, seed)) / "final" / RESOLVED_CONFIG
    record = read_json(record_path)
    if not record or not isinstance(record.get("config"), dict):
        return []
    prov = record.get("provenance") or {}
    why = _version_change("train", prov.get("stage_version"), "the training")
    text = json.dumps(record["config"], sort_keys=True)
    cache = {} if validated is None else validated
    try:
        if text not in cache:
            cache[text] = validate(record["config"], str(record_path))
        saved = cache[text]
    except ConfigError as err:
        from .keys import train_config_hash

        now = train_config_hash(cfg, size, method)
        if prov.get("config_hash") != now:
            reason = str(err).splitlines()[-1].strip()
            why.append(f"the training's result keys: hash {prov.get('config_hash')} then, {now} now "
                       f"(its recorded config no longer validates, so the keys cannot be named: {reason})")
        return why
    for diff in differences(train_result_config(saved, size, method),
                            train_result_config(cfg, size, method), then="then"):
        key, _, rest = diff.partition(":")
        why.append(f"{config_key_name(key, size, method)}:{rest}")
    why += _base_model_changes(paths, size)
    exp = cfg.experiment
    datasets = [*exp.train_datasets]
    if cfg.models[size].source == "scratch":
        datasets = [exp.sft_dataset, exp.train_datasets[0], *datasets]
    for dataset in dict.fromkeys(datasets):
        why += _data_changes(saved, cfg, paths, dataset)
    return why


def finished(paths: RunPaths, training: Training) -> bool:
    """A training whose outputs were written (model.json is written last)."""
    return os.path.exists(f"{paths.train_dir(*training)}/model.json")


def replaced_trainings(cfg: Config, paths: RunPaths) -> dict[Training, list[str]]:
    """Every finished training of the grid that the config now gives another result, with why."""
    out: dict[Training, list[str]] = {}
    validated: dict[str, Config] = {}
    exp = cfg.experiment
    for size in exp.sizes:
        for method in exp.methods:
            for seed in exp.seeds:
                if finished(paths, (size, method, seed)):
                    why = training_changes(cfg, paths, size, method, seed, validated)
                    if why:
                        out[(size, method, seed)] = why
    return out


def describe(replaced: Mapping[Training, list[str]], paths: RunPaths) -> str:
    """The list printed at parse time: each training and why."""
    lines = [f"{len(replaced)} finished training(s) would be replaced: the config now gives them "
             "another result"]
    for (size, method, seed), why in replaced.items():
        lines.append(f"  {paths.train_dir(size, method, seed)}")
        lines += [f"    {reason}" for reason in why]
    return "\n".join(lines)


ANNOUNCE_AT_EXIT: list[str] = []
"""The list, once more at the end of a dry run (after Snakemake's list of jobs); a real run's
onstart handler clears it."""


def announce(replaced: Mapping[Training, list[str]], paths: RunPaths) -> None:
    """Print the list at parse time, and again as the process exits unless a real run started."""
    import atexit

    text = describe(replaced, paths) + "\n" + consent_hint(replaced)
    print(text, file=sys.stderr)
    ANNOUNCE_AT_EXIT.append(text + "\nA real run stops before replacing them, unless given that consent.")
    atexit.register(lambda: ANNOUNCE_AT_EXIT and print(ANNOUNCE_AT_EXIT[0], file=sys.stderr))


# ----- the real run: stop, or move aside with consent -------------------------------------------
def _training_of(job) -> Training:
    w = job.wildcards_dict
    return (w["size"], w["method"], int(w["seed"]))


def guard_run(workflow, paths: RunPaths, replaced: Mapping[Training, list[str]],
              consent: Consent) -> list[Training]:
    """Called in the onstart handler of a real run: the finished trainings Snakemake is about to
    run again stop the run, unless the user consented, in which case they are moved aside.
    Returns the trainings moved aside."""
    rerun = sorted({_training_of(job) for job in workflow.dag.needrun_jobs()
                    if job.rule.name == "train" and finished(paths, _training_of(job))})
    if not rerun:
        return []
    reasons = {t: replaced.get(t) or [f"Snakemake: {_reason(workflow, t)}"] for t in rerun}
    refused = [t for t in rerun if not consent.covers(t)]
    if refused:
        lines = [f"error: this run would replace {len(refused)} finished training(s); nothing "
                 "was run or removed:"]
        for t in refused:
            lines.append(f"  {paths.train_dir(*t)}")
            lines += [f"    {reason}" for reason in reasons[t]]
        lines.append(consent_hint(refused))
        sys.exit("\n".join(lines))
    return move_aside(paths, {t: reasons[t] for t in rerun})


def _reason(workflow, training: Training) -> str:
    for job in workflow.dag.needrun_jobs():
        if job.rule.name == "train" and _training_of(job) == training:
            return str(workflow.dag.reason(job)).strip() or "rerun"
    return "rerun"


def move_aside(paths: RunPaths, trainings: Mapping[Training, list[str]]) -> list[Training]:
    """Move each training, its evaluations, overlap and log to results/<run>/replaced/<UTC
    time>/, at the same relative paths, with a replaced.json that says what and why."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    dest = Path(paths.replaced()) / stamp
    while dest.exists():  # a second replacement within the same second
        dest = dest.with_name(dest.name + "+")
    note = []
    for training, why in trainings.items():
        record = read_json(Path(paths.train_dir(*training)) / "final" / RESOLVED_CONFIG) or {}
        moved = []
        for path in paths.of_training(*training):
            if os.path.lexists(path):
                target = dest / os.path.relpath(path, paths.results)
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.move(path, target)
                moved.append(str(target))
        size, method, seed = training
        note.append({"size": size, "method": method, "seed": seed,
                     "provenance": record.get("provenance"), "why": why, "moved": moved})
        print(f"replacing {paths.train_dir(*training)}: the old training is kept in "
              f"{dest / os.path.relpath(paths.train_dir(*training), paths.results)}", file=sys.stderr)
    (dest / "replaced.json").write_text(json.dumps({"replaced_at": stamp, "trainings": note},
                                                   indent=2) + "\n")
    return list(trainings)


# ----- snakemake --touch -----------------------------------------------------------------------
def provenance_files(job) -> list[str]:
    """The outputs of a job that carry its stage's provenance (Parquet metadata or a record)."""
    files = [str(f) for f in job.output if str(f).endswith(".parquet")]
    if job.rule.name == "base_model":
        folder = os.path.dirname(str(job.output[0]))
        files += [f"{folder}/summary.json", f"{folder}/checkpoint/{RESOLVED_CONFIG}"]
    return files


def touch_refusal(workflow, cfg: Config, job) -> str | None:
    """Why `snakemake --touch` must not mark `job` up to date, or None where it may: all its
    outputs exist and its records (Snakemake's, of the run that made them) carry the job hash the
    config gives now, or, for a run finished before job hashes, the same result keys and a
    recorded stage version that is the current one."""
    missing = [str(f) for f in job.output if not os.path.exists(f)]
    if missing:
        return f"missing outputs ({', '.join(missing[:3])}{' …' if len(missing) > 3 else ''})"
    changed = sorted(map(str, workflow.dag.reason(job).updated_input))
    if changed:
        return f"its inputs changed since it ran ({', '.join(changed[:3])})"
    w = dict(job.wildcards_dict)
    rule = job.rule.name
    now, legacy = repr(job_hash_of(cfg, rule, w)), repr(legacy_config_hash(cfg, rule, w))
    for output in job.output:
        recorded = workflow.persistence.params(output)
        if recorded is None:
            return f"{output} has no record in .snakemake/metadata to compare with the config"
        if now in recorded:
            continue
        if legacy not in recorded:
            return "it was made with other result keys than the config's now"
        if "size" in w and numerics_keys(cfg, rule, w["size"]) and cfg.numerics.cpu_isa != "native":
            return ("it computed on the CPU before numerics were pinned, natively: with "
                    "numerics.cpu_isa 'native' it is kept, with 'avx2' it runs again")
        version = recorded_version(provenance_files(job))
        if version is not None and version != STAGE_VERSIONS[stage_of(rule)]:
            return (f"it was made by version {version!r} of the {stage_of(rule)} stage, and "
                    f"{STAGE_VERSIONS[stage_of(rule)]!r} is current")
    return None


def guard_touch(workflow, cfg: Config) -> None:
    """Called in the onstart handler under --touch: stop, touching nothing, unless every job it
    would mark up to date may be (touch_refusal)."""
    refused = []
    for job in workflow.dag.needrun_jobs():
        if job.output:
            why = touch_refusal(workflow, cfg, job)
            if why:
                refused.append(f"  {job.rule.name} {dict(job.wildcards_dict)}: {why}")
    if refused:
        sys.exit(f"error: --touch would mark {len(refused)} job(s) up to date whose results the "
                 "config does not give; nothing was touched:\n" + "\n".join(refused)
                 + "\nRun them (without --touch), or delete their outputs, before touching the rest.")
