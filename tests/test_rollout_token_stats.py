"""Rollouts and the token-statistics stage on a tiny untrained model (seconds on CPU)."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import polars as pl
import pytest
import torch

from stages.config import load_config
from stages.core.backends import SamplingSettings, generate
from stages.core.io import provenance, write_parquet
from stages.core.losses import group_advantages
from stages.core.problems import generate_arithmetic
from stages.core.scoring import pack, response_hidden
from tests.conftest import ROOT, run_stage, tiny_model, write_problems, write_yaml


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A saved untrained tiny model, its base.json, a prompt file and a config."""
    d = tmp_path_factory.mktemp("stage")
    tiny_model(d)
    write_problems(d / "prompts.parquet", generate_arithmetic(12, seed=0, max_terms=3))
    import yaml

    raw = yaml.safe_load((ROOT / "config" / "test.yaml").read_text())
    raw["rollout"].update(prompts=6, n=3, max_new_tokens=12)
    cfg = write_yaml(d / "cfg.yaml", raw)
    return d, cfg


def rollout(d, cfg, out):
    return run_stage("rollout", "--config", str(cfg), "--size", "tiny-s", "--model",
                     str(d / "base.json"), "--prompts", str(d / "prompts.parquet"), "--out", str(out))


@pytest.fixture(scope="module")
def rolled(setup) -> Path:
    """One rollout file of the tiny model, made once for the module (the stage is deterministic)."""
    d, cfg = setup
    proc = rollout(d, cfg, d / "r1.parquet")
    assert proc.returncode == 0, proc.stderr
    return d / "r1.parquet"


def test_rollout_columns_rewards_and_determinism(setup, rolled):
    d, cfg = setup
    frame = pl.read_parquet(d / "r1.parquet")
    assert frame.height == 18 and frame["sample_id"].n_unique() == 18
    for col in ("sample_id", "problem_id", "sample_idx", "prompt", "response", "prompt_token_ids",
                "response_token_ids", "finish_reason", "reward", "correct"):
        assert col in frame.columns
    assert frame.schema["response_token_ids"] == pl.List(pl.Int32)
    assert set(frame["finish_reason"]) <= {"stop", "length"}
    assert (frame["reward"] == frame["correct"].cast(pl.Float64)).all()  # reward 1 / 0
    lengths = frame["response_token_ids"].list.len()
    assert int(lengths.max()) <= 12
    for reason, ids in zip(frame["finish_reason"], frame["response_token_ids"], strict=True):
        # stop: ends with eos; length: the limit reached without one
        assert (ids[-1] == 256) if reason == "stop" else (len(ids) == 12 and 256 not in ids)
    assert rollout(d, cfg, d / "r2.parquet").returncode == 0
    assert (d / "r1.parquet").read_bytes() == (d / "r2.parquet").read_bytes()


def test_hf_backend_greedy_matches_unbatched(setup):
    d, _ = setup
    prompts = ["Q: 1+2=? A:", "Q: 13*4-7=? A:"]
    s = SamplingSettings(n=1, temperature=0.0, top_p=1.0, max_new_tokens=8, seed=0, batch_size=2)
    batched = generate("hf", d / "base.json", prompts, s)
    alone = [generate("hf", d / "base.json", [p], s)[0] for p in prompts]
    assert [x.response_token_ids for x in batched] == [x.response_token_ids for x in alone]


def test_rollout_bad_inputs(setup, tmp_path):
    d, cfg = setup
    (tmp_path / "base.json").write_text(json.dumps({"kind": "scratch", "path": "missing"}))
    proc = run_stage("rollout", "--config", str(cfg), "--size", "tiny-s", "--model",
                     str(tmp_path / "base.json"), "--prompts", str(d / "prompts.parquet"),
                     "--out", str(tmp_path / "o.parquet"))
    assert proc.returncode == 2 and "base.json: cannot load the model" in proc.stderr
    assert not (tmp_path / "o.parquet").exists()


def test_teacher_forcing_aligns_with_a_float64_reference(setup):
    """The stage's entropy, log-prob and JSD equal a plain full-logits float64 computation."""
    d, _ = setup
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(d / "checkpoint").eval()
    prompts = [[81, 58, 32, 49], [81, 58]]
    responses = [[50, 51, 52], [53, 54, 55, 56, 57]]
    ids, attention, rows, cols = pack(prompts, responses, pad_id=256)
    assert rows.tolist() == [0, 0, 0, 1, 1, 1, 1, 1] and cols.tolist() == [3, 4, 5, 1, 2, 3, 4, 5]
    hidden = response_hidden(model, prompts, responses, pad_id=256, batch_size=1)
    with torch.no_grad():
        logits = model.double()(ids, attention_mask=attention).logits  # (B, L, V) float64
    model.float()
    z = logits[rows, cols] / 0.7  # temperature 0.7
    p = torch.softmax(z, -1)
    tokens = torch.tensor([t for r in responses for t in r])
    h_ref = -(p * torch.log(p)).sum(-1)
    lp_ref = torch.log_softmax(z, -1)[torch.arange(len(tokens)), tokens]
    pbar = p.mean(0)
    m = 0.5 * (p + pbar)
    jsd_ref = 0.5 * (p * (p / m).log()).sum(-1) + 0.5 * (pbar * (pbar / m).log()).sum(-1)
    from stages.core.stats import chunked_token_statistics

    w = model.get_output_embeddings().weight
    stats = chunked_token_statistics(hidden, w, tokens, 0.7, chunk_positions=3, chunk_vocab=100)
    torch.testing.assert_close(stats["entropy"].double(), h_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(stats["logprob"].double(), lp_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(stats["jsd"].double(), jsd_ref, atol=1e-5, rtol=1e-4)


def test_token_stats_stage(setup, rolled):
    d, cfg = setup
    out = d / "ts"
    proc = run_stage("token_stats", "--config", str(cfg), "--size", "tiny-s", "--model",
                     str(d / "base.json"), "--rollouts", str(rolled), "--out-dir", str(out))
    assert proc.returncode == 0, proc.stderr
    tokens = pl.read_parquet(out / "tokens.parquet")
    rollouts = pl.read_parquet(rolled)
    n = int(rollouts["response_token_ids"].list.len().sum())
    assert tokens.height == n
    assert tokens["token_id"].to_list() == rollouts["response_token_ids"].explode().to_list()
    assert ((tokens["renyi2"] <= tokens["entropy"] + 1e-5) & (tokens["renyi2"] >= 0)).all()
    assert ((tokens["jsd"] >= 0) & (tokens["jsd"] <= math.log(2) + 1e-6)).all()
    assert ((tokens["logprob"] <= 0) & (tokens["max_prob"] <= 1)).all()
    assert tokens["sel_entropy20"].sum() == math.ceil(0.2 * n)
    # the picks are the highest-entropy tokens
    threshold = tokens.filter(pl.col("sel_entropy20"))["entropy"].min()
    assert tokens.filter(~pl.col("sel_entropy20"))["entropy"].max() <= threshold
    summary = json.loads((out / "summary.json").read_text())
    assert summary["tokens"] == n
    assert summary["selected_fraction_entropy20"] == pytest.approx(math.ceil(0.2 * n) / n)
    assert 0 <= summary["jaccard_entropy20_ict"] <= 1
    assert summary["selector_params"]["ict"] == {"rho": 0.1, "variant": "token_id"}
    assert pl.read_parquet(out / "summary.parquet").height == 1
    for f in ("entropy_hist.png", "top_tokens.png"):
        assert (out / f).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "<span class='tok" in (out / "tokens.html").read_text()


def test_token_stats_refuses_foreign_rollouts(setup, rolled, tmp_path):
    d, cfg = setup
    frame = pl.read_parquet(rolled)
    bad = frame.with_columns(pl.col("response_token_ids").list.eval(pl.element() + 1000))
    write_parquet(bad, tmp_path / "bad.parquet",
                  __import__("stages.rollout", fromlist=["ROLLOUT_SCHEMA"]).ROLLOUT_SCHEMA,
                  provenance("t", "1", "h", 0))
    proc = run_stage("token_stats", "--config", str(cfg), "--size", "tiny-s", "--model",
                     str(d / "base.json"), "--rollouts", str(tmp_path / "bad.parquet"),
                     "--out-dir", str(tmp_path / "out"))
    assert proc.returncode == 2
    assert "bad.parquet: column 'response_token_ids' holds token id" in proc.stderr
    assert not (tmp_path / "out").exists()
    empty = frame.head(0)
    from stages.rollout import ROLLOUT_SCHEMA

    write_parquet(empty, tmp_path / "empty.parquet", ROLLOUT_SCHEMA, provenance("t", "1", "h", 0))
    proc = run_stage("token_stats", "--config", str(cfg), "--size", "tiny-s", "--model",
                     str(d / "base.json"), "--rollouts", str(tmp_path / "empty.parquet"),
                     "--out-dir", str(tmp_path / "out"))
    assert proc.returncode == 2 and "empty.parquet: the rollout file is empty" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_group_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.5])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 2])
    adv = group_advantages(rewards, groups)
    std = math.sqrt((2 * 0.25 + 2 * 0.25) / 3)  # sample std of [1, 0, 0, 1]
    expected = [0.5 / (std + 1e-6), -0.5 / (std + 1e-6), -0.5 / (std + 1e-6), 0.5 / (std + 1e-6),
                0.0, 0.0, 0.0]
    assert adv.dtype == torch.float64
    torch.testing.assert_close(adv, torch.tensor(expected, dtype=torch.float64))


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed (GPU extra)")
def test_vllm_backend_produces_the_hf_columns(setup):
    if not torch.cuda.is_available():
        pytest.skip("vllm needs a GPU")
    d, _ = setup
    s = SamplingSettings(n=2, temperature=1.0, top_p=1.0, max_new_tokens=8, seed=0)
    out = generate("vllm", d / "base.json", ["Q: 1+2=? A:"], s)
    assert [(x.prompt_idx, x.sample_idx) for x in out] == [(0, 0), (0, 1)]
    assert all(x.finish_reason in ("stop", "length") and x.response_token_ids for x in out)


def test_the_test_config_loads():
    load_config(ROOT / "config" / "test.yaml")
