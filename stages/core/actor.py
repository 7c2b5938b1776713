"""The actor step: one optimizer step on one mini-batch, with the selective, chunked head.

1. The selector runs over the whole mini-batch (every micro-batch and rank: each rank gathers
   the statistics the selector needs, and only those, and makes the same mask), on the scores
   it is given: the sampling pass's, or a rescoring with the current policy (stages.train
   decides, from `methods.<m>.rescore`). During a dense warm-up every valid token is selected.
2. Loss weights follow `loss.denominator` over the whole mini-batch (stages.core.losses).
3. Per micro-batch (at most `micro_batch_size` sequences within `micro_batch_tokens`): the trunk
   runs with gradient (optionally checkpointed), the hidden states of the *selected* positions
   go through the chunked head (scorer.head_logprob), and :func:`micro_loss` gives the term to
   back-propagate. On-policy (the first update after sampling) the old log-prob is the current
   one detached, so the ratio is exactly 1; the reference log-prob is computed by the same
   function on the same rows, so the k3 KL is exactly 0 while the policy equals the reference.
4. DeepSpeed reduces the gradients (float32) across ranks, clips them and steps AdamW.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..config import Config, Loss, Method
from .engine import Dist
from .losses import clipped_surrogate, k3_kl, loss_weights
from .rollouts import Rollouts
from .scorer import Chunks, head_logprob, micro_batches, response_rows, trunk_hidden
from .selectors import STATISTICS, SelectionInput, grid, select_tokens, valid_grid


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
               world: int, ref: Tensor | None = None) -> tuple[Tensor, float, int, float]:
    """The loss of one micro-batch's selected tokens, scaled for DeepSpeed.

    logp (n,) with gradient, old (n,), advantages (n,), weights (n,) from loss_weights over the
    whole mini-batch, ref (n,) when β > 0. Returns (term to back-propagate, its value Σ w ℓ,
    clipped tokens, Σ k3 KL). ℓ = clipped surrogate + β·k3. DeepSpeed averages gradients over
    ranks while the mini-batch loss is a sum over them, so the term is Σ w ℓ × world: the sum of
    the micro-batches' values over every rank is the mini-batch's loss (METHODS §4)."""
    token_loss, clipped = clipped_surrogate(logp, old, advantages, loss.eps_low, loss.eps_high,
                                            loss.dual_clip)
    kl_sum = 0.0
    if loss.kl_beta > 0:
        if ref is None:
            raise ValueError("loss.kl_beta > 0 needs the reference log-probs")
        kl = k3_kl(logp, ref)
        token_loss = token_loss + loss.kl_beta * kl
        kl_sum = float(kl.detach().double().sum())
    part = (weights.to(logp.dtype) * token_loss).sum()
    return part * world, float(part.detach()), int(clipped.sum()), kl_sum


def actor_step(engine, mb: Rollouts, method: Method, cfg: Config, dist: Dist,
               generator: torch.Generator, pad_id: int, *, stats: dict[str, Tensor],
               on_policy: bool, dense: bool = False, ref_model=None) -> Update:
    """One optimizer step on a mini-batch (this rank's part in `mb`).

    stats: per-token scores of mb's tokens (flat (N,)) for the selector; mb.stats: the sampling
    policy's (old log-probs when not on-policy)."""
    tcfg, loss_cfg = cfg.train, cfg.train.loss
    model, device, temp = engine.module, dist.device, tcfg.temperature
    chunks = Chunks(cfg.token_stats.chunk_positions, cfg.token_stats.chunk_vocab)
    head = model.get_output_embeddings()
    sel = select(method, mb, stats, dist, generator, loss_cfg.denominator, dense)
    ids = mb.token_ids()  # (N,)
    adv_tok = mb.advantages.float().repeat_interleave(torch.tensor(mb.lengths, dtype=torch.long))
    starts = torch.tensor([0] + mb.lengths).cumsum(0).tolist()
    totals = [len(p) + len(r) for p, r in zip(mb.prompt_ids, mb.response_ids, strict=True)]
    micro = micro_batches(totals, tcfg.micro_batch_size, tcfg.micro_batch_tokens)
    total, clipped_n, kl_sum = 0.0, 0, 0.0
    for j, m in enumerate(micro):
        engine.set_gradient_accumulation_boundary(j == len(micro) - 1)
        prompts = [mb.prompt_ids[i] for i in m]
        responses = [mb.response_ids[i] for i in m]
        a, b = starts[m.start], starts[m.stop]
        pick = sel.selected[a:b].nonzero().squeeze(1)  # (n_sel,) within the micro-batch
        hidden, flat = trunk_hidden(model, prompts, responses, pad_id, device)
        tokens = ids[a:b][pick].to(device)
        logp = head_logprob(head, response_rows(hidden, flat, pick), tokens, temp, chunks)
        old = logp.detach() if on_policy else mb.stats["logprob"][a:b][pick].to(device, logp.dtype)
        ref = None
        if loss_cfg.kl_beta > 0:
            with torch.no_grad():
                rh, rf = trunk_hidden(ref_model, prompts, responses, pad_id, device)
                ref = head_logprob(ref_model.get_output_embeddings(), response_rows(rh, rf, pick),
                                   tokens, temp, chunks)
        term, value, clipped, kl = micro_loss(logp, old, adv_tok[a:b][pick].to(device),
                                              sel.weights[a:b][pick].to(device), loss_cfg,
                                              dist.world, ref)
        engine.backward(term)
        total += value
        clipped_n += clipped
        kl_sum += kl
        del hidden, logp, term
    grad_norm = None
    if tcfg.zero_stage == 0:  # ZeRO-0 keeps reduced full gradients on every rank
        grads = [p.grad.detach().float().norm() for p in model.parameters() if p.grad is not None]
        grad_norm = float(torch.stack(grads).norm()) if grads else None
    engine.step()
    if grad_norm is None:
        grad_norm = float(engine.get_global_grad_norm() or 0.0)
    sums = dist.sum(torch.tensor([total, clipped_n, kl_sum], dtype=torch.float64))
    picked = sel.mask[sel.valid]  # (N_all,)
    h_sel = h2_sel = 0.0
    if "entropy" in stats:
        h_sel = float(dist.cat(stats["entropy"].float())[picked].double().sum())
        h2_sel = float(dist.cat(stats["renyi2"].float())[picked].double().sum())
    return Update(loss=float(sums[0]), grad_norm=grad_norm, n_valid=int(sel.valid.sum()),
                  n_selected=int(sel.mask.sum()), n_clipped=int(sums[1]), kl_sum=float(sums[2]),
                  entropy_selected_sum=h_sel, renyi2_selected_sum=h2_sel, mask=sel.mask)
