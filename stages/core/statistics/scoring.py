"""Teacher forcing: the hidden states that predict each response token, and their statistics
streamed group by group.

The token-statistics and overlap stages score a rollout file through :func:`stream_statistics`:
the trunk runs in batches of a token budget without a KV cache (:func:`response_hidden`, the
trainer's packing rule, stages.core.statistics.batching.micro_batches), and only one group's hidden states
(the responses of one problem) exist at a time, so memory does not grow with the file.

The trainer feeds its trunk through :func:`pack_batch`: right-padded rows (:func:`pack`), or one
padding-free row whose sequences follow each other with position ids restarting at 0, so that a
micro-batch costs its tokens, not longest × sequences. transformers (5.x) reads the restarts, but
only with no attention mask and no KV cache (use_cache=False: with a cache it would let the
sequences attend to each other): sdpa then gets a block-diagonal causal mask built from them
(masking_utils.find_packed_sequence_indices; on the CPU, tests/test_packing.py shows that no
position attends to another sequence's), and flash_attention_2 reads them for variable-length
attention (its own path, not run on the CPU). sdpa's mask is L × L for a row of L tokens; long
packed rows want flash_attention_2.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from stages.core.common.progress import progress
from stages.core.statistics.batching import micro_batches
from stages.core.statistics.deviations import DEVIATIONS, deviation_reference, reference_key
from stages.core.statistics.per_token import chunked_token_statistics, distribution_sum, jsd_to_mean

BATCH_SEQUENCES = 32
"""response_hidden: at most this many sequences per forward."""
BATCH_TOKENS = 32768
"""response_hidden: sequences × longest prompt + response per forward (a longer sequence goes
alone). A module constant until token_stats has a key for it."""
STAT_KEYS = ("logsumexp", "entropy", "renyi2", "max_prob", "logprob")
"""What stream_statistics always returns (stats.chunked_token_statistics without jsd)."""


def pack(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], pad_id: int):
    """Right-padded prompt+response ids (B, L), attention mask (B, L), and for every response
    token its row and the index of the position whose output predicts it (both (N,))."""
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses, strict=True)]
    width = max(lengths)
    input_ids = torch.full((len(lengths), width), pad_id, dtype=torch.long)  # (B, L)
    attention = torch.zeros((len(lengths), width), dtype=torch.long)  # (B, L)
    rows, cols = [], []
    for b, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        seq = list(p) + list(r)
        input_ids[b, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        attention[b, : len(seq)] = 1
        rows += [b] * len(r)
        # the output at position len(p) + j - 1 predicts response token j
        cols += range(len(p) - 1, len(p) + len(r) - 1)
    return input_ids, attention, torch.tensor(rows, dtype=torch.long), torch.tensor(cols, dtype=torch.long)


@dataclass
class Packed:
    """A micro-batch as the trunk's input: ids, position ids (both (b, L)), the attention mask
    ((b, L) for padded rows; None for a padding-free row, whose positions say where each
    sequence starts), and flat (N,): for every response token, the index into the b·L positions
    of the one whose output predicts it."""

    input_ids: Tensor
    position_ids: Tensor
    attention_mask: Tensor | None
    flat: Tensor

    @property
    def width(self) -> int:
        return self.input_ids.shape[1]


def pack_batch(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], pad_id: int,
               padding_free: bool = False, multiple: int = 1) -> Packed:
    """The trunk's input for prompt + response sequences: right-padded rows (:func:`pack`), or one
    row of the sequences back to back with position ids from 0 in each (padding_free). The width
    is padded to a multiple of `multiple` (the sequence-parallel ranks' equal slices) with pad
    tokens: masked out in padded rows, a sequence of their own (positions from 0) in a
    padding-free row; either way after every real position, which causal attention never lets
    a real position see."""
    if not padding_free:
        ids, attention, rows, cols = pack(prompts, responses, pad_id)
        extra = -ids.shape[1] % multiple
        if extra:
            ids = torch.nn.functional.pad(ids, (0, extra), value=pad_id)
            attention = torch.nn.functional.pad(attention, (0, extra), value=0)
        width = ids.shape[1]
        positions = torch.arange(width).expand(ids.shape[0], width)
        return Packed(ids, positions, attention, rows * width + cols)
    tokens: list[int] = []
    positions: list[int] = []
    flat: list[int] = []
    for p, r in zip(prompts, responses, strict=True):
        start = len(tokens)
        tokens += list(p) + list(r)
        positions += range(len(p) + len(r))
        # the output at position len(p) + j - 1 of the sequence predicts response token j
        flat += range(start + len(p) - 1, start + len(p) + len(r) - 1)
    extra = -len(tokens) % multiple
    tokens += [pad_id] * extra
    positions += range(extra)
    return Packed(torch.tensor([tokens], dtype=torch.long), torch.tensor([positions], dtype=torch.long),
                  None, torch.tensor(flat, dtype=torch.long))


def trunk_and_head(model):
    """(the transformer without its LM head, head weight (V, D), head bias or None)."""
    head = model.get_output_embeddings()
    return model.get_decoder(), head.weight, head.bias


def response_hidden(model, prompts, responses, pad_id: int, batch_size: int = BATCH_SEQUENCES,
                    desc: str | None = None, batch_tokens: int | None = BATCH_TOKENS) -> Tensor:
    """Final hidden states (N, D) predicting every response token, in (sequence, position) order.

    Runs without gradient and without a KV cache, in the model's dtype and on its device, over
    consecutive sequences of at most `batch_size` while sequences × longest prompt + response
    stays within `batch_tokens` (a longer sequence goes alone; None: no token budget). The result
    is on the CPU, in the model's dtype, so that the model's device holds the model and one batch
    (the statistics move blocks of rows there). Responses must be non-empty.
    """
    trunk, _, _ = trunk_and_head(model)
    device = next(model.parameters()).device
    totals = [len(p) + len(r) for p, r in zip(prompts, responses, strict=True)]
    starts = [0]
    for r in responses:
        starts.append(starts[-1] + len(r))
    out = None  # (N, D), filled batch by batch: no list of pieces beside their concatenation
    with torch.no_grad():
        for mb in progress(micro_batches(totals, batch_size, batch_tokens), desc=desc,
                           unit="batch", leave=False, disable=desc is None):
            ids, attention, rows, cols = pack(prompts[mb.start : mb.stop],
                                              responses[mb.start : mb.stop], pad_id)
            hidden = trunk(input_ids=ids.to(device), attention_mask=attention.to(device),
                           use_cache=False).last_hidden_state  # (b, L, D)
            if out is None:
                out = torch.empty(starts[-1], hidden.shape[-1], dtype=hidden.dtype)
            out[starts[mb.start] : starts[mb.stop]].copy_(hidden[rows.to(device), cols.to(device)])
            del hidden
    return out


def group_members(groups: Sequence[Hashable]) -> list[list[int]]:
    """The sequence indices of each group, groups in order of first appearance."""
    members: dict[Hashable, list[int]] = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    return list(members.values())


@torch.no_grad()
def stream_statistics(model, prompts, responses, groups: Sequence[Hashable], pad_id: int,
                      temperature: float, needs=frozenset(), *, chunk_positions: int,
                      chunk_vocab: int, references: bool = False,
                      batch_size: int = BATCH_SEQUENCES,
                      batch_tokens: int | None = BATCH_TOKENS,
                      desc: str | None = None) -> dict[str, Tensor]:
    """Per-token statistics (N,) of every response token, in (sequence, position) order, on the
    CPU in the compute dtype (float32; float64 for a float64 model): always STAT_KEYS; ``jsd``
    (to the mean distribution of the whole file) and the deviations of deviations.DEVIATIONS
    (group_jsd: ICT's u, and the readings) that `needs` names; with `references`, beside each
    deviation its reference's probability of the token and β (stats.REFERENCE_FIELDS, float64,
    under deviations.reference_key(name, field)), from the deviation's own pass.

    groups (B,): the group of each sequence (any hashable, e.g. the problem id). The groups are
    visited one at a time, in order of first appearance: the trunk gives the group's hidden states
    (response_hidden), the statistics and the deviations (whose references never leave a group)
    are computed from them, and they are dropped before the next group's. ``jsd`` needs the whole
    file's p̄: the first pass adds up Σ p (V,) in float64 (float32 within a block of
    chunk_positions rows, as stats.distribution_sum), a second pass recomputes each group's
    hidden states for JSD(p ‖ p̄); without ``jsd`` there is one pass."""
    _, weight, bias = trunk_and_head(model)
    chunks = {"chunk_positions": chunk_positions, "chunk_vocab": chunk_vocab}
    forcing = {"batch_size": batch_size, "batch_tokens": batch_tokens}
    wanted = [name for name in DEVIATIONS if name in needs]
    lengths = [len(r) for r in responses]
    starts = torch.tensor([0, *lengths]).cumsum(0).tolist()
    members = group_members(groups)
    # (N_g,) the file's token indices of each group's tokens, in the group's order
    rows = [torch.cat([torch.arange(starts[i], starts[i + 1]) for i in idx]) for idx in members]

    def hidden_of(idx: list[int]) -> Tensor:  # (N_g, D) on the CPU
        return response_hidden(model, [prompts[i] for i in idx], [responses[i] for i in idx],
                               pad_id, **forcing)

    def first_pass(idx: list[int]) -> tuple[dict[str, Tensor], Tensor | None]:
        hidden = hidden_of(idx)
        ids = torch.tensor([t for i in idx for t in responses[i]], dtype=torch.long)
        out = chunked_token_statistics(hidden, weight, ids, temperature,
                                       head_bias=bias, jsd=False, **chunks)
        lse = out["logsumexp"]
        total = None
        if "jsd" in needs:  # float64 across blocks and groups
            total = sum(distribution_sum(hidden[a : a + chunk_positions], weight, temperature,
                                         head_bias=bias, logsumexp=lse[a : a + chunk_positions],
                                         **chunks)[0].double()
                        for a in range(0, hidden.shape[0], chunk_positions))
        for name in wanted:  # one group: its references are all within it
            ref = deviation_reference(name, hidden, weight, [0] * len(idx),
                                      [lengths[i] for i in idx], temperature, head_bias=bias,
                                      logsumexp=lse, token_ids=ids if references else None,
                                      **chunks)
            out[name] = ref.pop("u")
            out |= {reference_key(name, field): value for field, value in ref.items()}
        return {k: v.cpu() for k, v in out.items()}, total

    parts: dict[str, list[Tensor]] = {}
    total = None
    for idx in progress(members, desc=desc, unit="group", disable=desc is None):
        out, part = first_pass(idx)
        for key, value in out.items():
            parts.setdefault(key, []).append(value)
        if part is not None:
            total = part if total is None else total + part
    if "jsd" in needs:  # the second pass: the trunk again, group by group
        mean = total / starts[-1]  # p̄ (V,) float64
        parts["jsd"] = []
        for idx, lse in zip(progress(members, desc=desc and f"{desc} (p̄)", unit="group",
                                     disable=desc is None), parts["logsumexp"], strict=True):
            parts["jsd"].append(jsd_to_mean(hidden_of(idx), weight, mean, temperature,
                                            head_bias=bias, logsumexp=lse.to(weight.device),
                                            **chunks).cpu())
    order = torch.cat(rows)  # (N,) the file index of each value in group order
    result = {}
    for key, values in parts.items():
        flat = torch.cat(values)
        result[key] = torch.empty_like(flat)
        result[key][order] = flat
    return result
