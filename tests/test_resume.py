"""Which keys a job's results depend on (stages.keys): operational edits leave a training job's
hash and resume fingerprint as they are, result keys change them; the token statistics follow
only the selectors they report. The end-to-end checks (a resume through every operational edit,
a refused one naming its key, the workflow's dry runs) are in tests/test_train.py and
tests/test_workflow.py."""

from __future__ import annotations

import argparse
import copy

import pytest

from stages.config import validate
from stages.keys import (
    ENGINE_OPERATIONAL,
    MODEL_OPERATIONAL,
    TRAIN_OPERATIONAL,
    config_key_name,
    differences,
    token_stats_config_hash,
    train_config_hash,
    train_result_config,
)

OPERATIONAL_EDITS = {
    "train.vllm_gpu_memory_utilization": lambda r: r["train"].update(vllm_gpu_memory_utilization=0.5),
    "train.checkpoint_every": lambda r: r["train"].update(checkpoint_every=7),
    "train.checkpoint_every_minutes": lambda r: r["train"].update(checkpoint_every_minutes=30.0),
    "train.save_before_limit_minutes": lambda r: r["train"].update(save_before_limit_minutes=5.0),
    "train.stop_after_steps": lambda r: r["train"].update(stop_after_steps=2),
    "train.loggers": lambda r: r["train"].update(loggers=["tensorboard"]),
    "train.max_sampling_rounds": lambda r: r["train"].update(max_sampling_rounds=3),
    "train.micro_batch_size": lambda r: r["train"].update(micro_batch_size=2),
    "train.micro_batch_tokens": lambda r: r["train"].update(micro_batch_tokens=512),
    "train.gradient_checkpointing": lambda r: r["train"].update(gradient_checkpointing=True),
    "train.generation_batch_size": lambda r: r["train"].update(generation_batch_size=5),
    "train.engine_kwargs (operational ones)": lambda r: r["train"].update(
        engine_kwargs={"enforce_eager": True, "kv_cache_memory_bytes": 1 << 28, "max_num_seqs": 8}),
    "models.tiny-s.train.micro_batch_size": lambda r: r["models"]["tiny-s"].update(
        train={"micro_batch_size": 3}),
    "methods.ict.train.checkpoint_every": lambda r: r["methods"]["ict"].update(
        train={"checkpoint_every": 3}),
    "models.tiny-s.gpu_memory_gb": lambda r: r["models"]["tiny-s"].update(gpu_memory_gb=80.0),
    "models.tiny-s.train_processes": lambda r: r["models"]["tiny-s"].update(train_processes=2),
    "models.tiny-s.label": lambda r: r["models"]["tiny-s"].update(label="Tiny"),
    "models.tiny-s.tensor_parallel_size": lambda r: r["models"]["tiny-s"].update(tensor_parallel_size=2),
    "methods.ict.label": lambda r: r["methods"]["ict"].update(label="ICT (ours)"),
    "methods.ict.evaluate": lambda r: r["methods"]["ict"].update(evaluate={"max_new_tokens": 16}),
    "resources.train": lambda r: r["resources"]["train"].update(runtime=600, mem_mb=9000),
    "a method added to the run": lambda r: (r["methods"].update(top20={"selector": "entropy_top",
                                                                       "rho": 0.2}),
                                           r["experiment"]["methods"].append("top20")),
}

RESULT_EDITS = {
    "train.lr": lambda r: r["train"].update(lr=3e-4),
    "train.steps": lambda r: r["train"].update(steps=3),
    "train.generation_batch_multiple": lambda r: r["train"].update(generation_batch_multiple=2),
    "train.save_every": lambda r: r["train"].update(save_every=1),
    "train.engine_kwargs.kv_cache_dtype": lambda r: r["train"].update(engine_kwargs={"kv_cache_dtype": "fp8"}),
    "models.tiny-s.train.lr": lambda r: r["models"]["tiny-s"].update(train={"lr": 5e-4}),
    "models.tiny-s.lr": lambda r: r["models"]["tiny-s"].update(lr=5e-4),
    "models.tiny-s.stop_tokens": lambda r: r["models"]["tiny-s"].update(stop_tokens="generation_config"),
    "methods.ict.rho": lambda r: r["methods"]["ict"].update(rho=0.2),
    "methods.ict.warmup_steps": lambda r: r["methods"]["ict"].update(warmup_steps=0),
    "seed": lambda r: r.update(seed=1),
    "datasets.rl.max_response_tokens": lambda r: r["datasets"]["rl"].update(max_response_tokens=9),
}


def job_args(method: str = "ict"):
    return argparse.Namespace(size="tiny-s", method=method, seed=0)


def before_and_after(raw: dict, edit):
    """The config `raw` validated, and validated again after `edit`."""
    changed = copy.deepcopy(raw)
    edit(changed)
    return validate(raw, "t.yaml"), validate(changed, "t.yaml")


@pytest.mark.parametrize("name", OPERATIONAL_EDITS)
def test_an_operational_edit_keeps_the_training_hash(test_raw, name):
    base, edited = before_and_after(test_raw, OPERATIONAL_EDITS[name])
    for method in ("grpo", "ict"):
        assert train_config_hash(edited, "tiny-s", method) == train_config_hash(base, "tiny-s", method), name
        assert train_result_config(edited, "tiny-s", method) == train_result_config(base, "tiny-s", method)


@pytest.mark.parametrize("name", RESULT_EDITS)
def test_a_result_edit_changes_the_training_hash_and_names_the_key(test_raw, name):
    base, edited = before_and_after(test_raw, RESULT_EDITS[name])
    assert train_config_hash(edited, "tiny-s", "ict") != train_config_hash(base, "tiny-s", "ict"), name
    found = differences(train_result_config(base, "tiny-s", "ict"),
                        train_result_config(edited, "tiny-s", "ict"))
    named = [config_key_name(d.partition(":")[0], "tiny-s", "ict") for d in found]
    # the effective training section's key (train, then models.<size>.train applied) is named
    want = name.replace("models.tiny-s.train.", "train.").split(" ")[0]
    assert want in named or any(n.startswith(want + ".") for n in named), (name, found)


def test_every_operational_train_key_is_a_field_and_is_tested():
    from stages.config import ModelSize, Train

    assert set(TRAIN_OPERATIONAL) <= set(Train.model_fields)
    assert set(MODEL_OPERATIONAL) <= set(ModelSize.model_fields)
    from stages.core.models.vllm_args import ENGINE_ARGS

    assert set(ENGINE_OPERATIONAL) <= ENGINE_ARGS
    tested = {k.split(".")[1].split(" ")[0] for k in OPERATIONAL_EDITS if k.startswith("train.")}
    assert set(TRAIN_OPERATIONAL) <= tested


def test_sampling_rounds_and_world_size_decide_a_short_step_under_pool_rank(test_raw):
    """dynamic_sampling_pool 'rank': every rank fills its own slots and after max_sampling_rounds
    trains as many groups as the rank with fewest; both then are result keys."""
    test_raw["train"].update(dynamic_sampling=True, dynamic_sampling_pool="rank")
    for edit in (lambda r: r["train"].update(max_sampling_rounds=3),
                 lambda r: r["models"]["tiny-s"].update(train_processes=2)):
        base, edited = before_and_after(test_raw, edit)
        assert train_config_hash(edited, "tiny-s", "grpo") != train_config_hash(base, "tiny-s", "grpo")
    test_raw["train"]["dynamic_sampling_pool"] = "ranks"  # verl's pool: the rounds only stop a run
    base = validate(test_raw, "t.yaml")
    test_raw["train"]["max_sampling_rounds"] = 3
    assert train_config_hash(validate(test_raw, "t.yaml"), "tiny-s", "grpo") == \
        train_config_hash(base, "tiny-s", "grpo")


def test_token_statistics_follow_only_the_reported_selectors(test_raw):
    base = token_stats_config_hash(validate(test_raw, "t.yaml"), "tiny-s")

    def with_method(name, spec):
        raw = copy.deepcopy(test_raw)
        raw["methods"][name] = spec
        raw["experiment"]["methods"].append(name)
        return token_stats_config_hash(validate(raw, "t.yaml"), "tiny-s")

    # another method, a selector the stage does not report, or a reported one at its defaults
    assert with_method("grpo2", {"selector": "all", "label": "GRPO again"}) == base
    assert with_method("stapo", {"selector": "stapo"}) == base
    # a reported selector with other parameters than the ones the stage used
    assert with_method("top10", {"selector": "entropy_top", "rho": 0.1}) != base
    raw = copy.deepcopy(test_raw)
    raw["methods"]["ict"]["label"] = "ICT"  # labels are the tables' business
    raw["models"]["tiny-s"]["gpus"] = {"token_stats": 0, "train": 0}
    assert token_stats_config_hash(validate(raw, "t.yaml"), "tiny-s") == base
    raw["methods"]["ict"]["rho"] = 0.3
    assert token_stats_config_hash(validate(raw, "t.yaml"), "tiny-s") != base


def test_differences_name_each_dotted_key():
    saved = {"train": {"lr": 1e-3, "loss": {"eps_low": 0.2}}, "seed": 0}
    now = {"train": {"lr": 3e-3, "loss": {"eps_low": 0.1}, "extra": 1}, "seed": 0}
    assert differences(saved, now) == [
        "train.extra: absent in the resume state, 1 now",
        "train.loss.eps_low: 0.2 in the resume state, 0.1 now",
        "train.lr: 0.001 in the resume state, 0.003 now",
    ]
    assert differences(saved, saved) == []


def test_save_triggers_follow_the_wall_clock_and_the_signal(test_raw, monkeypatch):
    """SaveTriggers on one process: the minutes since the last save (a fake clock) and SIGURG
    sent to this process, each until the next save."""
    import os
    import signal
    import types

    from stages.core.training import resume

    clock = [1000.0]
    monkeypatch.setattr(resume.time, "monotonic", lambda: clock[0])
    previous = signal.getsignal(resume.SAVE_SIGNAL)
    job = types.SimpleNamespace(rank=0, world=1)
    raw = copy.deepcopy(test_raw)
    raw["train"]["checkpoint_every_minutes"] = 2.0
    try:
        triggers = resume.SaveTriggers(validate(raw, "t.yaml").train)
        clock[0] += 119.0
        assert triggers.poll(job) == (False, False)
        clock[0] += 1.0
        assert triggers.poll(job) == (True, False)
        triggers.saved()
        assert triggers.poll(job) == (False, False)
        os.kill(os.getpid(), resume.SAVE_SIGNAL)
        assert triggers.poll(job) == (False, True)
        # before an update: at once where the lead left (here 10 min less 119 s) is short of
        # what the update, sync and save need
        lead = copy.deepcopy(test_raw)
        lead["train"]["save_before_limit_minutes"] = 10.0
        lead["resources"]["train"]["runtime"] = 120
        early = resume.SaveTriggers(validate(lead, "t.yaml").train)
        assert not early.save_now(job, float("inf"))  # no signal: never
        os.kill(os.getpid(), resume.SAVE_SIGNAL)
        clock[0] += 119.0
        assert not early.save_now(job, 480.0) and early.save_now(job, 482.0)
        assert early.save_now(job, float("inf"))  # nothing measured yet: at once
        # no minutes: steps and the signal only
        off = resume.SaveTriggers(validate(test_raw, "t.yaml").train)
        clock[0] += 1e6
        assert off.poll(job) == (False, False)
    finally:
        signal.signal(resume.SAVE_SIGNAL, previous)
