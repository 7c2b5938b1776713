"""The rule for a new config key (stages.keys.UNHASHED_AT_DEFAULT): a key added after results
existed enters a hash only where it differs from its default, wherever it stands, so adding one
keeps every finished job; and every key added from now on is either such a key or operational.

To add a key: list it in UNHASHED_AT_DEFAULT (a result key whose default reproduces the results
made before it), or in the operational keys of its section (TRAIN_OPERATIONAL, MODEL_OPERATIONAL,
METHOD_OPERATIONAL). tests/fixtures/config_keys.txt, the keys that existed before the rule, is
not edited for a new key.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stages.config import Config, Method, ModelSize, Train, validate
from stages.keys import (
    HASHED_ON_ARRIVAL,
    METHOD_OPERATIONAL,
    MODEL_OPERATIONAL,
    PARTIAL_SECTIONS,
    TRAIN_OPERATIONAL,
    UNHASHED_AT_DEFAULT,
    field_model,
    job_hash_of,
    model_at,
)
from tests.test_loss_registry import toy  # noqa: F401 - the fixture registering toy_reinforce

BASELINE = Path(__file__).resolve().parent / "fixtures" / "config_keys.txt"
OPERATIONAL = {Train: TRAIN_OPERATIONAL, ModelSize: MODEL_OPERATIONAL, Method: METHOD_OPERATIONAL}


def config_keys() -> set[tuple[type, str]]:
    """Every (config model, field) reachable from Config."""
    seen, found, todo = set(), set(), [Config]
    while todo:
        model = todo.pop()
        if model in seen:
            continue
        seen.add(model)
        for key, field in model.model_fields.items():
            found.add((model, key))
            inner = PARTIAL_SECTIONS.get((model, key)) or field_model(field.annotation)[0]
            if inner is not None:
                todo.append(inner)
    return found


def test_every_key_is_old_or_follows_the_rule():
    baseline = set(BASELINE.read_text().split())
    new = sorted(f"{m.__name__}.{k}" for m, k in config_keys()
                 if f"{m.__name__}.{k}" not in baseline and (m, k) not in UNHASHED_AT_DEFAULT
                 and (m, k) not in HASHED_ON_ARRIVAL and k not in OPERATIONAL.get(m, ()))
    assert not new, (f"new config keys {new}: list each in stages.keys.UNHASHED_AT_DEFAULT (a result "
                     "key: its default must give the results made before it) or among its "
                     "section's operational keys")
    # every listed key is a key, and the baseline is the schema's keys (none removed unnoticed)
    assert all(k in m.model_fields for m, k in {**UNHASHED_AT_DEFAULT, **HASHED_ON_ARRIVAL})
    names = {f"{m.__name__}.{k}" for m, k in config_keys()}
    assert baseline <= names, sorted(baseline - names)


def test_the_walk_reaches_the_nested_sections():
    names = {f"{m.__name__}.{k}" for m, k in config_keys()}
    assert {"Loss.policy_loss", "Train.lr", "ModelSize.sft", "Sft.steps", "HubModel.revision"} <= names
    assert model_at(["models", "tiny-s", "train"]) == (Train, False)
    assert model_at(["train", "loss"])[0].__name__ == "Loss"
    assert model_at(["models", "tiny-s"]) == (ModelSize, False) and model_at(["models"]) == (ModelSize, True)
    assert model_at(["seed"]) == (None, False)


@pytest.mark.parametrize("where", ["train", "models.tiny-s.train", "methods.ict.train"])
def test_a_later_key_at_its_default_keeps_every_hash_wherever_it_stands(test_raw, where):
    base = validate(test_raw, "t")
    edited = json.loads(json.dumps(test_raw))
    section = edited
    for part in where.split("."):
        section = section.setdefault(part, {})
    section.setdefault("loss", {})["policy_loss"] = "ppo_clip"  # (Loss, policy_loss): its default
    cfg = validate(edited, "t")
    jobs = [("train", {"size": "tiny-s", "method": m}) for m in ("grpo", "ict")] + [
        ("tables", {}), ("base_model", {"size": "tiny-s"}), ("rollout", {"size": "tiny-s"})]
    assert [job_hash_of(cfg, r, w) for r, w in jobs] == [job_hash_of(base, r, w) for r, w in jobs]


@pytest.mark.usefixtures("toy")
def test_a_later_key_off_its_default_moves_what_reads_it(test_raw):
    base = validate(test_raw, "t")
    test_raw["methods"]["ict"]["train"] = {"loss": {"policy_loss": "toy_reinforce"}}
    cfg = validate(test_raw, "t")
    w = {"size": "tiny-s", "method": "ict"}
    assert job_hash_of(cfg, "train", w) != job_hash_of(base, "train", w)
    assert job_hash_of(cfg, "train", {**w, "method": "grpo"}) == job_hash_of(base, "train", {**w, "method": "grpo"})
