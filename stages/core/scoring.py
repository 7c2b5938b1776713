"""Teacher forcing: the hidden states that predict each response token, as the trainer sees them.

The token-statistics stage and the trainer both score responses through :func:`response_hidden`,
so the statistics a selector sees are those of the exact forward pass the loss uses.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .progress import progress


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


def trunk_and_head(model):
    """(the transformer without its LM head, head weight (V, D), head bias or None)."""
    head = model.get_output_embeddings()
    return model.get_decoder(), head.weight, head.bias


def response_hidden(model, prompts, responses, pad_id: int, batch_size: int = 32,
                    desc: str | None = None) -> Tensor:
    """Final hidden states (N, D) predicting every response token, in (sequence, position) order.

    Runs without gradient, in the model's dtype and on its device; the result is on the CPU, in
    the model's dtype, so that at paper scale the model's device holds the model and one block of
    rows at a time (the statistics move the blocks there). Responses must be non-empty.
    """
    trunk, _, _ = trunk_and_head(model)
    device = next(model.parameters()).device
    order = range(0, len(prompts), batch_size)
    chunks = []
    with torch.no_grad():
        for start in progress(order, desc=desc, unit="batch", leave=False, disable=desc is None):
            ids, attention, rows, cols = pack(prompts[start : start + batch_size],
                                              responses[start : start + batch_size], pad_id)
            hidden = trunk(input_ids=ids.to(device), attention_mask=attention.to(device))
            hidden = hidden.last_hidden_state  # (b, L, D)
            chunks.append(hidden[rows.to(device), cols.to(device)].cpu())  # (n, D)
    return torch.cat(chunks)
