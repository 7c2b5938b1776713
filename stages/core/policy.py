"""The trainer's per-token science on hidden states (METHODS §2–§4).

Two halves, both on the final hidden states that predict the response tokens:

- :func:`score_scope` scores every valid position of one selection scope without gradient, in
  chunks of positions × vocabulary (stats.chunked_token_statistics), and, for ICT, computes the
  deviation d = JSD(p ‖ p̄) against the mean distribution p̄ of the *whole* scope. A scope spread
  over several ranks needs exactly two V-sized all-reduces: Σ p (for p̄) and the per-id sums of d.
- :func:`head_logprobs` runs the language-model head and log-softmax with gradient, only at the
  positions it is given: the selected ones. Masked positions never enter the graph, so their
  hidden states get an exact zero gradient and the head's gradient does not depend on them.

A scope is described by flat (N,) tensors over its valid positions in (sequence, position)
order, plus the response lengths; :func:`grid` turns them into the (B, T) layout of
:class:`~stages.core.selectors.SelectionInput`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from .stats import (
    CHUNK_POSITIONS,
    CHUNK_VOCAB,
    chunked_token_statistics,
    distribution_sum,
    id_mean_scores,
    id_sums,
    jsd_to_mean,
    pooled_id_scores,
)

AllReduce = Callable[[Tensor], Tensor]
"""Sums a tensor over the ranks that share a scope (identity for one process)."""


def _local(t: Tensor) -> Tensor:
    return t


def head_logprobs(head: torch.nn.Module, hidden: Tensor, token_ids: Tensor,
                  temperature: float) -> Tensor:
    """log p(token) (n,) in nats, with gradient, from hidden states (n, D) through `head`.

    p = softmax(head(h) / T) over the full vocabulary, in float32 (float64 for float64 inputs):
    logit(token) − logsumexp(logits), as TRL's selective_log_softmax, which keeps only the
    logits and one more (n, V) tensor alive for the backward pass. n = 0 is allowed (an empty
    result whose backward gives the head a zero gradient).
    """
    logits = head(hidden)  # (n, V)
    logits = logits if logits.dtype == torch.float64 else logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    picked = logits.gather(1, token_ids.long()[:, None]).squeeze(1)  # (n,)
    return picked - torch.logsumexp(logits, dim=-1)


@torch.no_grad()
def score_scope(
    hidden: Tensor,
    head_weight: Tensor,
    head_bias: Tensor | None,
    token_ids: Tensor,
    temperature: float,
    *,
    deviation: str | None = None,
    all_reduce: AllReduce | None = None,
    chunk_positions: int = CHUNK_POSITIONS,
    chunk_vocab: int = CHUNK_VOCAB,
) -> dict[str, Tensor | tuple[Tensor, Tensor]]:
    """Statistics of this rank's valid positions of a scope: flat (N,) tensors in nats.

    hidden (N, D) and token_ids (N,) are the positions this process holds. Always returns
    ``entropy``, ``renyi2``, ``logprob`` (of the sampled token) and ``logsumexp``. `deviation`
    adds what ICT needs, with p̄ the mean distribution over every position of the scope on every
    rank (all_reduce sums the V-sized pieces):
    - ``"jsd"``: ``jsd`` (N,), d = JSD(p ‖ p̄) per position;
    - ``"token_id"``: also ``id_scores`` = (ids (U,), mean d per id (U,)) over the whole scope;
    - ``"pooled"``: ``id_scores`` = (ids, JSD(p̄_v ‖ p̄)); exact but needs the whole scope in one
      process, so all_reduce must be None.
    """
    reduce = all_reduce or _local
    kw = {"chunk_positions": chunk_positions, "chunk_vocab": chunk_vocab}
    out: dict = dict(chunked_token_statistics(hidden, head_weight, token_ids, temperature,
                                              head_bias=head_bias, jsd=False, **kw))
    if deviation is None:
        return out
    if deviation not in ("jsd", "token_id", "pooled"):
        raise ValueError(f"unknown deviation {deviation!r}: jsd, token_id or pooled")
    lse = out["logsumexp"]
    total, n = distribution_sum(hidden, head_weight, temperature, head_bias=head_bias,
                                logsumexp=lse, **kw)  # (V,), count
    # float64 before the sum over ranks, so p̄ hardly depends on how the scope is split
    total = reduce(total.double())
    count = reduce(torch.tensor([float(n)], dtype=torch.float64, device=total.device))
    mean_dist = total / count.clamp_min(1.0)
    if deviation == "pooled":
        if all_reduce is not None:
            raise ValueError("ICT 'pooled' needs the whole scope in one process")
        out["id_scores"] = pooled_id_scores(hidden, head_weight, token_ids, mean_dist, temperature,
                                            head_bias=head_bias, logsumexp=lse, **kw)
        return out
    out["jsd"] = jsd_to_mean(hidden, head_weight, mean_dist, temperature, head_bias=head_bias,
                             logsumexp=lse, **kw)
    if deviation == "token_id":
        sums, counts = id_sums(token_ids, out["jsd"], vocab_size=head_weight.shape[0])
        out["id_scores"] = id_mean_scores(reduce(sums), reduce(counts))
    return out


def grid(values: Tensor, lengths: list[int] | Tensor, fill: float | bool = 0) -> Tensor:
    """Flat per-position values (N,) → right-padded (B, T) in (sequence, position) order."""
    lengths = torch.as_tensor(lengths, dtype=torch.long)
    width = int(lengths.max()) if lengths.numel() else 0
    out = torch.full((lengths.numel(), width), fill, dtype=values.dtype, device=values.device)
    out[valid_grid(lengths).to(values.device)] = values
    return out


def valid_grid(lengths: list[int] | Tensor) -> Tensor:
    """(B, T) bool: True at the first lengths[b] positions of row b."""
    lengths = torch.as_tensor(lengths, dtype=torch.long)
    width = int(lengths.max()) if lengths.numel() else 0
    return torch.arange(width)[None, :] < lengths[:, None]


def deviation_for(method) -> str | None:
    """What score_scope must add for a method: ICT's deviation, nothing for the others."""
    if method.selector != "ict":
        return None
    return {"token_id": "token_id", "position": "jsd", "pooled": "pooled"}[method.variant]
