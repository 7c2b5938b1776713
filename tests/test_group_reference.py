"""The reference's probability of the picked token, P̄(y), the same with the response left out, and
the reference's β = Σ_a P̄(a)² (stats.group_step_reference, scorer.without_response), and the
diverged positions (stats.diverged_positions): hand-computed cases, a float64 reference, bounds
(METHODS §3, §10)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from stages.core.statistics.scorer import DEVIATIONS, deviation_reference, without_response
from stages.core.statistics.stats import (
    REFERENCE_FIELDS,
    diverged_positions,
    group_step_jsd,
    group_step_reference,
    mean_without,
)
from tests.test_group_jsd import V, lone_steps, problem, reading_layout

# One group of three responses at one step, V = 4: ICT's P̄_t is their mean (METHODS §3).
HAND = torch.tensor([[0.5, 0.25, 0.125, 0.125],
                     [0.25, 0.5, 0.125, 0.125],
                     [0.5, 0.25, 0.25, 0.0]], dtype=torch.float64)
HAND_TOKENS = torch.tensor([0, 1, 2])


def reference_values(logits, keys, mask, ids, temperature, leave_out=False):
    """Float64 prob, beta, key_sum, own, count per position with explicit loops: softmax, the rows
    of each key, their mean (of the other rows with leave_out; none: NaN)."""
    logits, keys, mask, ids = (np.asarray(x) for x in (logits, keys, mask, ids))
    p = torch.softmax(torch.from_numpy(logits.reshape(-1, logits.shape[-1])).double() / temperature,
                      dim=-1).numpy()
    k, m, y = keys.reshape(-1), mask.reshape(-1).astype(bool), ids.reshape(-1)
    out = {f: np.zeros(len(k)) for f in REFERENCE_FIELDS}
    for r in np.flatnonzero(m):
        rows = np.flatnonzero(m & (k == k[r]))
        others = rows[rows != r] if leave_out else rows
        out["key_sum"][r] = p[rows, y[r]].sum()
        out["own"][r] = p[r, y[r]]
        out["count"][r] = len(rows)
        if others.size == 0:
            out["prob"][r] = out["beta"][r] = math.nan
            continue
        mean = p[others].mean(axis=0)
        out["prob"][r] = mean[y[r]]
        out["beta"][r] = np.sum(mean**2)
    return {f: v.reshape(mask.shape) for f, v in out.items()}


def test_hand_computed_group_step():
    """P̄ = [1.25, 1, 0.5, 0.25] / 3 and β = (1.5625 + 1 + 0.25 + 0.0625) / 9 = 2.875 / 9; the
    picked tokens 0, 1, 2 have P̄(y) = 1.25/3, 1/3, 0.5/3. Leaving each response out, the other
    two's mean is [0.375, 0.375, 0.1875, 0.0625], [0.5, 0.25, 0.1875, 0.0625] and
    [0.375, 0.375, 0.125, 0.125]: P̄(y) = 0.375, 0.25, 0.125 and β = 0.3203125, 0.3515625, 0.3125."""
    keys = torch.zeros(3, dtype=torch.long)
    r = group_step_reference(HAND.log(), None, keys, token_ids=HAND_TOKENS, chunk_vocab=3)
    torch.testing.assert_close(r["prob"], torch.tensor([1.25, 1.0, 0.5], dtype=torch.float64) / 3,
                               rtol=0, atol=1e-15)
    torch.testing.assert_close(r["beta"], torch.full((3,), 2.875 / 9, dtype=torch.float64),
                               rtol=0, atol=1e-15)
    torch.testing.assert_close(r["own"], torch.tensor([0.5, 0.5, 0.25], dtype=torch.float64),
                               rtol=0, atol=1e-15)
    assert r["count"].tolist() == [3.0, 3.0, 3.0]
    loo = group_step_reference(HAND.log(), None, keys, token_ids=HAND_TOKENS, leave_out=True,
                               chunk_positions=1, chunk_vocab=2)  # a key larger than a block
    torch.testing.assert_close(loo["prob"], torch.tensor([0.375, 0.25, 0.125], dtype=torch.float64),
                               rtol=0, atol=1e-15)
    torch.testing.assert_close(loo["beta"], torch.tensor([0.3203125, 0.3515625, 0.3125],
                                                         dtype=torch.float64), rtol=0, atol=1e-15)
    # the same prob from the whole key's sum (what without_response uses)
    torch.testing.assert_close(mean_without(r["key_sum"], r["count"], r["own"]), loo["prob"],
                               rtol=0, atol=1e-15)
    assert r["key_sum"].tolist() == loo["key_sum"].tolist()


def test_a_token_no_other_response_shares():
    """At a step where the other active responses give the picked token no probability (logit
    −inf), P̄_t(y) = p_i(y) / n_active exactly (n_active, not the group's size: response 2 has
    ended at step 1), and the mean of the others is 0, in every dtype the stage runs."""
    p = torch.tensor([[[0.5, 0.25, 0.125, 0.125], [0.75, 0.25, 0.0, 0.0]],
                      [[0.25, 0.5, 0.125, 0.125], [0.0, 0.5, 0.5, 0.0]],
                      [[0.5, 0.25, 0.25, 0.0], [0.0, 0.0, 0.0, 1.0]]], dtype=torch.float64)
    mask = torch.tensor([[True, True], [True, True], [True, False]])
    keys = torch.arange(2).expand(3, 2).contiguous()
    ids = torch.tensor([[0, 0], [1, 2], [2, 0]])
    for dtype, tol in [(torch.float64, 1e-15), (torch.float32, 1e-7), (torch.bfloat16, 1e-2)]:
        for cp, cv in [(1, 1), (2, 3), (100, 100)]:
            r = group_step_reference(p.log().to(dtype), None, keys, mask=mask, token_ids=ids,
                                     chunk_positions=cp, chunk_vocab=cv)
            assert r["count"][:, 1].tolist() == [2.0, 2.0, 0.0]
            assert r["prob"][0, 1] == r["own"][0, 1] / 2 and r["prob"][1, 1] == r["own"][1, 1] / 2
            assert float(r["own"][0, 1]) == pytest.approx(0.75, abs=tol)
            assert float(r["own"][1, 1]) == pytest.approx(0.5, abs=tol)
            loo = group_step_reference(p.log().to(dtype), None, keys, mask=mask, token_ids=ids,
                                       leave_out=True, chunk_positions=cp, chunk_vocab=cv)
            assert loo["prob"][0, 1] == 0.0 and loo["prob"][1, 1] == 0.0
            assert mean_without(r["key_sum"], r["count"], r["own"])[0, 1] == 0.0


def test_a_lone_row_is_its_own_reference_and_has_none_left_out():
    hidden, weight, bias, mask, keys = problem(seed=21)
    ids = torch.randint(0, V, mask.shape, generator=torch.Generator().manual_seed(0))
    lone = lone_steps(mask, keys)
    assert lone.sum() == 3
    r = group_step_reference(hidden, weight, keys, 0.8, mask, bias, token_ids=ids,
                             chunk_positions=3, chunk_vocab=5)
    assert torch.equal(r["prob"][lone], r["own"][lone])  # bit for bit: the sum is p itself
    loo = group_step_reference(hidden, weight, keys, 0.8, mask, bias, token_ids=ids,
                               leave_out=True, chunk_positions=3, chunk_vocab=5)
    assert loo["prob"][lone].isnan().all() and loo["beta"][lone].isnan().all()
    assert not loo["prob"][mask & ~lone].isnan().any()
    for field in REFERENCE_FIELDS:  # padding holds 0
        assert r[field][~mask].abs().sum() == 0 and loo[field][~mask].abs().sum() == 0


@pytest.mark.parametrize("name", ["paper", "response_mean", "group_pooled", "group_leave_one_out"])
@pytest.mark.parametrize("chunks", [(3, 5), (1, 1), (1000, 1000)])
def test_every_reading_matches_a_float64_reference(name, chunks):
    """Materialised logits and a head with bias; chunk_positions 1 and 3 make the groups and the
    long responses keys larger than a block; u is group_step_jsd's, bit for bit."""
    hidden, weight, bias, _, _ = problem(seed=22)
    mask, keys, leave_out = reading_layout(name)
    ids = torch.randint(0, V, mask.shape, generator=torch.Generator().manual_seed(1))
    logits = hidden @ weight.T + bias
    want = reference_values(logits, keys, mask, ids, 0.7, leave_out)
    cp, cv = chunks
    for h, w, b in [(logits, None, None), (hidden, weight, bias)]:
        r = group_step_reference(h, w, keys, 0.7, mask, b, token_ids=ids, leave_out=leave_out,
                                 chunk_positions=cp, chunk_vocab=cv)
        assert set(r) == {"u", *REFERENCE_FIELDS}
        for field in REFERENCE_FIELDS:
            assert r[field].dtype == torch.float64
            np.testing.assert_allclose(r[field].numpy(), want[field], rtol=0, atol=1e-13,
                                       err_msg=field)
        assert torch.equal(r["u"], group_step_jsd(h, w, keys, 0.7, mask, b, leave_out=leave_out,
                                                  chunk_positions=cp, chunk_vocab=cv))
    assert np.nanmin(want["prob"][mask.numpy()]) < np.nanmax(want["prob"][mask.numpy()])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_inputs_reduced_in_float32(dtype):
    """The stage's bf16 and float32 models: the extras are float64, from float32 blocks, within
    float32 rounding of a float64 reference of the same (rounded) inputs."""
    hidden, weight, bias, mask, keys = problem(seed=23)
    ids = torch.randint(0, V, mask.shape, generator=torch.Generator().manual_seed(2))
    h, w, b = hidden.to(dtype), weight.to(dtype), bias.to(dtype)
    for leave_out in (False, True):
        r = group_step_reference(h, w, keys, 0.6, mask, b, token_ids=ids, leave_out=leave_out,
                                 chunk_positions=3, chunk_vocab=5)
        assert r["u"].dtype == torch.float32 and r["prob"].dtype == torch.float64
        want = reference_values(h.double() @ w.double().T + b.double(), keys, mask, ids, 0.6,
                                leave_out)
        for field in REFERENCE_FIELDS:
            np.testing.assert_allclose(r[field].numpy(), want[field], rtol=0, atol=2e-6,
                                       err_msg=f"{dtype} {field}")


@settings(max_examples=60, deadline=None)
@given(
    z=st.integers(1, 9).flatmap(
        lambda n: st.integers(2, 30).flatmap(
            lambda v: arrays(np.float32, (n, v), elements=st.floats(-1, 1, width=32))
        )
    ),
    scale=st.sampled_from([1e-3, 1.0, 30.0, 1e3]),
    seed=st.integers(0, 2**16),
    chunk_positions=st.sampled_from([1, 2, 1000]),
)
@example(z=np.ones((1, 3), np.float32), scale=1e3, seed=0, chunk_positions=1)  # CI found it
def test_bounds(z, scale, seed, chunk_positions):
    """0 ≤ P̄(y) ≤ 1, P̄(y)² ≤ β, 1/V ≤ β ≤ 1, own ≤ key_sum; the key's mean is the mixture
    p_i/n + (n − 1)/n · (the mean of the others), and the others' mean is the leave-out
    reference, NaN only where the row is alone."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.from_numpy(z) * scale  # (N, V)
    n, vocab = z.shape
    keys = torch.randint(0, 3, (n,), generator=g)
    mask = torch.rand(n, generator=g) > 0.2
    ids = torch.randint(0, vocab, (n,), generator=g)
    r = group_step_reference(logits, None, keys, 0.7, mask, token_ids=ids,
                             chunk_positions=chunk_positions, chunk_vocab=3)
    loo = group_step_reference(logits, None, keys, 0.7, mask, token_ids=ids, leave_out=True,
                               chunk_positions=chunk_positions, chunk_vocab=3)
    # float32 blocks: log-softmax of z / T rounds log p to a float32 ulp of |z / T|, so the
    # probabilities carry a relative error of that size (1.4e-5 in β at |z / T| = 1429)
    eps = 1e-6 + 2 * torch.finfo(torch.float32).eps * float(logits.abs().max()) / 0.7
    lone = lone_steps(mask[None], keys[None])[0]
    shared = mask & ~lone
    for ref, rows in ((r, mask), (loo, shared)):
        prob, beta = ref["prob"][rows], ref["beta"][rows]
        assert ((prob >= 0) & (prob <= 1 + eps)).all()
        assert ((beta >= 1 / vocab - eps) & (beta <= 1 + eps)).all()
        assert (prob.square() <= beta + eps).all()
    assert (r["own"][mask] <= r["key_sum"][mask] + eps).all()
    assert loo["prob"][lone].isnan().all() and not loo["prob"][shared].isnan().any()
    count = r["count"][shared]
    mix = r["own"][shared] / count + (count - 1) / count * loo["prob"][shared]
    torch.testing.assert_close(r["prob"][shared], mix, rtol=1e-5, atol=1e-7)


def test_mean_without_by_hand():
    total = torch.tensor([1.0, 0.6, 0.3, 0.5], dtype=torch.float64)
    count = torch.tensor([4.0, 3.0, 2.0, 2.0], dtype=torch.float64)
    part = torch.tensor([0.25, 0.6, 0.3 + 1e-17, 0.5], dtype=torch.float64)
    got = mean_without(total, count, part, torch.tensor([1.0, 1.0, 1.0, 2.0], dtype=torch.float64))
    assert got[:3].tolist() == [0.25, 0.0, 0.0]  # 0.75 / 3; nothing left of the sum (clamped)
    assert got[3].isnan()  # nothing left of the set


# ---------------------------------------------------------------------------------------------
# The response left out of each reading's reference (scorer.without_response)
# ---------------------------------------------------------------------------------------------
def test_without_response_for_every_reading():
    """One group of three responses of lengths 3, 2, 1 (materialised logits): at a step, the mean
    of the other active responses; of the response's own mean, nothing; of the group's pooled
    mean, the other responses' positions."""
    g = torch.Generator().manual_seed(24)
    lengths, groups = [3, 2, 1], [0, 0, 0]
    logits = torch.randn(6, V, generator=g, dtype=torch.float64)
    ids = torch.randint(0, V, (6,), generator=g)
    p = torch.softmax(logits, dim=-1)
    response = torch.tensor([0, 0, 0, 1, 1, 2])
    step = torch.tensor([0, 1, 2, 0, 1, 0])
    refs = {name: deviation_reference(name, logits, None, groups, lengths, 1.0, token_ids=ids,
                                      chunk_positions=2, chunk_vocab=5)
            for name in DEVIATIONS}
    for r in range(6):
        y = int(ids[r])
        at_step = [j for j in range(6) if step[j] == step[r] and response[j] != response[r]]
        others = [j for j in range(6) if response[j] != response[r]]
        want_step = p[at_step, y].mean() if at_step else math.nan
        for name in ("group_jsd", "group_loo_jsd"):
            got = float(without_response(name, refs)[r])
            assert got == pytest.approx(float(want_step), abs=1e-15, nan_ok=True), (name, r)
        assert float(without_response("group_pooled_jsd", refs)[r]) == pytest.approx(
            float(p[others, y].mean()), abs=1e-15)
        assert math.isnan(float(without_response("response_mean_jsd", refs)[r]))
    # the leave-one-out reading's own reference is already without the response
    torch.testing.assert_close(without_response("group_loo_jsd", refs), refs["group_loo_jsd"]["prob"],
                               rtol=0, atol=0, equal_nan=True)
    with pytest.raises(ValueError, match="response_mean_jsd"):
        without_response("group_pooled_jsd", {"group_pooled_jsd": refs["group_pooled_jsd"]})


# ---------------------------------------------------------------------------------------------
# Diverged positions
# ---------------------------------------------------------------------------------------------
def test_diverged_positions_by_hand():
    """Group "a" (responses 0, 1, 3) shares the prefix [1, 2] up to step 2; at step 3, 0's
    prefix [1, 2, 3] is all of response 3, which has no token at step 3 (not active: it does not
    count), so 0 diverges there, and so does 1 ([1, 2, 7]). Group "b" (2, 4): [5] and [6] share
    step 0's empty prefix only. A response alone in its group (5) is diverged from its first step."""
    responses = [[1, 2, 3, 4], [1, 2, 7, 9, 9], [5, 7], [1, 2, 3], [6], [8, 8]]
    groups = ["a", "a", "b", "a", "b", "c"]
    got = diverged_positions(responses, groups).tolist()
    want = [[False, False, False, True], [False, False, False, True, True], [False, True],
            [False, False, False], [False], [True, True]]
    assert got == [x for w in want for x in w]
    # the same responses in another order give the same flags
    order = [5, 3, 1, 0, 4, 2]
    again = diverged_positions([responses[i] for i in order], [groups[i] for i in order]).tolist()
    assert again == [x for i in order for x in want[i]]
    with pytest.raises(ValueError, match="6 responses but 5 groups"):
        diverged_positions(responses, groups[:5])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.lists(st.integers(0, 2), min_size=1, max_size=6)),
                min_size=1, max_size=8))
def test_diverged_positions_by_definition(rows):
    """Against the definition, by brute force over prefixes."""
    groups = [g for g, _ in rows]
    responses = [r for _, r in rows]
    want = []
    for i, (g, r) in enumerate(rows):
        for t in range(len(r)):
            want.append(not any(j != i and h == g and len(s) > t and s[:t] == r[:t]
                                for j, (h, s) in enumerate(rows)))
    assert diverged_positions(responses, groups).tolist() == want
