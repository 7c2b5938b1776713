"""Token selectors: which valid positions of a selection scope receive policy gradient (METHODS §3).

A selector is a pure function ``f(inp: SelectionInput, **params) -> Tensor`` registered by name
with :func:`register_selector`; call it through :func:`select_tokens`, which runs it under
no_grad and checks that the mask is boolean, of shape (B, T) and False on every invalid
position. A selector sees the whole scope at once, so its mask does not depend on how the scope
is split into micro-batches or ranks.

Conventions shared by all selectors:

- Counts are k = ceil(ρ·N) (N valid positions) or ceil(ρ·U) (U unique sampled ids), with ρ
  read as the decimal it is written as, so ρ = 0.7 and N = 10 give k = 7 (not the 8 that
  float rounding of 0.7·10 would give). ρ = 0 selects nothing; ρ = 1 selects every valid token;
  N = 0 gives an all-False mask.
- Top-k uses torch.topk for the k-th largest value, then takes every value above it and, among
  values equal to it, the earliest positions in row-major (sequence, then time) order. The mask
  is therefore deterministic under ties. Ties among vocabulary ids go to the smaller id, which
  does not depend on where in the batch an id first occurs.
- An integer (or 0/1 float) response mask is converted with ``!= 0`` after checking that it
  only holds 0 and 1, so it selects exactly what the boolean mask would.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction

import torch
from torch import Tensor

Selector = Callable[..., Tensor]
SELECTORS: dict[str, Selector] = {}


def register_selector(name: str) -> Callable[[Selector], Selector]:
    """Decorator: register a selector under `name` in SELECTORS."""

    def decorate(fn: Selector) -> Selector:
        if name in SELECTORS:
            raise ValueError(f"selector {name!r} is already registered")
        SELECTORS[name] = fn
        return fn

    return decorate


def as_bool_mask(mask: Tensor) -> Tensor:
    """A response mask as bool; int / float masks must hold only 0 and 1."""
    if mask.dtype == torch.bool:
        return mask
    if bool(((mask != 0) & (mask != 1)).any()):
        raise ValueError("a response mask must hold only 0 and 1 (or be boolean)")
    return mask != 0


@dataclass
class SelectionInput:
    """The per-token statistics of one selection scope; every (B, T) field aligns with valid.

    valid: (B, T) response positions (bool, or 0/1 ints). entropy: (B, T) H in nats.
    logprob: (B, T) log p(o) of the sampled token, nats. jsd: (B, T) d = JSD(p ‖ p̄), nats.
    token_ids: (B, T) sampled ids. advantages: (B,) per response or (B, T) per token.
    id_scores: (ids (U,), scores (U,)) per-id ICT scores computed over the whole scope (from
    stats.pooled_id_scores, or stats.id_mean_scores of all-reduced stats.id_sums); required by
    ict variant 'pooled', and used instead of jsd by 'token_id' when given.
    generator: torch.Generator for the 'random' selector (else a fresh one seeded with `seed`).
    """

    valid: Tensor
    entropy: Tensor | None = None
    logprob: Tensor | None = None
    jsd: Tensor | None = None
    token_ids: Tensor | None = None
    advantages: Tensor | None = None
    id_scores: tuple[Tensor, Tensor] | None = None
    generator: torch.Generator | None = None

    def __post_init__(self) -> None:
        self.valid = as_bool_mask(self.valid)
        if self.valid.dim() != 2:
            raise ValueError(f"valid must be (B, T), got shape {tuple(self.valid.shape)}")
        for name in ("entropy", "logprob", "jsd", "token_ids"):
            value = getattr(self, name)
            if value is not None and value.shape != self.valid.shape:
                raise ValueError(
                    f"{name} has shape {tuple(value.shape)}, valid has {tuple(self.valid.shape)}"
                )
        if self.advantages is not None and self.advantages.shape not in (
            self.valid.shape[:1], self.valid.shape
        ):
            raise ValueError(f"advantages must be (B,) or (B, T), got {tuple(self.advantages.shape)}")

    def need(self, name: str) -> Tensor:
        value = getattr(self, name)
        if value is None:
            raise ValueError(f"this selector needs {name!r} in its SelectionInput")
        return value


def select_tokens(name: str, inp: SelectionInput, **params) -> Tensor:
    """Run selector `name` on a scope: (B, T) bool mask, False on every invalid position."""
    if name not in SELECTORS:
        raise KeyError(f"unknown selector {name!r}; known: {sorted(SELECTORS)}")
    with torch.no_grad():
        mask = SELECTORS[name](inp, **params)
    if mask.dtype != torch.bool or mask.shape != inp.valid.shape:
        raise TypeError(f"selector {name!r} returned {mask.dtype} {tuple(mask.shape)}")
    if bool((mask & ~inp.valid).any()):
        raise AssertionError(f"selector {name!r} selected an invalid position")
    return mask


def count(rho: float, n: int) -> int:
    """k = ceil(ρ·n), with ρ taken as the decimal it prints as; 0 ≤ ρ ≤ 1."""
    if not 0.0 <= rho <= 1.0:
        raise ValueError(f"rho must lie in [0, 1], got {rho}")
    return min(n, math.ceil(Fraction(str(float(rho))) * n))


def top_k_first(values: Tensor, k: int) -> Tensor:
    """Bool mask (n,) of the k largest of values (n,); ties go to the lowest indices."""
    n = values.numel()
    if k <= 0 or n == 0:
        return torch.zeros(n, dtype=torch.bool, device=values.device)
    if k >= n:
        return torch.ones(n, dtype=torch.bool, device=values.device)
    if bool(torch.isnan(values).any()):
        raise ValueError("cannot rank NaN scores")
    kth = torch.topk(values, k, sorted=False).values.min()
    above = values > kth
    equal = values == kth
    room = k - int(above.sum())
    return above | (equal & (torch.cumsum(equal, 0) <= room))


def _scatter(valid: Tensor, chosen: Tensor) -> Tensor:
    """(B, T) mask from a choice (N,) over the valid positions in row-major order."""
    mask = torch.zeros_like(valid)
    mask[valid] = chosen
    return mask


def _top_positions(valid: Tensor, scores: Tensor, rho: float) -> Tensor:
    values = scores[valid]  # (N,) row-major
    return _scatter(valid, top_k_first(values, count(rho, values.numel())))


@register_selector("all")
def select_all(inp: SelectionInput) -> Tensor:
    """GRPO / DAPO: every valid token."""
    return inp.valid.clone()


@register_selector("entropy_top")
def select_entropy_top(inp: SelectionInput, rho: float = 0.2) -> Tensor:
    """20-Entropy: the ceil(ρN) valid tokens of highest entropy (ties: earliest first)."""
    return _top_positions(inp.valid, inp.need("entropy"), rho)


@register_selector("entropy_bottom")
def select_entropy_bottom(inp: SelectionInput, rho: float = 0.2) -> Tensor:
    """Control: the valid tokens that entropy_top leaves out, the N - ceil(ρN) lowest in H."""
    return inp.valid & ~select_entropy_top(inp, rho)


@register_selector("random")
def select_random(inp: SelectionInput, rho: float = 0.1, seed: int = 0) -> Tensor:
    """Control: ceil(ρN) valid tokens drawn uniformly without replacement.

    Uses inp.generator when given (a run's stream), else a CPU generator seeded with `seed`.
    """
    n = int(inp.valid.sum())
    generator = inp.generator
    if generator is None:
        generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(n, generator=generator, device=generator.device)
    chosen = torch.zeros(n, dtype=torch.bool, device=generator.device)
    chosen[order[: count(rho, n)]] = True
    return _scatter(inp.valid, chosen.to(inp.valid.device))


def linear_quantile(values: Tensor, q: float) -> Tensor:
    """The q-quantile of values (n,), n ≥ 1, by linear interpolation between order statistics.

    With v the ascending sort and h = q·(n - 1): v[⌊h⌋] + (h - ⌊h⌋)(v[⌈h⌉] - v[⌊h⌋]) — the
    definition of torch.quantile / numpy's default ('linear'), computed with a sort so it works
    on any number of elements.
    """
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must lie in [0, 1], got {q}")
    ordered = torch.sort(values.reshape(-1)).values
    h = q * (ordered.numel() - 1)
    lo, hi = math.floor(h), math.ceil(h)
    return ordered[lo] + (h - lo) * (ordered[hi] - ordered[lo])


def per_token(valid: Tensor, advantages: Tensor) -> Tensor:
    """Advantages (B,) or (B, T) as (B, T)."""
    return advantages[:, None].expand(valid.shape) if advantages.dim() == 1 else advantages


@register_selector("stapo")
def select_stapo(inp: SelectionInput, tau_p: float = 0.002, q: float = 0.75) -> Tensor:
    """STAPO (S2T): keep every valid token except the spurious ones, which are silenced.

    Spurious: Â > 0 ∧ p(o) < τ_p ∧ H < τ_h, τ_h the q-quantile (linear_quantile) of H over the
    candidates Â > 0 ∧ p(o) < τ_p of the scope. No candidates: nothing is silenced. Strict
    inequalities throughout, so a single candidate is never silenced (H < H is false).
    """
    valid = inp.valid
    entropy = inp.need("entropy")
    advantage = per_token(valid, inp.need("advantages"))
    candidates = valid & (advantage > 0) & (inp.need("logprob").exp() < tau_p)
    if not bool(candidates.any()):
        return valid.clone()
    tau_h = linear_quantile(entropy[candidates], q)
    return valid & ~(candidates & (entropy < tau_h))


@register_selector("ict")
def select_ict(inp: SelectionInput, rho: float = 0.1, variant: str = "token_id") -> Tensor:
    """ICT, in one of three readings (METHODS §3); scores d are JSD(p ‖ p̄) in nats.

    token_id: s_v = mean d over the positions whose sampled id is v; the top ceil(ρU) ids
    (ties: smaller id); every valid position of a selected id. position: the top ceil(ρN)
    positions by d. pooled: like token_id with s_v = JSD(p̄_v ‖ p̄) from inp.id_scores.
    """
    valid = inp.valid
    if variant == "position":
        return _top_positions(valid, inp.need("jsd"), rho)
    if variant not in ("token_id", "pooled"):
        raise ValueError(f"unknown ICT variant {variant!r}; known: token_id, position, pooled")
    token_ids = inp.need("token_ids")
    if inp.id_scores is not None:
        ids, scores = inp.id_scores
    elif variant == "pooled":
        raise ValueError("ICT 'pooled' needs id_scores (stats.pooled_id_scores)")
    else:
        ids, inverse = torch.unique(token_ids[valid], return_inverse=True)  # (U,) ascending
        total = torch.zeros(ids.numel(), dtype=torch.float64, device=valid.device)
        total.index_add_(0, inverse, inp.need("jsd")[valid].double())
        scores = total / torch.bincount(inverse, minlength=ids.numel())
    order = torch.argsort(ids)  # ascending ids, so ties go to the smaller id
    ids, scores = ids[order], scores[order]
    chosen = ids[top_k_first(scores, count(rho, ids.numel()))]
    return valid & torch.isin(token_ids, chosen.to(token_ids.device))
