"""Supervised training of a scratch model on worked solutions (the embedded default's base models).

The loss is the mean cross-entropy over response tokens only (the worked solution and eos), so
the model learns to answer, not to write questions.
"""

from __future__ import annotations

import math
import random

import torch

from stages.core.common.progress import progress


def encode_pairs(tokenizer, prompts: list[str], responses: list[str]) -> list[tuple[list[int], int]]:
    """(token ids of prompt + response + eos, number of prompt tokens) for each pair."""
    eos = tokenizer.eos_token_id
    out = []
    for p, r in zip(prompts, responses, strict=True):
        p_ids = tokenizer(p, add_special_tokens=False)["input_ids"]
        r_ids = tokenizer(r, add_special_tokens=False)["input_ids"]
        out.append((p_ids + r_ids + [eos], len(p_ids)))
    return out


def collate(batch: list[tuple[list[int], int]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded input ids, attention mask and labels (-100 on prompt and padding)."""
    width = max(len(ids) for ids, _ in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(batch), width), dtype=torch.long)
    labels = torch.full((len(batch), width), -100, dtype=torch.long)
    for r, (ids, n_prompt) in enumerate(batch):
        t = torch.tensor(ids)
        input_ids[r, : len(ids)] = t
        attention[r, : len(ids)] = 1
        labels[r, n_prompt : len(ids)] = t[n_prompt:]
    return {"input_ids": input_ids, "attention_mask": attention, "labels": labels}


def lr_at(step: int, peak: float, warmup: int, total: int) -> float:
    """Linear warm-up to `peak`, then cosine decay to 10% of it at `total`."""
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def train_sft(model, tokenizer, examples: list[tuple[list[int], int]], cfg, seed: int) -> list[dict]:
    """Train in place for cfg.steps AdamW steps of cfg.batch_size sequences; returns the loss log."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.98)
    )
    model.train()
    order: list[int] = []
    log = []
    bar = progress(range(cfg.steps), desc="sft", unit="step", leave=False)
    for step in bar:
        if len(order) < cfg.batch_size:  # epochs reshuffle; a step never straddles two
            order = list(range(len(examples)))
            rng.shuffle(order)
        batch = [examples[order.pop()] for _ in range(cfg.batch_size)]
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg.lr, cfg.warmup_steps, cfg.steps)
        loss = model(**collate(batch, tokenizer.pad_token_id)).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        log.append({"step": step, "loss": loss.item()})
        if step % 20 == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}")
    model.eval()
    return log
