"""Advantages and policy losses (METHODS §4), as pure tensor functions.

The policy losses and the loss aggregation modes are registries, as verl's
``register_policy_loss`` and ``agg_loss``'s modes: a user's new one is one decorated function in
one file, imported through the config's ``selector_modules`` and chosen by
``train.loss.policy_loss`` / ``train.loss.denominator`` (docs/science.md):

    @register_policy_loss("my_loss")
    def my_loss(logprob, old_logprob, advantages, cfg) -> tuple[Tensor, Tensor]: ...

    @register_loss_agg_mode("my_mode")
    def my_mode(m: Tensor, counts: Counts) -> Tensor: ...
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:  # the config sits above the library: types only
    from stages.config import Loss

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
PolicyLoss = Callable[[Tensor, Tensor, Tensor, "Loss"], tuple[Tensor, Tensor]]
"""(logprob, old_logprob, advantages, the config's train.loss) -> (ℓ per token, clipped per
token: bool, the tokens whose ratio was cut, for the clip fraction); all of one shape (n,)."""

POLICY_LOSSES: dict[str, PolicyLoss] = {}


def register_policy_loss(name: str) -> Callable[[PolicyLoss], PolicyLoss]:
    """Decorator: register a per-token policy loss under `name` (train.loss.policy_loss)."""

    def decorate(fn: PolicyLoss) -> PolicyLoss:
        if name in POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} is already registered")
        POLICY_LOSSES[name] = fn
        return fn

    return decorate


def policy_loss_fn(name: str) -> PolicyLoss:
    """The policy loss registered under `name`."""
    if name not in POLICY_LOSSES:
        raise KeyError(f"unknown policy loss {name!r}; known: {sorted(POLICY_LOSSES)}")
    return POLICY_LOSSES[name]


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


@register_policy_loss("ppo_clip")
def ppo_clip_loss(logprob: Tensor, old_logprob: Tensor, advantages: Tensor,
                  cfg: Loss) -> tuple[Tensor, Tensor]:
    """The default: :func:`clipped_surrogate` with the config's eps_low, eps_high and dual_clip
    (verl's "vanilla" policy loss, DAPO's clip-higher)."""
    return clipped_surrogate(logprob, old_logprob, advantages, cfg.eps_low, cfg.eps_high,
                             cfg.dual_clip)


K3_LOG_RATIO_CLAMP = LOG_RATIO_CLAMP
K3_CLAMP = 10.0


def k3_kl(logprob: Tensor, ref_logprob: Tensor) -> Tensor:
    """k3 estimator of KL(π_θ ‖ π_ref) per token: e^{δ} − δ − 1 ∈ [0, 10] (nats), δ = ref − logp.

    Clamped as verl's low_var_kl: δ to [−20, 20] (e^δ cannot overflow) and the estimate to at
    most 10, so one token whose probability collapsed under the policy cannot dominate the loss
    (its gradient is then 0, like a clipped ratio's). Exactly 0 where logp = ref."""
    delta = (ref_logprob - logprob).clamp(-K3_LOG_RATIO_CLAMP, K3_LOG_RATIO_CLAMP)
    return (torch.exp(delta) - delta - 1.0).clamp(min=0.0, max=K3_CLAMP)


@dataclass(frozen=True)
class Counts:
    """The counts of a whole aggregation scope (all micro-batches and ranks of a mini-batch)."""

    selected: float  # selected valid tokens
    valid: float  # valid tokens
    sequences: float  # sequences, those with nothing selected included


AggMode = Callable[[Tensor, Counts], Tensor]
"""(m (B, T): 1 on the selected valid tokens, 0 elsewhere, in the weights' dtype; the scope's
counts) -> weights w (B, T) with L = Σ w ℓ, 0 wherever m is."""

LOSS_AGG_MODES: dict[str, AggMode] = {}


def register_loss_agg_mode(name: str) -> Callable[[AggMode], AggMode]:
    """Decorator: register a loss aggregation mode under `name` (train.loss.denominator)."""

    def decorate(fn: AggMode) -> AggMode:
        if name in LOSS_AGG_MODES:
            raise ValueError(f"loss aggregation mode {name!r} is already registered")
        LOSS_AGG_MODES[name] = fn
        return fn

    return decorate


@register_loss_agg_mode("selected")
def mean_over_selected(m: Tensor, counts: Counts) -> Tensor:
    """w = m / Σ m: the mean over the selected tokens."""
    z = counts.selected
    return m / z if z > 0 else torch.zeros_like(m)


@register_loss_agg_mode("all")
def sum_over_valid(m: Tensor, counts: Counts) -> Tensor:
    """w = m / N_valid: the sum over the selected tokens, over all valid tokens."""
    z = counts.valid
    return m / z if z > 0 else torch.zeros_like(m)


@register_loss_agg_mode("sequence")
def mean_over_sequences(m: Tensor, counts: Counts) -> Tensor:
    """w = m_i,t / (Σ_t m_i,t · B): the mean over each sequence's selected tokens, then over the B
    sequences (a sequence with nothing selected contributes 0 but still counts)."""
    b = counts.sequences
    if b <= 0:
        return torch.zeros_like(m)
    per_seq = m.sum(dim=1, keepdim=True)  # (B, 1) selected tokens of each sequence
    return m / (per_seq.clamp_min(1.0) * b)  # rows with nothing selected stay 0


DENOMINATORS = LOSS_AGG_MODES
"""The loss denominators: the registered aggregation modes (built in: selected, all, sequence)."""


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

    selected and valid are (B, T) masks (selected ⊆ valid). `denominator` names a registered
    aggregation mode (LOSS_AGG_MODES); built in:
    - ``selected``: w = m / Σ m (the mean over selected tokens);
    - ``all``: w = m / N_valid (the sum over selected tokens, over all valid tokens);
    - ``sequence``: w = m_i,t / (Σ_t m_i,t · B): the mean over each sequence's selected tokens, then
      over the B sequences (a sequence with nothing selected contributes 0 but still counts).
    The counts default to those of the given tensors; pass the totals of the whole scope
    (all micro-batches and ranks) when this is one part of it. Zero counts give zero weights.
    Weights are in `dtype` (use the loss's: float64 in reference tests).
    """
    if denominator not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss denominator {denominator!r}; known: {list(LOSS_AGG_MODES)}")
    m = ((selected != 0) & (valid != 0)).to(dtype)
    counts = Counts(selected=float(m.sum()) if n_selected is None else float(n_selected),
                    valid=float((valid != 0).sum()) if n_valid is None else float(n_valid),
                    sequences=float(selected.shape[0]) if n_sequences is None else float(n_sequences))
    return LOSS_AGG_MODES[denominator](m, counts)


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
