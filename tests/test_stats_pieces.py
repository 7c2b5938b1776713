"""The piecewise kernels of stages.core.statistics.stats (in its blocks and uniqueness modules:
each block's rows visited in cache-sized pieces; ICT's u with one log per vocabulary entry)
against a straightforward float64 recomputation on awkward inputs, and their float64 sums bit
for bit as index_add_ forms them (METHODS §2–§3)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from stages.core.statistics import blocks
from stages.core.statistics.blocks import row_pieces
from stages.core.statistics.stats import (
    LN2,
    REFERENCE_FIELDS,
    group_step_reference,
    jensen_shannon,
    token_statistics,
)
from stages.core.statistics.uniqueness import _key_pieces, _Piece
from tests.test_group_jsd import reference
from tests.test_group_reference import reference_values

# the float64 references take log 0 at the -inf entries, which np.where then discards
pytestmark = pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning",
                                        "ignore:invalid value:RuntimeWarning")
B, T, V = 7, 9, 40
GROUPS = [0, 0, 0, 1, 1, 1, 2]  # group 0: three identical responses; group 2: one response
LENGTHS = [9, 9, 9, 9, 4, 6, 5]  # response 3 alone in its group at steps 6..8


def awkward(seed: int = 0):
    """(logits (B, T, V) float64, mask (B, T), token ids (B, T)): group 0's responses identical
    (their u is 0), four tied logits in every row, -inf at entry 0 everywhere (p = 0 and the
    reference 0 there) and at entry 1 for response 3 only (p = 0 where the reference is not),
    logits of scale 4, lone keys (response 3's late steps, all of response 6), and NaN at every
    masked position (never to be read)."""
    g = torch.Generator().manual_seed(seed)
    logits = 4.0 * torch.randn(B, T, V, generator=g, dtype=torch.float64)
    logits[1:3] = logits[0]  # group 0: identical responses
    logits[..., 2:6] = logits[..., 2:3]  # ties within each distribution
    logits[..., 0] = -math.inf
    logits[3, :, 1] = -math.inf
    mask = torch.arange(T)[None, :] < torch.tensor(LENGTHS)[:, None]
    logits[~mask] = math.nan
    ids = torch.randint(0, V, (B, T), generator=g)
    return logits, mask, ids


def keys_of(reading: str) -> torch.Tensor:
    """(B, T) keys: the group and step (ICT's rule), the response, or the group."""
    group = torch.tensor(GROUPS)[:, None].expand(B, T)
    if reading == "step":
        return group * T + torch.arange(T)[None, :]
    if reading == "response":
        return torch.arange(B)[:, None].expand(B, T).contiguous()
    return group.contiguous()


PIECES = {"default": blocks.PIECE_BYTES, "tiny": 64}  # 64 bytes: pieces of two rows of 7 floats
CHUNKS = [(4, 7), (3, 40), (1024, 32768)]  # chunk_positions 3 and 4: keys larger than a block


@pytest.mark.parametrize("reading,leave_out", [("step", False), ("step", True),
                                               ("response", False), ("group", False),
                                               ("group", True)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_pieces_equal_a_float64_recomputation(monkeypatch, reading, leave_out, dtype):
    """u and the reference fields of materialised logits (ties, -inf entries, lone keys, masked
    NaN, keys larger than chunk_positions, leaving the row out) against explicit float64 loops;
    u is exactly 0 where a key's rows agree or a row is alone, and the fields are the same bits
    whatever the pieces."""
    logits, mask, ids = awkward()
    keys = keys_of(reading)
    z = logits.to(dtype)
    exact = z.double()  # the same inputs, computed in float64
    u_ref = reference(exact.nan_to_num(0.0), keys, mask, 0.8, leave_out)
    fields_ref = reference_values(exact.nan_to_num(0.0), keys, mask, ids, 0.8, leave_out)
    # float32: u to ~eps·(H(p) + H(q)) (blocks.jsd_block), p to ~eps·|z − logsumexp| relative
    atol, rtol = (1e-12, 1e-12) if dtype == torch.float64 else (2e-6, 5e-6)
    agree = (mask & (torch.tensor(GROUPS)[:, None] == 0)) if reading == "step" else None
    fields_by_pieces = {}
    for piece_name, piece_bytes in PIECES.items():
        monkeypatch.setattr(blocks, "PIECE_BYTES", piece_bytes)
        for cp, cv in CHUNKS:
            out = group_step_reference(z, None, keys, 0.8, mask, token_ids=ids, leave_out=leave_out,
                                       chunk_positions=cp, chunk_vocab=cv)
            u = out["u"]
            assert u.dtype == dtype and torch.isfinite(u).all()
            np.testing.assert_allclose(u.double().numpy(), u_ref, rtol=0, atol=atol,
                                       err_msg=f"{piece_name} {cp} {cv}")
            assert (u >= 0).all() and (u <= LN2).all() and (u[~mask] == 0).all()
            lone = torch.from_numpy(u_ref == 0) & mask  # rows alone, or without a reference
            assert (u[lone] == 0).all()
            if agree is not None:  # group 0's identical responses: exactly 0, not noise
                assert (u[agree] == 0).all()
            for field in REFERENCE_FIELDS:
                np.testing.assert_allclose(out[field][mask].numpy(), fields_ref[field][mask],
                                           rtol=rtol, atol=1e-12, equal_nan=True, err_msg=field)
                fields_by_pieces.setdefault((cp, cv, field), []).append(out[field])
    for key, values in fields_by_pieces.items():
        assert all(torch.equal(v.nan_to_num(-1.0), values[0].nan_to_num(-1.0))
                   for v in values), key


@pytest.mark.parametrize("leave_out", [False, True])
def test_bf16_head_equals_a_float64_recomputation(monkeypatch, leave_out):
    """bf16 hidden states and head (the CPU's paper-scale dtype), reduced in float32 piece by
    piece, against float64 of the same bf16 values."""
    monkeypatch.setattr(blocks, "PIECE_BYTES", 200)
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(B, T, 16, generator=g).to(torch.bfloat16)
    weight = (0.7 * torch.randn(V, 16, generator=g)).to(torch.bfloat16)
    keys, mask = keys_of("step"), torch.arange(T)[None, :] < torch.tensor(LENGTHS)[:, None]
    ids = torch.randint(0, V, (B, T), generator=g)
    logits = hidden.double() @ weight.double().T
    out = group_step_reference(hidden, weight, keys, 0.6, mask, token_ids=ids, leave_out=leave_out,
                               chunk_positions=5, chunk_vocab=16)
    assert out["u"].dtype == torch.float32
    np.testing.assert_allclose(out["u"].double().numpy(),
                               reference(logits, keys, mask, 0.6, leave_out), rtol=0, atol=2e-6)
    ref = reference_values(logits, keys, mask, ids, 0.6, leave_out)
    for field in REFERENCE_FIELDS:
        np.testing.assert_allclose(out[field][mask].numpy(), ref[field][mask], rtol=1e-5,
                                   atol=1e-12, equal_nan=True, err_msg=field)


@pytest.mark.parametrize("piece_bytes", [1 << 21, 96, 1 << 30])
def test_key_sums_are_index_add_bit_for_bit(monkeypatch, piece_bytes):
    """key_sum is the float64 sum of p over the key's rows in row order, the bits index_add_
    gives: keys of 1 to 40 rows, split over pieces at 96 bytes a piece."""
    monkeypatch.setattr(blocks, "PIECE_BYTES", piece_bytes)
    counts = [1, 2, 3, 8, 16, 17, 40, 1]
    g = torch.Generator().manual_seed(4)
    keys = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))  # (N,) sorted
    n, v = keys.numel(), 24
    logits = 3.0 * torch.randn(n, v, generator=g)
    ids = torch.randint(0, v, (n,), generator=g)
    out = group_step_reference(logits, None, keys, token_ids=ids, chunk_positions=64, chunk_vocab=v)
    lse = token_statistics(logits)["logsumexp"]
    p = torch.exp(logits - lse[:, None])  # (N, V) as the library forms it, entry by entry
    sums = torch.zeros(len(counts), v, dtype=torch.float64).index_add_(0, keys, p.double())
    assert torch.equal(out["key_sum"], sums[keys, ids])
    assert torch.equal(out["own"], p[torch.arange(n), ids].double())


def test_row_pieces_never_leave_a_single_row():
    """A tensor of one row is summed by torch in two halves: no piece of one row but a block's."""
    assert row_pieces(5, 2) == [(0, 2), (2, 5)]
    assert row_pieces(17, 16) == [(0, 17)]
    assert row_pieces(32, 16) == [(0, 16), (16, 32)]
    assert row_pieces(1, 16) == [(0, 1)]
    assert row_pieces(7, 1) == [(0, 2), (2, 4), (4, 7)]
    assert row_pieces(0, 4) == []


def test_key_pieces_by_hand():
    """Keys of one count together up to the limit; a larger key split (no one-row tail); keys
    without rows here in none."""
    assert _key_pieces([8, 8, 8, 8, 8], 16) == [_Piece(0, 16, 0, 2, 8), _Piece(16, 32, 2, 4, 8),
                                                _Piece(32, 40, 4, 5, 8)]
    assert _key_pieces([3, 3, 1, 0, 1, 33, 2, 2], 16) == [
        _Piece(0, 6, 0, 2, 3), _Piece(6, 7, 2, 3, 1), _Piece(7, 8, 4, 5, 1),
        _Piece(8, 24, 5, 6, 16, True, False), _Piece(24, 41, 5, 6, 17, False, True),
        _Piece(41, 45, 6, 8, 2)]
    assert _key_pieces([0, 0], 4) == []


def test_jensen_shannon_with_zeros_and_ties_against_float64():
    """Zeros in p, in q, in both (0 · log 0 = 0), ties and a near-copy, float32 against float64."""
    p = torch.tensor([[0.5, 0.5, 0.0, 0.0, 0.0], [0.2, 0.2, 0.2, 0.2, 0.2],
                      [0.25, 0.25, 0.25, 0.25, 0.0], [0.6, 0.1, 0.1, 0.1, 0.1]],
                     dtype=torch.float64)
    q = torch.tensor([[0.0, 0.3, 0.7, 0.0, 0.0], [0.2, 0.2, 0.2, 0.2, 0.2],
                      [0.5, 0.5, 0.0, 0.0, 0.0], [0.6 + 1e-6, 0.1, 0.1, 0.1, 0.1 - 1e-6]],
                     dtype=torch.float64)

    def exact(a, b):
        m = 0.5 * (a + b)
        kl = [np.sum(np.where(x > 0, x * np.log(np.where(x > 0, x, 1.0) / np.where(m > 0, m, 1.0)),
                              0.0)) for x in (a, b)]
        return 0.5 * (kl[0] + kl[1])

    expected = [exact(a, b) for a, b in zip(p.numpy(), q.numpy(), strict=True)]
    np.testing.assert_allclose(jensen_shannon(p, q).numpy(), expected, rtol=0, atol=1e-15)
    np.testing.assert_allclose(jensen_shannon(p.float(), q.float()).double().numpy(), expected,
                               rtol=0, atol=1e-7)
    assert float(jensen_shannon(p[1], q[1])) == 0.0
    assert torch.equal(jensen_shannon(p, q), jensen_shannon(q, p))
