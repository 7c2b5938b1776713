"""The one scorer: every log-prob and statistic the trainer uses, with one numerics (METHODS §2–§4).

Old (sampling-policy), reference, current and selector-input values all come from here, so they
agree bit for bit where they should:

- the trunk (the model without its LM head) gives hidden states in the model's dtype (bf16 on
  GPUs); the head is never run in that dtype: blocks of logits are computed from the hidden
  states and head weight cast to float32 (blocks.LogitSource), and every reduction over the
  vocabulary is float32 (float64 for float64 models);
- :func:`head_logprob` is the head *with* gradient: a custom autograd function whose forward is
  the statistics' own chunked code and whose backward recomputes each chunk of logits, so peak
  memory is O(chunk_positions × chunk_vocab) whatever the number of selected tokens. It runs only
  at the positions it is given (the selected ones): masked positions never enter the graph.
- :func:`score_scope` scores every valid position of a scope without gradient: entropy, Rényi-2,
  log-prob, and the deviations the selectors need (``jsd`` to the scope's mean distribution,
  ``group_jsd``: ICT's u, to the group's mean at the same step, and the labelled readings of
  that reference in DEVIATIONS), from the selector registry's ``needs``.

A scope is a list of sequences (prompt ids, response ids, group index); flat (N,) per-token
tensors run over its response tokens in (sequence, position) order.

:func:`trunk_hidden` feeds the trunk as the Policy's Layout says (padded rows or one padding-free
row; with sequence parallelism this rank's slice of the positions) and says which response tokens
this rank's positions predict; :func:`sp_assemble` gathers per-token values (or hidden states)
of a sequence-parallel group into the whole micro-batch's.

The deviations' references and their readings (DEVIATIONS, deviation, without_response, ...) live
in stages.core.statistics.deviations, which scoring.stream_statistics shares; they are imported
here too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from stages.core.models.policy import as_policy
from stages.core.statistics.batching import RankMax, forward_plan, micro_batches  # noqa: F401  (the trainer imports them here)
from stages.core.statistics.blocks import CHUNK_POSITIONS, CHUNK_VOCAB, compute_dtype
from stages.core.statistics.deviations import (  # noqa: F401  (users import them here)
    DEVIATIONS,
    deviation,
    deviation_keys,
    deviation_reference,
    group_step_keys,
    reference_key,
    self_weight,
    without_response,
)
from stages.core.statistics.per_token import chunked_token_statistics, distribution_sum, jsd_to_mean
from stages.core.statistics.scoring import pack_batch

AllReduce = Callable[[Tensor], Tensor]
"""Sums a tensor over the ranks that share a scope (None: one process)."""



@dataclass(frozen=True)
class Chunks:
    """Chunking of every head computation: positions × vocabulary entries per block of logits."""

    positions: int = CHUNK_POSITIONS
    vocab: int = CHUNK_VOCAB


# ---------------------------------------------------------------------------------------------
# The trunk
# ---------------------------------------------------------------------------------------------
@dataclass
class Trunk:
    """The trunk's output for a micro-batch on this rank.

    hidden (b, L_local, D): final hidden states of this rank's positions (all L of them without
    sequence parallelism, its slice of L / k with k ranks per sequence); owned (N,) bool: the
    micro-batch's response tokens whose predicting position is in that slice (all of them
    without sequence parallelism); flat (n_owned,): the index of each owned token's predicting
    position into hidden's b·L_local positions."""

    hidden: Tensor
    owned: Tensor
    flat: Tensor

    def __iter__(self):
        """Unpacks as (hidden, flat), the pair trunk_hidden returned before sequence parallelism
        (flat then covers every response token)."""
        return iter((self.hidden, self.flat))

    def rows(self, pick: Tensor | None = None) -> Tensor:
        """Hidden states (n, D) predicting the owned tokens `pick` (indices into the owned
        tokens; all: None)."""
        return response_rows(self.hidden, self.flat, pick)

    @property
    def owned_index(self) -> Tensor:
        """(n_owned,) the owned tokens' indices among the micro-batch's N response tokens."""
        return self.owned.nonzero().squeeze(1)


def trunk_hidden(model, prompt_ids, response_ids, pad_id: int, device) -> Trunk:
    """The trunk on prompt + response sequences (:class:`Trunk`), with gradient if it is enabled.
    `model`: a Policy (fed as its Layout says: padded rows or one padding-free row; with
    sequence parallelism, this rank's slice of the positions through Ulysses attention) or a bare
    causal LM. No sequences: one pad token stands in, so that a rank with nothing to score still
    runs the forward the others run (ZeRO-3 gathers in each)."""
    policy = as_policy(model)
    layout = policy.layout
    if not prompt_ids:
        prompt_ids, response_ids = [[pad_id]], [[]]
    batch = pack_batch(prompt_ids, response_ids, pad_id, layout.padding_free, layout.sp_size)
    ids, positions, attention, flat = (batch.input_ids, batch.position_ids, batch.attention_mask,
                                       batch.flat)
    owned = torch.ones(flat.numel(), dtype=torch.bool)
    extra = {}
    if layout.sp is not None:  # this rank's slice of the positions; the positions decide the mask
        width = batch.width // layout.sp_size
        start = layout.sp.rank * width
        ids, positions, attention = ids[:, start:start + width], positions[:, start:start + width], None
        col = flat % batch.width
        owned = (col >= start) & (col < start + width)
        flat = flat[owned] // batch.width * width + col[owned] - start
        extra["sequence_parallel"] = True
    out = policy.trunk(input_ids=ids.to(device), position_ids=positions.to(device),
                       attention_mask=None if attention is None else attention.to(device),
                       use_cache=False, **extra)
    return Trunk(out.last_hidden_state, owned, flat.to(device))


def response_rows(hidden: Tensor, flat: Tensor, pick: Tensor | None = None) -> Tensor:
    """Hidden states (n, D) predicting the response tokens `pick` (indices into flat; all: None)."""
    rows = flat if pick is None else flat[pick.to(flat.device)]
    return hidden.flatten(0, 1)[rows]


def sp_assemble(local: Tensor, owned: Tensor, sp) -> Tensor:
    """Values (N, ...) of every token from the sequence-parallel group's ranks' values
    (n_r, ...) of the tokens each owns (owned (N,) bool on this rank; the ranks' sets are
    disjoint and cover all N): exact, the values are only moved. sp: a Dist (one rank: local).
    N is the same on every rank of the group, so all of them return early together or none."""
    if sp is None or sp.world == 1 or owned.numel() == 0:
        return local
    tail = local.shape[1:]
    parts = sp.gather(local.reshape(-1))
    masks = sp.gather(owned.to(torch.uint8))
    out = local.new_empty((owned.numel(), *tail))
    for part, mask in zip(parts, masks, strict=True):
        out[mask.bool().to(out.device)] = part.view(-1, *tail)
    return out


# ---------------------------------------------------------------------------------------------
# The head with gradient
# ---------------------------------------------------------------------------------------------
class _ChunkedHeadLogprob(torch.autograd.Function):
    """log p(token) = z_token − logsumexp(z), z = (h · Wᵀ + b) / T, forward and backward in chunks.

    Forward: the statistics' own block code (same numerics as every other log-prob here).
    Backward: ∂/∂z = g (onehot − p) / T per block, recomputed from h, W and the saved
    logsumexp; ∂h = Σ_blocks ∂z · W, ∂W = Σ_blocks ∂zᵀ · h, ∂b = Σ ∂z, accumulated in the
    compute dtype and returned in the inputs' dtypes.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, ids, temperature, chunk_positions, chunk_vocab):
        stats = chunked_token_statistics(hidden, weight, ids, temperature, head_bias=bias,
                                         chunk_positions=chunk_positions,
                                         chunk_vocab=chunk_vocab, jsd=False)
        ctx.save_for_backward(hidden, weight, bias, ids, stats["logsumexp"])
        ctx.config = (temperature, chunk_positions, chunk_vocab)
        return stats["logprob"]

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, bias, ids, lse = ctx.saved_tensors
        temperature, cp, cv = ctx.config
        dtype = compute_dtype(hidden, weight, bias)
        n, vocab = hidden.shape[0], weight.shape[0]
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        g = grad_out.to(dtype) / temperature  # (n,)
        h = hidden.to(dtype)  # (n, D)
        grad_h = torch.zeros_like(h) if need_h else None
        # the weight's gradient in its own dtype; one vocabulary chunk at a time in `dtype`
        grad_w = torch.zeros_like(weight) if need_w else None
        grad_b = torch.zeros_like(bias) if need_b and bias is not None else None
        inv_t = 1.0 / temperature
        for c0 in range(0, vocab, cv):
            c1 = min(c0 + cv, vocab)
            w = weight[c0:c1].to(dtype)  # (v, D)
            b = None if bias is None else bias[c0:c1].to(dtype)
            acc_w = torch.zeros_like(w) if grad_w is not None else None
            acc_b = torch.zeros(c1 - c0, dtype=dtype, device=w.device) if grad_b is not None else None
            for a in range(0, n, cp):
                e = min(a + cp, n)
                z = torch.matmul(h[a:e] * inv_t, w.T)  # (m, v), as blocks.LogitSource.block
                if b is not None:
                    z += b * inv_t
                dz = z.sub_(lse[a:e, None]).exp_().neg_()  # −p
                local = ids[a:e] - c0
                inside = ((local >= 0) & (local < c1 - c0)).nonzero().squeeze(1)
                dz[inside, local[inside]] += 1.0  # onehot − p
                dz.mul_(g[a:e, None])
                if grad_h is not None:
                    grad_h[a:e] += dz @ w
                if acc_w is not None:
                    acc_w += dz.T @ h[a:e]
                if acc_b is not None:
                    acc_b += dz.sum(dim=0)
            if acc_w is not None:
                grad_w[c0:c1] = acc_w
            if acc_b is not None:
                grad_b[c0:c1] = acc_b
        return (None if grad_h is None else grad_h.to(hidden.dtype), grad_w, grad_b,
                None, None, None, None)


def head_logprob(head: torch.nn.Module, hidden: Tensor, token_ids: Tensor, temperature: float,
                 chunks: Chunks = Chunks()) -> Tensor:
    """log p(token) (n,) in nats, with gradient, from hidden states (n, D) through `head`'s weight
    and bias: p = softmax(head(h) / T) over the full vocabulary, reduced in float32 (float64 for
    float64 inputs), memory O(chunk_positions × chunk_vocab) in the forward and the backward.
    n = 0 is allowed (the head's gradient is then 0). Under no_grad this is the same computation
    without a graph, so a reference or old log-prob of the same rows matches bit for bit."""
    ids = token_ids.long().to(hidden.device)
    if hidden.shape[0] == 0:
        dtype = compute_dtype(hidden, head.weight)
        return (hidden.sum() * 0 + head.weight.sum() * 0).to(dtype).reshape(1)[:0]
    return _ChunkedHeadLogprob.apply(hidden, head.weight, head.bias, ids, temperature,
                                     chunks.positions, chunks.vocab)


def head_statistics(head: torch.nn.Module, hidden: Tensor, token_ids: Tensor, temperature: float,
                    chunks: Chunks = Chunks(), jsd: bool = False) -> dict[str, Tensor]:
    """stats.chunked_token_statistics of hidden states (n, D) through `head`'s weight and bias."""
    return chunked_token_statistics(hidden, head.weight, token_ids.to(hidden.device), temperature,
                                    head_bias=head.bias, jsd=jsd, chunk_positions=chunks.positions,
                                    chunk_vocab=chunks.vocab)


# ---------------------------------------------------------------------------------------------
# Scoring a scope without gradient
# ---------------------------------------------------------------------------------------------
@dataclass
class Scope:
    """Sequences scored together: prompt ids, response ids (non-empty) and a group per sequence."""

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    groups: list[int]

    @property
    def lengths(self) -> list[int]:
        return [len(r) for r in self.response_ids]

    def token_ids(self) -> Tensor:
        return torch.tensor([t for r in self.response_ids for t in r], dtype=torch.long)


def _scope_deviations(head: torch.nn.Module, hv: Tensor, lse: Tensor, *, scope: Scope,
                      needs: set[str], temperature: float, chunks: Chunks,
                      all_reduce: AllReduce | None) -> dict[str, Tensor]:
    """``jsd`` and the DEVIATIONS in `needs` of a scope's hidden states hv (N, D) (on the CPU,
    moved to the head chunk by chunk) with their log-normalisers lse (N,)."""
    weight, bias = head.weight, head.bias
    kw = {"head_bias": bias, "chunk_positions": chunks.positions, "chunk_vocab": chunks.vocab}
    lse = lse.to(weight.device)
    out: dict[str, Tensor] = {}
    if "jsd" in needs:
        total, n = distribution_sum(hv, weight, temperature, logsumexp=lse, **kw)
        total = total.double()
        count = torch.tensor([float(n)], dtype=torch.float64, device=total.device)
        if all_reduce is not None:  # float64 before the sum over ranks
            total, count = all_reduce(total), all_reduce(count)
        mean = total / count.clamp_min(1.0)
        out["jsd"] = jsd_to_mean(hv, weight, mean, temperature, logsumexp=lse, **kw).cpu()
    for name in (n for n in DEVIATIONS if n in needs):
        out[name] = deviation(name, hv, weight, scope.groups, scope.lengths, temperature,
                              logsumexp=lse, **kw).cpu()
    return out


@torch.no_grad()
def score_scope(model, scope: Scope, pad_id: int, temperature: float, needs=frozenset(), *,
                device, max_sequences: int, max_tokens: int | None = None,
                chunks: Chunks = Chunks(), all_reduce: AllReduce | None = None,
                rank_max: RankMax | None = None) -> dict[str, Tensor]:
    """Per-token statistics (N,) of a scope under `model` (a Policy or a bare causal LM), float32
    on the CPU (float64 models: float64): always ``entropy``, ``renyi2``, ``logprob``; ``jsd``
    (to the mean distribution of the scope on every rank, all_reduce summing the V-sized pieces)
    and the deviations of DEVIATIONS (``group_jsd``: ICT's u, and the labelled readings; the
    groups of a scope never span ranks in the trainer, so they need no all_reduce) when `needs`
    names them. Hidden states go to the CPU after each trunk pass when a deviation is needed, so
    the device holds one micro-batch of them at a time.

    Several ranks (rank_max given) make equally many forward calls (forward_plan): a rank with
    fewer micro-batches runs the trunk and head on a one-token stand-in and discards it. The
    head is read only inside the Policy's forward (gathered there under ZeRO-3): once per
    micro-batch, and once for the deviations.

    Sequence parallelism (the Policy's Layout): each rank of the group scores the tokens its
    slice of positions predicts; the group then exchanges the values (and, for ``jsd`` and the
    deviations, whose references span positions, the hidden states of the scope), so every rank
    of the group returns the whole scope's statistics, as one rank would."""
    policy = as_policy(model)
    sp = policy.layout.sp
    trunk_needs = ({"jsd"} | set(DEVIATIONS)) & set(needs)
    out: dict[str, list[Tensor]] = {"entropy": [], "renyi2": [], "logprob": [], "logsumexp": []}
    kept: list[Tensor] = []
    owned: list[Tensor] = []
    ids = scope.token_ids()
    totals = [len(p) + len(r) for p, r in zip(scope.prompt_ids, scope.response_ids, strict=True)]
    starts = torch.tensor([0] + scope.lengths).cumsum(0).tolist()
    micro = micro_batches(totals, max_sequences, max_tokens, policy.layout.padding_free)
    for mb in forward_plan(micro, rank_max):
        seqs = [] if mb is None else list(mb)  # padding: trunk_hidden's one-token stand-in
        trunk = trunk_hidden(policy, [scope.prompt_ids[i] for i in seqs],
                             [scope.response_ids[i] for i in seqs], pad_id, device)
        rows = trunk.rows()  # (n_owned, D)
        tokens = ids[:0] if mb is None else ids[starts[mb.start]:starts[mb.stop]][trunk.owned]
        stats = policy(rows, tokens, fn=head_statistics, temperature=temperature, chunks=chunks)
        if mb is not None:
            for key in out:
                out[key].append(stats[key].cpu())
            owned.append(trunk.owned)
            if trunk_needs:
                kept.append(rows.cpu())
        del trunk, rows
    mine = torch.cat(owned) if owned else torch.zeros(0, dtype=torch.bool)
    result = {k: sp_assemble(torch.cat(v) if v else torch.zeros(0), mine, sp) for k, v in out.items()}
    if trunk_needs:
        width = policy.lm.config.hidden_size
        hv = torch.cat(kept) if kept else torch.zeros(0, width)  # (N, D) on the CPU
        hv = sp_assemble(hv, mine, sp)
        result |= policy(hv, result["logsumexp"], fn=_scope_deviations, scope=scope,
                         needs=trunk_needs, temperature=temperature, chunks=chunks,
                         all_reduce=all_reduce)
    return result
