"""Token selectors: which valid positions of a selection scope receive policy gradient (METHODS §3).

A selector is a pure function ``f(inp: SelectionInput, **params) -> Tensor`` registered by name
with :func:`register_selector`, which also declares what it reads and what it takes:

    @register_selector("my_rule", needs=("entropy", "logprob"), params=MyParams)
    def select_my_rule(inp: SelectionInput, alpha: float = 0.5) -> Tensor: ...

- ``needs`` names the :class:`SelectionInput` fields the selector reads (a tuple, or a function of
  its validated parameters when that depends on them). The trainer's scorer computes exactly the
  statistics in it (STATISTICS), and only those are gathered across ranks.
- ``params`` is a pydantic model of its keyword parameters with METHODS' defaults; the config's
  ``methods.<name>`` keys beside ``selector`` are validated against it, so a wrong key or value
  is an error naming ``methods.<name>.<key>``.
- ``per_response`` says whether the selector ranks each response's own positions (ICT's rule) or
  positions across the scope (20-Entropy); a bool, or a function of the validated parameters.
  Only scope-ranking selectors accept ``selection_scope: microbatch`` (the released 80/20 code's
  scope: one of verl's micro-batches, stages.core.statistics.batching), since a micro-batch may split a
  response's group.

Call a selector through :func:`select_tokens`, which runs it under no_grad and checks that the
mask is boolean, of shape (B, T) and False on every invalid position. A selector sees the whole
scope at once, so its mask does not depend on how the scope is split into micro-batches or ranks.

Conventions shared by all selectors:

- Counts are k = ceil(ρ·N) (N valid positions, or T_i of one response for per-response rules) or
  ceil(ρ·U) (U unique sampled ids), with ρ read as the decimal it is written as, so ρ = 0.7 and
  N = 10 give k = 7 (not the 8 that float rounding of 0.7·10 would give). ρ = 1 selects every
  valid token; N = 0 gives an all-False mask.
- Top-k takes the k largest values and, among values equal to the k-th, the earliest positions
  in row-major (sequence, then time) order, so the mask is deterministic under ties. Ties among
  vocabulary ids go to the smaller id, which does not depend on where in the batch an id occurs.
- An integer (or 0/1 float) response mask is converted with ``!= 0`` after checking that it
  only holds 0 and 1, so it selects exactly what the boolean mask would.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from fractions import Fraction
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor

from stages.core.common.names import ICT_LABELS  # noqa: F401  (re-exported: how each variant is printed)

Selector = Callable[..., Tensor]

STATISTICS = ("entropy", "logprob", "renyi2", "jsd", "group_jsd", "response_mean_jsd",
              "group_pooled_jsd", "group_loo_jsd")
"""The fields the scorer computes from the policy's distributions (the rest come with the batch):
entropy, logprob, renyi2 in one pass; jsd (deviation from the scope's mean distribution) and
group_jsd (ICT's u: deviation from the group's mean at the same step) cost two passes each, and
so do the readings of ICT's reference (stages.core.statistics.scorer.DEVIATIONS): response_mean_jsd,
group_pooled_jsd (two more for a reference of more than chunk_positions positions) and
group_loo_jsd."""
INPUTS = (*STATISTICS, "token_ids", "advantages")
"""The SelectionInput fields a selector may need."""


class Params(BaseModel):
    """Base of a selector's parameter model: unknown keys are errors, values are not coerced."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class NoParams(Params):
    """A selector without parameters."""


@dataclass(frozen=True)
class SelectorSpec:
    """A registered selector: the function, what it reads, and its parameter model."""

    name: str
    fn: Selector
    needs_: tuple[str, ...] | Callable[[Params], Iterable[str]]
    params: type[Params]
    per_response_: bool | Callable[[Params], bool] = False

    def validate(self, raw: dict) -> Params:
        """The selector's parameters from config keys (pydantic.ValidationError when wrong)."""
        return self.params.model_validate(raw)

    def needs(self, params: Params | None = None) -> frozenset[str]:
        """The SelectionInput fields this selector reads with these (validated) parameters."""
        if callable(self.needs_):
            return frozenset(self.needs_(params if params is not None else self.params()))
        return frozenset(self.needs_)

    def per_response(self, params: Params | None = None) -> bool:
        """Whether the selector ranks each response's own positions with these parameters."""
        if callable(self.per_response_):
            return bool(self.per_response_(params if params is not None else self.params()))
        return bool(self.per_response_)


SELECTORS: dict[str, SelectorSpec] = {}


def register_selector(name: str, *, needs: Iterable[str] | Callable[[Params], Iterable[str]] = (),
                      params: type[Params] = NoParams,
                      per_response: bool | Callable[[Params], bool] = False,
                      ) -> Callable[[Selector], Selector]:
    """Decorator: register a selector under `name`, with the inputs it needs, its parameters and
    whether it ranks each response's own positions."""
    if not callable(needs):
        needs = tuple(needs)
        if unknown := set(needs) - set(INPUTS):
            raise ValueError(f"selector {name!r} needs unknown inputs {sorted(unknown)}; known: {INPUTS}")

    def decorate(fn: Selector) -> Selector:
        if name in SELECTORS:
            raise ValueError(f"selector {name!r} is already registered")
        SELECTORS[name] = SelectorSpec(name, fn, needs, params, per_response)
        return fn

    return decorate


def spec_of(name: str) -> SelectorSpec:
    if name not in SELECTORS:
        raise KeyError(f"unknown selector {name!r}; known: {sorted(SELECTORS)}")
    return SELECTORS[name]


def as_bool_mask(mask: Tensor) -> Tensor:
    """A response mask as bool; int / float masks must hold only 0 and 1."""
    if mask.dtype == torch.bool:
        return mask
    if bool(((mask != 0) & (mask != 1)).any()):
        raise ValueError("a response mask must hold only 0 and 1 (or be boolean)")
    return mask != 0


def grid(values: Tensor, lengths: list[int] | Tensor, fill: float | bool = 0) -> Tensor:
    """Flat per-position values (N,) → right-padded (B, T) in (sequence, position) order."""
    lengths = torch.as_tensor(lengths, dtype=torch.long)
    width = int(lengths.max()) if lengths.numel() else 0
    out = torch.full((lengths.numel(), width), fill, dtype=values.dtype, device=values.device)
    out[valid_grid(lengths).to(values.device)] = values
    return out


def valid_grid(lengths: list[int] | Tensor) -> Tensor:
    """(B, T) bool: True at the first lengths[b] positions of row b."""
    lengths = torch.as_tensor(lengths, dtype=torch.long)
    width = int(lengths.max()) if lengths.numel() else 0
    return torch.arange(width)[None, :] < lengths[:, None]


@dataclass
class SelectionInput:
    """The per-token statistics of one selection scope; every (B, T) field aligns with valid.

    valid: (B, T) response positions (bool, or 0/1 ints). entropy: (B, T) H in nats.
    logprob: (B, T) log p(o) of the sampled token, nats. renyi2: (B, T) H2 in nats.
    jsd: (B, T) d = JSD(p ‖ p̄), p̄ the scope's mean distribution, nats.
    group_jsd: (B, T) ICT's u = JSD(p_{i,t} ‖ P̄_t), P̄_t the mean over the response's group at
    step t (stats.group_step_jsd), nats. The readings of that reference (ours, never ICT), nats:
    response_mean_jsd: (B, T) JSD(p_{i,t} ‖ mean of p_{i,t'} over the response's own positions);
    group_pooled_jsd: (B, T) JSD(p_{i,t} ‖ mean of p over every position of every response of
    the group); group_loo_jsd: (B, T) JSD(p_{i,t} ‖ mean over the group's OTHER responses active
    at step t), 0 where none is. token_ids: (B, T) sampled ids.
    advantages: (B,) per response or (B, T) per token.
    generator: torch.Generator for the 'random' selector (else a fresh one seeded with `seed`).
    """

    valid: Tensor
    entropy: Tensor | None = None
    logprob: Tensor | None = None
    renyi2: Tensor | None = None
    jsd: Tensor | None = None
    group_jsd: Tensor | None = None
    response_mean_jsd: Tensor | None = None
    group_pooled_jsd: Tensor | None = None
    group_loo_jsd: Tensor | None = None
    token_ids: Tensor | None = None
    advantages: Tensor | None = None
    generator: torch.Generator | None = None

    def __post_init__(self) -> None:
        self.valid = as_bool_mask(self.valid)
        if self.valid.dim() != 2:
            raise ValueError(f"valid must be (B, T), got shape {tuple(self.valid.shape)}")
        for name in (*STATISTICS, "token_ids"):
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
    """Run selector `name` on a scope: (B, T) bool mask, False on every invalid position.

    params are the selector's keyword parameters (validated against its parameter model; the
    model's defaults fill the rest)."""
    spec = spec_of(name)
    kwargs = spec.validate(params).model_dump()
    with torch.no_grad():
        mask = spec.fn(inp, **kwargs)
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


def top_per_response(valid: Tensor, scores: Tensor, rho: float) -> Tensor:
    """(B, T) mask of the top ceil(ρ·T_i) valid positions of each response i by score.

    T_i is response i's number of valid positions; ties go to the earliest position."""
    if bool(torch.isnan(scores[valid]).any()):
        raise ValueError("cannot rank NaN scores")
    ks = torch.tensor([count(rho, int(n)) for n in valid.sum(dim=1).tolist()], dtype=torch.long)
    keyed = torch.where(valid, scores.double(), torch.tensor(-math.inf, dtype=torch.float64))
    # a stable descending sort keeps equal scores in position order: ties go to the earliest
    order = torch.sort(keyed, dim=1, descending=True, stable=True).indices  # (B, T)
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(order.shape[1]).expand_as(order).contiguous())
    return valid & (rank < ks.to(rank.device)[:, None])


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


class EntropyParams(Params):
    rho: float = Field(0.2, gt=0, le=1, description="fraction of the scope's tokens by entropy")


@register_selector("entropy_top", needs=("entropy",), params=EntropyParams)
def select_entropy_top(inp: SelectionInput, rho: float = 0.2) -> Tensor:
    """20-Entropy: the ceil(ρN) valid tokens of highest entropy (ties: earliest first)."""
    return _top_positions(inp.valid, inp.need("entropy"), rho)


@register_selector("entropy_bottom", needs=("entropy",), params=EntropyParams)
def select_entropy_bottom(inp: SelectionInput, rho: float = 0.2) -> Tensor:
    """Control: the valid tokens that entropy_top leaves out, the N - ceil(ρN) lowest in H."""
    return inp.valid & ~select_entropy_top(inp, rho)


class RandomParams(Params):
    rho: float = Field(0.1, gt=0, le=1, description="fraction of tokens drawn")
    scope: Literal["batch", "response"] = Field(
        "batch", description="batch: ceil(ρN) of the scope; response: ceil(ρ·T_i) of each response")
    seed: int = Field(0, description="seed when no generator is given (the trainer gives one)")


@register_selector("random", params=RandomParams, per_response=lambda p: p.scope == "response")
def select_random(inp: SelectionInput, rho: float = 0.1, scope: str = "batch", seed: int = 0) -> Tensor:
    """Control: ceil(ρN) valid tokens of the scope (or ceil(ρ·T_i) of each response) drawn
    uniformly without replacement.

    Uses inp.generator when given (a run's stream), else a CPU generator seeded with `seed`.
    """
    generator = inp.generator
    if generator is None:
        generator = torch.Generator().manual_seed(seed)
    if scope == "response":
        scores = torch.rand(inp.valid.shape, generator=generator, device=generator.device)
        return top_per_response(inp.valid, scores.to(inp.valid.device), rho)
    n = int(inp.valid.sum())
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


class StapoParams(Params):
    tau_p: float = Field(0.002, gt=0, lt=1, description="probability threshold τ_p")
    q: float = Field(0.75, ge=0, le=1, description="entropy quantile of the candidates")


@register_selector("stapo", needs=("entropy", "logprob", "advantages"), params=StapoParams)
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


ICT_SCORES = {"paper": "group_jsd", "response_mean": "response_mean_jsd",
              "group_pooled": "group_pooled_jsd", "group_leave_one_out": "group_loo_jsd"}
"""The per-response variants of the ict selector and the statistic each ranks positions by."""
ICT_VARIANTS = (*ICT_SCORES, "token_id", "scope_position")


class IctParams(Params):
    rho: float = Field(0.1, gt=0, le=1, description="fraction ρ (of each response for the "
                       "per-response variants)")
    variant: Literal["paper", "response_mean", "group_pooled", "group_leave_one_out", "token_id",
                     "scope_position"] = Field(
        "paper", description="paper: ICT's rule (reference: the group's mean at the same step); "
        "the readings the summaries leave open, per response like the rule (ours, labelled, never "
        "ICT): response_mean (the response's own average over its positions), group_pooled (the "
        "group's average over all its positions), group_leave_one_out (the group-step mean of the "
        "other responses); token_id, scope_position: our earlier readings (labelled, never ICT)")
    part: Literal["unique", "frequent"] = Field(
        "unique", description="unique: the top ρ by u; frequent: the other positions of each "
        "response (the paper's '90%-frequent' control; per-response variants only)")


def _ict_needs(p: IctParams) -> tuple[str, ...]:
    if p.variant in ICT_SCORES:
        return (ICT_SCORES[p.variant],)
    return {"token_id": ("jsd", "token_ids"), "scope_position": ("jsd",)}[p.variant]


@register_selector("ict", needs=_ict_needs, params=IctParams,
                   per_response=lambda p: p.variant in ICT_SCORES)
def select_ict(inp: SelectionInput, rho: float = 0.1, variant: str = "paper",
               part: str = "unique") -> Tensor:
    """ICT (METHODS §3). Scores are JSDs in nats.

    paper (ICT's rule): per response i, the top ceil(ρ·T_i) of its positions by
    u_{i,t} = JSD(p_{i,t} ‖ P̄_t), P̄_t the mean distribution of its group at step t (ties:
    earliest); part='frequent' keeps the other positions instead.
    The readings of the reference the summaries leave open pick the same way by their own
    deviation (ICT_SCORES; labelled, never ICT): response_mean, group_pooled,
    group_leave_one_out.
    Our earlier readings, labelled as such wherever they appear and contradicted by the
    recovered text: token_id: s_v = mean of d = JSD(p ‖ p̄) (p̄ the scope mean) over the
    positions whose sampled id is v, the top ceil(ρU) ids (ties: smaller id), every valid
    position of a selected id; scope_position: the top ceil(ρN) positions of the scope by d.
    """
    valid = inp.valid
    if variant in ICT_SCORES:
        top = top_per_response(valid, inp.need(ICT_SCORES[variant]), rho)
        return top if part == "unique" else valid & ~top
    if part != "unique":
        raise ValueError(f"ICT part {part!r} applies to the per-response variants only "
                         f"({list(ICT_SCORES)})")
    if variant == "scope_position":
        return _top_positions(valid, inp.need("jsd"), rho)
    if variant != "token_id":
        raise ValueError(f"unknown ICT variant {variant!r}; known: {list(ICT_VARIANTS)}")
    token_ids = inp.need("token_ids")
    ids, inverse = torch.unique(token_ids[valid], return_inverse=True)  # (U,) ascending
    total = torch.zeros(ids.numel(), dtype=torch.float64, device=valid.device)
    total.index_add_(0, inverse, inp.need("jsd")[valid].double())
    scores = total / torch.bincount(inverse, minlength=ids.numel())
    chosen = ids[top_k_first(scores, count(rho, ids.numel()))]  # ascending ids: ties to the smaller
    return valid & torch.isin(token_ids, chosen.to(token_ids.device))
