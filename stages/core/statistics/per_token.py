"""The per-token statistics of the full-vocabulary distribution at every position of a scope
(METHODS §2): entropy, Rényi-2, logsumexp, max p and log p of the token, and JSD to the
scope's mean distribution p̄ (with p̄'s pieces for ranks to all-reduce), from logits or
from hidden states times the head, chunked (stages.core.statistics.blocks).
"""

from __future__ import annotations

import torch
from torch import Tensor

from stages.core.statistics.blocks import (
    CHUNK_POSITIONS,
    CHUNK_VOCAB,
    LN2,
    LogitSource,
    jsd_block,
    log_probs,
    row_pieces,
    source_logsumexp,
    source_statistics,
    valid_token_ids,
    valid_values,
)


def _distribution_sum(src: LogitSource, lse: Tensor) -> Tensor:
    total = torch.zeros(src.vocab, dtype=src.dtype, device=src.device)  # (V,)
    for a, b in src.position_chunks():
        for c0, c1 in src.vocab_chunks():
            total[c0:c1] += src.probs(a, b, c0, c1, lse).sum(dim=0)
    return total


def _jsd(src: LogitSource, lse: Tensor, mean_dist: Tensor) -> Tensor:
    q = mean_dist.to(device=src.device, dtype=src.dtype)  # (V,)
    if q.shape != (src.vocab,):
        raise ValueError(f"mean distribution of shape {tuple(q.shape)}, expected ({src.vocab},)")
    out = torch.zeros(src.n, dtype=src.dtype, device=src.device)  # (N_valid,)
    for a, b in src.position_chunks():
        for c0, c1 in src.vocab_chunks():
            ref = q[None, c0:c1]  # (1, v)
            log_ref = log_probs(ref)
            z = src.block(a, b, c0, c1)  # (n, v)
            for r0, r1 in row_pieces(b - a, src.piece_rows(c1 - c0)):
                p, logp = src.piece_probs(z, lse[a:b], r0, r1)
                out[a + r0:a + r1] += jsd_block(p, logp, ref, log_ref, src.piece_mix(p.shape))
    return out.clamp_(0.0, LN2)


# ---------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------
@torch.no_grad()
def token_statistics(
    logits: Tensor,
    temperature: float = 1.0,
    mask: Tensor | None = None,
    token_ids: Tensor | None = None,
    *,
    jsd: bool = False,
    chunk_positions: int = CHUNK_POSITIONS,
    chunk_vocab: int = CHUNK_VOCAB,
) -> dict[str, Tensor]:
    """Statistics of p = softmax(logits / T) at every position of logits (..., V).

    Returns tensors of shape (...) in the compute dtype (float32, or float64 for float64 input):
    ``entropy``, ``renyi2``, ``logsumexp``, ``max_prob``; ``logprob`` when token_ids (...) is
    given; ``jsd`` (d = JSD(p ‖ p̄), p̄ the mean over the valid positions) when jsd=True.
    All in nats except max_prob. Masked positions (mask 0 / False) hold 0.
    The logits are read block by block, so no (..., V) float32 copy of them is made.
    Runs under no_grad: these statistics score and describe tokens; the loss computes its own
    log-probabilities with gradient.
    """
    return _all_statistics(
        logits, None, token_ids, temperature, mask, None, chunk_positions, chunk_vocab, jsd
    )


@torch.no_grad()
def chunked_token_statistics(
    hidden: Tensor,
    head_weight: Tensor | None,
    token_ids: Tensor | None,
    temperature: float = 1.0,
    mask: Tensor | None = None,
    head_bias: Tensor | None = None,
    chunk_positions: int = CHUNK_POSITIONS,
    chunk_vocab: int = CHUNK_VOCAB,
    *,
    jsd: bool = True,
) -> dict[str, Tensor]:
    """Statistics of p = softmax((hidden · W^T + b) / T) without materialising the logits.

    hidden (..., D), head_weight (V, D), head_bias (V,) or None, token_ids (...) or None.
    Streams over chunk_positions × chunk_vocab blocks of logits (peak memory O(their product));
    returns (...) tensors ``entropy``, ``renyi2``, ``logsumexp``, ``max_prob`` and (with
    token_ids) ``logprob``, all nats but max_prob; with jsd=True also ``jsd`` (nats), the
    deviation d = JSD(p ‖ p̄) from the mean distribution p̄ over the valid positions, which costs
    two more passes over the vocabulary (p̄, then d). Masked positions hold 0.
    head_weight=None reads `hidden` as materialised logits (..., V).
    """
    return _all_statistics(
        hidden, head_weight, token_ids, temperature, mask, head_bias,
        chunk_positions, chunk_vocab, jsd,
    )


def _all_statistics(
    hidden, head_weight, token_ids, temperature, mask, head_bias, chunk_positions, chunk_vocab,
    jsd,
) -> dict[str, Tensor]:
    src = LogitSource(hidden, head_weight, temperature, mask, head_bias, chunk_positions,
                      chunk_vocab)
    ids = None if token_ids is None else valid_token_ids(src, token_ids)
    out = source_statistics(src, ids)
    if jsd:
        mean_dist = _distribution_sum(src, out["logsumexp"]) / max(src.n, 1)
        out["jsd"] = _jsd(src, out["logsumexp"], mean_dist)
    return {key: src.scatter(value) for key, value in out.items()}


@torch.no_grad()
def distribution_sum(
    hidden: Tensor,
    head_weight: Tensor | None,
    temperature: float = 1.0,
    mask: Tensor | None = None,
    head_bias: Tensor | None = None,
    logsumexp: Tensor | None = None,
    chunk_positions: int = CHUNK_POSITIONS,
    chunk_vocab: int = CHUNK_VOCAB,
) -> tuple[Tensor, int]:
    """(Σ_i p_i over the valid positions (V,), number of valid positions).

    The pieces of p̄ that ranks all-reduce before dividing. logsumexp (...) from
    :func:`chunked_token_statistics` saves a pass over the vocabulary.
    """
    src = LogitSource(hidden, head_weight, temperature, mask, head_bias, chunk_positions,
                      chunk_vocab)
    lse = source_logsumexp(src) if logsumexp is None else valid_values(src, logsumexp)
    return _distribution_sum(src, lse), src.n


def mean_distribution(
    hidden: Tensor,
    head_weight: Tensor | None,
    temperature: float = 1.0,
    mask: Tensor | None = None,
    head_bias: Tensor | None = None,
    logsumexp: Tensor | None = None,
    chunk_positions: int = CHUNK_POSITIONS,
    chunk_vocab: int = CHUNK_VOCAB,
) -> Tensor:
    """p̄ (V,): the mean of p_i over the valid positions (zeros when there are none)."""
    total, n = distribution_sum(
        hidden, head_weight, temperature, mask, head_bias, logsumexp, chunk_positions, chunk_vocab
    )
    return total / max(n, 1)


@torch.no_grad()
def jsd_to_mean(
    hidden: Tensor,
    head_weight: Tensor | None,
    mean_dist: Tensor,
    temperature: float = 1.0,
    mask: Tensor | None = None,
    head_bias: Tensor | None = None,
    logsumexp: Tensor | None = None,
    chunk_positions: int = CHUNK_POSITIONS,
    chunk_vocab: int = CHUNK_VOCAB,
) -> Tensor:
    """d_i = JSD(p_i ‖ mean_dist) in nats, (...), 0 at masked positions; mean_dist (V,)."""
    src = LogitSource(hidden, head_weight, temperature, mask, head_bias, chunk_positions,
                      chunk_vocab)
    lse = source_logsumexp(src) if logsumexp is None else valid_values(src, logsumexp)
    return src.scatter(_jsd(src, lse, mean_dist))
