"""The 80/20 paper's overlap of top-entropy positions (stages.overlap): by hand, its bounds, and the
stage on tiny models (a model with itself overlaps fully; bad input names the file)."""

from __future__ import annotations

import polars as pl
import pytest
import torch
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from stages.core.common.io import provenance, write_parquet
from stages.overlap import OVERLAP_SCHEMA, overlap_row, trained_entropy
from stages.rollout import ROLLOUT_SCHEMA
from tests.conftest import ROOT, run_stage, tiny_model, write_yaml


def test_overlap_by_hand():
    base = torch.tensor([5.0, 4.0, 3.0, 2.0, 1.0, 0.0])
    trained = torch.tensor([0.0, 4.0, 5.0, 3.0, 9.0, 1.0])
    row = overlap_row(base, trained, 0.5)  # A = {0, 1, 2}, B = {4, 2, 1}
    assert (row["positions"], row["tokens"]) == (3, 6)
    assert row["overlap"] == pytest.approx(2 / 3) and row["jaccard"] == pytest.approx(2 / 4)
    assert overlap_row(base, base, 0.2)["overlap"] == 1.0
    # ties go to the earliest position, as the selectors break them
    flat = overlap_row(torch.zeros(10), torch.zeros(10), 0.3)
    assert flat["overlap"] == 1.0 and flat["positions"] == 3
    with pytest.raises(ValueError, match="shapes"):
        overlap_row(base, trained[:5], 0.5)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 40), st.floats(0.01, 1.0), st.integers(0, 10_000))
def test_overlap_bounds_and_its_jaccard(n, rho, seed):
    """0 ≤ overlap ≤ 1, and with |A| = |B|: Jaccard = overlap / (2 − overlap) (float64)."""
    g = torch.Generator().manual_seed(seed)
    row = overlap_row(torch.rand(n, generator=g, dtype=torch.float64),
                      torch.rand(n, generator=g, dtype=torch.float64), rho)
    assert 0.0 <= row["overlap"] <= 1.0 and 1 <= row["positions"] <= n
    assert row["jaccard"] == pytest.approx(row["overlap"] / (2 - row["overlap"]), rel=1e-12)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A tiny model's 'rollouts' (random responses) and the base model's token entropies."""
    from stages.config import load_config

    d = tmp_path_factory.mktemp("overlap")
    tok, _ = tiny_model(d / "base", seed=0)
    tiny_model(d / "other", seed=1)
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(6):
        response = torch.randint(0, 256, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g)
        rows.append({"sample_id": f"p{i // 2}-{i % 2}", "problem_id": f"p{i // 2}", "sample_idx": i % 2,
                     "prompt": "Q", "response": "r", "prompt_token_ids": [81, 58],
                     "response_token_ids": response.tolist(), "finish_reason": "length",
                     "answer": "1", "answer_type": "math", "extracted": None, "grade_error": None,
                     "correct": False, "reward": 0.0})
    write_parquet(rows, d / "rollouts.parquet", ROLLOUT_SCHEMA, provenance("test", "1", "h", 0))
    raw = yaml.safe_load((ROOT / "config" / "test.yaml").read_text())
    raw["token_stats"]["overlap_top"] = 0.25
    cfg_path = write_yaml(d / "cfg.yaml", raw)
    entropy = trained_entropy(load_config(cfg_path), str(d / "base" / "base.json"),
                              pl.read_parquet(d / "rollouts.parquet"))
    pl.DataFrame({"entropy": entropy.numpy()}).write_parquet(d / "tokens.parquet")
    return d, cfg_path


def overlap_stage(d, cfg, model, out, tokens="tokens.parquet"):
    return run_stage("overlap", "--config", str(cfg), "--size", "tiny-s", "--method", "grpo",
                     "--seed", "0", "--model", str(d / model / "base.json"),
                     "--rollouts", str(d / "rollouts.parquet"), "--tokens", str(d / tokens),
                     "--out", str(d / out))


@pytest.mark.slow
def test_the_stage_overlaps_a_model_with_itself_fully_and_another_less(files):
    d, cfg = files
    for model, out in (("base", "same.parquet"), ("other", "other.parquet")):
        proc = overlap_stage(d, cfg, model, out)
        assert proc.returncode == 0, proc.stderr[-2000:]
    same = pl.read_parquet(d / "same.parquet").row(0, named=True)
    other = pl.read_parquet(d / "other.parquet").row(0, named=True)
    assert pl.read_parquet(d / "same.parquet").columns == OVERLAP_SCHEMA.names
    assert same["overlap"] == 1.0 and same["entropy_mean_base"] == same["entropy_mean_trained"]
    assert other["overlap"] < 1.0 and same["positions"] == other["positions"] > 0
    assert same["top"] == 0.25


def test_trained_entropy_streams_group_by_group_in_one_pass(files, monkeypatch):
    """The trained model's entropies come from the token-statistics stage's streaming path: one
    group's hidden states at a time, one pass (no jsd), equal to the whole file's at once."""
    from stages.config import load_config
    from stages.core.models.modeling import load_model_and_tokenizer
    from stages.core.statistics import scoring
    from stages.core.statistics.stats import chunked_token_statistics

    d, cfg_path = files
    cfg = load_config(cfg_path)
    frame = pl.read_parquet(d / "rollouts.parquet")
    real, calls = scoring.response_hidden, []

    def spy(model, prompts, responses, *args, **kwargs):
        calls.append(len(responses))
        return real(model, prompts, responses, *args, **kwargs)

    monkeypatch.setattr(scoring, "response_hidden", spy)
    entropy = trained_entropy(cfg, str(d / "base" / "base.json"), frame)
    assert calls == [2, 2, 2]  # three problems of two responses, once each
    model, tokenizer = load_model_and_tokenizer(d / "base" / "base.json", dtype=torch.float32)
    responses = frame["response_token_ids"].to_list()
    hidden = real(model, frame["prompt_token_ids"].to_list(), responses, tokenizer.pad_token_id)
    _, weight, bias = scoring.trunk_and_head(model)
    ids = torch.tensor([t for r in responses for t in r])
    whole = chunked_token_statistics(hidden, weight, ids, cfg.rollout.temperature, head_bias=bias,
                                     jsd=False, chunk_positions=cfg.token_stats.chunk_positions,
                                     chunk_vocab=cfg.token_stats.chunk_vocab)["entropy"]
    torch.testing.assert_close(entropy, whole.float())


def test_the_stage_refuses_token_statistics_of_other_rollouts(files, tmp_path):
    d, cfg = files
    pl.DataFrame({"entropy": [0.1, 0.2]}).write_parquet(d / "short.parquet")
    proc = overlap_stage(d, cfg, "base", tmp_path / "x.parquet", tokens="short.parquet")
    assert proc.returncode == 2 and "2 tokens, but" in proc.stderr and "short.parquet" in proc.stderr
    assert not (tmp_path / "x.parquet").exists()
