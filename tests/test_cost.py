"""The cost plan: every formula against hand-computed numbers, the configs' estimates, the
partition's limit, the training rule's retries, and bad input. Pure Python (no torch work)."""

from __future__ import annotations

import copy
import json
import math
import subprocess

import hypothesis.strategies as st
import pytest
import yaml
from hypothesis import given

from stages import cost, cost_report
from stages import plan as plan_cli
from stages.config import ConfigError, validate
from stages.core.plans import cost as cc
from stages.core.plans.memory import HUB_ARCHS
from tests.conftest import ROOT, write_yaml

Q05 = HUB_ARCHS["Qwen/Qwen2.5-0.5B"]  # 494,032,768 parameters, tied, 24 layers, q_width 896
Q8 = HUB_ARCHS["Qwen/Qwen3-8B-Base"]  # 8,190,735,360 parameters, untied (151,936 x 4,096 head)


def raw(name: str) -> dict:
    return copy.deepcopy(yaml.safe_load((ROOT / "config" / f"{name}.yaml").read_text()))


def cfg_of(name: str, edit=None):
    r = raw(name)
    if edit:
        edit(r)
    return validate(r, f"{name}.yaml")


# ---------------------------------------------------------------------------------------------
# Formulas
# ---------------------------------------------------------------------------------------------
def test_matmul_parameters_leave_out_the_input_embedding():
    assert cc.matmul_params(Q05) == 494_032_768  # tied: the embedding's matrix is the head
    assert cc.matmul_params(Q8) == 8_190_735_360 - 151_936 * 4_096 == 7_568_405_504


def test_forward_flops_by_hand():
    # 2 x 494,032,768 + 4 x 24 layers x 896 x 100 positions
    assert cc.forward_flops(Q05, 100) == 988_065_536 + 8_601_600
    assert cc.forward_flops(Q8, 0) == 2 * 7_568_405_504
    assert cc.mean_context(200, 4000) == 2100


def test_forward_passes_of_a_step():
    # ICT's setup: 2 epochs of 8 mini-batches, rescored but the first, KL on, checkpointing
    assert cc.step_forwards(2, 8, rescore=True, reference=True, checkpointing=True) == {
        "sampling": 1.0, "rescoring": 15 / 8, "reference": 2.0, "training": 8.0}
    # the 80/20 study's: 1 epoch of 16 verl mini-batches, no KL
    assert cc.step_forwards(1, 16, rescore=True, reference=False, checkpointing=True) == {
        "sampling": 1.0, "rescoring": 0.9375, "training": 4.0}
    assert cc.step_forwards(1, 1, rescore=True, reference=False, checkpointing=False) == {
        "sampling": 1.0, "rescoring": 0.0, "training": 3.0}
    assert "rescoring" not in cc.step_forwards(1, 16, rescore=False, reference=False, checkpointing=True)


def test_seconds_of_compute_and_generation():
    assert cc.compute_seconds(1e15, 4, 1000, 0.25) == pytest.approx(1.0)  # 1e15 / (4 x 1e15 x 0.25)
    assert cc.generation_seconds(24_000, 8, 3000) == 1.0


@pytest.mark.parametrize("work, attempt, startup, lost, want", [
    (50, 60, 10, 20, 1),     # fits the first attempt's 50 minutes of compute
    (100, 60, 10, 20, 3),    # 30 kept by each killed attempt: 30 + 30, then 40 <= 50
    (110, 60, 10, 20, 3),    # 30 + 30, then the last attempt's whole 50
    (111, 60, 10, 20, 4),    # 30 + 30 + 30, then 21
    (100, 60, 10, 50, None),  # a kill loses all 50 computed minutes: never past a state
])
def test_attempts_by_hand(work, attempt, startup, lost, want):
    assert cc.attempts(work, attempt, startup, lost) == want


def test_wall_time_counts_start_ups_and_lost_work():
    # two killed attempts of 60 minutes, then 10 of start-up and the last 40 of work
    assert cc.wall_minutes(100, 3, 10, 20) == 60 + 60 + 10 + 40 == 170


def test_checkpoint_bytes_by_hand():
    p = Q8.params
    assert cc.hf_checkpoint_bytes(Q8, 2) == 2 * p
    assert cc.resume_state_bytes(Q8, 2, 2) == 14 * p  # bf16 weights, fp32 master, Adam's 2 moments
    assert cc.resume_state_bytes(Q8, 2, 3) == 14 * p
    assert cc.resume_state_bytes(Q8, 4, 0) == 12 * p  # float32 ZeRO-0: no second copy
    assert cc.resume_state_bytes(Q8, 4, 1) == 16 * p


@pytest.mark.parametrize("rule, attempt, limit, want", [
    ("train", 1, None, 10080), ("train", 3, None, 10080), ("train", 2, 2880, 2880),
    ("evaluate", 1, None, 720), ("evaluate", 2, None, 1440), ("evaluate", 2, 1000, 1000),
])
def test_each_attempts_walltime(rule, attempt, limit, want):
    request = 10080 if rule == "train" else 720
    assert cost.attempt_runtime(rule, request, attempt, limit) == want


@pytest.mark.parametrize("text, minutes", [
    ("UNLIMITED", None), ("INFINITE", None), ("30", 30), ("30:59", 30), ("1:00:00", 60),
    ("2-00:00:00", 2880), ("1-12", 2160), ("1-12:30", 2190), ("0-00:10:30", 10),
])
def test_slurm_times(text, minutes):
    assert cc.slurm_minutes(text) == minutes


def test_a_bad_slurm_time_is_refused():
    with pytest.raises(ValueError, match="not a SLURM time"):
        cc.slurm_minutes("two days")


SCONTROL = ("PartitionName=cpu AllowGroups=ALL Default=YES MaxTime=1-00:00:00 State=UP\n"
            "PartitionName=gpu AllowGroups=ALL Default=NO MaxTime=2-00:00:00 State=UP\n"
            "PartitionName=long AllowGroups=ALL MaxTime=UNLIMITED State=UP\n")


def test_partition_limits_from_scontrol(monkeypatch):
    calls = []

    def run(cmd, **kw):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, SCONTROL, "")

    monkeypatch.setattr(cc.shutil, "which", lambda name: "/usr/bin/scontrol")
    assert cc.partition_max_minutes("gpu", run) == 2880
    assert cc.partition_max_minutes(None, run) == 1440  # the default partition
    assert cc.partition_max_minutes("long", run) is None
    assert cc.partition_max_minutes("missing", run) is None
    assert calls[0] == ["scontrol", "show", "partition", "--oneliner", "gpu"]
    failed = lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1, "", "no such partition")  # noqa: E731
    assert cc.partition_max_minutes("gpu", failed) is None
    monkeypatch.setattr(cc.shutil, "which", lambda name: None)
    assert cc.partition_max_minutes("gpu", run) is None  # no SLURM here: no limit


# `sacctmgr --noheader --parsable2 show qos NAME format=Name,MaxWall` as SLURM 24.11 prints it
SACCTMGR = {"normal": "normal|2-00:00:00\n", "long": "long|\n", "short": "short|04:00:00\n",
            "mins": "mins|90\n"}


def test_qos_limits_from_sacctmgr_and_the_lower_of_the_two(monkeypatch):
    def run(cmd, **kw):
        if cmd[0] == "scontrol":
            return subprocess.CompletedProcess(cmd, 0, SCONTROL, "")
        assert cmd[:5] == ["sacctmgr", "--noheader", "--parsable2", "show", "qos"]
        return subprocess.CompletedProcess(cmd, 0, SACCTMGR.get(cmd[5], ""), "")

    monkeypatch.setattr(cc.shutil, "which", lambda name: f"/usr/bin/{name}")
    assert cc.qos_max_minutes("normal", run) == 2880
    assert cc.qos_max_minutes("short", run) == 240 and cc.qos_max_minutes("mins", run) == 90
    assert cc.qos_max_minutes("long", run) is None  # no MaxWall set
    assert cc.qos_max_minutes("absent", run) is None and cc.qos_max_minutes(None, run) is None
    nodb = lambda cmd, **kw: subprocess.CompletedProcess(  # noqa: E731
        cmd, 1, "", "sacctmgr: error: Problem talking to the database")
    assert cc.qos_max_minutes("normal", nodb) is None  # no slurmdbd: no QOS limit known
    # the lower limit wins, and says where it comes from
    assert cc.site_max_minutes("gpu", "short", run) == (240, "MaxWall of QOS short (sacctmgr)")
    assert cc.site_max_minutes("cpu", "normal", run) == (1440, "MaxTime of partition cpu (scontrol)")
    assert cc.site_max_minutes("long", "long", run) == (None, "")
    monkeypatch.setenv("SBATCH_QOS", "short")
    monkeypatch.setenv("ICT_GPU_PARTITION", "gpu")
    monkeypatch.setattr(cc.subprocess, "run", run)
    assert cost.runtime_limit(cfg_of("paper")) == (240, "MaxWall of QOS short (sacctmgr)")


@pytest.mark.parametrize("x, text", [(0, "0"), (1234, "1,200"), (15_900, "16,000"), (2.47, "2.5"),
                                     (9.96, "10"), (0.031, "0.031"), (203_000, "200,000")])
def test_two_significant_digits(x, text):
    assert cc.approx(x) == text


@pytest.mark.parametrize("minutes, text", [(0.5, "30 s"), (30, "30 min"), (90, "1.5 h"),
                                           (10080, "7.0 days")])
def test_durations(minutes, text):
    assert cc.hours(minutes) == text


def test_sizes():
    assert cc.size_of(4.2e12) == "4.2 TB" and cc.size_of(16.4e9) == "16 GB" and cc.size_of(9e6) == "9.0 MB"


# ---------------------------------------------------------------------------------------------
# Jobs of the shipped configs, by hand
# ---------------------------------------------------------------------------------------------
def test_an_ict_training_of_05b_by_hand():
    cfg = cfg_of("paper")
    job = cost.train_cost(cfg, "qwen2.5-0.5b", "grpo", None)
    # 128 prompts x 8 responses on 4 GPUs at 10,000 tokens/s each; exponential lengths of mean
    # 400 cut at the longest limit, 2,048: 400 (1 - e^(-2048/400)) tokens on average
    resp = 400 * (1 - math.exp(-2048 / 400))
    gen_s = 128 * 8 * resp / (4 * 10_000)
    # 1,024 sequences of 150 + resp tokens; per token 2 x 494,032,768 + 4 x 24 x 896 x (150 + resp) / 2
    flops = 1024 * (150 + resp) * (2 * 494_032_768 + 4 * 24 * 896 * (150 + resp) / 2)
    pass_s = flops / (4 * 989e12 * 0.1)
    # sampling pass 1, reference 2 (KL, 2 epochs), training 2 x 4 (checkpointing); 30 s beside
    step_s = gen_s + 11 * pass_s + 30
    assert job.work_min == pytest.approx(116 * step_s / 60)
    # its walltime from the plan: the work and the start-up x 1.5 (cost.walltime_margin), rounded
    # up to 30 minutes
    planned = math.ceil((116 * step_s / 60 + 10) * 1.5 / 30) * 30
    assert planned == 180
    assert (job.attempts, job.request_min, job.attempt_min, job.gpus, job.jobs) == (1, 180, 180, 4, 5)
    assert job.wall_min == pytest.approx(job.work_min + 10)
    assert job.kept_bytes == 2 * Q05.params  # the final model, bf16; no curve checkpoints
    assert job.transient_bytes == 2 * 14 * Q05.params


def test_walltimes_from_the_plan_a_hand_set_one_and_none():
    cfg = cfg_of("paper")
    est = cost.train_cost(cfg, "qwen2.5-7b", "grpo", None)
    need = est.work_min + cfg.cost.startup_minutes
    assert est.request_min == math.ceil(need * 1.5 / 30) * 30 and est.request_min >= need
    # a size's own runtime is set by hand and wins; the plan then warns where it is too short
    raw = cfg.model_dump(mode="json")
    raw["resources"]["train"]["sizes"]["qwen2.5-7b"]["runtime"] = 60
    hand = validate(raw, "hand.yaml")
    assert cost.train_cost(hand, "qwen2.5-7b", "grpo", None).request_min == 60
    plan = cost.cost_plan(hand)
    assert any("qwen2.5-7b" in w and "attempts" in w for w in plan.warnings), plan.warnings
    # no margin: every job asks for its configured runtime
    raw["cost"]["walltime_margin"] = None
    none = validate(raw, "none.yaml")
    assert cost.train_cost(none, "qwen2.5-0.5b", "grpo", None).request_min == \
        none.resources.train.runtime
    assert cost.planned_requests(none, None) == {}
    # the rules' walltimes: every GPU job of the plan, checkpoint evaluations and overlaps apart
    planned = cost.planned_requests(cfg, None)
    assert planned[("train", "qwen2.5-7b", "grpo")] == est.request_min
    assert planned[("rollout", "qwen2.5-7b", None)] >= 30
    assert ("overlap", "qwen2.5-7b", "ict") in planned and ("evaluate", "qwen2.5-7b", "base") in planned


def test_rescoring_and_warm_up():
    cfg = cfg_of("paper")
    grpo, ent = (cost.train_cost(cfg, "qwen2.5-0.5b", m, None) for m in ("grpo", "entropy20"))
    seq = 150 + 400 * (1 - math.exp(-2048 / 400))  # the length model's mean response, cut at 2,048
    pass_s = 1024 * seq * (2 * 494_032_768 + 4 * 24 * 896 * seq / 2) / (4 * 989e12 * 0.1)
    # every mini-batch after the first of the first epoch, in every one of the 116 steps
    assert ent.work_min - grpo.work_min == pytest.approx(116 * 15 / 8 * pass_s / 60)
    # ICT scores once per step (rescore: false): as GRPO; with rescoring, not in its warm-up
    assert cost.train_cost(cfg, "qwen2.5-0.5b", "ict", None).work_min == grpo.work_min
    rescored = cfg_of("paper", lambda r: r["methods"]["ict"].update(rescore=True))
    ict = cost.train_cost(rescored, "qwen2.5-0.5b", "ict", None)
    assert ict.work_min - grpo.work_min == pytest.approx((116 - 20) * 15 / 8 * pass_s / 60)


def test_an_8020_training_of_8b_by_hand():
    cfg = cfg_of("beyond-80-20")
    job = cost.train_cost(cfg, "qwen3-8b", "entropy20", None)
    # dynamic sampling: 1.2 generation batches of 3 x 512 prompts x 16 responses of 4,000 tokens
    # on average before the limit, cut at 20,480: 4,000 (1 - e^(-20480/4000)) = 3,976 tokens
    resp = 4000 * (1 - math.exp(-20480 / 4000))
    gen_s = 512 * 3 * 1.2 * 16 * resp / (8 * 3000)
    flops = 512 * 16 * (200 + resp) * (2 * 7_568_405_504 + 4 * 36 * 4096 * (200 + resp) / 2)
    pass_s = flops / (8 * 989e12 * 0.25)
    step_s = gen_s + (1 + 15 / 16 + 4) * pass_s + 60
    assert job.work_min == pytest.approx(1000 * step_s / 60)
    # 168 h attempts, 15 min start-up, a limit losing at most the SIGURG lead (150 min, above a
    # step: the trainer saves at the step's end): the attempts by hand
    assert step_s / 60 < 150
    lost = 150
    first, useful = 10080 - 15, 10080 - 15 - lost
    assert job.attempts == 1 + -(-(job.work_min - first) // useful)
    assert job.attempts > 1
    # 2 x 7,568,405,504 FLOPs per generated token at 3,000 tokens/s of a 989 TFLOP/s GPU: 4.6%
    assert "generation at 2 P_mm FLOPs per token uses 4.6% of the GPUs' peak" in job.detail[1]
    assert job.kept_bytes == 20 * 2 * Q8.params  # 19 curve checkpoints (save_every 50) + final
    assert job.transient_bytes == 2 * 14 * Q8.params


def test_a_lead_shorter_than_a_step_loses_the_checkpoint_interval_and_is_warned():
    r = raw("beyond-80-20")
    r["models"]["qwen3-8b"]["train"]["save_before_limit_minutes"] = 10
    short = validate(r, "short.yaml")
    job = cost.train_cost(short, "qwen3-8b", "dapo", None)
    step = job.work_min / job.steps
    assert "a time limit loses up to" in job.detail[2] and "shorter than a step" in job.detail[2]
    covered = cost.train_cost(cfg_of("beyond-80-20"), "qwen3-8b", "dapo", None)
    assert job.attempts > covered.attempts  # each limit costs up to 10 steps, not 150 minutes
    assert cost.cc.hours(10 * step) in job.detail[2]
    plan = cost.cost_plan(short)
    assert any("qwen3-8b (dapo): train.save_before_limit_minutes (10 min) is shorter than a step"
               in w for w in plan.warnings)
    assert not any("qwen3-14b" in w and "shorter than a step" in w for w in plan.warnings)


def test_the_partition_limit_adds_attempts():
    cfg = cfg_of("beyond-80-20")
    week = cost.train_cost(cfg, "qwen3-8b", "dapo", None)
    two_days = cost.train_cost(cfg, "qwen3-8b", "dapo", 2880)
    assert two_days.attempt_min == 2880 and two_days.attempts > week.attempts
    assert two_days.wall_min > week.wall_min  # more start-ups, more lost intervals


def test_evaluations_by_hand():
    cfg = cfg_of("beyond-80-20")
    job = cost.generation_cost(cfg, "evaluate", "qwen3-8b", "dapo", None, 1)
    # AIME'24 30 + AIME'25 30 + AMC'23 40 + MATH-500 500 + Minerva 272 + OlympiadBench 674
    problems = 30 + 30 + 40 + 500 + 272 + 674
    resp = 4000 * (1 - math.exp(-20480 / 4000))  # cut at the evaluation's 20,480 tokens
    assert job.work_min == pytest.approx(problems * 16 * resp / (2 * 3000) / 60)
    ckpt = cost.generation_cost(cfg, "evaluate_checkpoint", "qwen3-8b", "dapo", None, 19)
    assert ckpt.work_min == pytest.approx(60 * 16 * resp / (2 * 3000) / 60)  # the two AIMEs
    # its walltime from the plan: 10.7 min of samples and 15 min of start-up x 1.5, rounded up
    # to 30 minutes: 1 h (an evaluation's configured 12 h would be its ceiling)
    assert (ckpt.gpus, ckpt.request_min, ckpt.jobs) == (2, 60, 19)
    assert ckpt.request_min == math.ceil((ckpt.work_min + 15) * 1.5 / 30) * 30
    # the 29k run's evaluations cut the same lengths at 29,696 tokens: the tail above 20,480
    long = cost.generation_cost(cfg, "evaluate", "qwen3-32b", "entropy20-29k", None, 1)
    longer = 4000 * (1 - math.exp(-29696 / 4000))
    assert long.work_min == pytest.approx(problems * 16 * longer / (4 * 1200) / 60)
    assert longer > resp


def test_the_requests_follow_the_plan():
    """docs review §2a counted one attempt of every job at its request: 10,362 GPU-hours for ICT's
    903 estimated, when the trainings asked for 24-48 h by hand; the requests are now the plan's."""
    paper, beyond = cost_report.docs_plans(ROOT)
    assert paper.jobs == 3 + 3 + 60 + 75 + 60
    for plan in (paper, beyond):
        for r in plan.rows:  # each job's estimate x 1.5, rounded up, at most its rule's runtime
            cfg = cfg_of("paper" if plan is paper else "beyond-80-20")
            need = (r.work_min if r.rule == "train" else r.wall_min - cfg.cost.startup_minutes) \
                + cfg.cost.of(r.size).startup_minutes
            assert r.request_min == cost.planned_request(cfg, r.rule, r.size, need)
            if r.rule != "train":
                assert r.wall_min <= r.request_min <= math.ceil(r.wall_min * 1.5 / 30) * 30
    assert paper.requested_gpu_hours < 1.7 * paper.gpu_hours  # was 11.5 x
    # every attempt of every job at its walltime: the 80/20 trainings' 11 to 20 week-long attempts
    trains = [r for r in beyond.rows if r.rule == "train"]
    assert all(r.attempts > 10 and r.attempt_min == 10080 for r in trains)
    assert sum(r.requested_gpu_hours for r in trains) == sum(
        r.jobs * r.gpus * r.attempts * 10080 / 60 for r in trains)
    assert beyond.requested_gpu_hours > beyond.gpu_hours
    ckpt = sum(r.requested_gpu_hours for r in beyond.rows if r.rule == "evaluate_checkpoint")
    # 114 checkpoint evaluations of about 25 min, an hour each (38 x (2 + 4 + 4) GPU-hours); they
    # asked for 12 h each by hand: 4,560
    assert ckpt == 38 * (2 + 4 + 4) * 1 == 380


def test_chain_of_jobs_by_hand():
    def row(rule, wall):
        return cost.JobCost(rule, "s", [], 1, 1, wall, wall, 1, 60, 60, 0.0)

    plan = cost.CostPlan("x", [row("rollout", 10), row("token_stats", 5), row("train", 100),
                               row("evaluate", 20), row("evaluate_checkpoint", 30),
                               row("overlap", 7)], None, "", [], [])
    assert plan.chain_min() == 100 + 30
    plan.rows[0] = row("rollout", 200)  # the statistics' chain is the longer one
    assert plan.chain_min() == 205 + 30


# ---------------------------------------------------------------------------------------------
# Problems, retries, bad config
# ---------------------------------------------------------------------------------------------
def test_problem_counts():
    paper = cfg_of("paper")
    assert [cost.problems_of(paper, b) for b in paper.experiment.benchmarks] == [
        500, 1319, 3153, 198, 30, 30, 30]
    default = cfg_of("config")
    assert cost.problems_of(default, "arith-easy") == default.datasets["arith-easy"].source.n
    limited = cfg_of("paper", lambda r: r["datasets"]["gsm8k"]["source"].update(limit=100))
    assert cost.problems_of(limited, "gsm8k") == 100
    local = cfg_of("paper", lambda r: r["datasets"]["gpqa"].update(
        source={"kind": "local", "path": "x.jsonl", "adapter": "gpqa"}))
    with pytest.raises(ConfigError, match=r"cost\.problems\.gpqa: .*set it"):
        cost.problems_of(local, "gpqa")
    given = cfg_of("paper", lambda r: (r["datasets"]["gpqa"].update(
        source={"kind": "local", "path": "x.jsonl", "adapter": "gpqa"}),
        r["cost"].update(problems={"gpqa": 448})))
    assert cost.problems_of(given, "gpqa") == 448


def test_the_training_rules_retries():
    assert cost.train_retries(cfg_of("paper"), None) is None  # every training fits its request
    beyond = cfg_of("beyond-80-20")
    most = max(r.attempts for r in cost_report.docs_plans(ROOT)[1].rows if r.rule == "train")
    assert cost.train_retries(beyond, None) == most - 1
    assert cost.train_retries(beyond, 2880) > most - 1
    assert cost.train_retries(cfg_of("config"), None) is None  # CPU trainings


@pytest.mark.parametrize("edit, expect", [
    (lambda r: r["cost"]["sizes"].update({"qwen9": {"train_mfu": 0.5}}),
     "cost.sizes.qwen9: unknown model size"),
    (lambda r: r["cost"].update(problems={"nope": 3}), "cost.problems.nope: unknown dataset"),
    (lambda r: r["cost"].update(problems={"aime24": 0}), "cost.problems.aime24: Input should be greater than 0"),
    (lambda r: r["cost"].update(generation_batches=11),
     "cost.generation_batches: 11 generation batches per step on average, but a step stops after 10"),
    (lambda r: r["cost"]["sizes"]["qwen3-14b"].update(generation_batches=12),
     "cost.sizes.qwen3-14b.generation_batches: 12"),
    (lambda r: r["cost"].update(train_mfu=1.5), "cost.train_mfu: Input should be less than or equal to 1"),
    (lambda r: r["cost"].update(response_tokens=0), "cost.response_tokens: Input should be greater than 0"),
    (lambda r: r["resources"].update(max_runtime=0), "resources.max_runtime: Input should be greater than 0"),
])
def test_bad_cost_keys_name_the_file_and_key(edit, expect):
    r = raw("beyond-80-20")
    edit(r)
    with pytest.raises(ConfigError) as info:
        validate(r, "beyond.yaml")
    assert f"beyond.yaml: {expect}" in str(info.value)


# ---------------------------------------------------------------------------------------------
# The CLI
# ---------------------------------------------------------------------------------------------
def test_cli_prints_the_totals_and_warns(capsys):
    assert plan_cli.main(["--configfile", str(ROOT / "config" / "beyond-80-20.yaml"), "--cost",
                          "--max-runtime", "2880"]) == 0
    out, err = capsys.readouterr()
    assert "total: 141 GPU jobs" in out and "partition limit per attempt: 48 h (--max-runtime)" in out
    assert "train qwen3-8b (dapo): estimated" in err and "attempts" in err
    # every 80/20 request is over two days: each is capped, and said so
    assert "rollout qwen3-8b: asks for" not in err
    assert "train qwen3-8b (dapo): asks for 7.0 days (resources.train.runtime)" in err


def test_cli_json(capsys):
    assert plan_cli.main(["--configfile", str(ROOT / "config" / "paper.yaml"), "--cost", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["gpu_jobs"] == 201
    assert data["requested_gpu_hours"] == round(cost_report.docs_plans(ROOT)[0].requested_gpu_hours, 1)
    train = [j for j in data["jobs"] if j["rule"] == "train"]
    assert {tuple(j["methods"]) for j in train} == {("grpo", "ict"), ("entropy20", "stapo")}


def test_cli_exits_1_where_a_training_never_finishes(tmp_path, capsys):
    r = raw("beyond-80-20")
    r["train"]["checkpoint_every"] = 500  # 500 steps of ~2 h between states, in 7-day attempts
    for size in r["models"].values():  # and a SIGURG lead shorter than a step: no save at the limit
        size.get("train", {}).pop("save_before_limit_minutes", None)
    path = write_yaml(tmp_path / "never.yaml", r)
    assert plan_cli.main(["--configfile", str(path), "--cost"]) == 1
    assert "would never get past a resume state" in capsys.readouterr().err


def test_cli_on_a_cpu_config(capsys):
    assert plan_cli.main(["--configfile", str(ROOT / "config" / "config.yaml"), "--cost"]) == 0
    assert "no GPU jobs" in capsys.readouterr().out


def test_a_size_override_applies_to_that_size_only():
    cfg = cfg_of("beyond-80-20")
    assert cfg.cost.of("qwen3-14b").generation_tokens_per_s == 2000
    assert cfg.cost.of("qwen3-8b").generation_tokens_per_s == 3000
    assert cfg.cost.of("qwen3-14b").prompt_tokens == cfg.cost.prompt_tokens


def test_the_config_written_back_validates(tmp_path):
    """The resolved config every job reads keeps the cost section (it validates again)."""
    cfg = cfg_of("beyond-80-20")
    path = write_yaml(tmp_path / "resolved.yaml", cfg.model_dump(mode="json"))
    assert validate(yaml.safe_load(path.read_text()), "resolved").cost == cfg.cost


def test_capped_mean_is_the_mean_of_exponential_lengths_cut_at_the_limit():
    """float64 reference: E[min(X, c)] for X exponential of mean m, by numerical integration."""
    from scipy import integrate

    for m, c in [(4000.0, 20480.0), (4000.0, 29696.0), (400.0, 512.0), (25.0, 64.0), (30.0, 8.0)]:
        # below the limit x has its density; the rest of the mass sits at the limit
        want = integrate.quad(lambda x, m=m: x * math.exp(-x / m) / m, 0, c)[0] \
            + c * math.exp(-c / m)
        assert cc.capped_mean(m, c) == pytest.approx(want, rel=1e-9)


@given(st.floats(1.0, 1e5), st.floats(1.0, 1e5), st.floats(1.0, 1e5))
def test_capped_mean_bounds_monotonicity_and_inverse(m, c, longer):
    got = cc.capped_mean(m, c)
    assert 0 < got <= min(m, c) * (1 + 1e-12)
    assert cc.capped_mean(m, c + longer) >= got  # a longer limit lets more of the tail through
    back = cc.uncapped_mean(got, c)
    if got < 0.9 * c:
        assert back == pytest.approx(m, rel=1e-6)
    else:
        assert back is None
