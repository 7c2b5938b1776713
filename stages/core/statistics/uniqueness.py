"""ICT's uniqueness u = JSD(p ‖ the mean of p over the positions sharing a key) (METHODS §3),
with the key's group and step (ICT) or another reading's, and the reference's fields from
the same pass (REFERENCE_FIELDS): the keys' blocks and pieces, their float64 sums, and the
means that leave a part of a reference out.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from stages.core.statistics.blocks import (
    CHUNK_POSITIONS,
    CHUNK_VOCAB,
    LN2,
    LogitSource,
    half_of,
    jsd_block,
    log_probs,
    row_pieces,
    source_logsumexp,
    valid_token_ids,
    valid_values,
)

U_FLOOR_ULPS = 64
"""group_step_jsd: u below this many machine epsilons of the compute dtype is rounding noise: 0."""


@torch.no_grad()
def group_step_jsd(
    hidden: Tensor,
    head_weight: Tensor | None,
    keys: Tensor,
    temperature: float = 1.0,
    mask: Tensor | None = None,
    head_bias: Tensor | None = None,
    logsumexp: Tensor | None = None,
    *,
    leave_out: bool = False,
    all_reduce: Callable[[Tensor], Tensor] | None = None,
    all_keys: Tensor | None = None,
    chunk_positions: int = CHUNK_POSITIONS,
    chunk_vocab: int = CHUNK_VOCAB,
) -> Tensor:
    """u_i = JSD(p_i ‖ mean of p over the positions sharing i's key) in nats, (...), in [0, ln 2].

    With keys = (group, step) this is ICT's uniqueness u_{i,t} = JSD(p_{i,t} ‖ P̄_t) (METHODS §3);
    with keys = the response, resp. the group, it is the response-mean, resp. group-pooled
    reading of the reference, and with leave_out=True the group-step reading that leaves the
    response out (stages.core.statistics.deviations.DEVIATIONS composes the keys of each).

    p = softmax(z / T) over the full vocabulary, z from hidden (..., D) × head_weight (V, D)
    [+ head_bias (V,)], or hidden read as materialised logits (..., V) when head_weight is None.
    keys (...) integer: the key of each position, composed by the caller (e.g.
    group * max_len + step). The reference of a key is the mean of p over the valid positions with
    that key: padding (mask 0 / False) is excluded from the mean (ours; the paper does not say how
    unequal lengths are handled), is never computed, and holds 0 in the result. A key that one
    position alone holds (a step where one response of the group is still active) has a reference
    equal to p bit for bit, so u = 0 exactly. Returned in the compute dtype (float32; float64 for
    float64 input). logsumexp (...), e.g. from :func:`chunked_token_statistics`, saves the first
    pass.

    leave_out: the reference of row i with key k is (S_k − p_i) / (n_k − 1), S_k the float64 sum
    of p over the key's n_k rows (over every rank), the difference clamped at 0 against rounding.
    A key that one row alone holds leaves no reference: its u is 0 (ours).

    Resolution: u below U_FLOOR_ULPS machine epsilons of the compute dtype (7.6e-6 nats in
    float32, 1.4e-14 in float64) is set to exactly 0. Where a group's responses agree (the same
    context, so the same distribution up to rounding) the computed u is rounding noise, and ICT
    ranks positions by u: with the floor, such positions tie at 0 and the tie goes to the earliest
    position, so the mask does not depend on the noise (ours; checked against a float64
    recomputation of the default run's token statistics).

    Memory: the valid rows are sorted by key (stably, so ties keep position order). Keys are
    visited in blocks of whole keys of at most chunk_positions rows in all (counted over every
    rank); for each block and chunk of chunk_vocab entries, p of its rows, the per-key sums of
    that chunk (index_add, float64) and the JSD terms of each row against its key's reference are
    formed, one pass over the vocabulary after the logsumexp pass. A key of more rows than
    chunk_positions (a whole response, or a whole group of 8 × 2,048 positions, as one key) is
    visited on its own in sub-blocks of chunk_positions rows, in two passes: its full-vocabulary
    sum (V,) float64 first, then the JSD terms, each row's p computed twice. Without logsumexp
    and with a head, a block holds at most CACHE_BLOCKS · chunk_positions · chunk_vocab / V rows
    (441 at the defaults and V = 151,936), whose logits over the whole vocabulary are formed once
    and kept between the logsumexp and the divergences, so the head's matmul runs once per row
    (a larger key, and materialised logits, as before). Nothing larger than chunk_positions ×
    chunk_vocab (a few buffers of it, CACHE_BLOCKS of them for the kept logits, two for a
    float64 copy of a block's p) or keys × V (for the keys of one block, whose count is bounded
    by chunk_positions) ever exists.

    Ranks: when a key's rows sit on several processes, all_reduce (sums a tensor over the ranks,
    returning the sum) is applied to the per-key counts once, to every block's per-key sums of
    each vocabulary chunk, and to every large key's (V,) sum, and all_keys (1-D, sorted unique
    keys of every rank, gathered by the caller) fixes the blocks (from the summed counts), so that
    every rank makes the same collective calls in the same order, also for blocks in which it
    holds no row. The float64 sums make u independent of how rows are split, to rounding. Without
    all_reduce, all_keys defaults to this call's unique keys.
    """
    return group_step_reference(
        hidden, head_weight, keys, temperature, mask, head_bias, logsumexp, leave_out=leave_out,
        all_reduce=all_reduce, all_keys=all_keys, chunk_positions=chunk_positions,
        chunk_vocab=chunk_vocab)["u"]


REFERENCE_FIELDS = ("prob", "beta", "key_sum", "own", "count")
"""What :func:`group_step_reference` returns per position beside u, float64 (METHODS §3, ours):

- ``prob``     the reference's probability of the position's token, P̄(y) (ICT: P̄_t(y_{i,t}));
- ``beta``     β = Σ_a P̄(a)², the reference's collision probability (1/V ≤ β ≤ 1);
- ``key_sum``  S_k(y) = Σ_j p_j(y) over the key's rows j, the row itself included, whatever
  leave_out says (so that a caller can leave out another part of the key: :func:`mean_without`);
- ``own``      p_i(y), the position's own probability of its token, from the same blocks;
- ``count``    n_k, the key's rows (over every rank).

Leaving the row out, prob and beta are those of (S_k − p_i) / (n_k − 1), NaN for a lone row
(it has no reference)."""


@torch.no_grad()
def group_step_reference(
    hidden: Tensor,
    head_weight: Tensor | None,
    keys: Tensor,
    temperature: float = 1.0,
    mask: Tensor | None = None,
    head_bias: Tensor | None = None,
    logsumexp: Tensor | None = None,
    *,
    token_ids: Tensor | None = None,
    leave_out: bool = False,
    all_reduce: Callable[[Tensor], Tensor] | None = None,
    all_keys: Tensor | None = None,
    chunk_positions: int = CHUNK_POSITIONS,
    chunk_vocab: int = CHUNK_VOCAB,
) -> dict[str, Tensor]:
    """:func:`group_step_jsd` (``u``) and, with token_ids (...), the reference's probability of
    each position's token and its β, from the same pass over the vocabulary (REFERENCE_FIELDS).

    Arguments, u, blocks, ranks and memory as :func:`group_step_jsd`. The extras read the float64
    per-key sums that u's references are made of, at the column of each row's token (a gather per
    vocabulary chunk) and, for β, their squares summed over each chunk (of the key's mean; of each
    row's own reference leaving the row out, whose float64 block exists anyway): nothing of size
    positions × V is added, and no collective call (they read the sums after all_reduce). A key
    that one row alone holds has prob = own exactly (its sum is the row's p) and β = Σ p². The
    extras are float64 (..., 0 at masked positions); u is in the compute dtype.
    """
    src = LogitSource(hidden, head_weight, temperature, mask, head_bias, chunk_positions,
                      chunk_vocab)
    if keys.shape != src.shape:
        raise ValueError(f"keys shape {tuple(keys.shape)} != positions {tuple(src.shape)}")
    if keys.dtype.is_floating_point or keys.dtype.is_complex or keys.dtype == torch.bool:
        raise ValueError(f"keys must be integers, got {keys.dtype}")
    row_keys, order = torch.sort(keys.reshape(-1).to(src.device)[src.rows].long(), stable=True)
    src.reorder(order)  # the rows of a key are now contiguous
    ids = None if token_ids is None else valid_token_ids(src, token_ids)  # (N_valid,) sorted rows
    # without a logsumexp, each block's is formed block by block below: with a head, from
    # logits kept for the block's second pass (fill), in blocks of at most cache_rows() rows
    keep = logsumexp is None and src.head is not None
    lse = (torch.empty(src.n, dtype=src.dtype, device=src.device) if logsumexp is None
           else valid_values(src, logsumexp))  # (N_valid,)
    if all_keys is None:
        if all_reduce is not None:
            raise ValueError("all_reduce needs all_keys: the sorted unique keys of every rank")
        all_keys = torch.unique_consecutive(row_keys)  # (K,)
    else:
        all_keys = all_keys.to(src.device).long()
        if all_keys.dim() != 1 or not bool((all_keys[1:] > all_keys[:-1]).all()):
            raise ValueError("all_keys must be 1-D, sorted and unique")
    n_keys = all_keys.numel()
    out = torch.zeros(src.n, dtype=src.dtype, device=src.device)  # (N_valid,)
    extras = None if ids is None else {
        f: torch.zeros(src.n, dtype=torch.float64, device=src.device) for f in ("key_sum", "own", "beta")}
    if n_keys == 0:
        return _reference_result(src, out, extras, None, leave_out)
    key_index = torch.searchsorted(all_keys, row_keys)  # (N_valid,) into all_keys
    if src.n and not bool((all_keys[key_index.clamp(max=n_keys - 1)] == row_keys).all()):
        raise ValueError("keys missing from all_keys")
    local_counts = torch.bincount(key_index, minlength=n_keys)  # (K,)
    counts = local_counts.to(torch.float64)
    if all_reduce is not None:
        counts = all_reduce(counts)
    # row range of each key in the sorted local rows; blocks from the global counts only
    start = torch.cat([local_counts.new_zeros(1), local_counts.cumsum(0)]).tolist()
    # the reference's divisor: n_k, or n_k − 1 leaving the row out (1 for a lone key: u = 0 below)
    divisor = (counts - 1.0 if leave_out else counts).clamp_min(1.0)  # (K,)
    # blocks from chunk_positions itself, not from this rank's share of rows (src.cp)
    limit = min(chunk_positions, src.cache_rows()) if keep else chunk_positions
    for k0, k1 in _key_blocks(counts.round().long().tolist(), limit):
        a, b = start[k0], start[k1]
        if a == b and all_reduce is None:
            continue  # keys of all_keys that no row here holds, and no rank to answer
        large = k1 - k0 == 1 and float(counts[k0]) > chunk_positions  # read twice: not kept
        if logsumexp is None and b > a:
            lse[a:b] = (src.fill(a, b) if keep and not large and b - a <= src.cache_rows()
                        else source_logsumexp(src, a, b))
        block = None if extras is None else {f: v[a:b] for f, v in extras.items()}  # views
        row_ids = None if ids is None else ids[a:b]
        if large:
            out[a:b] = _large_key_jsd(src, lse, a, b, float(divisor[k0]), leave_out, all_reduce,
                                      row_ids, block)
        else:
            out[a:b] = _key_block_jsd(src, lse, a, b, key_index[a:b] - k0, divisor[k0:k1],
                                      leave_out, all_reduce, row_ids, block)
        src.release()
    if leave_out:
        out[counts[key_index] < 2] = 0.0  # a lone row: no other response to compare with
    out.clamp_(0.0, LN2)
    out[out < U_FLOOR_ULPS * torch.finfo(out.dtype).eps] = 0.0
    return _reference_result(src, out, extras, counts[key_index], leave_out)


def _reference_result(src: LogitSource, u: Tensor, extras: dict[str, Tensor] | None,
                      count: Tensor | None, leave_out: bool) -> dict[str, Tensor]:
    """group_step_reference's dict, every value scattered to the positions' shape; extras
    (key_sum, own, beta per sorted valid row) and count (N_valid,) float64 become
    REFERENCE_FIELDS."""
    if extras is None:
        return {"u": src.scatter(u)}
    if count is None:  # no valid position
        count = torch.zeros(src.n, dtype=torch.float64, device=src.device)
    # the reference's probability of the token: the key's mean, without the row's own p(y)
    # leaving it out
    prob = (mean_without(extras["key_sum"], count, extras["own"]) if leave_out
            else mean_without(extras["key_sum"], count, torch.zeros_like(count), 0.0))
    if leave_out:
        extras["beta"][count < 2] = math.nan  # no reference: nothing to square
    values = {"prob": prob, "beta": extras["beta"], "key_sum": extras["key_sum"],
              "own": extras["own"], "count": count}
    return {"u": src.scatter(u), **{f: src.scatter(values[f]) for f in REFERENCE_FIELDS}}


def mean_without(total: Tensor, count: Tensor, part: Tensor, part_count: Tensor | float = 1.0
                 ) -> Tensor:
    """(total − part) / (count − part_count), float64: the mean over a set of `count` members
    whose sum is `total`, with a part of `part_count` members summing to `part` left out (one
    row: its own value and 1; a response: its own sum and length). Clamped at 0, since the
    difference of two float sums can round below 0 where the rest holds ~0; NaN where nothing is
    left (count − part_count < 1). All broadcast; counts are whole numbers."""
    left = torch.as_tensor(count, dtype=torch.float64) - part_count  # (...)
    rest = total.double() - part.double()
    return torch.where(left > 0.5, _divide_rest(rest, left.clamp_min(1.0)),
                       torch.tensor(math.nan, dtype=torch.float64, device=rest.device))


def _divide_rest(rest: Tensor, divisor: Tensor | float) -> Tensor:
    """rest / divisor clamped at 0, in place (rest float64: a sum minus the part left out, which
    can round below 0 where the others' values are ~0); divisor ≥ 1."""
    return rest.div_(divisor).clamp_min_(0.0)


def _key_blocks(counts: list[int], limit: int) -> list[tuple[int, int]]:
    """Consecutive key ranges [k0, k1) of at most `limit` rows in all; a key of more rows alone.

    counts are the rows of each key over every rank, so every rank forms the same blocks."""
    blocks, k0, rows = [], 0, 0
    for k, n in enumerate(counts):
        if k > k0 and rows + n > limit:
            blocks.append((k0, k))
            k0, rows = k, 0
        rows += n
    if k0 < len(counts):
        blocks.append((k0, len(counts)))
    return blocks


def _at_tokens(values: Tensor, ids: Tensor, c0: int, c1: int, rows: Tensor | None = None) -> Tensor:
    """(n,) float64: each row's entry at its token's column of a vocabulary chunk [c0, c1), 0 for
    a row whose token lies outside it; values (m, c1 − c0) holds row r's entries in its row r,
    or in its row rows[r]."""
    local = ids - c0
    inside = (local >= 0) & (local < c1 - c0)
    which = torch.arange(ids.numel(), device=ids.device) if rows is None else rows
    return torch.where(inside, values[which, local.clamp(0, c1 - c0 - 1)].double(), 0.0)


@dataclass(frozen=True)
class _Piece:
    """Rows [r0, r1) of a block's sorted rows, within the block: keys [k0, k1) of the block with
    `rows` rows each, so that they view as (keys, rows, v). A key of more rows than a piece is
    split over several pieces; first / last: the piece holds the key's first / last rows."""

    r0: int
    r1: int
    k0: int
    k1: int
    rows: int
    first: bool = True
    last: bool = True


def _key_pieces(counts: list[int], limit: int) -> list[_Piece]:
    """The pieces of a block, in row order, from the rows of each of its keys here (counts):
    consecutive keys of one count together, up to `limit` rows, and a key of more rows in pieces
    of at most `limit` (the last one never a single row, see row_pieces); keys without rows here
    are in no piece."""
    pieces, r, k = [], 0, 0
    while k < len(counts):
        c = counts[k]
        if c > limit:
            for j0, j1 in row_pieces(c, limit):
                pieces.append(_Piece(r + j0, r + j1, k, k + 1, j1 - j0, j0 == 0, j1 == c))
            k1 = k + 1
        else:
            k1 = k + 1
            while k1 < len(counts) and counts[k1] == c and (k1 + 1 - k) * c <= limit:
                k1 += 1
            if c:
                pieces.append(_Piece(r, r + (k1 - k) * c, k, k1, c))
        r, k = r + (k1 - k) * c, k1
    return pieces


def _probs_and_sums(src: LogitSource, z: Tensor, lse: Tensor, piece: _Piece, sums: Tensor,
                    keep: bool) -> tuple[Tensor, Tensor]:
    """(p, log p) of a piece's rows, each (keys, rows, v) (src.piece_probs: p in z's place, log p
    kept for the block when `keep`), p added to the float64 sums (k, v) of its keys row after
    row, the sums index_add_ forms (torch.sum's order over rows depends on the shapes)."""
    p, logp = src.piece_probs(z, lse, piece.r0, piece.r1, keep)
    shape = (piece.k1 - piece.k0, piece.rows, p.shape[-1])
    p, logp = p.view(shape), logp.view(shape)
    acc = sums[piece.k0:piece.k1]  # (keys, v)
    # widened once, then added in float64: adding float32 rows to float64 ones element by
    # element converts each entry on its own, ~3x slower on a CPU; the same bits (exact casts)
    wide = src.scratch("wide", shape, torch.float64).copy_(p)
    if piece.first:
        acc.copy_(wide[:, 0])
    for j in range(1 if piece.first else 0, piece.rows):
        acc.add_(wide[:, j])
    return p, logp


def _row_sums(x: Tensor, alone: bool) -> Tensor:
    """x.sum(dim=-1), x (..., v) float64, with each row's sum as torch forms it inside a block of
    several rows: torch sums a tensor of a single row in two halves (one per thread), another
    rounding, so a lone row is summed beside a copy of itself, unless `alone` (its block has no
    other row: the sum it always had)."""
    if x.numel() == x.shape[-1] and not alone:
        return x.reshape(1, -1).expand(2, -1).sum(dim=1)[:1].reshape(x.shape[:-1])
    return x.sum(dim=-1)


def _piece_jsd(src: LogitSource, p: Tensor, logp: Tensor, piece: _Piece, sums: Tensor,
               divisor: Tensor, leave_out: bool, beta: Tensor | None, alone: bool) -> Tensor:
    """u's terms (piece rows,) of one vocabulary chunk: p and log p (keys, rows, v), sums (k, v)
    float64 over every rank, divisor (k,). A key's reference (and its log) is formed when the
    piece holds its first rows, then kept for its later pieces; leaving the row out, each row's
    own (adding its β's terms to beta (piece rows,) when given)."""
    k0, k1 = piece.k0, piece.k1
    if leave_out:
        rest = torch.sub(sums[k0:k1, None, :], p,  # (keys, rows, v) float64: S_k − p_i
                         out=src.scratch("wide", p.shape, torch.float64))
        ref = _leave_out_reference(rest, divisor[k0:k1, None, None], src.scratch("ref", p.shape))
        if beta is not None:  # rest now holds each row's float64 reference
            beta += _row_sums(rest.square_(), alone).reshape(-1)
        log_ref = log_probs(ref, out=src.scratch("log_ref", p.shape))
    else:
        shape = (k1 - k0, 1, p.shape[-1])
        ref, log_ref = src.scratch("ref", shape), src.scratch("log_ref", shape)
        half = src.scratch("half_ref", shape)
        if piece.first:  # exactly p for a lone key
            # divided in float64, then rounded once (a float64 / float64 division written to
            # float32 converts entry by entry, several times slower)
            mean = torch.div(sums[k0:k1, None], divisor[k0:k1, None, None],
                             out=src.scratch("mean", shape, torch.float64))
            ref.copy_(mean)
            log_probs(ref, out=log_ref)
            half_of(ref, out=half)
        return jsd_block(p, logp, ref, log_ref, src.piece_mix(p.shape), half).reshape(-1)
    return jsd_block(p, logp, ref, log_ref, src.piece_mix(p.shape)).reshape(-1)


def _key_block_jsd(src: LogitSource, lse: Tensor, a: int, b: int, local: Tensor, divisor: Tensor,
                   leave_out: bool, all_reduce: Callable[[Tensor], Tensor] | None,
                   ids: Tensor | None = None, extras: dict[str, Tensor] | None = None) -> Tensor:
    """u (b - a,) of sorted valid rows a..b holding whole keys; local (b - a,) the key of each row
    within the block, divisor (k,) float64 of each key. With ids (b - a,) the rows' tokens, adds
    each row's key_sum, own and beta (REFERENCE_FIELDS) of this block's chunks into extras.

    Each vocabulary chunk's block of logits is visited in pieces of rows (_key_pieces): p and its
    keys' float64 sums, then the JSD terms of the same rows while they are in the cache. Without
    all_reduce a piece's keys are complete when it ends (a split key's: with its last piece); with
    it, every key's sum goes through the collective first, so p of every piece is formed before
    any JSD term (p stays in the block's buffer)."""
    k, n = divisor.numel(), b - a
    u = torch.zeros(n, dtype=src.dtype, device=src.device)
    key_beta = None if extras is None or leave_out else torch.zeros(k, dtype=torch.float64,
                                                                    device=src.device)
    counts = torch.bincount(local, minlength=k).tolist()  # the rows of each key here
    lse = lse[a:b]
    for c0, c1 in src.vocab_chunks():
        sums = src.scratch("sums", (k, c1 - c0), torch.float64)  # (k, v)
        if n == 0 or 0 in counts:
            sums.zero_()  # keys no row here holds (other ranks' rows)
        if n == 0:
            all_reduce(sums)
            continue
        z = src.block(a, b, c0, c1)  # (n, v); p in its place after _probs_and_sums
        pieces = _key_pieces(counts, src.piece_rows(c1 - c0))
        if all_reduce is None:
            groups, pending = [], []
            for piece in pieces:
                pending.append(piece)
                if piece.last:
                    groups.append(pending)
                    pending = []
        else:
            groups = [pieces]
        probs: dict[int, tuple[Tensor, Tensor]] = {}
        for group in groups:
            for piece in group:
                probs[piece.r0] = _probs_and_sums(src, z, lse, piece, sums,
                                                  keep=len(group) > 1)
            if all_reduce is not None:
                sums = all_reduce(sums)
            for piece in group:
                beta = None if extras is None or not leave_out else extras["beta"][piece.r0:piece.r1]
                u[piece.r0:piece.r1] += _piece_jsd(src, *probs.pop(piece.r0), piece, sums,
                                                   divisor, leave_out, beta, alone=n == 1)
        if extras is not None:
            extras["key_sum"] += _at_tokens(sums, ids, c0, c1, rows=local)
            extras["own"] += _at_tokens(z, ids, c0, c1)  # p in z's place
            if key_beta is not None:  # the block's keys at once, as their sums' rows
                key_beta += sums.div_(divisor[:, None]).square().sum(dim=1)
    if key_beta is not None:
        extras["beta"] += key_beta[local]
    return u


def _large_key_jsd(src: LogitSource, lse: Tensor, a: int, b: int, divisor: float, leave_out: bool,
                   all_reduce: Callable[[Tensor], Tensor] | None, ids: Tensor | None = None,
                   extras: dict[str, Tensor] | None = None) -> Tensor:
    """u (b - a,) of sorted valid rows a..b, all of one key of more than chunk_positions rows
    (over every rank): the key's sum over the whole vocabulary first, then the JSD terms, in
    sub-blocks of chunk_positions rows (visited in pieces of rows, as _key_block_jsd). With ids
    (b - a,), extras as :func:`_key_block_jsd`."""
    sums = torch.zeros(src.vocab, dtype=torch.float64, device=src.device)  # (V,)
    for a1 in range(a, b, src.cp):
        b1 = min(a1 + src.cp, b)
        for c0, c1 in src.vocab_chunks():
            sums[c0:c1] += src.probs(a1, b1, c0, c1, lse).sum(dim=0, dtype=torch.float64)
    if all_reduce is not None:
        sums = all_reduce(sums)
    mean = None if leave_out else sums / divisor  # (V,) float64
    if extras is not None:
        extras["key_sum"] += sums[ids]
        if mean is not None:
            extras["beta"] += mean.square().sum()
    mean = None if mean is None else mean.to(src.dtype)
    u = torch.zeros(b - a, dtype=src.dtype, device=src.device)
    for a1 in range(a, b, src.cp):
        b1 = min(a1 + src.cp, b)
        for c0, c1 in src.vocab_chunks():
            z = src.block(a1, b1, c0, c1)  # (n, v); p in its place, piece by piece
            if not leave_out:
                ref = mean[None, c0:c1]  # (1, v)
                log_ref = log_probs(ref)
            for r0, r1 in row_pieces(b1 - a1, src.piece_rows(c1 - c0)):
                rows = slice(a1 - a + r0, a1 - a + r1)
                p, logp = src.piece_probs(z, lse[a1:b1], r0, r1)  # (m, v) each
                if leave_out:
                    rest = torch.sub(sums[None, c0:c1], p,  # (m, v) float64: S_k − p_i
                                     out=src.scratch("wide", p.shape, torch.float64))
                    ref = _leave_out_reference(rest, divisor, src.scratch("ref", p.shape))
                    if extras is not None:
                        extras["beta"][rows] += _row_sums(rest.square_(), alone=b1 - a1 == 1)
                    log_ref = log_probs(ref, out=src.scratch("log_ref", p.shape))
                u[rows] += jsd_block(p, logp, ref, log_ref, src.piece_mix(p.shape))
            if extras is not None:
                extras["own"][a1 - a:b1 - a] += _at_tokens(z, ids[a1 - a:b1 - a], c0, c1)
    return u


def _leave_out_reference(rest: Tensor, divisor: Tensor | float, out: Tensor) -> Tensor:
    """rest / divisor clamped at 0 (_divide_rest, in place: rest holds it after), written into
    out in its dtype; rest (n, v) float64 holds S − p, divisor (n, 1) or a float."""
    return out.copy_(_divide_rest(rest, divisor))
