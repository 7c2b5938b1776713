"""Pilots and the cost plan's calibration (stages.calibrate): the pilots lay on their
configurations and pass through every layout; a calibration from a run predicts that same run
(its counted work exactly, its times to the rounding of the rates); a run too short is refused."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from stages import calibrate
from stages.config import ConfigError, load_configs
from stages.cost import cost_plan
from tests.conftest import ROOT, workflow_env

PILOTS = {"paper.yaml": 15.0, "beyond-80-20.yaml": 150.0}  # GPU-hours each may cost at most


def test_config_files_are_laid_on_each_other_as_snakemake_does(tmp_path):
    over = tmp_path / "over.yaml"
    over.write_text("run: other\nexperiment: {seeds: [7]}\ntrain: {steps: 3}\n")
    cfg = load_configs([ROOT / "config" / "test.yaml", over])
    base = load_configs([ROOT / "config" / "test.yaml"])
    assert (cfg.run, cfg.experiment.seeds, cfg.train.steps) == ("other", [7], 3)
    # mappings merge key by key: the rest of each section is the first file's
    assert cfg.experiment.methods == base.experiment.methods
    assert cfg.train.prompts_per_step == base.train.prompts_per_step
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: {steps: 0}\n")
    with pytest.raises(ConfigError, match=r"config/test.yaml \+ .*bad.yaml: train.steps"):
        load_configs([ROOT / "config" / "test.yaml", bad])


def layouts(cfg, sizes) -> set[tuple]:
    """What a size's GPU jobs run as: GPUs, nodes, engines' tensor parallelism, ZeRO stage and
    sequence parallelism of its trainings."""
    out = set()
    for s in sizes:
        m, t = cfg.models[s], cfg.train_for(cfg.experiment.methods[0], s)
        out.add((m.gpus.train, m.train_nodes, m.tensor_parallel_size, m.train_tensor_parallel_size,
                 t.zero_stage, t.sequence_parallel))
    return out


@pytest.mark.parametrize("name", sorted(PILOTS))
def test_each_gpu_pilot_covers_every_layout_and_forces_a_resume_within_its_budget(name):
    full = load_configs([ROOT / "config" / name])
    pilot = load_configs([ROOT / "config" / name, ROOT / "config" / "pilots" / name])
    assert pilot.run != full.run  # its own results and lock
    assert layouts(pilot, pilot.experiment.sizes) == layouts(full, full.experiment.sizes)
    assert len(pilot.experiment.seeds) == 1 and len(pilot.experiment.methods) == 2
    assert set(pilot.experiment.methods) <= set(full.experiment.methods)
    assert len(pilot.experiment.benchmarks) == 1
    plan = cost_plan(pilot)
    for m in pilot.experiment.methods:
        for s in pilot.experiment.sizes:
            t = pilot.train_for(m, s)
            assert pilot.methods[m].warmup_steps < t.steps  # steps past any warm-up
            assert t.stop_after_steps < t.steps and t.save_every is None
    trainings = [r for r in plan.rows if r.rule == "train"]
    assert trainings and all(r.attempts == 2 for r in trainings)  # a save and a resume each
    assert not [w for w in plan.warnings if "shorter than a step" in w]
    assert plan.gpu_hours <= PILOTS[name], plan.gpu_hours


def run_pilot(wd, *configs):
    return subprocess.run(
        ["timeout", "-k", "10", "900", sys.executable, "-m", "snakemake", "-s", str(ROOT / "Snakefile"),
         "--directory", str(wd), "--cores", "2", "--configfile", *map(str, configs)],
        capture_output=True, text=True, env=workflow_env(), cwd=wd)


def calibrate_in(wd, *args):
    return subprocess.run([sys.executable, "-m", "stages.calibrate", *map(str, args)],
                          capture_output=True, text=True, cwd=wd, timeout=300,
                          env={**workflow_env(), "PYTHONPATH": str(ROOT)})


@pytest.mark.slow
def test_a_calibration_from_a_run_predicts_that_run(tmp_path):
    """config/test.yaml's pilot (4 steps, each training stopped after 2 and resumed by the rule's
    retries) runs end to end; calibrated from itself, the plan counts its trainings' responses,
    generated tokens and attempts exactly and its jobs' times to the rates' rounding."""
    test, pilot = ROOT / "config" / "test.yaml", ROOT / "tests" / "fixtures" / "pilot-test.yaml"
    proc = run_pilot(tmp_path, test, pilot)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stderr.count("Trying to restart job") >= 2  # each training resubmitted once
    nothing = tmp_path / "nothing.yaml"
    nothing.write_text("# the pilot is the full run\n")
    out = calibrate_in(tmp_path, "--configfile", test, pilot, "--pilot", nothing, "--check")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = json.loads(out.stdout.strip().splitlines()[-1])
    assert [r["rule"] for r in rows] == ["rollout", "token_stats", "train", "evaluate", "total"]
    assert [r["jobs"] for r in rows] == [1, 1, 2, 3, 7]
    for r in rows:
        assert r["predicted_s"] == pytest.approx(r["measured_s"], rel=5e-3), r
    written = yaml.safe_load((tmp_path / "results" / "test-pilot" / "calibration.yaml").read_text())
    own = written["cost"]["sizes"]["tiny-s"]
    assert written["cost"]["cpu_jobs"] is True
    assert set(own["rules"]) == {"train", "evaluate", "evaluate_checkpoint", "token_stats",
                                 "overlap", "rollout"}
    metrics = [tmp_path / "results" / "test-pilot" / "train" / "size=tiny-s" / f"method={m}" /
               "seed=0" / "metrics.parquet" for m in ("grpo", "ict")]
    import polars as pl

    frames = [pl.read_parquet(p) for p in metrics]
    tokens = sum(float((f["tokens_per_second"] * f["time_s"]).sum()) for f in frames)
    responses = sum(float((f["tokens_per_second"] * f["time_s"] / f["response_length_mean"]).sum())
                    for f in frames)
    # the mean before the limit whose exponential lengths, cut at the pilot's 32 tokens, give the
    # measured mean (the plan's length model)
    from stages.core.plans.cost import capped_mean

    assert capped_mean(own["response_tokens"], 32) == pytest.approx(tokens / responses, rel=1e-9)


@pytest.mark.slow
def test_a_run_too_short_to_calibrate_from_is_refused(local_test_run):
    """config/test.yaml trains 2 steps: fewer than a calibration takes, and the command says so
    and writes nothing."""
    wd, proc = local_test_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    nothing = wd / "nothing.yaml"
    nothing.write_text("{}\n")
    out = calibrate_in(wd, "--configfile", ROOT / "config" / "test.yaml", "--pilot", nothing)
    assert out.returncode == 2
    assert f"2 steps, fewer than the {calibrate.MIN_STEPS} a calibration needs" in out.stderr
    assert not (wd / "results" / "test" / "calibration.yaml").exists()
