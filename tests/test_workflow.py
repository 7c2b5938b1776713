"""The Snakemake workflow: lint, dry runs of both configs, config errors, one real run."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest
import yaml

from tests.conftest import ROOT, write_yaml


def snakemake(*args: str, cwd: Path, timeout: int = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "snakemake", "-s", str(ROOT / "Snakefile"), "--directory", str(cwd),
         *args],
        capture_output=True, text=True, env=env, timeout=timeout,
    )


def job_counts(stdout: str) -> dict[str, int]:
    """The 'Job stats' table of a dry run as {rule: count}."""
    table = stdout.split("Job stats:")[1].split("Reasons:")[0]
    return {m[1]: int(m[2]) for m in re.finditer(r"^(\w+)\s+(\d+)$", table, re.M)}


# The stages run in the project's own virtual environment (scripts/setup.sh), not in per-rule
# conda environments or containers, so that one lint is expected and every other one is not.
ACCEPTED_LINTS = {"Specify a conda environment or container for each rule."}


@pytest.mark.slow  # a stage or Snakemake in a subprocess: the full tier
def test_lint_is_clean_but_for_the_environment_lint():
    proc = snakemake("--lint", cwd=ROOT)
    out = proc.stdout + proc.stderr
    assert "Lints for" in out or "Congratulations" in out, out
    titles = set(re.findall(r"^\s+\* (.+?):$", out, re.M))
    assert titles <= ACCEPTED_LINTS, out


@pytest.mark.slow  # a stage or Snakemake in a subprocess: the full tier
def test_dry_run_default(tmp_path):
    proc = snakemake("-n", "--configfile", str(ROOT / "config" / "config.yaml"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    counts = job_counts(proc.stdout)
    assert counts["prepare_data"] == 5 and counts["base_model"] == 1  # tiny-s


PAPER_BENCHMARKS = ["math500", "gsm8k", "mmlu-stem", "gpqa", "aime23", "aime24", "aime25"]
PAPER_SIZES = ["qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b"]
PAPER_ABLATIONS = ["ict-rho0.2", "ict-rho0.3", "ict-frequent90", "random10-response",
                   "ict-warmup10", "ict-warmup40", "jsd-token-id", "jsd-scope-position"]


def paper_dry_run(config: Path, cwd: Path, monkeypatch) -> subprocess.CompletedProcess:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a dry run needs no network
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    proc = snakemake("-n", "--configfile", str(config), cwd=cwd)
    assert proc.returncode == 0, proc.stderr
    return proc


def trained_methods(stdout: str) -> set[str]:
    return set(re.findall(r"/train/size=[^/\s]+/method=([^/\s]+)/seed=\d+/model\.json", stdout))


@pytest.mark.slow
def test_dry_run_paper_lists_the_grid_offline(tmp_path, monkeypatch):
    proc = paper_dry_run(ROOT / "config" / "paper.yaml", tmp_path, monkeypatch)
    counts = job_counts(proc.stdout)
    assert counts["prepare_data"] == 9  # GSM8K train + MATH train + seven benchmarks
    assert counts["base_model"] == 3  # 0.5B, 1.5B, 7B
    assert counts["train"] == 3 * 4 * 5  # sizes x methods x seeds
    assert counts["evaluate"] == 3 * (1 + 4) * 5  # sizes x (base + methods) x seeds: one job per model
    for size in PAPER_SIZES:
        assert f"size={size}/base.json" in proc.stdout
    benches = set(re.findall(r"/bench=([^/\s]+)/metrics\.parquet", proc.stdout))
    assert benches == set(PAPER_BENCHMARKS)
    data = set(re.findall(r"/data/dataset=([^/\s]+)/problems\.parquet", proc.stdout))
    assert data == {*PAPER_BENCHMARKS, "gsm8k-train", "math-train"}
    assert trained_methods(proc.stdout) == {"grpo", "entropy20", "stapo", "ict"}
    # the default config is not merged into the paper's: no tiny models appear
    assert "tiny-s" not in proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("name", ["paper.yaml", "beyond-80-20.yaml"])
def test_every_gpu_jobs_walltime_in_a_dry_run_is_the_plans(name, tmp_path, monkeypatch):
    """cost.walltime_margin: each GPU job asks for the plan's estimate x the margin (stages.cost.
    planned_requests), not its rule's configured runtime (24-48 h trainings and 12 h checkpoint
    evaluations before); the jobs the plan does not estimate keep theirs."""
    from stages import cost
    from stages.config import load_config

    cfg = load_config(ROOT / "config" / name)
    runtimes = dry_run_runtimes(paper_dry_run(ROOT / "config" / name, tmp_path, monkeypatch).stdout)
    planned = cost.planned_requests(cfg, cost.runtime_limit(cfg)[0])
    for rule in ("rollout", "token_stats", "train", "evaluate", "evaluate_checkpoint", "overlap"):
        assert runtimes.get(rule, set()) == {v for (r, _, _), v in planned.items() if r == rule}, rule
    assert runtimes["prepare_data"] == {cfg.resources.prepare_data.runtime}
    assert max(runtimes.get("evaluate_checkpoint", set()) | runtimes["overlap"]) <= 60 * 3


@pytest.mark.slow
def test_a_gpu_type_and_a_node_feature_reach_the_gpu_jobs_once(tmp_path, monkeypatch):
    """$ICT_GPU_MODEL and $ICT_GPU_CONSTRAINT: a GPU job on one node asks for --gpus=<model>:<n>
    (the plugin's gpu_model), one on several nodes for --gres=gpu:<model>:<per node> and no
    --gpus, each with -C <feature>; jobs without GPUs ask for neither. The sbatch arguments are
    the installed SLURM plugin's own (set_gres_string)."""
    from snakemake_executor_plugin_slurm.utils import set_gres_string

    monkeypatch.setenv("ICT_GPU_MODEL", "h100")
    monkeypatch.setenv("ICT_GPU_CONSTRAINT", "ib")
    proc = paper_dry_run(ROOT / "config" / "beyond-80-20.yaml", tmp_path, monkeypatch)
    jobs = {}
    for block in proc.stdout.split("\nrule ")[1:]:
        name, res = block.split(":", 1)[0], re.search(r"resources: (.*)", block)
        size = re.search(r"size=(qwen3-\d+b)", block)
        jobs[(name, size[1] if size else None)] = dict(
            kv.split("=", 1) for kv in res[1].split(", ") if "=" in kv)

    class Job:  # what set_gres_string reads of a job: its resources, by key and attribute
        def __init__(self, res):
            self.resources = type("R", (dict,), {"__getattr__": dict.get})(res)

    one, two = jobs[("train", "qwen3-8b")], jobs[("train", "qwen3-32b")]
    assert (one["gpu"], one["gpu_model"], one["constraint"]) == ("8", "h100", "ib")
    assert set_gres_string(Job(one)).split() == ["--gpus=h100:8"]
    assert "gpu" not in two and "gpu_model" not in two and two["constraint"] == "ib"
    assert set_gres_string(Job(two)).split() == ["--gres=gpu:h100:8"]
    assert set_gres_string(Job(jobs[("evaluate", "qwen3-14b")])).split() == ["--gpus=h100:4"]
    cpu = jobs[("prepare_data", None)]
    assert "gpu_model" not in cpu and "constraint" not in cpu and cpu["gpu"] == "0"


@pytest.mark.slow
def test_dry_run_paper_with_the_ablation_presets(tmp_path, monkeypatch):
    raw = yaml.safe_load((ROOT / "config" / "paper.yaml").read_text())
    raw["experiment"]["methods"] += PAPER_ABLATIONS
    proc = paper_dry_run(write_yaml(tmp_path / "ablations.yaml", raw), tmp_path, monkeypatch)
    counts = job_counts(proc.stdout)
    assert counts["train"] == 3 * (4 + len(PAPER_ABLATIONS)) * 5
    assert counts["evaluate"] == 3 * (1 + 4 + len(PAPER_ABLATIONS)) * 5
    assert trained_methods(proc.stdout) == {"grpo", "entropy20", "stapo", "ict", *PAPER_ABLATIONS}


@pytest.mark.parametrize(
    "edit, expect",
    [
        (lambda c: c["train"].update(learnig_rate=1.0), "train.learnig_rate: unknown key"),
        (lambda c: c["experiment"]["methods"].append("ppo"), "experiment.methods.2: unknown name 'ppo'"),
        (lambda c: c["experiment"].update(benchmarks=["mmlu"]), "experiment.benchmarks.0: unknown name 'mmlu'"),
        (lambda c: c["experiment"].update(sizes=["70b"]), "experiment.sizes.0: unknown name '70b'"),
        (lambda c: c["evaluate"].update(n="eight"), "evaluate.n:"),
    ],
)
def test_bad_config_stops_before_scheduling(tmp_path, test_raw, edit, expect):
    edit(test_raw)
    cfg = write_yaml(tmp_path / "bad.yaml", test_raw)
    proc = snakemake("-n", "--configfile", str(cfg), cwd=tmp_path)
    assert proc.returncode != 0
    assert f"{cfg}: {expect}" in proc.stderr
    assert "Job stats" not in proc.stdout


def test_real_run_of_the_test_config(local_test_run):
    """The quick tier's one end-to-end workflow: config/test.yaml with the local executor."""
    wd, proc = local_test_run
    cfg = ROOT / "config" / "test.yaml"
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = wd / "results" / "test"
    data = pl.scan_parquet(results / "data" / "**" / "*.parquet", hive_partitioning=True).collect()
    assert sorted(data["dataset"].unique().to_list()) == ["arith-easy", "rl", "sft"]
    ref = json.loads((results / "models" / "size=tiny-s" / "base.json").read_text())
    assert ref == {"kind": "scratch", "path": "checkpoint"}
    summary = json.loads((results / "models" / "size=tiny-s" / "summary.json").read_text())
    assert 0.0 <= summary["accuracy_sampled"] <= 1.0 and summary["sft_steps"] == 20
    assert (results / "models" / "size=tiny-s" / "checkpoint" / "model.safetensors").exists()
    # a second run has nothing to do
    again = snakemake("--cores", "2", "--configfile", str(cfg), cwd=wd)
    assert again.returncode == 0
    assert "Nothing to be done" in again.stdout + again.stderr


def dry_run_counts(wd: Path, raw: dict, name: str) -> dict[str, int]:
    """The jobs `snakemake -n` lists in `wd` for the config `raw` ({} when nothing is to be
    done), without `all`."""
    proc = snakemake("-n", "--configfile", str(write_yaml(wd / f"{name}.yaml", raw)), cwd=wd,
                     timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    if "Nothing to be done" in out:
        return {}
    return {rule: n for rule, n in job_counts(proc.stdout).items() if rule not in ("all", "total")}


@pytest.mark.slow
def test_operational_edits_rerun_nothing_and_a_new_method_only_its_own_jobs(local_test_run,
                                                                            tmp_path, test_raw):
    """On a finished run of the test config: edits of how jobs run list no job (labels only the
    tables, which print them); a new method lists its own training, evaluation and overlap and
    the tables, and neither the token statistics nor another method's work; a result key reruns
    the trainings. A copy of the run, so that its resolved_config.yaml stays the session's."""
    import shutil

    wd, proc = local_test_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    copy = tmp_path / "run"
    shutil.copytree(wd, copy, symlinks=True)
    raw = json.loads(json.dumps(test_raw))
    raw["train"].update(checkpoint_every=5, micro_batch_size=3, gradient_checkpointing=True,
                        vllm_gpu_memory_utilization=0.5, max_sampling_rounds=4)
    raw["models"]["tiny-s"].update(gpu_memory_gb=80.0, train_processes=2, label="Tiny")
    raw["methods"]["ict"]["label"] = "ICT (ours)"
    raw["resources"]["train"]["runtime"] = 20
    assert dry_run_counts(copy, raw, "operational") == {"tables": 1}
    raw["methods"]["top20"] = {"selector": "entropy_top", "rho": 0.2}
    raw["experiment"]["methods"].append("top20")
    assert dry_run_counts(copy, raw, "new-method") == {"train": 1, "evaluate": 1, "overlap": 1,
                                                       "tables": 1}
    raw["train"]["lr"] = 3e-4
    assert dry_run_counts(copy, raw, "result")["train"] == 3


# ----- walltime and retries from the cost plan ----------------------------------------------------
def dry_run_runtimes(stdout: str) -> dict[str, set[int]]:
    """{rule: the runtimes its jobs ask for} of a dry run."""
    out: dict[str, set[int]] = {}
    for block in re.split(r"\n(?=rule \w+:)", stdout):
        rule, runtime = re.match(r"rule (\w+):", block), re.search(r"\bruntime=(\d+)", block)
        if rule and runtime:
            out.setdefault(rule[1], set()).add(int(runtime[1]))
    return out


@pytest.mark.slow  # a stage or Snakemake in a subprocess: the full tier
def test_the_limit_is_each_partitions_maxtime_from_scontrol(tmp_path, test_raw, monkeypatch):
    # a stand-in scontrol: GPU jobs go to `gpu` (MaxTime 30 min), the others to `cpu` (20 min)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(
        "#!/bin/sh\necho 'PartitionName=cpu Default=YES MaxTime=00:20:00 State=UP'\n"
        "echo 'PartitionName=gpu Default=NO MaxTime=30 State=UP'\n")
    (bin_dir / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("ICT_GPU_PARTITION", "gpu")
    monkeypatch.setenv("SBATCH_PARTITION", "cpu")
    test_raw["models"]["tiny-s"]["gpus"] = {"evaluate": 1}
    for rule in test_raw["resources"]:
        test_raw["resources"][rule]["runtime"] = 60
    proc = snakemake("-n", "--configfile", str(write_yaml(tmp_path / "c.yaml", test_raw)), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    runtimes = dry_run_runtimes(proc.stdout)
    assert runtimes["evaluate"] == {30} and runtimes["train"] == {20} and runtimes["prepare_data"] == {20}


RESTART_TIMES = """
import sys
from pathlib import Path
from snakemake.api import SnakemakeApi
from snakemake.settings.types import ConfigSettings, ResourceSettings
with SnakemakeApi() as api:
    wf = api.workflow(resource_settings=ResourceSettings(), snakefile=Path(sys.argv[1]),
                      config_settings=ConfigSettings(configfiles=[Path(sys.argv[2])]),
                      workdir=Path(sys.argv[3]))
    print({r.name: r._restart_times for r in wf._workflow.rules})
"""


def rule_retries(config: Path, cwd: Path) -> dict:
    """Each rule's own `retries` as Snakemake parses the workflow (None: the profile's)."""
    proc = subprocess.run([sys.executable, "-c", RESTART_TIMES, str(ROOT / "Snakefile"), str(config),
                           str(cwd)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return eval(proc.stdout.strip().splitlines()[-1])  # a dict of names and ints or None


@pytest.mark.slow  # a stage or Snakemake in a subprocess: the full tier
def test_the_training_rule_retries_as_often_as_the_cost_plan_counts(tmp_path, test_raw):
    from stages.config import validate
    from stages.cost import train_retries

    # a GPU training of ten 28-minute steps in attempts capped at 100 minutes (resources.max_runtime)
    test_raw["models"]["tiny-s"]["gpus"] = {"train": 1}
    test_raw["train"].update(steps=10, checkpoint_every=1)
    test_raw["resources"]["train"]["runtime"] = 600
    test_raw["resources"]["max_runtime"] = 100
    test_raw["cost"] = {"generation_tokens_per_s": 0.3, "step_overhead_s": 0, "startup_minutes": 1}
    config = write_yaml(tmp_path / "long.yaml", test_raw)
    cfg = validate(test_raw, "long.yaml")
    want = train_retries(cfg, 100)
    assert want > 1 and train_retries(cfg, None) is None  # uncapped, 600 minutes are enough
    retries = rule_retries(config, tmp_path)
    assert retries["train"] == want and retries["evaluate"] is None  # the others: the profile's
