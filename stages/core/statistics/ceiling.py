"""What bounds ICT's u and where p enters its step mean once: the ceiling c(w) of a deviation
from a mixture that contains p itself with weight w, and the diverged positions, whose
response prefix no other active response of the group shares (METHODS §3, §10; ours).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence

import torch
from torch import Tensor

from stages.core.statistics.blocks import LN2

CEILING_RTOL = 1e-3
"""at_ceiling: u within this relative distance of its ceiling c(w) counts as at the ceiling (ours)."""


# ---------------------------------------------------------------------------------------------
# The ceiling of a deviation from a mixture that contains p itself
# ---------------------------------------------------------------------------------------------
def jsd_ceiling(w: Tensor | float) -> Tensor:
    """c(w) = max over distributions p, r of JSD(p ‖ w·p + (1 − w)·r), in nats, float64, w ∈ [0, 1].

        c(w) = ½ [ln(2 / (1 + w)) + w·ln(2w / (1 + w)) + (1 − w)·ln 2];  c(0) = ln 2, c(1) = 0.

    w is the weight of p itself in its reference mixture q = w·p + (1 − w)·r: 1/n_t for ICT's
    rule (n_t active responses of the group at step t), 1/T_i for the response-mean reading,
    1/(the group's positions) for the group-pooled one, 0 leaving the response out.

    Derivation. JSD(p ‖ q) = Σ_j φ(p_j, q_j) with φ(x, y) = ½[x·ln(2x/(x+y)) + y·ln(2y/(x+y))],
    convex and positively homogeneous of degree 1. So is g(x, y) = φ(x, w·x + (1 − w)·y), hence
    subadditive: g(x, y) ≤ g(x, 0) + g(0, y) = x·A + y·B with A = g(1, 0) = ½[ln(2/(1 + w)) +
    w·ln(2w/(1 + w))] and B = g(0, 1) = ½(1 − w)·ln 2. Summing over j with Σ p_j = Σ r_j = 1:
    JSD(p ‖ w·p + (1 − w)·r) ≤ A + B = c(w), with equality where every entry has p_j = 0 or
    r_j = 0 (for w < 1, g is strictly convex across rays, so only there): p and r disjoint, e.g.
    p = δ_a with r(a) = 0 — a near-certain token whose step-mates are near-certain on other
    tokens. Check at a point mass: m = ½(p + q) has m_a = (1 + w)/2, so KL(p ‖ m) =
    ln(2/(1 + w)) and KL(q ‖ m) = w·ln(2w/(1 + w)) + (1 − w)·ln 2.
    """
    w = torch.as_tensor(w, dtype=torch.float64)
    return 0.5 * (torch.log(2.0 / (1.0 + w)) + torch.xlogy(w, 2.0 * w / (1.0 + w))
                  + (1.0 - w) * LN2)


def at_ceiling(u: Tensor, w: Tensor) -> Tensor:
    """Bool (...): u ≥ c(w)·(1 − CEILING_RTOL) where c(w) > 0 (ours). u (...) nats, w (...) the
    weight of p itself in its reference; a position that is its own reference (w = 1, c = 0)
    cannot deviate and is never at the ceiling."""
    c = jsd_ceiling(w)
    return (c > 0) & (u.double() >= c * (1.0 - CEILING_RTOL))


# ---------------------------------------------------------------------------------------------
# Where a response's context is its own
# ---------------------------------------------------------------------------------------------
def diverged_positions(responses: Sequence[Sequence[int]], groups: Sequence[Hashable]) -> Tensor:
    """(N,) bool over the flat response tokens, in (response, position) order: position t of
    response i is diverged when no other response of its group that is still active at step t
    (has a token there) begins with the same t tokens y_{i,<t} (ours, METHODS §10).

    The responses of a group share the prompt, so equal prefixes mean equal contexts and equal
    distributions p at step t: at a shared position the group's step mean P̄_t holds p_i several
    times; at a diverged one p_i enters it once, P̄_t(y) = p_i(y)/n_t + the others' share. Step 0
    is diverged only where the response is alone in its group. Exact (token ids, no rounding):
    a trie of each group's prefixes counts the active responses at each node."""
    if len(responses) != len(groups):
        raise ValueError(f"{len(responses)} responses but {len(groups)} groups")
    visits: list[int] = []  # per flat token: the trie node of its prefix
    count: Counter = Counter()  # active responses per node
    children: dict[tuple, int] = {}
    root = {g: i for i, g in enumerate(dict.fromkeys(groups))}  # one root node per group
    for tokens, group in zip(responses, groups, strict=True):
        node = -1 - root[group]  # roots are negative, trie nodes 0, 1, ...
        for token in tokens:
            visits.append(node)
            count[node] += 1
            node = children.setdefault((node, int(token)), len(children))
    return torch.tensor([count[node] == 1 for node in visits], dtype=torch.bool)
