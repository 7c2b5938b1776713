"""Exact per-token statistics against float64 numpy/scipy references (METHODS §2)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from scipy.spatial.distance import jensenshannon
from scipy.special import log_softmax, softmax
from scipy.stats import entropy as scipy_entropy

from stages.core.statistics.ceiling import CEILING_RTOL
from stages.core.statistics.stats import (
    LN2,
    at_ceiling,
    chunked_token_statistics,
    distribution_sum,
    jensen_shannon,
    jsd_ceiling,
    jsd_to_mean,
    mean_distribution,
    token_statistics,
)

KEYS = ("entropy", "renyi2", "logsumexp", "max_prob", "logprob", "jsd")


def reference(logits: np.ndarray, temperature: float, mask: np.ndarray, ids: np.ndarray) -> dict:
    """Float64 statistics of softmax(logits / T) over (N, V) rows, written with scipy."""
    z = logits.astype(np.float64) / temperature
    p = softmax(z, axis=-1)
    mean = p[mask].mean(axis=0) if mask.any() else np.zeros(z.shape[-1])
    out = {
        "entropy": scipy_entropy(p, axis=-1),
        "renyi2": -np.log(np.sum(p**2, axis=-1)),
        "logsumexp": np.log(np.sum(np.exp(z - z.max(-1, keepdims=True)), -1)) + z.max(-1),
        "max_prob": p.max(axis=-1),
        "logprob": np.take_along_axis(log_softmax(z, axis=-1), ids[:, None], -1)[:, 0],
        "jsd": np.array([jensenshannon(row, mean) ** 2 for row in p]),
    }
    return {k: np.where(mask, v, 0.0) for k, v in out.items()}


def problem(n=14, d=6, v=29, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=g, dtype=dtype)
    weight = 2.0 * torch.randn(v, d, generator=g, dtype=dtype)
    bias = torch.randn(v, generator=g, dtype=dtype)
    ids = torch.randint(0, v, (n,), generator=g)
    mask = torch.rand(n, generator=g) > 0.3
    return hidden, weight, bias, ids, mask


def assert_matches(out: dict, ref: dict, atol: float) -> None:
    for key in KEYS:
        np.testing.assert_allclose(out[key].double().numpy(), ref[key], rtol=0, atol=atol,
                                   err_msg=key)


def test_float64_matches_scipy_reference():
    hidden, weight, bias, ids, mask = problem()
    logits = hidden @ weight.T + bias  # (N, V)
    ref = reference(logits.numpy(), 0.7, mask.numpy(), ids.numpy())
    out = token_statistics(logits, 0.7, mask, ids, jsd=True)
    assert all(out[k].dtype == torch.float64 for k in KEYS)
    assert_matches(out, ref, 1e-12)


@pytest.mark.parametrize("chunk_positions", [1, 3, 5, 100])
@pytest.mark.parametrize("chunk_vocab", [1, 4, 7, 1000])
def test_chunked_head_equals_reference(chunk_positions, chunk_vocab):
    hidden, weight, bias, ids, mask = problem(seed=chunk_vocab)
    ref = reference((hidden @ weight.T + bias).numpy(), 1.3, mask.numpy(), ids.numpy())
    out = chunked_token_statistics(
        hidden.float(), weight.float(), ids, 1.3, mask, bias.float(),
        chunk_positions=chunk_positions, chunk_vocab=chunk_vocab,
    )
    assert out["entropy"].dtype == torch.float32
    assert_matches(out, ref, 2e-5)


def test_logits_and_head_paths_agree_and_keep_batch_shape():
    hidden, weight, bias, ids, mask = problem(n=12)
    h, i, m = hidden.reshape(3, 4, -1), ids.reshape(3, 4), mask.reshape(3, 4)
    logits = h @ weight.T + bias  # (B, T, V)
    a = token_statistics(logits, 0.5, m, i, jsd=True, chunk_positions=5, chunk_vocab=6)
    b = chunked_token_statistics(h, weight, i, 0.5, m, bias, chunk_positions=2, chunk_vocab=11)
    for key in KEYS:
        assert a[key].shape == (3, 4)
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=1e-12)


def test_low_precision_input_is_reduced_in_float32():
    hidden, weight, bias, ids, mask = problem()
    logits = (hidden @ weight.T + bias).to(torch.bfloat16)
    out = token_statistics(logits, 1.0, mask, ids)
    ref = reference(logits.double().numpy(), 1.0, mask.numpy(), ids.numpy())
    assert out["entropy"].dtype == torch.float32
    for key in ("entropy", "renyi2", "logprob", "logsumexp", "max_prob"):
        np.testing.assert_allclose(out[key].numpy(), ref[key], atol=2e-5, err_msg=key)


def test_jensen_shannon_matches_scipy_and_bounds():
    g = torch.Generator().manual_seed(3)
    p = torch.softmax(3 * torch.randn(5, 17, generator=g, dtype=torch.float64), -1)
    q = torch.softmax(3 * torch.randn(5, 17, generator=g, dtype=torch.float64), -1)
    expected = [jensenshannon(a, b) ** 2 for a, b in zip(p.numpy(), q.numpy(), strict=True)]
    np.testing.assert_allclose(jensen_shannon(p, q).numpy(), expected, atol=1e-14)
    assert float(jensen_shannon(p[0], p[0])) == 0.0
    disjoint = jensen_shannon(torch.tensor([0.5, 0.5, 0.0, 0.0]), torch.tensor([0.0, 0.0, 0.3, 0.7]))
    assert float(disjoint) == pytest.approx(LN2, abs=1e-7)
    # q_j << p_j: 2q/(p+q) must not be formed as 2 - 2p/(p+q), which rounds to 0 (log 0 = -inf)
    a, b = np.array([0.5, 0.5]), np.array([1e-13, 1 - 1e-13])
    close = jensen_shannon(torch.tensor(a, dtype=torch.float32), torch.tensor(b, dtype=torch.float32))
    assert float(close) == pytest.approx(jensenshannon(a, b) ** 2, abs=1e-6)


def test_mean_distribution_and_jsd_to_mean_pieces():
    hidden, weight, bias, ids, mask = problem()
    p = torch.softmax((hidden @ weight.T + bias) / 0.9, -1)  # (N, V)
    total, n = distribution_sum(hidden, weight, 0.9, mask, bias, chunk_positions=4, chunk_vocab=5)
    assert n == int(mask.sum())
    torch.testing.assert_close(total, p[mask].sum(0), rtol=0, atol=1e-12)
    mean = mean_distribution(hidden, weight, 0.9, mask, bias, chunk_vocab=3)
    torch.testing.assert_close(mean, p[mask].mean(0), rtol=0, atol=1e-14)
    other = torch.softmax(torch.arange(29, dtype=torch.float64), 0)  # any distribution
    d = jsd_to_mean(hidden, weight, other, 0.9, mask, bias, chunk_positions=3, chunk_vocab=4)
    expected = [jensenshannon(row, other.numpy()) ** 2 if keep else 0.0
                for row, keep in zip(p.numpy(), mask.numpy(), strict=True)]
    np.testing.assert_allclose(d.numpy(), expected, atol=1e-13)


def test_one_hot_and_uniform():
    one_hot = torch.tensor([[0.0, -math.inf, -math.inf], [1e4, 0.0, -5.0]])
    out = token_statistics(one_hot, 1.0, None, torch.tensor([0, 0]))
    for key in ("entropy", "renyi2", "logprob"):
        assert out[key].tolist() == [0.0, 0.0], key
    assert out["max_prob"].tolist() == [1.0, 1.0]
    uniform = token_statistics(torch.full((2, 1000), 3.0), 0.3)
    torch.testing.assert_close(uniform["entropy"], torch.full((2,), math.log(1000)))
    torch.testing.assert_close(uniform["renyi2"], torch.full((2,), math.log(1000)))
    torch.testing.assert_close(uniform["max_prob"], torch.full((2,), 1e-3))


def test_neg_inf_logits_contribute_nothing():
    logits = torch.tensor([[1.0, 2.0, -math.inf, 0.5, -math.inf]])
    finite = torch.tensor([[1.0, 2.0, 0.5]])
    b = token_statistics(finite, 1.0)
    for chunk_vocab in (1, 2, 5):  # including blocks that hold only -inf
        a = token_statistics(logits, 1.0, chunk_vocab=chunk_vocab)
        for key in ("entropy", "renyi2", "logsumexp", "max_prob"):
            torch.testing.assert_close(a[key], b[key])


def test_all_padding_gives_zeros():
    hidden, weight, bias, ids, _ = problem(n=6)
    mask = torch.zeros(6, dtype=torch.bool)
    out = chunked_token_statistics(hidden, weight, ids, 1.0, mask, bias, chunk_positions=4)
    assert all(out[k].tolist() == [0.0] * 6 for k in KEYS)
    assert mean_distribution(hidden, weight, 1.0, mask).abs().sum() == 0


def test_int_mask_equals_bool_mask_and_masked_positions_are_zero():
    hidden, weight, bias, ids, mask = problem()
    a = chunked_token_statistics(hidden, weight, ids, 1.0, mask, bias)
    b = chunked_token_statistics(hidden, weight, ids, 1.0, mask.long(), bias)
    for key in KEYS:
        assert torch.equal(a[key], b[key])
        assert a[key][~mask].abs().sum() == 0
    # garbage at padding (even NaN) must not leak into p̄ or the statistics
    hidden[~mask] = math.nan
    c = chunked_token_statistics(hidden, weight, ids, 1.0, mask, bias)
    for key in KEYS:
        assert torch.equal(a[key], c[key])


def test_bad_arguments():
    logits = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="temperature"):
        token_statistics(logits, 0.0)
    with pytest.raises(ValueError, match="mask shape"):
        token_statistics(logits, 1.0, torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        token_statistics(logits, 1.0, None, torch.tensor([0, 3]))


scales = st.sampled_from([1e-4, 1.0, 30.0, 1e3, 1e4])
rows = st.integers(1, 4).flatmap(
    lambda n: st.integers(2, 40).flatmap(
        lambda v: arrays(np.float32, (n, v), elements=st.floats(-1, 1, width=32))
    )
)


@settings(max_examples=60, deadline=None)
@given(z=rows, scale=scales, temperature=st.sampled_from([0.3, 1.0, 2.5]))
def test_entropy_bounds(z, scale, temperature):
    logits = torch.from_numpy(z) * scale
    out = token_statistics(logits, temperature, jsd=True, chunk_vocab=7)
    h, h2, d = out["entropy"], out["renyi2"], out["jsd"]
    log_v = math.log(z.shape[1])
    tol = 1e-5
    assert torch.isfinite(torch.stack([h, h2, d])).all()
    assert (h2 >= 0).all() and (h2 <= h + tol).all() and (h <= log_v + tol).all()
    assert (d >= 0).all() and (d <= LN2 + tol).all()
    assert ((out["max_prob"] > 0) & (out["max_prob"] <= 1 + tol)).all()


@settings(max_examples=60, deadline=None)
@given(a=rows, b=rows, scale=scales)
def test_jsd_bounds(a, b, scale):
    v = min(a.shape[1], b.shape[1])
    p = torch.softmax(torch.from_numpy(a[:1, :v]) * scale, -1)
    q = torch.softmax(torch.from_numpy(b[:1, :v]) * scale, -1)
    d = jensen_shannon(p, q)
    assert (d >= 0).all() and (d <= LN2 + 1e-6).all()
    torch.testing.assert_close(d, jensen_shannon(q, p), rtol=1e-5, atol=1e-6)  # symmetric


# ---------------------------------------------------------------------------------------------
# The ceiling c(w) of JSD(p ‖ w·p + (1 − w)·r)
# ---------------------------------------------------------------------------------------------
def simplex_grid(v: int, steps: int) -> np.ndarray:
    """Every distribution over v entries whose probabilities are multiples of 1/steps (vertices
    included), (M, v)."""
    points = [c for c in np.ndindex(*(steps + 1,) * (v - 1)) if sum(c) <= steps]
    return np.array([[*c, steps - sum(c)] for c in points], dtype=np.float64) / steps


@pytest.mark.parametrize(("v", "steps"), [(2, 40), (3, 12), (4, 6)])
def test_jsd_ceiling_is_the_maximum_over_the_simplex(v, steps):
    """Brute force: over a grid of p and r (the vertices included), JSD(p ‖ w·p + (1 − w)·r)
    never exceeds c(w), and its maximum equals c(w), reached where p is disjoint from r (a point
    mass p disjoint from r among them)."""
    grid = torch.from_numpy(simplex_grid(v, steps))  # (M, v)
    p, r = grid[:, None, :], grid[None, :, :]  # every pair
    for w in (0.0, 1 / 8, 1 / 3, 0.5, 0.9, 1.0):
        values = jensen_shannon(p, w * p + (1 - w) * r)  # (M, M) float64
        c = float(jsd_ceiling(w))
        assert float(values.max()) == pytest.approx(c, abs=1e-12), w
        assert float(values.max()) <= c + 1e-12
        # reached exactly where p and r have disjoint supports (a point mass p = δ_a with
        # r(a) = 0 among them); for w = 1, q = p everywhere and c = 0
        disjoint = ((p > 0) & (r > 0)).sum(dim=-1) == 0  # (M, M)
        top = values >= c - 1e-12
        assert torch.equal(top, disjoint) if w < 1 else bool(top.all()), w
        vertex = grid.max(dim=1).values == 1  # (M,)
        assert (disjoint & vertex[:, None]).any()


def test_jsd_ceiling_closed_form_values():
    assert float(jsd_ceiling(0.0)) == pytest.approx(LN2, abs=1e-15)
    assert float(jsd_ceiling(1.0)) == 0.0
    # w = 1/2: ½[ln(4/3) + ½ ln(2/3) + ½ ln 2]
    half = 0.5 * (math.log(4 / 3) + 0.5 * math.log(2 / 3) + 0.5 * math.log(2))
    assert float(jsd_ceiling(0.5)) == pytest.approx(half, abs=1e-15)
    w = torch.linspace(0, 1, 101, dtype=torch.float64)
    c = jsd_ceiling(w)
    assert (c[1:] < c[:-1]).all()  # a larger own weight leaves less room to deviate
    # against scipy on the point masses themselves
    for w in (1 / 8, 1 / 3, 0.7):
        p, q = np.array([1.0, 0.0]), np.array([w, 1 - w])
        assert float(jsd_ceiling(w)) == pytest.approx(jensenshannon(p, q, base=math.e) ** 2,
                                                      abs=1e-14)


@settings(max_examples=100, deadline=None)
@given(
    v=st.integers(2, 12),
    w=st.floats(0, 1),
    seed=st.integers(0, 2**16),
    concentration=st.sampled_from([0.05, 1.0, 20.0]),
)
def test_jsd_never_exceeds_its_ceiling(v, w, seed, concentration):
    rng = np.random.default_rng(seed)
    p = torch.from_numpy(rng.dirichlet([concentration] * v))
    r = torch.from_numpy(rng.dirichlet([concentration] * v))
    assert float(jensen_shannon(p, w * p + (1 - w) * r)) <= float(jsd_ceiling(w)) + 1e-12


def test_at_ceiling():
    w = torch.tensor([0.0, 0.25, 0.25, 0.25, 1.0], dtype=torch.float64)
    c = jsd_ceiling(w)
    u = torch.stack([c[0], c[1], c[2] * (1 - CEILING_RTOL), c[3] * (1 - 2 * CEILING_RTOL),
                     torch.tensor(0.0, dtype=torch.float64)]).float()
    # at c, at the tolerance (u rounded to float32 sits within it), below it, and w = 1 (c = 0):
    # a position that is its own reference is never at the ceiling
    assert at_ceiling(u, w).tolist() == [True, True, True, False, False]
