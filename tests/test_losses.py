"""Policy-loss pieces (METHODS §4) against hand-computed values and float64 references."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stages.core.training.losses import (
    LOG_RATIO_CLAMP,
    aggregate_loss,
    clipped_surrogate,
    group_advantages,
    k3_kl,
    loss_weights,
    overlong_penalty,
)

D = torch.float64


def t(*values) -> torch.Tensor:
    return torch.tensor(values, dtype=D)


def test_clipped_surrogate_by_hand():
    # ratios 1.5, 1.5, 0.5, 0.5, 1.1 against advantages +1, -1, +1, -1, +2; ε = (0.2, 0.28)
    ratio = t(1.5, 1.5, 0.5, 0.5, 1.1)
    adv = t(1.0, -1.0, 1.0, -1.0, 2.0)
    loss, clipped = clipped_surrogate(ratio.log(), torch.zeros(5, dtype=D), adv, 0.2, 0.28)
    # -min(rA, clip(r)A): -min(1.5, 1.28), -min(-1.5, -1.28), -min(0.5, 0.8), -min(-0.5, -0.8), -min(2.2, 2.2)
    assert torch.allclose(loss, t(-1.28, 1.5, -0.5, 0.8, -2.2), atol=1e-12, rtol=0)
    assert clipped.tolist() == [True, False, False, True, False]


def test_clipped_tokens_get_no_gradient_and_the_rest_the_policy_gradient():
    logp = t(math.log(1.5), math.log(1.5), math.log(0.5), math.log(0.5)).requires_grad_()
    adv = t(1.0, -1.0, 1.0, -1.0)
    loss, clipped = clipped_surrogate(logp, torch.zeros(4, dtype=D), adv, 0.2, 0.28)
    loss.sum().backward()
    ratio = logp.detach().exp()
    expect = torch.where(clipped, torch.zeros(4, dtype=D), -adv * ratio)  # d(-rA)/dlogp = -rA
    assert torch.equal(logp.grad, expect)


def test_the_log_ratio_is_clamped_at_20_as_verl_does():
    """verl's ratio exp(clamp(Δ, −20, 20)) in float64, by hand: beyond ±20 the ratio is e^±20 and
    its gradient 0; within, the unclamped surrogate. Δ = 30 with Â < 0 would overflow to inf in
    float32 without the clamp (e^30 ≈ 1e13 is finite, e^90 is not)."""
    delta = t(-30.0, -20.0, -5.0, 0.0, 19.5, 25.0, 90.0).requires_grad_()
    adv = t(1.0, 1.0, 1.0, -1.0, -1.0, -1.0, -1.0)
    loss, _ = clipped_surrogate(delta, torch.zeros(7, dtype=D), adv, 0.2, 0.28)
    ratio = torch.exp(delta.detach().clamp(-20.0, 20.0))
    expect = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.28))
    assert torch.equal(loss.detach(), expect)
    assert float(loss.detach()[-1]) == math.exp(20.0)  # Â = −1 at Δ = 90: e^20, not e^90
    loss.sum().backward()
    assert delta.grad[0] == 0 and delta.grad[5] == 0 and delta.grad[6] == 0  # the clamp's
    assert delta.grad[4] == pytest.approx(math.exp(19.5))  # within: d(−rÂ)/dΔ = r
    wide, _ = clipped_surrogate(t(90.0).float(), t(0.0).float(), t(-1.0).float(), 0.2, 0.28)
    assert torch.isfinite(wide).all()  # float32 e^90 would be inf


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(-200, 200), min_size=1, max_size=20),
       st.lists(st.floats(-5, 5), min_size=20, max_size=20))
def test_the_clamped_ratio_stays_within_e_to_the_20(deltas, advantages):
    """For any log-ratio, |ℓ| ≤ |Â| e^20 (the ratio never leaves [e^−20, e^20]) and ℓ is finite;
    where |Δ| ≤ 20 it equals the float64 unclamped surrogate."""
    delta = torch.tensor(deltas, dtype=D)
    adv = torch.tensor(advantages[: len(deltas)], dtype=D)
    loss, _ = clipped_surrogate(delta, torch.zeros_like(delta), adv, 0.2, 0.28)
    assert torch.isfinite(loss).all()
    assert (loss.abs() <= adv.abs() * math.exp(LOG_RATIO_CLAMP) * (1 + 1e-12)).all()
    inside = delta.abs() <= LOG_RATIO_CLAMP
    r = delta.exp()
    plain = torch.maximum(-adv * r, -adv * r.clamp(0.8, 1.28))
    assert torch.equal(loss[inside], plain[inside])


def test_dual_clip_caps_negative_advantage_tokens():
    ratio = t(5.0, 5.0, 1.0)
    adv = t(-1.0, 1.0, -2.0)
    loss, clipped = clipped_surrogate(ratio.log(), torch.zeros(3, dtype=D), adv, 0.2, 0.28,
                                      dual_clip=3.0)
    # Â < 0 with r = 5: max(5, 1.28) = 5 is capped at -c·Â = 3; Â > 0 is untouched; r = 1 is below the cap
    assert torch.allclose(loss, t(3.0, -1.28, 2.0), atol=1e-12, rtol=0)
    assert clipped.tolist() == [True, True, False]
    with pytest.raises(ValueError, match="dual_clip"):
        clipped_surrogate(ratio.log(), torch.zeros(3, dtype=D), adv, 0.2, 0.28, dual_clip=1.0)


def test_k3_kl_by_hand_and_nonnegative():
    logp = t(math.log(0.5), math.log(0.25), -1.0)
    ref = t(math.log(0.25), math.log(0.5), -1.0)
    kl = k3_kl(logp, ref)
    # e^{δ} - δ - 1 with δ = ref - logp = -ln 2, +ln 2, 0
    assert torch.allclose(kl, t(0.5 + math.log(2) - 1, 2 - math.log(2) - 1, 0.0), atol=1e-15, rtol=0)
    x = torch.randn(1000, dtype=D) * 3
    assert (k3_kl(x, x.flip(0)) >= 0).all()


def grid_case():
    valid = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]], dtype=torch.bool)
    selected = torch.tensor([[1, 0, 1, 0], [0, 0, 0, 0], [1, 1, 1, 0]], dtype=torch.bool)
    loss = torch.arange(1.0, 13.0, dtype=D).reshape(3, 4)
    return valid, selected, loss


def test_denominators_by_hand():
    valid, selected, loss = grid_case()
    # selected tokens: 1, 3 (row 0), none (row 1), 9, 10, 11 (row 2)
    assert aggregate_loss(loss, selected, valid, "selected") == pytest.approx((1 + 3 + 9 + 10 + 11) / 5)
    assert aggregate_loss(loss, selected, valid, "all") == pytest.approx((1 + 3 + 9 + 10 + 11) / 9)
    # per sequence: (1+3)/2, nothing (0), (9+10+11)/3, averaged over the 3 sequences
    assert aggregate_loss(loss, selected, valid, "sequence") == pytest.approx((2 + 0 + 10) / 3)


def test_selected_and_all_differ_by_exactly_n_valid_over_n_selected():
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        valid = torch.rand(6, 9, generator=gen) < 0.8
        selected = valid & (torch.rand(6, 9, generator=gen) < 0.3)
        if not selected.any():
            continue
        loss = torch.randn(6, 9, generator=gen, dtype=D)
        a = aggregate_loss(loss, selected, valid, "selected")
        b = aggregate_loss(loss, selected, valid, "all")
        assert float(a / b) == pytest.approx(int(valid.sum()) / int(selected.sum()), rel=1e-12)


def test_weights_with_scope_totals_sum_parts_to_the_whole():
    valid, selected, loss = grid_case()
    for denominator in ("selected", "all", "sequence"):
        whole = aggregate_loss(loss, selected, valid, denominator)
        totals = {"n_selected": selected.sum(), "n_valid": valid.sum(), "n_sequences": 3}
        parts = sum(
            (loss[rows] * loss_weights(selected[rows], valid[rows], denominator, **totals, dtype=D)).sum()
            for rows in (slice(0, 1), slice(1, 3))
        )
        assert float(parts) == pytest.approx(float(whole), rel=1e-12)


def test_masked_tokens_get_exactly_zero_gradient_even_when_their_loss_is_not_finite():
    valid, selected, loss = grid_case()
    loss = loss.clone()
    loss[0, 1] = float("inf")  # masked; must neither poison the loss nor the gradient
    loss.requires_grad_()
    for denominator in ("selected", "all", "sequence"):
        loss.grad = None
        aggregate_loss(loss, selected, valid, denominator).backward()
        assert torch.isfinite(loss.grad).all()
        assert (loss.grad[~selected] == 0).all()
        assert (loss.grad[selected] > 0).all()


def test_unknown_denominator_and_empty_selection():
    valid, selected, loss = grid_case()
    with pytest.raises(ValueError, match="unknown loss denominator 'tokens'"):
        loss_weights(selected, valid, "tokens")
    none = torch.zeros_like(selected)
    for denominator in ("selected", "all", "sequence"):
        assert float(aggregate_loss(loss, none, valid, denominator)) == 0.0


def test_overlong_penalty_by_hand():
    lengths = torch.tensor([10, 15, 16, 18, 20, 25])
    # L_max = 20, buffer 5: 0 up to 15 tokens, then -1/5 per token, -1 at 20 and beyond
    assert overlong_penalty(lengths, 20, 5).tolist() == pytest.approx([0, 0, -0.2, -0.6, -1, -1])
    with pytest.raises(ValueError, match="overlong buffer"):
        overlong_penalty(lengths, 20, 0)


def test_group_advantages_are_the_grpo_formula():
    rewards = t(1, 0, 0, 1, 1, 1, 0, 1)
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    adv = group_advantages(rewards, groups)
    g0 = t(1, 0, 0, 1)
    assert torch.allclose(adv[:4], (g0 - g0.mean()) / (g0.std() + 1e-6), atol=1e-12, rtol=0)
    assert group_advantages(t(1, 1, 1), torch.tensor([0, 0, 0])).tolist() == [0, 0, 0]
