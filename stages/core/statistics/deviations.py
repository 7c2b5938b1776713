"""The references of ICT's uniqueness u and their readings (METHODS §3): which positions share a
reference (DEVIATIONS, by statistic), the key and self-weight of each response token, u and the
reference's fields by statistic, and the reference with the token's whole response left out.

scorer.score_scope and scoring.stream_statistics both compute the deviations through here;
stages.core.statistics.scorer re-exports every name.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from stages.core.statistics.blocks import CHUNK_POSITIONS, CHUNK_VOCAB
from stages.core.statistics.uniqueness import group_step_reference, mean_without


def group_step_keys(groups: Sequence[int], lengths: Sequence[int]) -> Tensor:
    """(N,) key of each response token: its group and its step, group-major (groups need not be
    consecutive; keys only need to be equal for the same (group, step))."""
    width = max(lengths) if lengths else 0
    return torch.tensor([g * width + t for g, n in zip(groups, lengths, strict=True)
                         for t in range(n)], dtype=torch.long)


DEVIATIONS: dict[str, tuple[str, bool]] = {
    "group_jsd": ("group_step", False),
    "response_mean_jsd": ("response", False),
    "group_pooled_jsd": ("group", False),
    "group_loo_jsd": ("group_step", True),
}
"""u_i = JSD(p_i ‖ reference) by statistic (METHODS §3): the positions that share a reference
(their key: the group and step, the response, or the group) and whether position i is left out of
its own. group_jsd is ICT's rule; the other three are the readings the summaries leave open
(ours, never called ICT): the response's own sequence average, the group's average pooled over
all its positions, the group-step mean of the other responses."""


def deviation_keys(name: str, groups: Sequence[int], lengths: Sequence[int]) -> Tensor:
    """(N,) key of each response token for the reference of statistic `name` (DEVIATIONS)."""
    kind, _ = DEVIATIONS[name]
    if kind == "group_step":
        return group_step_keys(groups, lengths)
    per_response = torch.arange(len(lengths)) if kind == "response" else torch.as_tensor(groups)
    return per_response.long().repeat_interleave(torch.as_tensor(lengths, dtype=torch.long))


def self_weight(name: str, groups: Sequence[int], lengths: Sequence[int]) -> Tensor:
    """(N,) float64: the weight w of p_i itself in its reference mixture for statistic `name`,
    1 / (positions sharing its key), 0 when it is left out; c(w) (stats.jsd_ceiling) bounds u."""
    keys = deviation_keys(name, groups, lengths)
    if DEVIATIONS[name][1]:
        return torch.zeros(keys.numel(), dtype=torch.float64)
    _, inverse, counts = torch.unique(keys, return_inverse=True, return_counts=True)
    return 1.0 / counts[inverse].double()


def deviation(name: str, hidden: Tensor, head_weight: Tensor | None, groups: Sequence[int],
              lengths: Sequence[int], temperature: float, *, head_bias: Tensor | None = None,
              logsumexp: Tensor | None = None, chunk_positions: int = CHUNK_POSITIONS,
              chunk_vocab: int = CHUNK_VOCAB) -> Tensor:
    """Statistic `name` of DEVIATIONS (N,) in nats for the flat response tokens hidden (N, D) (or
    logits (N, V) with head_weight None) of responses of `lengths` in `groups`."""
    return deviation_reference(name, hidden, head_weight, groups, lengths, temperature,
                               head_bias=head_bias, logsumexp=logsumexp,
                               chunk_positions=chunk_positions, chunk_vocab=chunk_vocab)["u"]


def deviation_reference(name: str, hidden: Tensor, head_weight: Tensor | None,
                        groups: Sequence[int], lengths: Sequence[int], temperature: float, *,
                        token_ids: Tensor | None = None, head_bias: Tensor | None = None,
                        logsumexp: Tensor | None = None, chunk_positions: int = CHUNK_POSITIONS,
                        chunk_vocab: int = CHUNK_VOCAB) -> dict[str, Tensor]:
    """:func:`deviation` as ``u`` and, with token_ids (N,), its reference's probability of each
    token and β, float64 (stats.REFERENCE_FIELDS), from the same pass over the vocabulary."""
    keys = deviation_keys(name, groups, lengths)
    return group_step_reference(hidden, head_weight, keys, temperature, head_bias=head_bias,
                                logsumexp=logsumexp, token_ids=token_ids,
                                leave_out=DEVIATIONS[name][1], chunk_positions=chunk_positions,
                                chunk_vocab=chunk_vocab)


def reference_key(name: str, field: str) -> str:
    """The key of a deviation's reference field (stats.REFERENCE_FIELDS) among per-token values."""
    return f"{name}/{field}"


def without_response(name: str, refs: dict[str, dict[str, Tensor]]) -> Tensor:
    """(N,) float64: the reference of statistic `name` (DEVIATIONS) at each token's own token,
    P̄(y), with the token's whole response left out of the mean (stats.mean_without, ours).

    refs: REFERENCE_FIELDS (N,) by statistic. At a step (group_jsd, group_loo_jsd) the response is
    the row itself: the mean of the other active responses at the step (group_loo_jsd's own
    reference; NaN where the response is alone). The response's own mean (response_mean_jsd)
    leaves nothing: NaN. The group's pooled mean (group_pooled_jsd) leaves out the response's
    positions, whose sum at each token is the response-mean reference's key_sum, so refs must
    hold response_mean_jsd as well."""
    kind, _ = DEVIATIONS[name]
    ref = refs[name]
    if kind == "group_step":
        part, part_count = ref["own"], 1.0
    elif kind == "response":
        part, part_count = ref["key_sum"], ref["count"]
    else:
        mine = refs.get("response_mean_jsd")
        if mine is None:
            raise ValueError(f"{name}: leaving the response out of the group's pooled mean needs "
                             "the response-mean reference's sums (response_mean_jsd)")
        part, part_count = mine["key_sum"], mine["count"]
    return mean_without(ref["key_sum"], ref["count"], part, part_count)
