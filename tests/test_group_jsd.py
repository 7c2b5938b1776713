"""ICT's uniqueness u = JSD(p ‖ group-step mean) and the readings of its reference (the response's
own mean, the group's pooled mean, the group-step mean leaving the response out) against a float64
reference (METHODS §3)."""

from __future__ import annotations

import math
import os
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from scipy.spatial.distance import jensenshannon
from scipy.special import softmax

from stages.core.statistics.blocks import LogitSource
from stages.core.statistics.scorer import DEVIATIONS, deviation, deviation_keys, self_weight
from stages.core.statistics.stats import (
    LN2,
    REFERENCE_FIELDS,
    at_ceiling,
    chunked_token_statistics,
    group_step_jsd,
    group_step_reference,
    jsd_ceiling,
)
from stages.core.statistics.uniqueness import _key_blocks
from stages.launch import free_port

G, WIDTH, V, D = 3, 7, 13, 5
LENGTHS = [7, 4, 2, 5, 5, 1]  # two groups of three responses, right-padded to WIDTH


def layout(lengths=LENGTHS, width=WIDTH, group_size=G):
    """(mask (B, T) bool, keys (B, T) = group * width + step) of a right-padded batch."""
    steps = torch.arange(width)[None, :]
    mask = steps < torch.tensor(lengths)[:, None]
    group = torch.arange(len(lengths))[:, None] // group_size
    return mask, group * width + steps


def problem(seed=0, dtype=torch.float64):
    """hidden (B, T, D), head weight (V, D), bias (V,) and the layout's mask and keys."""
    g = torch.Generator().manual_seed(seed)
    mask, keys = layout()
    hidden = torch.randn(*mask.shape, D, generator=g, dtype=dtype)
    weight = 2.0 * torch.randn(V, D, generator=g, dtype=dtype)
    bias = torch.randn(V, generator=g, dtype=dtype)
    return hidden, weight, bias, mask, keys


def reference(logits, keys, mask, temperature, leave_out=False):
    """Float64 u with explicit sums: softmax, a loop over keys, the mean (of the other rows with
    leave_out; none: u = 0), ½KL + ½KL to the mix."""
    logits, keys, mask = (np.asarray(x) for x in (logits, keys, mask))
    p = softmax(logits.reshape(-1, logits.shape[-1]).astype(np.float64) / temperature, axis=-1)
    k, m = keys.reshape(-1), mask.reshape(-1).astype(bool)
    u = np.zeros(len(k))
    for key in np.unique(k[m]):
        rows = np.flatnonzero(m & (k == key))
        for r in rows:
            others = rows[rows != r] if leave_out else rows
            if others.size == 0:
                continue  # leaving out a lone row leaves no reference: u = 0
            mean = p[others].mean(axis=0)
            mix = 0.5 * (p[r] + mean)
            kl_p = np.sum(np.where(p[r] > 0, p[r] * np.log(p[r] / mix), 0.0))
            kl_q = np.sum(np.where(mean > 0, mean * np.log(mean / mix), 0.0))
            u[r] = 0.5 * kl_p + 0.5 * kl_q
    return u.reshape(mask.shape)


def lone_steps(mask, keys):
    """(B, T) bool: valid positions whose key no other valid position holds."""
    k = keys[mask]
    counts = dict(zip(*np.unique(k.numpy(), return_counts=True), strict=True))
    lone = torch.zeros_like(mask)
    lone[mask] = torch.tensor([counts[int(x)] == 1 for x in k], dtype=torch.bool)
    return lone


def test_reference_agrees_with_scipy():
    hidden, weight, bias, mask, keys = problem()
    logits = (hidden @ weight.T + bias).numpy()
    u = reference(logits, keys, mask, 0.7)
    p = softmax(logits / 0.7, axis=-1)
    group_step_one = p[3:6, 1][mask[3:6, 1].numpy()]  # group 1, step 1: responses 3 and 4
    expected = jensenshannon(group_step_one[0], group_step_one.mean(0), base=math.e) ** 2
    assert u[3, 1] == pytest.approx(expected, abs=1e-14)
    assert u[3, 1] > 1e-3  # the check is not vacuous


@pytest.mark.parametrize("chunks", [(3, 5), (1, 1), (2, 13), (4, 4), (1000, 1000)])
def test_logits_match_float64_reference(chunks):
    hidden, weight, bias, mask, keys = problem(seed=1)
    logits = hidden @ weight.T + bias  # (B, T, V)
    u = group_step_jsd(logits, None, keys, 0.7, mask,
                       chunk_positions=chunks[0], chunk_vocab=chunks[1])
    assert u.shape == mask.shape and u.dtype == torch.float64
    np.testing.assert_allclose(u.numpy(), reference(logits, keys, mask, 0.7), rtol=0, atol=1e-12)


@pytest.mark.parametrize("chunks", [(3, 5), (1, 2), (7, 3), (1000, 1000)])
def test_head_with_bias_matches_float64_reference(chunks):
    hidden, weight, bias, mask, keys = problem(seed=2)
    u = group_step_jsd(hidden, weight, keys, 1.6, mask, bias,
                       chunk_positions=chunks[0], chunk_vocab=chunks[1])
    ref = reference(hidden @ weight.T + bias, keys, mask, 1.6)
    np.testing.assert_allclose(u.numpy(), ref, rtol=0, atol=1e-12)
    assert (u[mask] > 0).sum() == (~lone_steps(mask, keys))[mask].sum()


def test_given_logsumexp_equals_computed():
    hidden, weight, bias, mask, keys = problem(seed=3)
    lse = chunked_token_statistics(hidden, weight, None, 0.8, mask, bias, jsd=False)["logsumexp"]
    a = group_step_jsd(hidden, weight, keys, 0.8, mask, bias, chunk_positions=3, chunk_vocab=5)
    b = group_step_jsd(hidden, weight, keys, 0.8, mask, bias, lse, chunk_positions=3,
                       chunk_vocab=5)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-14)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_lone_step_is_exactly_zero(dtype):
    hidden, weight, bias, mask, keys = problem(seed=4, dtype=dtype)
    lone = lone_steps(mask, keys)
    assert lone[0, 4:].all() and lone.sum() == 3  # response 0 alone at steps 4..6 of group 0
    for chunks in [(3, 5), (1, 1), (1000, 1000)]:
        u = group_step_jsd(hidden, weight, keys, 0.6, mask, bias,
                           chunk_positions=chunks[0], chunk_vocab=chunks[1])
        assert u[lone].tolist() == [0.0] * 3
        assert (u[mask & ~lone] > 1e-4).all()
        assert u[~mask].abs().sum() == 0


def test_identical_distributions_in_a_group_give_zero():
    mask, keys = layout()
    g = torch.Generator().manual_seed(5)
    per_step = torch.randn(2, WIDTH, V, generator=g, dtype=torch.float64)  # (groups, T, V)
    logits = per_step.repeat_interleave(G, dim=0)  # every response of a group the same
    for dtype, atol in [(torch.float64, 1e-15), (torch.float32, 0.0)]:
        u = group_step_jsd(logits.to(dtype), None, keys, 1.3, mask, chunk_positions=3,
                           chunk_vocab=5)
        torch.testing.assert_close(u, torch.zeros_like(u), rtol=0, atol=atol)


def test_padding_is_excluded_and_never_read():
    hidden, weight, bias, mask, keys = problem(seed=6)
    a = group_step_jsd(hidden, weight, keys, 1.0, mask, bias, chunk_positions=3, chunk_vocab=5)
    hidden[~mask] = math.nan  # garbage at padding must not reach any mean
    b = group_step_jsd(hidden, weight, keys, 1.0, mask.long(), bias, chunk_positions=3,
                       chunk_vocab=5)
    assert torch.equal(a, b)
    # with padding counted, group 0's late steps would not be lone: the mean excludes it
    logits = hidden.nan_to_num(0.0) @ weight.T + bias
    padded_in = reference(logits, keys, torch.ones_like(mask), 1.0)
    assert np.abs(padded_in[0, 4:]).min() > 1e-4 and a[0, 4:].tolist() == [0.0] * 3


def test_row_order_and_chunk_sizes_do_not_matter():
    hidden, weight, bias, mask, keys = problem(seed=7)
    logits = (hidden @ weight.T + bias).reshape(-1, V)  # (N, V)
    flat_keys, flat_mask = keys.reshape(-1), mask.reshape(-1)
    base = group_step_jsd(logits, None, flat_keys, 0.9, flat_mask)
    perm = torch.randperm(logits.shape[0], generator=torch.Generator().manual_seed(0))
    for cp, cv in [(1, 1), (3, 5), (5, 2), (64, 13)]:
        u = group_step_jsd(logits[perm], None, flat_keys[perm], 0.9, flat_mask[perm],
                           chunk_positions=cp, chunk_vocab=cv)
        torch.testing.assert_close(u, base[perm], rtol=0, atol=1e-12)


def test_low_precision_inputs_reduced_in_float32():
    hidden, weight, bias, mask, keys = problem(seed=8)
    for dtype in (torch.bfloat16, torch.float32):
        h, w, b = hidden.to(dtype), weight.to(dtype), bias.to(dtype)
        u = group_step_jsd(h, w, keys, 0.6, mask, b, chunk_positions=3, chunk_vocab=5)
        assert u.dtype == torch.float32
        ref = reference(h.double() @ w.double().T + b.double(), keys, mask, 0.6)
        np.testing.assert_allclose(u.numpy(), ref, rtol=0, atol=1e-5, err_msg=str(dtype))


def test_bad_arguments():
    hidden, weight, bias, mask, keys = problem()
    with pytest.raises(ValueError, match="keys shape"):
        group_step_jsd(hidden, weight, keys.reshape(-1), 1.0, mask)
    with pytest.raises(ValueError, match="keys shape"):
        group_step_jsd(hidden, weight, keys[:, :3], 1.0, mask)
    with pytest.raises(ValueError, match="integers"):
        group_step_jsd(hidden, weight, keys.double(), 1.0, mask)
    with pytest.raises(ValueError, match="needs all_keys"):
        group_step_jsd(hidden, weight, keys, 1.0, mask, all_reduce=lambda t: t)
    with pytest.raises(ValueError, match="missing from all_keys"):
        group_step_jsd(hidden, weight, keys, 1.0, mask, all_keys=torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="sorted and unique"):
        group_step_jsd(hidden, weight, keys, 1.0, mask, all_keys=torch.tensor([2, 1]))


def test_no_valid_position():
    hidden, weight, bias, mask, keys = problem()
    u = group_step_jsd(hidden, weight, keys, 1.0, torch.zeros_like(mask), bias)
    assert u.shape == mask.shape and u.abs().sum() == 0


scales = st.sampled_from([1e-3, 1.0, 30.0, 1e3])


@settings(max_examples=60, deadline=None)
@given(
    z=st.integers(1, 9).flatmap(
        lambda n: st.integers(2, 30).flatmap(
            lambda v: arrays(np.float32, (n, v), elements=st.floats(-1, 1, width=32))
        )
    ),
    scale=scales,
    seed=st.integers(0, 2**16),
    chunk_vocab=st.sampled_from([1, 3, 1000]),
)
def test_bounds(z, scale, seed, chunk_vocab):
    g = torch.Generator().manual_seed(seed)
    logits = torch.from_numpy(z) * scale  # (N, V)
    keys = torch.randint(0, 3, (z.shape[0],), generator=g)
    mask = torch.rand(z.shape[0], generator=g) > 0.2
    u = group_step_jsd(logits, None, keys, 0.7, mask, chunk_positions=2, chunk_vocab=chunk_vocab)
    assert torch.isfinite(u).all()
    assert (u >= 0).all() and (u <= LN2).all()
    assert u[~mask].abs().sum() == 0
    assert (u[lone_steps(mask, keys)] == 0).all()


# ---------------------------------------------------------------------------------------------
# Two processes holding parts of the same groups
# ---------------------------------------------------------------------------------------------
RANK_ROWS = ([0, 1, 3], [2, 4, 5])  # rank 1 holds no row of group 0's steps 2..6
RANK_TOKENS = torch.randint(0, V, (len(LENGTHS), WIDTH), generator=torch.Generator().manual_seed(3))


def _worker(rank, port, out_dir, hidden, weight, bias, mask, cases):
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    try:
        rows = RANK_ROWS[rank]
        local_mask = mask[rows]
        out = {}
        for name, (keys, leave_out) in cases.items():
            local_keys = keys[rows]
            gathered = [None, None]
            dist.all_gather_object(gathered, local_keys[local_mask].unique())
            all_keys = torch.unique(torch.cat(gathered))
            calls = []

            def all_reduce(t, calls=calls):
                buf = t.clone()
                dist.all_reduce(buf)
                calls.append(tuple(buf.shape))
                return buf

            ref = group_step_reference(hidden[rows], weight, local_keys, 0.7, local_mask, bias,
                                       token_ids=RANK_TOKENS[rows], leave_out=leave_out,
                                       all_reduce=all_reduce, all_keys=all_keys,
                                       chunk_positions=3, chunk_vocab=5)
            out[name] = {**ref, "calls": calls}
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_two_ranks_equal_one_process(tmp_path):
    """ICT's rule and every reading: rows of the same keys on two ranks, all_reduce summing the
    per-key counts and sums (group_pooled's 13-row group 0 and response_mean's 7-row response 0
    are keys larger than chunk_positions, summed over the whole vocabulary). The reference's
    probability of each token and its β come from the same sums with no collective call of their
    own, and equal one process's."""
    hidden, weight, bias, _, _ = problem(seed=9)
    cases = {name: reading_layout(name)[1:] for name in READINGS}
    mask = layout()[0]
    mp.spawn(_worker, args=(free_port(), str(tmp_path), hidden, weight, bias, mask, cases),
             nprocs=2, join=True)
    parts = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    for name, (keys, leave_out) in cases.items():
        single = group_step_jsd(hidden, weight, keys, 0.7, mask, bias, leave_out=leave_out,
                                chunk_positions=3, chunk_vocab=5)
        calls = [part[name]["calls"] for part in parts]
        assert calls[0] == calls[1] and len(calls[0]) >= 3, name
        if name == "group_pooled":  # two groups larger than a block: one (V,) sum each
            assert calls[0] == [(2,), (V,), (V,)]
        joined = torch.zeros_like(single)
        for rows, part in zip(RANK_ROWS, parts, strict=True):
            joined[rows] = part[name]["u"]
        torch.testing.assert_close(joined, single, rtol=0, atol=1e-12, msg=name)
        whole = group_step_reference(hidden, weight, keys, 0.7, mask, bias, token_ids=RANK_TOKENS,
                                     leave_out=leave_out, chunk_positions=3, chunk_vocab=5)
        for field in REFERENCE_FIELDS:
            joined_field = torch.zeros_like(whole[field])
            for rows, part in zip(RANK_ROWS, parts, strict=True):
                joined_field[rows] = part[name][field]
            torch.testing.assert_close(joined_field, whole[field], rtol=0, atol=1e-14,
                                       equal_nan=True, msg=f"{name} {field}")
        ref = reference(hidden @ weight.T + bias, keys, mask, 0.7, leave_out)
        np.testing.assert_allclose(joined.numpy(), ref, rtol=0, atol=1e-12, err_msg=name)
        assert joined[mask].max() > 1e-3, name


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_rounding_noise_below_the_floor_is_exactly_zero(dtype):
    """Two responses with the same context give the same distribution up to rounding: their u is
    noise, set to 0 below U_FLOOR_ULPS epsilons, so a ranking by u ties them at 0 (earliest first)."""
    from stages.core.statistics.uniqueness import U_FLOOR_ULPS

    g = torch.Generator().manual_seed(4)
    base = torch.randn(1, 5, 7, generator=g, dtype=torch.float64)
    # response 1 = response 0 plus noise far below the floor, response 2 differs for real
    logits = torch.cat([base, base + 1e-13 * torch.randn(1, 5, 7, generator=g, dtype=torch.float64),
                        torch.randn(1, 5, 7, generator=g, dtype=torch.float64)]).to(dtype)
    keys = torch.arange(5).expand(3, 5)
    u = group_step_jsd(logits, None, keys)
    floor = U_FLOOR_ULPS * torch.finfo(dtype).eps
    assert ((u == 0) | (u >= floor)).all()
    two = group_step_jsd(logits[:2], None, keys[:2])
    assert (two == 0).all()  # noise only: exactly 0, not 1e-17
    assert (u[2] > floor).all()


# ---------------------------------------------------------------------------------------------
# The readings of ICT's reference (ours, never ICT): the same function, other keys
# ---------------------------------------------------------------------------------------------
READINGS = ["paper", "response_mean", "group_pooled", "group_leave_one_out"]


def reading_layout(name, lengths=LENGTHS, width=WIDTH, group_size=G):
    """(mask (B, T), keys (B, T), leave_out) of a reading on the right-padded layout: (group,
    step) keys for the paper's rule and leave-one-out, the response for response_mean, the group
    for group_pooled."""
    mask, step_keys = layout(lengths, width, group_size)
    b = len(lengths)
    if name in ("paper", "group_leave_one_out"):
        keys = step_keys
    elif name == "response_mean":
        keys = torch.arange(b)[:, None].expand(b, width)
    else:
        keys = (torch.arange(b) // group_size)[:, None].expand(b, width)
    return mask, keys.contiguous(), name == "group_leave_one_out"


def test_readings_reference_agrees_with_scipy():
    hidden, weight, bias, mask, _ = problem()
    logits = (hidden @ weight.T + bias).numpy()
    p = softmax(logits / 0.7, axis=-1)

    def js(a, b):
        return jensenshannon(a, b, base=math.e) ** 2

    _, keys, _ = reading_layout("group_leave_one_out")
    u = reference(logits, keys, mask, 0.7, leave_out=True)
    assert u[3, 1] == pytest.approx(js(p[3, 1], p[4, 1]), abs=1e-14)  # the other active response
    assert u[0, 1] == pytest.approx(js(p[0, 1], (p[1, 1] + p[2, 1]) / 2), abs=1e-14)
    assert u[0, 5] == 0.0 and u[5, 0] > 1e-3  # alone at step 5; step 0 shared with 3 and 4
    _, keys, _ = reading_layout("response_mean")
    u = reference(logits, keys, mask, 0.7)
    assert u[1, 2] == pytest.approx(js(p[1, 2], p[1, :4].mean(0)), abs=1e-14)
    assert u[5, 0] == 0.0  # a one-token response is its own mean
    _, keys, _ = reading_layout("group_pooled")
    u = reference(logits, keys, mask, 0.7)
    pooled = np.concatenate([p[3, :5], p[4, :5], p[5, :1]]).mean(0)
    assert u[4, 3] == pytest.approx(js(p[4, 3], pooled), abs=1e-14) and u[4, 3] > 1e-3


@pytest.mark.parametrize("name", READINGS)
@pytest.mark.parametrize("chunks", [(3, 5), (1, 1), (4, 13), (1000, 1000)])
def test_readings_match_float64_reference(name, chunks):
    """Materialised logits and a head with bias; chunk_positions 1, 3 and 4 make the groups (13
    and 11 positions) and the long responses keys larger than a block."""
    hidden, weight, bias, _, _ = problem(seed=11)
    mask, keys, leave_out = reading_layout(name)
    logits = hidden @ weight.T + bias
    ref = reference(logits, keys, mask, 0.7, leave_out)
    cp, cv = chunks
    u = group_step_jsd(logits, None, keys, 0.7, mask, leave_out=leave_out, chunk_positions=cp,
                       chunk_vocab=cv)
    assert u.shape == mask.shape and u.dtype == torch.float64
    np.testing.assert_allclose(u.numpy(), ref, rtol=0, atol=1e-12)
    head = group_step_jsd(hidden, weight, keys, 0.7, mask, bias, leave_out=leave_out,
                          chunk_positions=cp, chunk_vocab=cv)
    np.testing.assert_allclose(head.numpy(), ref, rtol=0, atol=1e-12)
    assert (u[mask] > 1e-3).sum() >= mask.sum() - 4  # not vacuous: only lone rows are 0


@pytest.mark.parametrize("name", READINGS)
def test_readings_int_masks_equal_bool_masks_and_ignore_padding(name):
    hidden, weight, bias, _, _ = problem(seed=12)
    mask, keys, leave_out = reading_layout(name)
    a = group_step_jsd(hidden, weight, keys, 1.0, mask, bias, leave_out=leave_out,
                       chunk_positions=3, chunk_vocab=5)
    hidden[~mask] = math.nan  # garbage at padding must not reach any reference
    for m in (mask.long(), mask.to(torch.uint8), mask.float()):
        b = group_step_jsd(hidden, weight, keys, 1.0, m, bias, leave_out=leave_out,
                           chunk_positions=3, chunk_vocab=5)
        assert torch.equal(a, b)
    assert a[~mask].abs().sum() == 0


@pytest.mark.parametrize("name", READINGS)
def test_readings_row_order_and_chunk_sizes_do_not_matter(name):
    hidden, weight, bias, _, _ = problem(seed=13)
    mask, keys, leave_out = reading_layout(name)
    logits = (hidden @ weight.T + bias).reshape(-1, V)  # (N, V)
    flat_keys, flat_mask = keys.reshape(-1), mask.reshape(-1)
    base = group_step_jsd(logits, None, flat_keys, 0.9, flat_mask, leave_out=leave_out)
    perm = torch.randperm(logits.shape[0], generator=torch.Generator().manual_seed(1))
    for cp, cv in [(1, 1), (3, 5), (5, 2), (64, 13)]:
        u = group_step_jsd(logits[perm], None, flat_keys[perm], 0.9, flat_mask[perm],
                           leave_out=leave_out, chunk_positions=cp, chunk_vocab=cv)
        torch.testing.assert_close(u, base[perm], rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", READINGS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_readings_zero_where_defined_so(name, dtype):
    """u = 0 exactly where a position is its own reference (a lone key) or has none (leave-one-out
    alone at a step), and wherever every position sharing a key has the same distribution."""
    hidden, weight, bias, _, _ = problem(seed=14, dtype=dtype)
    mask, keys, leave_out = reading_layout(name)
    lone = lone_steps(mask, keys)
    expected_lone = {"paper": 3, "group_leave_one_out": 3, "response_mean": 1, "group_pooled": 0}
    assert int(lone.sum()) == expected_lone[name]
    for cp, cv in [(3, 5), (1, 1), (1000, 1000)]:
        u = group_step_jsd(hidden, weight, keys, 0.6, mask, bias, leave_out=leave_out,
                           chunk_positions=cp, chunk_vocab=cv)
        assert (u[lone] == 0).all() and (u[mask & ~lone] > 1e-4).all()
        assert u[~mask].abs().sum() == 0
    table = torch.randn(int(keys.max()) + 1, V, generator=torch.Generator().manual_seed(15),
                        dtype=torch.float64)
    logits = table[keys].to(dtype)  # every position of a key the same distribution
    for cp, cv in [(3, 5), (1000, 1000)]:
        u = group_step_jsd(logits, None, keys, 1.3, mask, leave_out=leave_out, chunk_positions=cp,
                           chunk_vocab=cv)
        assert (u == 0).all(), (cp, cv)


@pytest.mark.parametrize("name", READINGS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_readings_rounding_noise_below_the_floor_is_exactly_zero(name, dtype):
    """Positions sharing a key whose distributions differ by noise far below U_FLOOR_ULPS
    epsilons: u is exactly 0, not 1e-17, so a ranking ties them (earliest first)."""
    mask, keys, leave_out = reading_layout(name)
    g = torch.Generator().manual_seed(16)
    table = torch.randn(int(keys.max()) + 1, V, generator=g, dtype=torch.float64)
    noise = 1e-13 * torch.randn(*keys.shape, V, generator=g, dtype=torch.float64)
    u = group_step_jsd((table[keys] + noise).to(dtype), None, keys, 1.0, mask, leave_out=leave_out,
                       chunk_positions=3, chunk_vocab=5)
    assert (u == 0).all()


def self_weight_of(mask, keys, leave_out):
    """(B, T) w: 1 / (valid positions sharing the key), 0 leaving the row out."""
    if leave_out:
        return torch.zeros(mask.shape, dtype=torch.float64)
    k = keys[mask]
    counts = dict(zip(*np.unique(k.numpy(), return_counts=True), strict=True))
    w = torch.zeros(mask.shape, dtype=torch.float64)
    w[mask] = torch.tensor([1.0 / counts[int(x)] for x in k], dtype=torch.float64)
    return w


scales_wide = st.sampled_from([1e-3, 1.0, 30.0, 1e3])


@settings(max_examples=60, deadline=None)
@given(
    z=st.integers(1, 9).flatmap(
        lambda n: st.integers(2, 30).flatmap(
            lambda v: arrays(np.float32, (n, v), elements=st.floats(-1, 1, width=32))
        )
    ),
    scale=scales_wide,
    seed=st.integers(0, 2**16),
    leave_out=st.booleans(),
    chunk_positions=st.sampled_from([1, 2, 1000]),
)
def test_readings_bounds(z, scale, seed, leave_out, chunk_positions):
    """0 ≤ u ≤ c(w) ≤ ln 2, w the row's own weight in its reference, for any keys (a key may be
    larger than a block), with or without the row in its reference."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.from_numpy(z) * scale  # (N, V)
    keys = torch.randint(0, 3, (z.shape[0],), generator=g)
    mask = torch.rand(z.shape[0], generator=g) > 0.2
    u = group_step_jsd(logits, None, keys, 0.7, mask, leave_out=leave_out,
                       chunk_positions=chunk_positions, chunk_vocab=3)
    assert torch.isfinite(u).all()
    assert (u >= 0).all() and (u <= LN2).all()
    ceiling = jsd_ceiling(self_weight_of(mask, keys, leave_out))
    assert (u.double() <= ceiling + 1e-5).all()
    assert u[~mask].abs().sum() == 0
    assert (u[lone_steps(mask, keys)] == 0).all()


def test_key_blocks_by_hand():
    # limit 4: [2] | [3, 1] | [9] alone | [2, 2]
    assert _key_blocks([2, 3, 1, 9, 2, 2], 4) == [(0, 1), (1, 3), (3, 4), (4, 6)]
    assert _key_blocks([9], 4) == [(0, 1)]
    assert _key_blocks([1, 1, 1, 1, 1], 2) == [(0, 2), (2, 4), (4, 5)]
    assert _key_blocks([], 4) == []


@pytest.mark.parametrize("name", ["group_pooled", "response_mean"])
def test_memory_stays_within_a_block_for_keys_larger_than_a_block(name, monkeypatch):
    """A key of many positions (a whole group as one key) never makes a buffer of more than
    chunk_positions × chunk_vocab: p is formed for at most chunk_positions rows at a time."""
    asked = []
    original = LogitSource.buffers

    def buffers(self, n, v):
        asked.append((n, v))
        return original(self, n, v)

    monkeypatch.setattr(LogitSource, "buffers", buffers)
    lengths = [40, 33, 29, 40]  # one group of 142 positions, responses of up to 40
    mask, keys, leave_out = reading_layout(name, lengths, 40, 4)
    logits = torch.randn(*mask.shape, 11, generator=torch.Generator().manual_seed(17),
                         dtype=torch.float64)
    u = group_step_jsd(logits, None, keys, 1.0, mask, leave_out=leave_out, chunk_positions=8,
                       chunk_vocab=4)
    assert asked and max(n for n, _ in asked) <= 8 and max(v for _, v in asked) <= 4
    np.testing.assert_allclose(u.numpy(), reference(logits, keys, mask, 1.0), rtol=0, atol=1e-12)


def test_deviation_keys_and_self_weights_by_hand():
    groups, lengths = [4, 4, 9], [3, 1, 2]
    assert set(DEVIATIONS) == {"group_jsd", "response_mean_jsd", "group_pooled_jsd", "group_loo_jsd"}
    step = deviation_keys("group_jsd", groups, lengths).tolist()
    assert step == [12, 13, 14, 12, 27, 28]  # group * 3 + step
    assert deviation_keys("group_loo_jsd", groups, lengths).tolist() == step
    assert deviation_keys("response_mean_jsd", groups, lengths).tolist() == [0, 0, 0, 1, 2, 2]
    assert deviation_keys("group_pooled_jsd", groups, lengths).tolist() == [4, 4, 4, 4, 9, 9]
    assert self_weight("group_jsd", groups, lengths).tolist() == [0.5, 1, 1, 0.5, 1, 1]
    assert self_weight("response_mean_jsd", groups, lengths).tolist() == [1 / 3] * 3 + [1, 0.5, 0.5]
    assert self_weight("group_pooled_jsd", groups, lengths).tolist() == [0.25] * 4 + [0.5, 0.5]
    assert self_weight("group_loo_jsd", groups, lengths).tolist() == [0.0] * 6


def test_a_point_mass_disjoint_from_its_reference_reaches_the_ceiling():
    """Response 0 of a group of three is near-certain on token 0 at its first position, every other
    position of the group on token 1: its u is c(w) with w its own weight in each reference
    (1/3 at a step of three, 1/3 of its three positions, 1/8 of the group's eight positions, 0
    leaving it out), and it is the only position at the ceiling."""
    groups, lengths = [0, 0, 0], [3, 3, 2]
    logits = torch.zeros(8, 6, dtype=torch.float64)
    logits[:, 1] = 60.0
    logits[0, 0], logits[0, 1] = 60.0, 0.0
    expected = {"group_jsd": 1 / 3, "response_mean_jsd": 1 / 3, "group_pooled_jsd": 1 / 8,
                "group_loo_jsd": 0.0}
    for name, w in expected.items():
        u = deviation(name, logits, None, groups, lengths, 1.0, chunk_positions=2, chunk_vocab=4)
        weight = self_weight(name, groups, lengths)
        assert float(weight[0]) == w
        assert float(u[0]) == pytest.approx(float(jsd_ceiling(w)), abs=1e-12), name
        assert at_ceiling(u, weight).tolist() == [True] + [False] * 7, name
