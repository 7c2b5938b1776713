"""The `token_stats` section: the exact per-token statistics and the token-statistics stage."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .base import Strict


class TokenStats(Strict):
    """Chunking of the exact per-token statistics (METHODS §2) and the token-statistics stage."""

    chunk_positions: int = Field(1024, gt=0, description="positions per chunk")
    chunk_vocab: int = Field(32768, gt=0, description="vocabulary entries per chunk")
    batch_tokens: int = Field(
        32768, gt=0, description="token-statistics and overlap stages: tokens per teacher-forcing "
        "forward (sequences x longest prompt + response; a longer sequence goes alone)")
    dtype: Literal["float32", "bfloat16", "float64"] = Field(
        "float32", description="token-statistics stage: dtype the model is loaded and run in "
        "(reductions in float32 for float32 and bf16; float64 end to end for float64)")
    high_entropy_quantile: float = Field(
        0.5, ge=0, le=1, description="token-statistics stage: a token is high-entropy when H "
        "exceeds this quantile of H over the file's tokens (ours; 0.5 = the median), for the share "
        "of high- and low-entropy tokens among ICT's picks")
    ict_readings: bool = Field(
        True, description="token-statistics stage: also score every labelled reading of ICT's "
        "reference (the response's own sequence average, the group's pooled average, the group-step "
        "mean leaving the response out) and a random 10% per response, and report their picks beside "
        "the paper's statistics (the ict_readings table)")
    early_positions: int = Field(
        4, gt=0, description="token-statistics stage: the readings table reports the share of picks "
        "among each response's first N positions (ours)")
    overlap_top: float | None = Field(
        0.2, gt=0, le=1, description="the 80/20 paper's overlap: the top fraction of positions by "
        "entropy, under the base model and under each trained model on the same base-model "
        "rollouts, and |A ∩ B| / |A| (one job per trained model; None: not computed)")
