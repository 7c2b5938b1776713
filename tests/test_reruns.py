"""Reruns that destroy nothing (stages.reruns, stages.keys.job_hash, profiles/default).

On a finished run of config/test.yaml: how or where a job runs (the interpreter, the checkout's
folder, a reinstall, a rule's command text) reruns nothing, and a dry run writes nothing under
results/; a changed result key reruns exactly what depends on it and names the finished trainings
it would replace, which a real run replaces only with the user's consent, keeping the old ones;
a bumped stage version reruns that stage and what depends on it; and `snakemake --touch` brings
the records of a run made by the workflow before job hashes up to date, refusing where the
config gives other results.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from stages import reruns
from stages.config import ConfigError, validate
from stages.keys import (
    RESOLVED_CONFIG,
    STAGE_VERSIONS,
    job_hash,
    job_hash_of,
    stage_of,
    train_config_hash,
)
from stages.paths import RunPaths
from tests.conftest import ROOT, workflow_env, write_yaml
from tests.helpers import contents, copy_checkout, move_run, snapshot

PRE_JOB_HASH_COMMIT = "c085e4f5b190b8d2e7898b46072048cad5434117"
"""The last commit whose rules had the interpreter and `config_hash` as parameters."""


# ----- the pieces, without Snakemake --------------------------------------------------------------
@pytest.mark.parametrize("value, everything, named", [
    (None, False, set()), (False, False, set()), (True, True, set()), ("all", True, set()),
    ("tiny-s/ict/0", False, {("tiny-s", "ict", 0)}),
    ("tiny-s/ict/0, tiny-s/grpo/1", False, {("tiny-s", "ict", 0), ("tiny-s", "grpo", 1)}),
    (["a/b/2"], False, {("a", "b", 2)}),
])
def test_consent_is_all_or_named_trainings(value, everything, named):
    consent = reruns.parse_consent(value, "--config")
    assert consent.everything == everything and consent.named == named
    assert consent.covers(("tiny-s", "ict", 0)) == (everything or ("tiny-s", "ict", 0) in named)


@pytest.mark.parametrize("value", ["yes", "tiny-s/ict", "tiny-s/ict/zero", "a/b/c/0"])
def test_a_bad_consent_names_the_key(value):
    with pytest.raises(ConfigError, match=r"--config: replace_trainings: .* is not 'all'"):
        reruns.parse_consent(value, "--config")


def test_the_job_hash_moves_with_the_stage_version_and_the_result_keys(test_raw, monkeypatch):
    cfg = validate(test_raw, "t")
    w = {"size": "tiny-s", "method": "ict", "seed": "0"}
    before = job_hash_of(cfg, "train", w)
    assert before == job_hash("train", train_config_hash(cfg, "tiny-s", "ict"))
    assert job_hash("train", train_config_hash(cfg, "tiny-s", "ict"), version="4") != before
    monkeypatch.setitem(STAGE_VERSIONS, "train", "99")
    assert job_hash_of(cfg, "train", w) != before
    monkeypatch.undo()
    test_raw["train"]["lr"] = 2e-4
    assert job_hash_of(validate(test_raw, "t"), "train", w) != before
    # an evaluation of the curves runs the evaluation stage, whose version it hashes
    assert stage_of("evaluate_checkpoint") == "evaluate" and stage_of("train") == "train"


def test_the_base_model_hashes_only_what_it_is_made_from(test_raw):
    base = validate(test_raw, "t")
    w = {"size": "tiny-s"}
    edited = json.loads(json.dumps(test_raw))
    edited["models"]["tiny-s"].update(tensor_parallel_size=2, lr=1e-3, stop_tokens="generation_config")
    assert job_hash_of(validate(edited, "t"), "base_model", w) == job_hash_of(base, "base_model", w)
    edited["models"]["tiny-s"]["sft"]["steps"] = 40
    assert job_hash_of(validate(edited, "t"), "base_model", w) != job_hash_of(base, "base_model", w)


def fake_finished_training(results: Path, raw: dict, size="tiny-s", method="ict", seed=0) -> RunPaths:
    """A finished training's record and the upstream files it was made from, as the stages
    write them (their contents do not matter here, only their presence and provenance)."""
    from stages.core.common.io import provenance, write_parquet
    from stages.core.data.problems import PROBLEM_SCHEMA

    paths = RunPaths(str(results))
    cfg = validate(raw, "t")
    train = Path(paths.train_dir(size, method, seed))
    (train / "final").mkdir(parents=True)
    (train / "model.json").write_text('{"kind": "scratch", "path": "final"}')
    prov = provenance("train", STAGE_VERSIONS["train"], train_config_hash(cfg, size, method), 0)
    (train / "final" / RESOLVED_CONFIG).write_text(json.dumps(
        {"config": cfg.model_dump(mode="json"), "provenance": prov}))
    model = Path(paths.model_dir(size))
    model.mkdir(parents=True)
    (model / "base.json").write_text('{"kind": "scratch", "path": "checkpoint"}')
    (model / "summary.json").write_text(json.dumps(
        {"provenance": provenance("base_model", STAGE_VERSIONS["base_model"], "h", 0)}))
    for dataset in ("sft", "rl"):
        write_parquet([], paths.data(dataset), PROBLEM_SCHEMA,
                      provenance("prepare_data", STAGE_VERSIONS["prepare_data"], "h", 0))
    return paths


def test_a_finished_trainings_changes_are_named(tmp_path, test_raw, monkeypatch):
    paths = fake_finished_training(tmp_path / "results" / "test", test_raw)
    assert reruns.replaced_trainings(validate(test_raw, "t"), paths) == {}
    edited = json.loads(json.dumps(test_raw))
    edited["train"]["lr"] = 2e-4
    edited["models"]["tiny-s"]["gpu_memory_gb"] = 80.0  # operational: not named
    edited["datasets"]["sft"]["source"]["n"] = 256  # the base model's data
    edited["templates"]["arith"] = "Question: {question} Answer:"  # the SFT's and the prompts'
    found = reruns.replaced_trainings(validate(edited, "t"), paths)
    assert list(found) == [("tiny-s", "ict", 0)]
    why = found["tiny-s", "ict", 0]
    assert "train.lr: 0.0001 then, 0.0002 now" in why
    assert "its data 'sft': datasets.sft.source.n: 512 then, 256 now" in why
    for dataset in ("sft", "rl"):
        assert (f"its data {dataset!r}: templates.arith: 'Q: {{question}} A:' then, "
                f"'Question: {{question}} Answer:' now") in why
    assert not any("gpu_memory_gb" in line for line in why)
    # a bumped stage version upstream, and a missing upstream output
    monkeypatch.setitem(STAGE_VERSIONS, "base_model", "2")
    os.remove(paths.data("rl"))
    why = reruns.training_changes(validate(test_raw, "t"), paths, "tiny-s", "ict", 0)
    assert why == ["its base model: the base_model stage's version '1' then, '2' now",
                   f"its data 'rl': {paths.data('rl')} is missing and will be made again"]


def test_a_record_that_no_longer_validates_falls_back_to_its_hash(tmp_path, test_raw):
    paths = fake_finished_training(tmp_path / "results" / "test", test_raw)
    record = Path(paths.train_dir("tiny-s", "ict", 0)) / "final" / RESOLVED_CONFIG
    saved = json.loads(record.read_text())
    saved["config"]["train"]["removed_key"] = 1
    record.write_text(json.dumps(saved))
    assert reruns.replaced_trainings(validate(test_raw, "t"), paths) == {}  # same hash
    test_raw["train"]["lr"] = 2e-4
    (why,) = reruns.replaced_trainings(validate(test_raw, "t"), paths).values()
    assert len(why) == 1 and "its recorded config no longer validates" in why[0]
    assert "train.removed_key: unknown key" in why[0]


def test_moving_aside_keeps_the_training_its_evaluations_and_log(tmp_path):
    paths = RunPaths(str(tmp_path / "results" / "test"))
    mine = [paths.train_dir("s", "m", 0), paths.eval_dir("s", "m", 0, "b"),
            os.path.dirname(paths.overlap("s", "m", 0))]
    other = [paths.train_dir("s", "m", 1), paths.eval_dir("s", "base", 0, "b")]
    for folder in mine + other:
        Path(folder).mkdir(parents=True)
        (Path(folder) / "x").write_text(folder)
    Path(paths.train_log("s", "m", 0)).parent.mkdir(parents=True)
    Path(paths.train_log("s", "m", 0)).write_text("log")
    assert reruns.move_aside(paths, {("s", "m", 0): ["train.lr: 1 then, 2 now"]}) == [("s", "m", 0)]
    (dest,) = Path(paths.replaced()).iterdir()
    for folder in mine:
        assert not os.path.exists(folder)
        kept = dest / os.path.relpath(folder, paths.results) / "x"
        assert kept.read_text() == folder
    assert (dest / "logs" / "train" / "s" / "m" / "0.log").read_text() == "log"
    assert all((Path(f) / "x").exists() for f in other)
    note = json.loads((dest / "replaced.json").read_text())
    assert note["trainings"][0]["why"] == ["train.lr: 1 then, 2 now"]


# ----- on a finished run, through Snakemake ------------------------------------------------------
def snakemake(wd: Path, *args: str, snakefile: Path = ROOT / "Snakefile", env=None,
              timeout: int = 600) -> subprocess.CompletedProcess:
    """`python -m snakemake` in `wd` with the workflow of `snakefile` (its folder's stages)."""
    env = env or workflow_env(PYTHONPATH=str(snakefile.parent))
    return subprocess.run([sys.executable, "-m", "snakemake", "-s", str(snakefile), *args],
                          cwd=wd, env=env, capture_output=True, text=True, timeout=timeout)


def jobs(proc: subprocess.CompletedProcess) -> dict[str, int]:
    """{rule: count} of the jobs a run lists ({} for nothing to be done), without `all`."""
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    if "Nothing to be done" in out:
        return {}
    table = out.split("Job stats:")[1].split("total")[0]
    return {m[1]: int(m[2]) for m in re.finditer(r"^(\w+)\s+(\d+)$", table, re.M) if m[1] != "all"}


@pytest.fixture
def finished(local_test_run, tmp_path) -> Path:
    """A copy of the session's finished run of config/test.yaml (results/ and .snakemake/)."""
    wd, proc = local_test_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    copy = tmp_path / "run"
    copy.mkdir()
    for name in ("results", ".snakemake"):
        shutil.copytree(wd / name, copy / name, symlinks=True)
    shutil.rmtree(copy / ".snakemake" / "log", ignore_errors=True)
    return copy


def config_with(raw: dict, folder: Path, name: str, **train) -> Path:
    edited = json.loads(json.dumps(raw))
    edited["train"].update(train)
    return write_yaml(folder / f"{name}.yaml", edited)


@pytest.mark.slow  # Snakemake in subprocesses: the full tier
def test_how_or_where_a_job_runs_reruns_nothing_and_a_dry_run_writes_nothing(finished, tmp_path,
                                                                              test_raw):
    cfg = str(ROOT / "config" / "test.yaml")
    before = snapshot(finished / "results")
    # 1. another path to the same interpreter
    link = tmp_path / "python"
    link.symlink_to(sys.executable)
    assert jobs(snakemake(finished, "-n", "--configfile", cfg,
                          env=workflow_env(ICT_RLVR_STAGE_PYTHON=str(link)))) == {}
    # 2. the checkout in another folder, run as `python -m snakemake` from there, with the run
    moved = copy_checkout(tmp_path / "moved")
    move_run(finished, moved)
    assert jobs(snakemake(moved, "-n", "--configfile", "config/test.yaml",
                          snakefile=moved / "Snakefile")) == {}
    # 4. a rule's command text edited: nothing, though Snakemake's `code` trigger would rerun it
    rule = moved / "workflow" / "rules" / "train.smk"
    rule.write_text(rule.read_text().replace(' 2>&1 | tee {log}"', ' 2>&1 | tee {log}  # edited"'))
    assert "# edited" in rule.read_text()
    assert jobs(snakemake(moved, "-n", "--configfile", "config/test.yaml",
                          snakefile=moved / "Snakefile")) == {}
    assert jobs(snakemake(moved, "-n", "--configfile", "config/test.yaml", "--rerun-triggers",
                          "mtime", "params", "input", "code", snakefile=moved / "Snakefile"))["train"] == 2
    # 5. dry runs with edited configs, operational and result keys
    for name, edit in [("operational", {"micro_batch_size": 3}), ("result", {"lr": 3e-4})]:
        proc = snakemake(moved, "-n", "--configfile", str(config_with(test_raw, tmp_path, name, **edit)),
                         snakefile=moved / "Snakefile")
        assert bool(jobs(proc)) == (name == "result")
    # 3. the package installed again (editable, as scripts/setup.sh does)
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "-e", str(ROOT)],
                         capture_output=True, text=True)
    assert pip.returncode == 0, pip.stderr[-3000:]
    assert jobs(snakemake(moved, "-n", "--configfile", "config/test.yaml",
                          snakefile=moved / "Snakefile")) == {}
    after = snapshot(moved / "results")
    assert {k: v for k, v in after.items() if k != "README.md"} == before  # contents, mtimes


def new_logs(results, since: float) -> list:
    """The training logs written since `since` (a log moved aside meanwhile is not one)."""
    out = []
    for log in (results / "logs" / "train").glob("tiny-s/*/0.log"):
        try:
            if log.stat().st_mtime >= since:
                out.append(log)
        except FileNotFoundError:
            pass
    return out


@pytest.mark.slow
def test_a_result_key_replaces_finished_trainings_only_with_consent(finished, tmp_path, test_raw):
    results = finished / "results" / "test"
    doubled = str(config_with(test_raw, tmp_path, "lr", lr=2e-4))
    before = snapshot(results)
    dry = snakemake(finished, "-n", "--configfile", doubled)
    # exactly what depends on the training: its evaluations, overlaps and the tables
    assert jobs(dry) == {"train": 2, "evaluate": 2, "overlap": 2, "tables": 1}
    for method in ("grpo", "ict"):
        named = f"results/test/train/size=tiny-s/method={method}/seed=0\n    train.lr: 0.0001 then, 0.0002 now"
        assert named in dry.stderr.split("This was a dry-run")[-1], dry.stderr[-3000:]  # after the jobs
    # without consent: stops before anything runs or is removed
    real = snakemake(finished, "--cores", "2", "--configfile", doubled)
    assert real.returncode != 0 and "error: this run would replace 2 finished training(s)" in real.stderr
    assert "replace_trainings=all" in real.stderr
    partial = snakemake(finished, "--cores", "2", "--configfile", doubled, "--config",
                        "replace_trainings=tiny-s/ict/0")
    assert partial.returncode != 0 and "would replace 1 finished training(s)" in partial.stderr
    assert "method=grpo" in partial.stderr.split("error:")[1]
    assert snapshot(results) == before
    # with consent: the trainings run again, the old ones kept aside with their evaluations; a dry
    # run with another edit meanwhile changes nothing the jobs read
    old = json.loads((results / "train/size=tiny-s/method=ict/seed=0/final" / RESOLVED_CONFIG).read_text())
    tripled = str(config_with(test_raw, tmp_path, "lr3", lr=3e-4))
    resolved = results / "resolved_config.yaml"
    started = time.time() - 1  # a log written after this is the new training's
    real = subprocess.Popen(
        [sys.executable, "-m", "snakemake", "-s", str(ROOT / "Snakefile"), "--cores", "2",
         "--configfile", doubled, "--config", "replace_trainings=all"],
        cwd=finished, env=workflow_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        # a training started: the old ones were moved aside, and its log begun (an old log can be
        # seen before it is moved aside: the new one is written after the run started)
        while not ((results / "replaced").exists() and new_logs(results, started)):
            assert real.poll() is None and time.monotonic() < deadline, real.communicate()[0][-3000:]
            time.sleep(0.1)
        written = resolved.read_text()
        assert yaml.safe_load(written)["train"]["lr"] == 2e-4
        assert jobs(snakemake(finished, "-n", "--configfile", tripled))["train"] == 2
        assert resolved.read_text() == written
    finally:
        out = real.communicate(timeout=600)[0]
    assert real.returncode == 0, out[-3000:]
    assert jobs(subprocess.CompletedProcess([], 0, out, "")) == {"train": 2, "evaluate": 2,
                                                                 "overlap": 2, "tables": 1}
    (kept,) = (results / "replaced").iterdir()
    for rel in ("train/size=tiny-s/method=ict/seed=0/final/model.safetensors",
                "eval/size=tiny-s/method=ict/seed=0/bench=arith-easy/metrics.parquet",
                "overlap/size=tiny-s/method=grpo/seed=0/overlap.parquet"):
        assert contents(snapshot(kept))[rel] == contents(before)[rel]
    note = json.loads((kept / "replaced.json").read_text())
    assert {t["method"] for t in note["trainings"]} == {"grpo", "ict"}
    for training in note["trainings"]:  # the old training's own record, with its hash
        assert training["provenance"]["config_hash"] == train_config_hash(
            validate(test_raw, "t"), "tiny-s", training["method"])
        assert training["why"] == ["train.lr: 0.0001 then, 0.0002 now"]
    for method in ("grpo", "ict"):
        new = json.loads((results / f"train/size=tiny-s/method={method}/seed=0/final"
                          / RESOLVED_CONFIG).read_text())
        assert new["config"]["train"]["lr"] == 2e-4
    assert old["config"]["train"]["lr"] == 1e-4
    assert jobs(snakemake(finished, "-n", "--configfile", doubled)) == {}


@pytest.mark.slow
def test_a_bumped_stage_version_reruns_that_stage_and_what_depends_on_it(finished, tmp_path):
    moved = copy_checkout(tmp_path / "checkout")
    move_run(finished, moved)
    keys = moved / "stages" / "keys.py"
    text = keys.read_text()
    expected = {"token_stats": {"token_stats": 1, "overlap": 2, "tables": 1},
                "evaluate": {"evaluate": 3, "tables": 1},
                "train": {"train": 2, "evaluate": 2, "overlap": 2, "tables": 1}}
    for stage, listed in expected.items():
        version = re.search(rf'^    "{stage}": "(\d+)",', text, re.M)
        keys.write_text(text.replace(version[0], f'    "{stage}": "{int(version[1]) + 1}",'))
        proc = snakemake(moved, "-n", "--configfile", "config/test.yaml", snakefile=moved / "Snakefile")
        assert jobs(proc) == listed, stage
        if stage == "train":
            assert (f"the training: the train stage's version {version[1]!r} then, "
                    f"'{int(version[1]) + 1}' now") in proc.stderr
    keys.write_text(text)
    assert jobs(snakemake(moved, "-n", "--configfile", "config/test.yaml", snakefile=moved / "Snakefile")) == {}


@pytest.fixture
def pre_job_hash_workflow(tmp_path) -> Path:
    """The workflow as it was before job hashes (PRE_JOB_HASH_COMMIT), from the checkout's history."""
    tree = tmp_path / "old"
    tree.mkdir()
    archive = subprocess.run(["git", "archive", PRE_JOB_HASH_COMMIT], cwd=ROOT, capture_output=True)
    if archive.returncode != 0:
        pytest.skip(f"commit {PRE_JOB_HASH_COMMIT[:7]} is not in this checkout's history (a shallow "
                    f"clone?): {archive.stderr.decode().strip()}")
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
    return tree


@pytest.mark.slow
def test_touch_brings_a_run_recorded_before_job_hashes_up_to_date(finished, pre_job_hash_workflow,
                                                                   tmp_path, test_raw):
    """The old workflow's own --touch records the run as it recorded every run (the interpreter
    and the result keys' hash as parameters); the new one then lists every job, and its --touch,
    after checking each, leaves nothing to do and every file's content as it was. A run of then
    computed natively on the CPU (numerics came later), so only numerics.cpu_isa 'native' keeps
    its CPU jobs."""
    old = pre_job_hash_workflow / "Snakefile"
    raw = json.loads(json.dumps(test_raw))
    raw["numerics"] = {"cpu_isa": "native"}
    cfg = str(write_yaml(tmp_path / "native.yaml", raw))
    test_cfg = str(ROOT / "config" / "test.yaml")  # the old workflow knows no `numerics`
    assert jobs(snakemake(finished, "--touch", "--cores", "1", "--configfile", test_cfg, snakefile=old))
    contents_before = contents(snapshot(finished / "results"))
    assert jobs(snakemake(finished, "-n", "--configfile", cfg))["train"] == 2  # every job
    # the CPU numerics pinned, or a result key edited since: refused, touching nothing
    before = snapshot(finished / "results")
    pinned = snakemake(finished, "--touch", "--cores", "1", "--configfile", test_cfg)
    assert pinned.returncode != 0 and "before numerics were pinned" in pinned.stderr, pinned.stderr[-2000:]
    doubled = str(config_with(raw, tmp_path, "lr", lr=2e-4))
    refused = snakemake(finished, "--touch", "--cores", "1", "--configfile", doubled)
    assert refused.returncode != 0 and "nothing was touched" in refused.stderr
    assert "train {'size': 'tiny-s', 'method': 'ict', 'seed': '0'}: it was made with other result keys" in refused.stderr
    assert snapshot(finished / "results") == before
    # the config it was made with: touched, and nothing left to run
    assert jobs(snakemake(finished, "--touch", "--cores", "1", "--configfile", cfg))
    assert jobs(snakemake(finished, "-n", "--configfile", cfg)) == {}
    after = contents(snapshot(finished / "results"))
    resolved = "test/resolved_config.yaml"  # rewritten by the touch: the config it checked against
    assert {k: v for k, v in after.items() if k != resolved} == {
        k: v for k, v in contents_before.items() if k != resolved}
    assert yaml.safe_load((finished / "results" / resolved).read_text())["numerics"] == {"cpu_isa": "native"}
