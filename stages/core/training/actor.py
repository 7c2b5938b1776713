"""The actor step: one optimizer step on one mini-batch, with the selective, chunked head.

1. The selector runs over the whole mini-batch (every micro-batch and rank: each rank gathers
   the statistics the selector needs, and only those, and makes the same mask), on the scores
   it is given: the sampling pass's, or a rescoring with the current policy (stages.train
   decides, from `methods.<m>.rescore`). During a dense warm-up every valid token is selected.
2. Loss weights follow `loss.denominator` over the whole mini-batch: the aggregation mode of that
   name (stages.core.training.losses.LOSS_AGG_MODES).
3. Per micro-batch (at most `micro_batch_size` sequences within `micro_batch_tokens`): the trunk
   runs with gradient (optionally checkpointed), the hidden states of the *selected* positions
   go through the chunked head (scorer.head_logprob, inside the Policy's forward, where ZeRO-3
   has gathered the head), and :func:`micro_loss` gives the term to back-propagate. On-policy
   (the first update after sampling) the old log-prob is the current one detached, so the ratio
   is exactly 1; the reference log-prob is computed by the same function on the same rows, so
   the k3 KL is exactly 0 while the policy equals the reference.
   With `train.tis_cap` the policy-gradient term of each token is weighted by truncated
   importance sampling against the sampler (METHODS; verl's and TRL's TIS).
4. Every rank runs the same number of forward/backward calls, of the policy and of the
   reference: ranks whose token budget gives fewer micro-batches add empty ones (a forward of a
   one-token stand-in whose selection is empty: exactly zero gradient), since ZeRO-3 gathers
   parameters in every forward and ZeRO-2 reduces gradients on every backward, and a rank left
   waiting in either waits forever.
5. DeepSpeed reduces the gradients (float32) across ranks, clips them and steps AdamW.

Sequence parallelism (the Policy's Layout): the ranks of a group hold the same mini-batch; each
runs its slice of every micro-batch's positions and back-propagates the loss of the selected
tokens that slice predicts, so the group's terms add up to one rank's.

`methods.<m>.selection_scope: microbatch` replaces 1-2 by the released 80/20 code's scope
(:func:`select_micro`): the mini-batch is verl's, in the layout of `train.virtual_layout`
(stages.core.statistics.batching.virtual_step; the sequences moved to the rank that computes their virtual
data-parallel group, stages.core.training.rollouts.virtual_minibatches), and each of its virtual
micro-batches ranks its own tokens on the current policy's scores (a no-grad rescoring pass,
which equals the gradient forward's up to the rounding of a different batching); a
micro-batch's loss is the mean over its own selected tokens × B_micro / B_mini (its share of its
group's mini-batch), and the groups' losses are averaged, as verl's ranks' gradients are. The
physical forwards (3) are then any size memory allows.

A non-finite gradient norm skips the optimizer step and clears the gradients, as verl does:
DeepSpeed does so itself under ZeRO 1-3 (its ZeRO optimizers' overflow check, which in 0.19.8 also
covers bf16 and float32), and :func:`actor_step` does under ZeRO-0, which would clip and step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from stages.core.models.engine import Dist, gradient_world
from stages.core.models.policy import as_policy
from stages.core.statistics.batching import MicroScope, forward_plan, micro_batches
from stages.core.statistics.scorer import Chunks, head_logprob, trunk_hidden
from stages.core.training.losses import k3_kl, loss_weights, policy_loss_fn
from stages.core.training.rollouts import Rollouts
from stages.core.training.selectors import (
    STATISTICS,
    SelectionInput,
    grid,
    select_tokens,
    valid_grid,
)

if TYPE_CHECKING:  # the config sits above the library: types only
    from stages.config import Config, Loss, Method


@dataclass
class Update:
    """What one optimizer step reports (sums over the whole mini-batch, all ranks)."""

    loss: float
    grad_norm: float
    n_valid: int
    n_selected: int
    n_clipped: int
    kl_sum: float
    entropy_selected_sum: float
    renyi2_selected_sum: float
    mask: Tensor  # (B_global, T) the selection, for tests
    n_truncated: int = 0  # selected tokens whose importance weight was cut at train.tis_cap
    micro_batches: int = 0  # forward/backward calls of this optimizer step on each rank
    skipped: bool = False  # a non-finite gradient norm: no optimizer step (verl's rule)


@dataclass
class Selection:
    """A mini-batch's mask and weights, and this rank's slice of them."""

    mask: Tensor  # (B_all, T)
    valid: Tensor  # (B_all, T)
    selected: Tensor  # (N_local,) bool: this rank's tokens
    weights: Tensor  # (N_local,) loss weights


def select(method: Method, mb: Rollouts, stats: dict[str, Tensor], dist: Dist,
           generator: torch.Generator, denominator: str, dense: bool = False) -> Selection:
    """The method's mask over the whole mini-batch (all ranks), from per-token `stats` of this
    rank's tokens; every rank gathers exactly the fields the selector needs."""
    per_rank = dist.gather(torch.tensor(mb.lengths, dtype=torch.long))
    lengths_all = torch.cat(per_rank)
    offset = int(sum(int(x.sum()) for x in per_rank[: dist.rank]))
    valid = valid_grid(lengths_all)
    selector, params = ("all", {}) if dense else (method.selector, method.selector_params())
    needs = frozenset() if dense else method.needs()
    fields: dict[str, Tensor] = {}
    for name in needs & set(STATISTICS):
        if name not in stats:
            raise KeyError(f"selector {method.selector!r} needs {name!r}, which was not scored")
        fields[name] = grid(dist.cat(stats[name].float()), lengths_all)
    if "token_ids" in needs:
        fields["token_ids"] = grid(dist.cat(mb.token_ids()), lengths_all)
    if "advantages" in needs:
        fields["advantages"] = dist.cat(mb.advantages.float())
    inp = SelectionInput(valid=valid, generator=generator, **fields)
    mask = select_tokens(selector, inp, **params)  # (B_all, T)
    n_local = sum(mb.lengths)
    weights = loss_weights(mask, valid, denominator)[valid][offset : offset + n_local]
    return Selection(mask, valid, mask[valid][offset : offset + n_local], weights)


def micro_loss(logp: Tensor, old: Tensor, advantages: Tensor, weights: Tensor, loss: Loss,
               world: int, ref: Tensor | None = None, *, sampling: Tensor | None = None,
               sampler: Tensor | None = None,
               tis_cap: float | None = None) -> tuple[Tensor, float, int, float, int]:
    """The loss of one micro-batch's selected tokens, scaled for DeepSpeed.

    logp (n,) with gradient, old (n,) the ratio's denominator, advantages (n,), weights (n,) from
    loss_weights over the whole mini-batch, ref (n,) when β > 0. Returns (term to back-propagate,
    its value Σ w ℓ, clipped tokens, Σ k3 KL, truncated tokens). ℓ = ψ · policy loss + β·k3 (the
    policy loss: the one registered under loss.policy_loss, by default the clipped surrogate),
    where ψ is the truncated importance weight min(exp(sampling − sampler), tis_cap) when tis_cap
    is set — sampling: the trainer's log-prob under the policy that sampled (the sampling pass,
    detached; not the current log-prob, and not the on-policy old = logp.detach(), whose weight
    would always be 1), sampler: the sampler's own — and 1 otherwise. ψ multiplies the
    policy-gradient term after clipping and dual-clip, never the KL and never the normaliser.
    DeepSpeed sums gradients over every rank and divides by `world` (engine.gradient_world: the
    data-parallel world, or under ZeRO-3 every rank), while the mini-batch loss is a sum over
    the ranks' parts, so the term is Σ w ℓ × world: the sum of the micro-batches' values over
    every rank is the mini-batch's loss (METHODS §4). Under sequence parallelism each rank's
    part is the loss of the tokens its slice of positions predicts."""
    token_loss, clipped = policy_loss_fn(loss.policy_loss)(logp, old, advantages, loss)
    truncated = 0
    if tis_cap is not None:
        if sampler is None or sampling is None:
            raise ValueError("train.tis_cap needs the sampler's and the sampling pass's log-probs")
        psi, cut = truncated_importance_weights(sampling, sampler, tis_cap)
        token_loss = token_loss * psi.to(token_loss.dtype)
        truncated = int(cut.sum())
    kl_sum = 0.0
    if loss.kl_beta > 0:
        if ref is None:
            raise ValueError("loss.kl_beta > 0 needs the reference log-probs")
        kl = k3_kl(logp, ref)
        token_loss = token_loss + loss.kl_beta * kl
        kl_sum = float(kl.detach().double().sum())
    part = (weights.to(logp.dtype) * token_loss).sum()
    return part * world, float(part.detach()), int(clipped.sum()), kl_sum, truncated


def truncated_importance_weights(old: Tensor, sampler: Tensor, cap: float) -> tuple[Tensor, Tensor]:
    """(ψ = min(exp(old − sampler), cap), truncated: where exp(old − sampler) > cap), per token.

    old: the trainer's log-prob of each sampled token under the policy that sampled it (the
    sampling pass, detached), sampler: the sampler's own log-prob of it (nats). ψ corrects the
    sampler/trainer mismatch of the responses' distribution, as verl's and TRL's truncated
    importance sampling do; it is 1 wherever the two agree."""
    if not cap > 0:
        raise ValueError(f"tis_cap must be > 0, got {cap}")
    ratio = torch.exp(old.detach().double() - sampler.detach().double())
    return ratio.clamp(max=cap), ratio > cap


def select_micro(method: Method, mb: Rollouts, stats: dict[str, Tensor], dist: Dist,
                 generator: torch.Generator, scope: MicroScope, dense: bool = False) -> Selection:
    """The released 80/20 code's mask and weights: per virtual micro-batch P of this rank (scope:
    lists of indices into mb's sequences), the method's selection over P's own tokens on `stats`
    (the current policy's, flat (N,) over mb's tokens; every valid token during a dense warm-up),
    and weights |P| / B_mini / n_sel(P) / groups on P's selected tokens: verl's masked token-mean
    × B_micro / B_mini, averaged over the data-parallel groups. `mask` covers every rank's
    sequences (B_all, T) in rank order, for the metrics and tests."""
    selector, params = ("all", {}) if dense else (method.selector, method.selector_params())
    needs = frozenset() if dense else method.needs()
    lengths = mb.lengths
    starts = torch.tensor([0] + lengths).cumsum(0).tolist()
    ids = mb.token_ids()
    selected = torch.zeros(starts[-1], dtype=torch.bool)
    weights = torch.zeros(starts[-1], dtype=torch.float64)
    for part in scope.micro:
        tokens = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in part])  # (n_P,)
        own = [lengths[i] for i in part]
        fields: dict[str, Tensor] = {}
        for name in needs & set(STATISTICS):
            if name not in stats:
                raise KeyError(f"selector {method.selector!r} needs {name!r}, which was not scored")
            fields[name] = grid(stats[name].float()[tokens], own)
        if "token_ids" in needs:
            fields["token_ids"] = grid(ids[tokens], own)
        if "advantages" in needs:
            fields["advantages"] = mb.advantages.float()[part]
        valid = valid_grid(own)
        mask = select_tokens(selector, SelectionInput(valid=valid, generator=generator, **fields),
                             **params)[valid]  # (n_P,)
        n_sel = int(mask.sum())
        selected[tokens] = mask
        if n_sel:
            weights[tokens[mask]] = len(part) / scope.group_batch / n_sel / scope.groups
    lengths_all = torch.cat(dist.gather(torch.tensor(lengths, dtype=torch.long)))
    valid_all = valid_grid(lengths_all)
    mask_all = grid(dist.cat(selected), lengths_all, fill=False)
    return Selection(mask_all, valid_all, selected, weights)


def _selected_logprob(head, rows: Tensor, tokens: Tensor, *, chosen: Tensor, owned: Tensor,
                      temperature: float, chunks: Chunks) -> Tensor:
    """The head's part of one micro-batch, run inside the Policy's forward: log p (n_sel,) with
    gradient of this rank's chosen tokens. rows (n_owned, D), tokens (n_owned,): this rank's
    response tokens of the micro-batch (all of them without sequence parallelism), owned
    (n_owned,) their indices among its N tokens, chosen (N,) bool the selection over them."""
    pick = chosen.to(owned.device)[owned].nonzero().squeeze(1)  # (n_sel,) among the owned rows
    return head_logprob(head, rows[pick], tokens[pick], temperature, chunks)


def actor_step(engine, mb: Rollouts, method: Method, cfg: Config, dist: Dist,
               generator: torch.Generator, pad_id: int, *, stats: dict[str, Tensor],
               on_policy: bool, dense: bool = False, ref_model=None,
               scope: MicroScope | None = None) -> Update:
    """One optimizer step on a mini-batch (this rank's part in `mb`).

    stats: per-token scores of mb's tokens (flat (N,)) for the selector; mb.stats: the sampling
    policy's (old log-probs when not on-policy); mb.sampler_logprobs: the sampler's own.
    scope: this rank's virtual micro-batches (selection_scope: microbatch; stats must then be the
    current policy's). engine.module and ref_model: Policies; each forward call runs the trunk,
    then the head inside the Policy's forward (gathered there under ZeRO-3), the policy's
    through the engine.

    dist: the data-parallel group. With sequence parallelism (the Policy's Layout) the ranks of
    a sequence-parallel group hold the same mini-batch and run the same micro-batches; each
    computes the loss of the selected tokens its slice of positions predicts, so the group's
    terms add up to the one-rank term; the reported sums add over the group too."""
    tcfg, loss_cfg = cfg.train, cfg.train.loss
    model, device, temp = as_policy(engine.module), dist.device, tcfg.temperature
    ref = None if ref_model is None else as_policy(ref_model)
    chunks = Chunks(cfg.token_stats.chunk_positions, cfg.token_stats.chunk_vocab)
    if method.selection_scope == "microbatch" and scope is None:
        raise ValueError("selection_scope 'microbatch' needs the virtual micro-batches (scope)")
    sel = (select_micro(method, mb, stats, dist, generator, scope, dense) if scope is not None
           else select(method, mb, stats, dist, generator, loss_cfg.denominator, dense))
    ids = mb.token_ids()  # (N,)
    adv_tok = mb.advantages.float().repeat_interleave(torch.tensor(mb.lengths, dtype=torch.long))
    starts = torch.tensor([0] + mb.lengths).cumsum(0).tolist()
    totals = [len(p) + len(r) for p, r in zip(mb.prompt_ids, mb.response_ids, strict=True)]
    plan = forward_plan(micro_batches(totals, tcfg.micro_batch_size, tcfg.micro_batch_tokens,
                                      model.layout.padding_free),
                        dist.max if dist.world > 1 else None)
    if tcfg.tis_cap is not None and mb.sampler_logprobs is None:
        raise ValueError("train.tis_cap: the sampler gave no log-probs of its tokens")
    divisor = gradient_world(tcfg, dist)
    total, clipped_n, kl_sum, truncated = 0.0, 0, 0.0, 0
    for j, m in enumerate(plan):
        engine.set_gradient_accumulation_boundary(j == len(plan) - 1)
        padding = m is None  # a forward of trunk_hidden's stand-in, selecting nothing: zero gradient
        seqs = [] if padding else list(m)
        prompts = [mb.prompt_ids[i] for i in seqs]
        responses = [mb.response_ids[i] for i in seqs]
        a, b = (0, 0) if padding else (starts[m.start], starts[m.stop])
        trunk = trunk_hidden(model, prompts, responses, pad_id, device)
        rows = trunk.rows()  # (n_owned, D) this rank's response tokens of the micro-batch
        owned = trunk.owned_index  # (n_owned,) their indices among the micro-batch's
        tokens = ids[a:b].to(device)
        chosen = torch.zeros(0, dtype=torch.bool) if padding else sel.selected[a:b]  # (n,)
        # through the engine: DeepSpeed counts micro-batches in its forward (ZeRO-3 accumulates
        # a micro-batch's gradients onto the previous ones only when one ran in between)
        logp = engine(rows, tokens[owned.to(device)], fn=_selected_logprob, chosen=chosen,
                      owned=owned.to(device), temperature=temp, chunks=chunks)
        mine = chosen[owned.cpu()].nonzero().squeeze(1)  # among the owned rows
        pick = owned.cpu()[mine]  # (n_sel,) this rank's chosen tokens, within the micro-batch
        tokens = tokens[pick.to(device)]
        old = logp.detach() if on_policy else mb.stats["logprob"][a:b][pick].to(device, logp.dtype)
        weights = torch.zeros(0, dtype=torch.float64) if padding else sel.weights[a:b][pick]
        ref_logp = None
        if loss_cfg.kl_beta > 0:
            with torch.no_grad():
                rt = trunk_hidden(ref, prompts, responses, pad_id, device)
                ref_logp = ref(rt.rows(mine), tokens, fn=head_logprob, temperature=temp,
                               chunks=chunks)
        tis = {}
        if tcfg.tis_cap is not None:
            tis = {"sampling": mb.stats["logprob"][a:b][pick].to(device),
                   "sampler": mb.sampler_logprobs[a:b][pick].to(device), "tis_cap": tcfg.tis_cap}
        term, value, clipped, kl, cut = micro_loss(logp, old, adv_tok[a:b][pick].to(device),
                                                   weights.to(device), loss_cfg, divisor, ref_logp, **tis)
        engine.backward(term)
        total += value
        clipped_n += clipped
        kl_sum += kl
        truncated += cut
        del trunk, rows, logp, term
    grad_norm, skipped = optimizer_step(engine, model, tcfg)
    # each rank's part of the loss: its own tokens (its slice of the positions under sequence
    # parallelism), so the sums run over the sequence-parallel group, then the data-parallel one
    sums = dist.sum(dist.sp.sum(torch.tensor([total, clipped_n, kl_sum, truncated], dtype=torch.float64)))
    picked = sel.mask[sel.valid]  # (N_all,)
    h_sel = h2_sel = 0.0
    if "entropy" in stats:
        h_sel = float(dist.cat(stats["entropy"].float())[picked].double().sum())
        h2_sel = float(dist.cat(stats["renyi2"].float())[picked].double().sum())
    return Update(loss=float(sums[0]), grad_norm=grad_norm, n_valid=int(sel.valid.sum()),
                  n_selected=int(sel.mask.sum()), n_clipped=int(sums[1]), kl_sum=float(sums[2]),
                  entropy_selected_sum=h_sel, renyi2_selected_sum=h2_sel, mask=sel.mask,
                  n_truncated=int(sums[3]), micro_batches=len(plan), skipped=skipped)


def optimizer_step(engine, model, tcfg) -> tuple[float, bool]:
    """Clip and step unless the global gradient norm is not finite; returns (the norm before
    clipping, whether the step was skipped). verl skips such a step and clears the gradients.
    DeepSpeed's ZeRO 1-3 optimizers do so in engine.step() (their overflow check: the step is
    counted in engine.skipped_steps). ZeRO-0 would clip a NaN norm and step, so the norm of its
    reduced full gradients (the same on every rank) is checked here first."""
    if tcfg.zero_stage == 0:  # ZeRO-0 keeps reduced full gradients on every rank
        grads = [p.grad.detach().float().norm() for p in model.parameters() if p.grad is not None]
        norm = float(torch.stack(grads).norm()) if grads else 0.0
        if not math.isfinite(norm):
            engine.zero_grad()
            if hasattr(engine, "skipped_steps"):
                engine.skipped_steps += 1
            return norm, True
        engine.step()
        return norm, False
    before = getattr(engine, "skipped_steps", 0)
    engine.step()
    return float(engine.get_global_grad_norm() or 0.0), getattr(engine, "skipped_steps", 0) > before
