"""The `hf` rollout backend: batched, left-padded, KV-cache sampling with transformers.

Each (prompt, sample) pair is one sequence; sequences are sampled in batches, and the random
state is reset from (seed, batch index) before each batch, so the same call gives the same
tokens on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .progress import progress


@dataclass(frozen=True)
class Sample:
    prompt_idx: int
    sample_idx: int
    prompt_token_ids: list[int]
    response_token_ids: list[int]
    response: str
    finish_reason: str  # "stop" (eos sampled) or "length" (max_new_tokens reached)


@torch.no_grad()
def sample_hf(
    model,
    tokenizer,
    prompts: list[str],
    *,
    n: int,
    temperature: float,
    top_p: float,
    max_new_tokens: int,
    seed: int,
    batch_size: int,
    desc: str = "sampling",
) -> list[Sample]:
    """`n` sampled responses for each prompt, ordered by (prompt, sample); temperature 0 is greedy."""
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    prompt_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    jobs = [(i, j) for i in range(len(prompts)) for j in range(n)]
    device = next(model.parameters()).device
    out: list[Sample] = []
    bar = progress(total=len(jobs), desc=desc, unit="seq", leave=False)
    for b, start in enumerate(range(0, len(jobs), batch_size)):
        batch = jobs[start : start + batch_size]
        seqs = [prompt_ids[i] for i, _ in batch]
        width = max(map(len, seqs))
        input_ids = torch.full((len(seqs), width), pad, dtype=torch.long)
        attention = torch.zeros((len(seqs), width), dtype=torch.long)
        for r, s in enumerate(seqs):  # left padding: generated tokens line up on the right
            input_ids[r, width - len(s) :] = torch.tensor(s)
            attention[r, width - len(s) :] = 1
        torch.manual_seed(seed * 1_000_003 + b)
        generated = model.generate(
            input_ids=input_ids.to(device),
            attention_mask=attention.to(device),
            # top_k=0: transformers otherwise truncates to the 50 likeliest tokens
            **(
                {"do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": 0}
                if temperature > 0
                else {"do_sample": False}
            ),
            max_new_tokens=max_new_tokens,
            eos_token_id=eos,
            pad_token_id=pad,
        )[:, width:].cpu()
        for r, (i, j) in enumerate(batch):
            tokens = generated[r].tolist()
            if eos in tokens:
                tokens = tokens[: tokens.index(eos) + 1]
                reason = "stop"
            else:
                reason = "length"
            text = tokenizer.decode(tokens, skip_special_tokens=True)
            out.append(Sample(i, j, prompt_ids[i], tokens, text, reason))
        bar.update(len(batch))
    bar.close()
    return out
