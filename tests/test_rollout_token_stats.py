"""Rollouts and the token-statistics stage on a tiny untrained model (seconds on CPU)."""

from __future__ import annotations

import importlib.util
import json
import math
import weakref
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import torch
import yaml

from stages.config import load_config
from stages.core.common.io import provenance, read_parquet, write_parquet
from stages.core.data.problems import generate_arithmetic
from stages.core.models.backends import SamplingSettings, generate
from stages.core.models.modeling import load_model_and_tokenizer
from stages.core.statistics.blocks import LogitSource
from stages.core.statistics.scorer import DEVIATIONS, deviation_reference, reference_key
from stages.core.statistics.scoring import pack, response_hidden, stream_statistics, trunk_and_head
from stages.core.statistics.stats import (
    chunked_token_statistics,
    group_step_jsd,
    token_statistics,
)
from stages.core.training.losses import group_advantages
from stages.rollout import ROLLOUT_SCHEMA
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


@pytest.mark.slow
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
    w = model.get_output_embeddings().weight
    stats = chunked_token_statistics(hidden, w, tokens, 0.7, chunk_positions=3, chunk_vocab=100)
    torch.testing.assert_close(stats["entropy"].double(), h_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(stats["logprob"].double(), lp_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(stats["jsd"].double(), jsd_ref, atol=1e-5, rtol=1e-4)


@pytest.fixture(scope="module")
def staged(setup, rolled) -> Path:
    """The token-statistics stage run once on the module's rollout file."""
    d, cfg = setup
    out = d / "ts"
    proc = run_stage("token_stats", "--config", str(cfg), "--size", "tiny-s", "--model",
                     str(d / "base.json"), "--rollouts", str(rolled), "--out-dir", str(out))
    assert proc.returncode == 0, proc.stderr
    return out


SUMMARY_KEYS = {"ict_u_mean", "high_entropy_quantile", "high_entropy_threshold",
                "ict_high_entropy_share", "ict_low_entropy_share", "ict_high_low_ratio",
                "ict_prob_mean", "ict_prob_sd"}


def test_token_stats_stage(rolled, staged):
    out = staged
    tokens = pl.read_parquet(out / "tokens.parquet")
    rollouts = pl.read_parquet(rolled)
    n = int(rollouts["response_token_ids"].list.len().sum())
    assert tokens.height == n
    assert tokens["token_id"].to_list() == rollouts["response_token_ids"].explode().to_list()
    assert tokens.schema["ict_u"] == pl.Float32
    assert ((tokens["renyi2"] <= tokens["entropy"] + 1e-5) & (tokens["renyi2"] >= 0)).all()
    assert ((tokens["ict_u"] >= 0) & (tokens["ict_u"] <= math.log(2) + 1e-6)).all()
    # no reported selector reads the deviation from the file's mean here, but the token_id and
    # scope_position readings do (token_stats.ict_readings: on by default)
    assert tokens["jsd"].null_count() == 0
    assert ((tokens["logprob"] <= 0) & (tokens["max_prob"] <= 1)).all()
    assert tokens["sel_entropy20"].sum() == math.ceil(0.2 * n)
    # the picks are the highest-entropy tokens
    threshold = tokens.filter(pl.col("sel_entropy20"))["entropy"].min()
    assert tokens.filter(~pl.col("sel_entropy20"))["entropy"].max() <= threshold
    summary = json.loads((out / "summary.json").read_text())
    assert summary["tokens"] == n
    assert summary["selected_fraction_entropy20"] == pytest.approx(math.ceil(0.2 * n) / n)
    assert 0 <= summary["jaccard_entropy20_ict"] <= 1
    # the experiment's ict method (config/test.yaml: rho 0.1, the paper's rule)
    assert summary["selector_params"]["ict"] == {"rho": 0.1, "variant": "paper", "part": "unique"}
    assert summary["selector_params"]["entropy20"] == {"rho": 0.2}  # no such method: defaults
    assert summary["jsd_mean"] == pytest.approx(float(tokens["jsd"].mean()), rel=1e-5)
    assert SUMMARY_KEYS <= set(summary)
    assert summary["ict_u_mean"] == pytest.approx(float(tokens["ict_u"].mean()), rel=1e-5)
    assert summary["high_entropy_quantile"] == 0.5
    picked = tokens.filter(pl.col("sel_ict"))
    median = float(tokens["entropy"].quantile(0.5, "linear"))
    assert summary["high_entropy_threshold"] == pytest.approx(median, rel=1e-6)
    high = int((picked["entropy"] > summary["high_entropy_threshold"]).sum())
    assert summary["ict_high_entropy_share"] == pytest.approx(high / picked.height)
    assert summary["ict_low_entropy_share"] == pytest.approx(1 - high / picked.height)
    assert summary["ict_high_low_ratio"] == pytest.approx(high / (picked.height - high))
    prob = picked["logprob"].cast(pl.Float64).exp()
    assert summary["ict_prob_mean"] == pytest.approx(float(prob.mean()), rel=1e-6)
    assert summary["ict_prob_sd"] == pytest.approx(float(prob.std()), rel=1e-5)
    for col in ("entropy20", "stapo", "ict"):
        top = summary["top_tokens"][col]
        counts = picked if col == "ict" else tokens.filter(pl.col(f"sel_{col}"))
        assert len(top) == min(20, counts["token_id"].n_unique())
        assert [c for _, c in top] == sorted((c for _, c in top), reverse=True)
    row = pl.read_parquet(out / "summary.parquet")
    assert row.height == 1 and SUMMARY_KEYS <= set(row.columns)
    for f in ("entropy_hist.png", "top_tokens.png"):
        assert (out / f).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "<span class='tok" in (out / "tokens.html").read_text()


READING_NAMES = ["paper", "response_mean", "group_pooled", "group_leave_one_out", "token_id",
                 "scope_position", "random10_response", "all_tokens"]
PICKS = {"paper": "sel_ict", "response_mean": "sel_ict_response_mean",
         "group_pooled": "sel_ict_group_pooled", "group_leave_one_out": "sel_ict_group_loo",
         "token_id": "sel_ict_token_id", "scope_position": "sel_ict_scope_position",
         "random10_response": "sel_random10_response"}
OWN_REFERENCE = ("paper", "response_mean", "group_pooled", "group_leave_one_out")


def picked_rows(tokens: pl.DataFrame, reading: str) -> pl.DataFrame:
    """The token table's rows that a reading picks (every row for all_tokens)."""
    return tokens if reading == "all_tokens" else tokens.filter(pl.col(PICKS[reading]))


def diverged_by_definition(frame: pl.DataFrame) -> list[bool]:
    """Per flat token: no other response of its problem with a token at step t has the same t
    first tokens (brute force)."""
    rows = list(zip(frame["problem_id"], frame["response_token_ids"].to_list(), strict=True))
    return [not any(j != i and h == g and len(s) > t and s[:t] == r[:t]
                    for j, (h, s) in enumerate(rows))
            for i, (g, r) in enumerate(rows) for t in range(len(r))]


def spread_of(values: pl.Series) -> tuple[float | None, float | None, float | None]:
    """(mean, sample sd, linear median) of the non-null values, None where too few."""
    values = values.drop_nulls().cast(pl.Float64)
    n = values.len()
    return (float(values.mean()) if n else None, float(values.std()) if n > 1 else None,
            float(values.median()) if n else None)


def assert_same_spread(got, want, rel: float, msg) -> None:
    """(mean, sd, median) equal to rel, None where the other is None."""
    for g, w in zip(got, want, strict=True):
        assert (g is None) == (w is None), msg
        if w is not None:
            assert g == pytest.approx(w, rel=rel, abs=1e-15), msg


def test_token_stats_readings(rolled, staged):
    """readings.parquet: one row per reading, its profile computed from the token table's picks;
    the paper's reported figures on the paper rule's row only."""
    from stages.core.report.reported import ICT_HIGH_LOW_RATIO, ICT_SELECTED_PROB
    from stages.token_stats import READINGS_SCHEMA, TOKEN_SCHEMA

    tokens = pl.read_parquet(staged / "tokens.parquet")
    assert tokens.columns == TOKEN_SCHEMA.names
    for column in ("u_response_mean", "u_group_pooled", "u_group_loo"):
        assert tokens.schema[column] == pl.Float32 and tokens[column].null_count() == 0
        assert ((tokens[column] >= 0) & (tokens[column] <= math.log(2) + 1e-6)).all()
    readings = pl.read_parquet(staged / "readings.parquet")
    assert readings.columns == READINGS_SCHEMA.names
    assert readings["reading"].to_list() == READING_NAMES
    labels = dict(zip(readings["reading"], readings["label"], strict=True))
    assert labels["paper"] == "ICT (paper's rule)"
    assert all(labels[r].endswith("(ours, not ICT)") for r in READING_NAMES[1:6])
    assert "random" in labels["random10_response"] and labels["all_tokens"] == "all tokens (for scale)"
    rollouts = pl.read_parquet(rolled)
    lengths = rollouts["response_token_ids"].list.len().to_list()
    per_response = sum(math.ceil(0.1 * k) for k in lengths)
    threshold = float(tokens["entropy"].quantile(0.5, "linear"))
    stopped = rollouts["finish_reason"].to_numpy() == "stop"
    last = tokens["position"].to_numpy() == np.repeat(np.array(lengths) - 1, lengths)
    eot = last & np.repeat(stopped, lengths)
    summary = json.loads((staged / "summary.json").read_text())
    assert summary["ict_readings"] == readings.to_dicts()
    # the diverged flags by their definition; the default's responses do diverge, and not all
    diverged = diverged_by_definition(rollouts)
    assert tokens["diverged"].to_list() == diverged and 0 < sum(diverged) < len(diverged)
    for row in readings.iter_rows(named=True):
        picked = picked_rows(tokens, row["reading"])
        k = picked.height
        assert row["picks"] == k and row["picks_share"] == pytest.approx(k / tokens.height)
        if row["reading"] == "all_tokens":
            assert k == tokens.height and row["rho"] == 1.0
        else:
            assert row["rho"] == 0.1
        if row["reading"] in (*OWN_REFERENCE, "random10_response"):  # ceil(ρ·T_i) of each response
            assert k == per_response
        prob = picked["logprob"].cast(pl.Float64).exp()
        assert row["prob_mean"] == pytest.approx(float(prob.mean()), rel=1e-6)
        assert row["prob_sd"] == pytest.approx(float(prob.std()), rel=1e-5)
        assert row["prob_median"] == pytest.approx(float(prob.median()), rel=1e-6)
        # the reference's profile: the reading's own reference, else the paper rule's, whose
        # values per token the token table holds (float32 there)
        assert row["reference_of"] == (row["reading"] if row["reading"] in OWN_REFERENCE else "paper")
        at = picked.filter(pl.col("diverged"))
        assert row["diverged_picks"] == at.height
        assert row["diverged_share"] == pytest.approx(at.height / k)
        assert row["diverged_prob_mean"] == pytest.approx(
            float(at["logprob"].cast(pl.Float64).exp().mean()), rel=1e-6)
        if row["reference_of"] == "paper":
            for value, column in [("ref_prob", "ict_ref_prob"), ("ref_prob_out", "ict_ref_prob_out"),
                                  ("beta", "ict_ref_beta")]:
                for where, prefix in ((picked, ""), (at, "diverged_")):
                    want = spread_of(where[column])
                    got = tuple(row[f"{prefix}{value}_{s}"] for s in ("mean", "sd", "median"))
                    assert_same_spread(got, want, 1e-5, (row["reading"], prefix, value))
            assert row["ref_prob_out_picks"] == picked["ict_ref_prob_out"].drop_nulls().len()
            above = int((picked["ict_ref_prob"] > picked["ict_ref_beta"]).sum())
            assert row["above_beta_share"] == pytest.approx(above / k)
        assert 0 <= row["ref_prob_mean"] <= 1 and 0 < row["beta_mean"] <= 1
        if row["reading"] == "response_mean":  # nothing is left without the response
            assert row["ref_prob_out_picks"] == 0 and row["ref_prob_out_mean"] is None
        else:
            assert row["ref_prob_out_picks"] > 0
        assert row["max_prob_mean"] == pytest.approx(float(picked["max_prob"].mean()), rel=1e-6)
        assert row["entropy_mean"] == pytest.approx(float(picked["entropy"].mean()), rel=1e-5)
        high = int((picked["entropy"] > threshold).sum())
        assert row["high_share"] == pytest.approx(high / k)
        assert row["high_low_ratio"] == (pytest.approx(high / (k - high)) if k > high else None)
        early = int((picked["position"] < 4).sum())
        assert row["early_share"] == pytest.approx(early / k)
        mask = (np.ones(tokens.height, dtype=bool) if row["reading"] == "all_tokens"
                else tokens[PICKS[row["reading"]]].to_numpy())
        assert row["eot_share"] == pytest.approx(int((mask & eot).sum()) / k)
        assert 0 <= row["ceiling_share"] <= 1
        assert row["ceiling_of"] == row["reference_of"]
        if row["reading"] == "paper":
            assert (row["reported_prob_mean"], row["reported_prob_sd"]) == ICT_SELECTED_PROB
            assert row["reported_high_low_ratio"] == ICT_HIGH_LOW_RATIO["GSM8K"]
            assert row["reported_high_low_ratio_math"] == ICT_HIGH_LOW_RATIO["MATH"]
            assert "2606.19771" in row["reported_source"]
        else:
            assert all(row[c] is None for c in readings.columns if c.startswith("reported_"))
    assert summary["ict_readings_params"] == {"rho": 0.1, "random_rho": 0.1, "seed": 0,
                                              "early_positions": 4, "ceiling_rtol": 1e-3}


def test_token_stats_readings_off(setup, rolled, tmp_path):
    """token_stats.ict_readings false: the readings' columns are null and the readings table holds
    the paper's rule alone."""
    from stages.token_stats import compute

    d, cfg_path = setup
    raw = yaml.safe_load(cfg_path.read_text())
    raw["token_stats"]["ict_readings"] = False
    cfg = load_config(write_yaml(tmp_path / "cfg.yaml", raw))
    model, tokenizer = load_model_and_tokenizer(d / "base.json", dtype=torch.float32)
    table, summary = compute(cfg, model, tokenizer, read_parquet(rolled, ROLLOUT_SCHEMA))
    for column in ("u_response_mean", "u_group_pooled", "u_group_loo", *PICKS.values()):
        if column != "sel_ict":
            assert table[column].null_count() == table.height, column
    assert table["jsd"].null_count() == table.height  # nothing reads it without the readings
    assert [r["reading"] for r in summary["ict_readings"]] == ["paper"]
    paper = summary["ict_readings"][0]
    assert paper["picks"] == int(table["sel_ict"].sum())
    # the paper rule's reference comes with its own u: profiled without the readings too
    picked = table.filter(pl.col("sel_ict"))
    assert table["ict_ref_prob"].null_count() == 0 and table["ict_ref_beta"].null_count() == 0
    assert paper["ref_prob_mean"] == pytest.approx(float(picked["ict_ref_prob"].cast(pl.Float64).mean()),
                                                   rel=1e-6)
    assert paper["ref_prob_out_mean"] is not None and paper["diverged_picks"] >= 0


def floor(u: list[float]) -> list[float]:
    """group_step_jsd's documented resolution in float64: u below U_FLOOR_ULPS epsilons is 0."""
    from stages.core.statistics.uniqueness import U_FLOOR_ULPS

    eps = U_FLOOR_ULPS * torch.finfo(torch.float64).eps
    return [0.0 if x < eps else x for x in u]


def top_per_response(u: list[float], rho: float = 0.1) -> list[bool]:
    k = math.ceil(rho * len(u))
    top = set(sorted(range(len(u)), key=lambda t: (-u[t], t))[:k])
    return [t in top for t in range(len(u))]


def test_readings_picks_equal_a_float64_recomputation(setup, rolled, tmp_path):
    """compute() with token_stats.dtype float64 (and chunk_positions 4, so that the groups and
    most responses are keys larger than a block): every reading's u and picks equal a float64
    recomputation from materialised softmaxes, one response at a time, with explicit means; the
    readings table's profile and ceiling shares follow from those picks, and so does its
    reference profile: each reference's probability of the picked token, the same without the
    token's response, β, at every pick and at the diverged ones."""
    from stages.core.statistics.stats import jsd_ceiling
    from stages.token_stats import compute

    d, cfg_path = setup
    raw = yaml.safe_load(cfg_path.read_text())
    raw["token_stats"].update(dtype="float64", chunk_positions=4, chunk_vocab=100)
    cfg = load_config(write_yaml(tmp_path / "cfg.yaml", raw))
    frame = read_parquet(rolled, ROLLOUT_SCHEMA)
    model, tokenizer = load_model_and_tokenizer(d / "base.json", dtype=torch.float64)
    table, summary = compute(cfg, model, tokenizer, frame)

    probs = []  # per response: (T_i, V) float64
    with torch.no_grad():
        for prompt, response in zip(frame["prompt_token_ids"], frame["response_token_ids"],
                                    strict=True):
            ids = torch.tensor([list(prompt) + list(response)])
            logits = model(ids).logits[0, len(prompt) - 1 : len(prompt) + len(response) - 1]
            probs.append(torch.softmax(logits / 1.0, dim=-1))  # config/test.yaml's temperature
    problems = frame["problem_id"].to_list()
    group = {g: [i for i, x in enumerate(problems) if x == g] for g in dict.fromkeys(problems)}
    u = {name: [] for name in ("paper", "response_mean", "group_pooled", "group_leave_one_out")}
    weight = {name: [] for name in u}
    # each reference at the token: P̄(y), P̄(y) without the token's response, β (NaN: none)
    ref = {name: {"ref_prob": [], "ref_prob_out": [], "beta": []} for name in u}
    nan = float("nan")

    def add(name, mean, out, y):
        ref[name]["ref_prob"].append(nan if mean is None else float(mean[y]))
        ref[name]["beta"].append(nan if mean is None else float(mean.square().sum()))
        ref[name]["ref_prob_out"].append(nan if out is None else float(out[y]))
    for i, p in enumerate(probs):
        mates = group[problems[i]]
        pooled = torch.cat([probs[j] for j in mates]).mean(0)
        n_pooled = sum(len(probs[j]) for j in mates)
        own_mean = p.mean(0)
        for t in range(len(p)):
            active = [j for j in mates if len(probs[j]) > t]
            others = [j for j in active if j != i]
            u["paper"].append(jsd64(p[t], torch.stack([probs[j][t] for j in active]).mean(0)))
            u["response_mean"].append(jsd64(p[t], own_mean))
            u["group_pooled"].append(jsd64(p[t], pooled))
            u["group_leave_one_out"].append(
                jsd64(p[t], torch.stack([probs[j][t] for j in others]).mean(0)) if others else 0.0)
            weight["paper"].append(1 / len(active))
            weight["response_mean"].append(1 / len(p))
            weight["group_pooled"].append(1 / n_pooled)
            weight["group_leave_one_out"].append(0.0)
            y = int(frame["response_token_ids"][i][t])
            step_mean = torch.stack([probs[j][t] for j in active]).mean(0)
            step_others = torch.stack([probs[j][t] for j in others]).mean(0) if others else None
            add("paper", step_mean, step_others, y)
            add("response_mean", own_mean, None, y)
            rest = [probs[j] for j in mates if j != i]
            add("group_pooled", pooled, torch.cat(rest).mean(0) if rest else None, y)
            add("group_leave_one_out", step_others, step_others, y)
    lengths = [len(p) for p in probs]
    starts = np.cumsum([0, *lengths])
    picks = {}
    for name, values in u.items():
        values = floor(values)
        u[name] = values
        picks[name] = [x for a, b in zip(starts[:-1], starts[1:], strict=True)
                       for x in top_per_response(values[a:b])]
    # our earlier readings: the file is the scope, d = JSD(p ‖ the file's mean distribution)
    flat = torch.cat(probs)  # (N, V)
    d_file = [jsd64(row, flat.mean(0)) for row in flat]
    n = len(d_file)
    ranked = sorted(range(n), key=lambda r: (-d_file[r], r))[: math.ceil(0.1 * n)]
    picks["scope_position"] = [r in set(ranked) for r in range(n)]
    ids = table["token_id"].to_list()
    score = {v: np.mean([d_file[r] for r in range(n) if ids[r] == v]) for v in set(ids)}
    chosen = set(sorted(score, key=lambda v: (-score[v], v))[: math.ceil(0.1 * len(score))])
    picks["token_id"] = [v in chosen for v in ids]

    columns = {"paper": "ict_u", "response_mean": "u_response_mean",
               "group_pooled": "u_group_pooled", "group_leave_one_out": "u_group_loo"}
    for name, column in columns.items():
        stage_u = torch.tensor(table[column].to_numpy(), dtype=torch.float64)
        torch.testing.assert_close(stage_u, torch.tensor(u[name], dtype=torch.float64),
                                   atol=1e-7, rtol=1e-6, msg=name)
        assert max(u[name]) > 1e-3, name  # not vacuous
    for name, mask in picks.items():
        assert table[PICKS[name]].to_list() == mask, name
    # the picks differ between readings: the comparison is not of one mask with itself
    assert len({tuple(m) for m in picks.values()}) == len(picks)
    rows = {r["reading"]: r for r in summary["ict_readings"]}
    random = table["sel_random10_response"].to_numpy()
    assert rows["random10_response"]["picks"] == sum(math.ceil(0.1 * k) for k in lengths)
    assert all(random[a:b].sum() == math.ceil(0.1 * (b - a))
               for a, b in zip(starts[:-1], starts[1:], strict=True))
    logprob = table["logprob"].to_numpy().astype(np.float64)
    for name, mask in {**picks, "random10_response": list(random)}.items():
        chosen_rows = np.flatnonzero(mask)
        assert rows[name]["prob_mean"] == pytest.approx(np.exp(logprob[chosen_rows]).mean(),
                                                        rel=1e-6)
        ceiling_of = name if name in u else "paper"
        c = jsd_ceiling(torch.tensor(weight[ceiling_of], dtype=torch.float64)).numpy()
        at = np.array(u[ceiling_of]) >= c * (1 - 1e-3)
        at &= c > 0
        assert rows[name]["ceiling_share"] == pytest.approx(at[chosen_rows].mean()), name
    # the reference profile, against the recomputation (the paper rule's reference for the
    # readings without one of their own) and the diverged positions by their definition
    diverged = np.array(diverged_by_definition(frame))
    assert table["diverged"].to_list() == list(diverged)
    own_p = np.exp(logprob)
    n_tokens = len(own_p)
    for name, mask in {**picks, "random10_response": list(random),
                       "all_tokens": [True] * n_tokens}.items():
        row = rows[name]
        of = name if name in ref else "paper"
        assert row["reference_of"] == of
        chosen_rows = np.asarray(mask, dtype=bool)
        at = chosen_rows & diverged
        assert row["diverged_picks"] == int(at.sum()) > 0
        values = {key: np.array(v) for key, v in ref[of].items()} | {"prob": own_p}
        for key, where, prefix in [(k, chosen_rows, "") for k in ("ref_prob", "ref_prob_out", "beta")] + [
                (k, at, "diverged_") for k in ("prob", "ref_prob", "ref_prob_out", "beta")]:
            chosen = values[key][where]
            chosen = chosen[np.isfinite(chosen)]
            want = ((float(chosen.mean()), float(chosen.std(ddof=1)) if len(chosen) > 1 else None,
                     float(np.median(chosen))) if len(chosen) else (None, None, None))
            got = tuple(row[f"{prefix}{key}_{s}"] for s in ("mean", "sd", "median"))
            assert_same_spread(got, want, 1e-9, (name, prefix, key))
        above = values["ref_prob"][chosen_rows] > values["beta"][chosen_rows]
        assert row["above_beta_share"] == pytest.approx(above.mean(), abs=1e-12), name
    # the token table holds the paper rule's reference per token
    np.testing.assert_allclose(table["ict_ref_prob"].to_numpy(), ref["paper"]["ref_prob"], rtol=1e-6)
    np.testing.assert_allclose(table["ict_ref_beta"].to_numpy(), ref["paper"]["beta"], rtol=1e-6)
    np.testing.assert_allclose(table["ict_ref_prob_out"].fill_null(float("nan")).to_numpy(),
                               ref["paper"]["ref_prob_out"], rtol=1e-6, atol=1e-30)


def jsd64(p: torch.Tensor, q: torch.Tensor) -> float:
    """JSD(p ‖ q) in nats, term by term (0 · log 0 = 0)."""
    m = 0.5 * (p + q)
    return float(0.5 * torch.xlogy(p, p / m).sum() + 0.5 * torch.xlogy(q, q / m).sum())


def test_ict_u_and_picks_equal_a_float64_recomputation(setup, rolled, staged):
    """u_{i,t} = JSD(p_{i,t} ‖ P̄_t), P̄_t the mean over the problem's responses at step t, from the
    saved model in float64, one response at a time; sel_ict = the top ceil(0.1·T_i) of each
    response by u (ties: earliest)."""
    d, _ = setup
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(d / "checkpoint", dtype=torch.float64).eval()
    rollouts = pl.read_parquet(rolled)
    temperature = 1.0  # config/test.yaml's rollout temperature
    probs = []  # per response: (T_i, V) float64
    with torch.no_grad():
        for prompt, response in zip(rollouts["prompt_token_ids"], rollouts["response_token_ids"],
                                    strict=True):
            ids = torch.tensor([list(prompt) + list(response)])
            logits = model(ids).logits[0, len(prompt) - 1 : len(prompt) + len(response) - 1]
            probs.append(torch.softmax(logits / temperature, dim=-1))
    members: dict[tuple[str, int], list[torch.Tensor]] = {}
    for problem, p in zip(rollouts["problem_id"], probs, strict=True):
        for t in range(len(p)):
            members.setdefault((problem, t), []).append(p[t])
    u_ref, sel_ref = [], []
    for problem, p in zip(rollouts["problem_id"], probs, strict=True):
        u = [jsd64(p[t], torch.stack(members[problem, t]).mean(0)) for t in range(len(p))]
        k = math.ceil(0.1 * len(u))
        top = set(sorted(range(len(u)), key=lambda t: (-u[t], t))[:k])
        u_ref += u
        sel_ref += [t in top for t in range(len(u))]
    tokens = pl.read_parquet(staged / "tokens.parquet")
    u_stage = torch.tensor(tokens["ict_u"].to_numpy(), dtype=torch.float64)
    torch.testing.assert_close(u_stage, torch.tensor(u_ref, dtype=torch.float64), atol=1e-7, rtol=1e-4)
    assert max(u_ref) > 1e-3  # the groups' responses do differ
    assert tokens["sel_ict"].to_list() == sel_ref


def whole_file_statistics(model, prompts, responses, groups, pad_id, temperature,
                          needs=frozenset(), *, chunk_positions, chunk_vocab, references=False, **_):
    """The stage's statistics before it streamed: every hidden state of the file at once, jsd and
    the deviations (and their references) over the whole file (stream_statistics' signature)."""
    _, weight, bias = trunk_and_head(model)
    hidden = response_hidden(model, prompts, responses, pad_id)  # (N, D)
    ids = torch.tensor([t for r in responses for t in r])
    kw = {"head_bias": bias, "chunk_positions": chunk_positions, "chunk_vocab": chunk_vocab}
    out = chunked_token_statistics(hidden, weight, ids, temperature, jsd="jsd" in needs, **kw)
    index = {g: k for k, g in enumerate(dict.fromkeys(groups))}
    lengths = [len(r) for r in responses]
    for name in (n for n in DEVIATIONS if n in needs):
        ref = deviation_reference(name, hidden, weight, [index[g] for g in groups], lengths,
                                  temperature, logsumexp=out["logsumexp"],
                                  token_ids=ids if references else None, **kw)
        out[name] = ref.pop("u")
        out |= {reference_key(name, field): value for field, value in ref.items()}
    return {k: v.cpu() for k, v in out.items()}


def test_streamed_stage_equals_the_whole_file_bit_for_bit(setup, rolled, tmp_path, monkeypatch):
    """compute() streamed group by group (jsd in a second pass) writes the same token table and
    summary, bit for bit, as the whole file's hidden states at once, in float64: chunk_positions 4,
    so that blocks straddle groups in the whole file and groups span blocks; the rows shuffled, so
    that the groups are interleaved and visited in another order than the file's."""
    from stages import token_stats

    d, cfg_path = setup
    raw = yaml.safe_load(cfg_path.read_text())
    raw["token_stats"].update(dtype="float64", chunk_positions=4, chunk_vocab=100)
    cfg = load_config(write_yaml(tmp_path / "cfg.yaml", raw))
    frame = read_parquet(rolled, ROLLOUT_SCHEMA).sample(fraction=1.0, shuffle=True, seed=0)
    assert frame["problem_id"].to_list() != sorted(frame["problem_id"].to_list())
    model, tokenizer = load_model_and_tokenizer(d / "base.json", dtype=torch.float64)
    table, summary = token_stats.compute(cfg, model, tokenizer, frame)
    monkeypatch.setattr(token_stats, "stream_statistics", whole_file_statistics)
    reference, reference_summary = token_stats.compute(cfg, model, tokenizer, frame)
    assert table["jsd"].null_count() == 0 and table["u_group_loo"].null_count() == 0
    assert table.equals(reference)
    assert json.dumps(summary) == json.dumps(reference_summary)


def test_one_group_of_hidden_states_at_a_time(setup, rolled, monkeypatch):
    """stream_statistics holds one group's hidden states at a time (every earlier group's are freed
    before the next is made), however many groups the file has; two passes with jsd, one without;
    every trunk forward runs without a KV cache within the token budget (or one sequence alone)."""
    from stages.core.statistics import scoring

    d, _ = setup
    frame = read_parquet(rolled, ROLLOUT_SCHEMA)
    model, tokenizer = load_model_and_tokenizer(d / "base.json", dtype=torch.float32)
    made, alive_before = [], []  # every hidden-state tensor handed out; rows alive at each call
    real = scoring.response_hidden

    def spy(*args, **kwargs):
        alive_before.append(sum(r().shape[0] for r in made if r() is not None))
        out = real(*args, **kwargs)
        made.append(weakref.ref(out))
        return out

    monkeypatch.setattr(scoring, "response_hidden", spy)
    forwards = []
    hook = model.get_decoder().register_forward_pre_hook(
        lambda _m, _a, kw: forwards.append((tuple(kw["input_ids"].shape), kw.get("use_cache"))),
        with_kwargs=True)
    widest = max(len(q) + len(r) for q, r in zip(frame["prompt_token_ids"],
                                                  frame["response_token_ids"], strict=True))
    budget = 2 * widest
    try:
        for problems, needs in [(2, {"jsd", "group_jsd", "group_loo_jsd"}), (6, {"jsd"}), (6, set())]:
            first = frame["problem_id"].unique(maintain_order=True)[:problems]
            part = frame.filter(pl.col("problem_id").is_in(first))
            made.clear(), alive_before.clear(), forwards.clear()
            responses = part["response_token_ids"].to_list()
            out = stream_statistics(model, part["prompt_token_ids"].to_list(), responses,
                                    part["problem_id"].to_list(), tokenizer.pad_token_id, 1.0,
                                    needs, chunk_positions=4, chunk_vocab=100, batch_tokens=budget)
            assert len(made) == problems * (2 if "jsd" in needs else 1)
            assert alive_before == [0] * len(made)  # no other group's hidden states alive
            assert set(out) == {"logsumexp", "entropy", "renyi2", "max_prob", "logprob", *needs}
            assert all(v.shape == (sum(map(len, responses)),) for v in out.values())
            assert all(cache is False for _, cache in forwards)
            assert all(b == 1 or b * width <= budget for (b, width), _ in forwards)
            assert any(b > 1 for (b, _), _ in forwards)  # the budget does batch
    finally:
        hook.remove()


def test_token_stats_refuses_groups_of_one(setup, rolled, tmp_path):
    """ICT's reference is a group mean: a problem with a single response is an error, nothing written."""
    d, cfg = setup
    frame = pl.read_parquet(rolled)
    lone = frame["problem_id"][0]
    bad = frame.filter((pl.col("problem_id") != lone) | (pl.col("sample_idx") == 0))
    from stages.rollout import ROLLOUT_SCHEMA

    write_parquet(bad, tmp_path / "lone.parquet", ROLLOUT_SCHEMA, provenance("t", "1", "h", 0))
    proc = run_stage("token_stats", "--config", str(cfg), "--size", "tiny-s", "--model",
                     str(d / "base.json"), "--rollouts", str(tmp_path / "lone.parquet"),
                     "--out-dir", str(tmp_path / "out"))
    assert proc.returncode == 2
    assert f"lone.parquet: problem_id {lone!r} has 1 response(s)" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_cpu_hidden_with_a_cpu_head_equals_its_logits_blocks():
    """Hidden states stay where they are, in their dtype; the head path computes exactly the
    blocks (h / T) · W[c0:c1]^T + b / T that the materialised-logits path reads."""
    torch.manual_seed(0)
    hidden, w, b = torch.randn(3, 5, 16), torch.randn(40, 16), torch.randn(40)
    ids, mask = torch.randint(0, 40, (3, 5)), torch.rand(3, 5) > 0.2
    t, cv = 0.7, 16
    src = LogitSource(hidden, w, t, mask, b, chunk_positions=4, chunk_vocab=cv)
    assert src.data.data_ptr() == hidden.data_ptr() and src.data.dtype == hidden.dtype
    assert src.device == w.device
    # one position chunk, so that both paths run the same matmuls
    h = hidden.reshape(-1, 16) * (1.0 / t)
    z = torch.cat([h @ w[c:c + cv].T + b[c:c + cv] * (1.0 / t) for c in range(0, 40, cv)], 1)
    head = chunked_token_statistics(hidden, w, ids, t, mask=mask, head_bias=b, chunk_positions=15,
                                    chunk_vocab=cv, jsd=True)
    logits = token_statistics(z.reshape(3, 5, 40), 1.0, mask=mask, token_ids=ids, jsd=True,
                              chunk_positions=15, chunk_vocab=cv)
    for key, value in head.items():
        assert value.device == w.device
        assert torch.equal(value, logits[key]), key
    keys = torch.arange(5).repeat(3, 1)  # three responses of one group, step = position
    torch.testing.assert_close(
        group_step_jsd(hidden, w, keys, t, mask=mask, head_bias=b, chunk_positions=4, chunk_vocab=cv),
        group_step_jsd(z.reshape(3, 5, 40), None, keys, 1.0, mask=mask, chunk_vocab=cv),
        atol=1e-6, rtol=1e-5)


def test_bf16_model_statistics_match_float32(setup):
    """A bf16 model's CPU hidden states and head give the float32 statistics to bf16 accuracy,
    reduced in float32."""
    d, _ = setup
    from transformers import AutoModelForCausalLM

    prompts = [[81, 58, 32, 49], [81, 58, 32, 49], [81, 58]]
    responses = [[50, 51, 52, 60], [53, 54, 55], [56, 57, 58, 59, 60]]
    ids = torch.tensor([t for r in responses for t in r])
    keys = torch.tensor([g * 5 + t for g, r in zip([0, 0, 1], responses, strict=True)
                         for t in range(len(r))])
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = AutoModelForCausalLM.from_pretrained(d / "checkpoint", dtype=dtype).eval()
        hidden = response_hidden(model, prompts, responses, pad_id=256, batch_size=2)
        assert hidden.device.type == "cpu" and hidden.dtype == dtype
        w = model.get_output_embeddings().weight
        stats = chunked_token_statistics(hidden, w, ids, 0.7, chunk_positions=4, chunk_vocab=100)
        stats["u"] = group_step_jsd(hidden, w, keys, 0.7, chunk_positions=4, chunk_vocab=100)
        assert all(v.dtype == torch.float32 for v in stats.values())
        out[dtype] = stats
    for key in ("entropy", "logprob", "renyi2", "jsd", "u"):  # torch's bf16 tolerance
        torch.testing.assert_close(out[torch.bfloat16][key], out[torch.float32][key],
                                   atol=1e-5, rtol=1.6e-2, msg=key)
    assert float(out[torch.float32]["u"].max()) > 1e-3  # u is not all zeros


@pytest.mark.slow
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
