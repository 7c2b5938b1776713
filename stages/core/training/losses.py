"""Advantages and policy losses (METHODS §4), as pure tensor functions."""

from __future__ import annotations

import torch
from torch import Tensor

ADV_EPS = 1e-6


def group_advantages(rewards: Tensor, groups: Tensor) -> Tensor:
    """Â_i = (R_i − mean(R_group)) / (std(R_group) + 1e-6) for responses (B,) in groups (B,).

    std is the sample standard deviation (Bessel-corrected, as torch.std, TRL and verl use);
    a group whose rewards are all equal, or a group of one, gets 0.
    """
    rewards = rewards.to(torch.float64)
    _, inverse = torch.unique(groups, return_inverse=True)
    n_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    size = torch.bincount(inverse, minlength=n_groups).to(torch.float64)  # (G,)
    mean = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, inverse, rewards) / size
    dev = rewards - mean[inverse]
    sq = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, inverse, dev * dev)
    std = torch.sqrt(sq / (size - 1).clamp(min=1))
    adv = dev / (std[inverse] + ADV_EPS)
    return torch.where(std[inverse] > 0, adv, torch.zeros_like(adv))


# ---------------------------------------------------------------------------------------------
# Policy loss (METHODS §4). Every function maps per-token tensors to per-token tensors or a
# scalar; the trainer sums weighted per-token terms over micro-batches and ranks, so the loss of
# a mini-batch does not depend on how it is split.
# ---------------------------------------------------------------------------------------------
DENOMINATORS = ("selected", "all", "sequence")

LOG_RATIO_CLAMP = 20.0
"""verl clamps log p − log p_old to ±20 before the exponential (core_algos.compute_policy_loss)."""


def clipped_surrogate(
    logprob: Tensor,
    old_logprob: Tensor,
    advantages: Tensor,
    eps_low: float,
    eps_high: float,
    dual_clip: float | None = None,
) -> tuple[Tensor, Tensor]:
    """PPO-clip per token: (ℓ = −min(r Â, clip(r, 1−ε_low, 1+ε_high) Â), clipped) with
    r = exp(clamp(logp − logp_old, −20, 20)), as verl clamps it: the ratio lies in [e^−20, e^20]
    and cannot overflow, and beyond the clamp its gradient is 0.

    All arguments broadcast to one shape. `clipped` (bool) marks the tokens where the clipped
    branch is the active one (its gradient is 0), the PPO "clip fraction". With dual_clip = c
    (verl's dual-clip, c > 1), tokens with Â < 0 are bounded by ℓ ≤ −c Â, so a huge ratio on a
    bad token cannot dominate; those tokens count as clipped too.
    """
    ratio = torch.exp((logprob - old_logprob).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    unclipped = -advantages * ratio
    clipped_loss = -advantages * torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    loss = torch.maximum(unclipped, clipped_loss)
    clipped = clipped_loss > unclipped
    if dual_clip is not None:
        if not dual_clip > 1.0:
            raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
        bound = -advantages * dual_clip
        capped = (advantages < 0) & (loss > bound)
        loss = torch.where(capped, bound, loss)
        clipped = clipped | capped
    return loss, clipped


K3_LOG_RATIO_CLAMP = LOG_RATIO_CLAMP
K3_CLAMP = 10.0


def k3_kl(logprob: Tensor, ref_logprob: Tensor) -> Tensor:
    """k3 estimator of KL(π_θ ‖ π_ref) per token: e^{δ} − δ − 1 ∈ [0, 10] (nats), δ = ref − logp.

    Clamped as verl's low_var_kl: δ to [−20, 20] (e^δ cannot overflow) and the estimate to at
    most 10, so one token whose probability collapsed under the policy cannot dominate the loss
    (its gradient is then 0, like a clipped ratio's). Exactly 0 where logp = ref."""
    delta = (ref_logprob - logprob).clamp(-K3_LOG_RATIO_CLAMP, K3_LOG_RATIO_CLAMP)
    return (torch.exp(delta) - delta - 1.0).clamp(min=0.0, max=K3_CLAMP)


def loss_weights(
    selected: Tensor,
    valid: Tensor,
    denominator: str,
    *,
    n_selected: float | None = None,
    n_valid: float | None = None,
    n_sequences: float | None = None,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Weights w (B, T) with L = Σ w ℓ for per-token losses ℓ (B, T); 0 wherever not selected.

    selected and valid are (B, T) masks (selected ⊆ valid). `denominator`:
    - ``selected``: w = m / Σ m (the mean over selected tokens);
    - ``all``: w = m / N_valid (the sum over selected tokens, over all valid tokens);
    - ``sequence``: w = m_i,t / (Σ_t m_i,t · B): the mean over each sequence's selected tokens, then
      over the B sequences (a sequence with nothing selected contributes 0 but still counts).
    The counts default to those of the given tensors; pass the totals of the whole scope
    (all micro-batches and ranks) when this is one part of it. Zero counts give zero weights.
    Weights are in `dtype` (use the loss's: float64 in reference tests).
    """
    if denominator not in DENOMINATORS:
        raise ValueError(f"unknown loss denominator {denominator!r}; known: {list(DENOMINATORS)}")
    m = ((selected != 0) & (valid != 0)).to(dtype)
    if denominator == "selected":
        z = float(m.sum()) if n_selected is None else float(n_selected)
        return m / z if z > 0 else torch.zeros_like(m)
    if denominator == "all":
        z = float((valid != 0).sum()) if n_valid is None else float(n_valid)
        return m / z if z > 0 else torch.zeros_like(m)
    b = float(selected.shape[0]) if n_sequences is None else float(n_sequences)
    if b <= 0:
        return torch.zeros_like(m)
    per_seq = m.sum(dim=1, keepdim=True)  # (B, 1) selected tokens of each sequence
    return m / (per_seq.clamp_min(1.0) * b)  # rows with nothing selected stay 0


def aggregate_loss(token_loss: Tensor, selected: Tensor, valid: Tensor, denominator: str) -> Tensor:
    """L = Σ w ℓ over one whole scope (see :func:`loss_weights`); masked tokens enter with weight 0
    and, being multiplied rather than indexed out, still receive an exact zero gradient."""
    w = loss_weights(selected, valid, denominator, dtype=token_loss.dtype)
    return (torch.where(w != 0, token_loss, torch.zeros_like(token_loss)) * w).sum()


def overlong_penalty(lengths: Tensor, max_length: int | Tensor, buffer: int,
                     factor: float = 1.0) -> Tensor:
    """DAPO's soft overlong penalty per response: min(−(L − (L_max − L_buf)) / L_buf · factor, 0).

    0 up to L_max − L_buf tokens, then falling linearly to −factor at L_max (a response never
    exceeds L_max; longer lengths are held at −factor). max_length is one limit or one per response
    (datasets may have their own); the buffer must be shorter than every limit. As verl's DAPO
    reward manager, the penalty is added to the reward once and never to the correctness.
    """
    limit = torch.as_tensor(max_length, dtype=torch.float64)
    if not (buffer > 0 and bool((buffer < limit).all())):
        raise ValueError(f"overlong buffer must lie in (0, max_length={max_length}), got {buffer}")
    if not factor > 0:
        raise ValueError(f"overlong penalty factor must be > 0, got {factor}")
    excess = lengths.to(torch.float64) - (limit - buffer)
    return torch.clamp(-excess / buffer * factor, min=-factor, max=0.0)
