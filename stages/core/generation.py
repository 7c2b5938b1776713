"""The `hf` rollout backend: batched, left-padded, KV-cache sampling with transformers.

Each (prompt, sample) pair is one sequence; sequences are sampled in batches, and the random
state is reset from (seed, batch index) before each batch, so the same call gives the same
tokens on CPU.
"""

from __future__ import annotations

from collections.abc import Sequence
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


END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>")
"""End-of-turn tokens of the chat formats we know (ChatML, Llama 3, Gemma)."""


def stop_token_ids(tokenizer) -> list[int]:
    """The ids a response stops at: end-of-text first, then the chat template's end-of-turn
    token when the tokenizer has a chat template that uses one (Qwen2.5 base models write
    `<|im_end|>` after a ChatML prompt; a tokenizer without a template stops at eos only)."""
    stops = [tokenizer.eos_token_id]
    template = getattr(tokenizer, "chat_template", None) or ""
    for token in END_OF_TURN:
        if token in template:
            tid = tokenizer.convert_tokens_to_ids(token)
            if isinstance(tid, int) and tid != tokenizer.unk_token_id and tid not in stops:
                stops.append(tid)
    return stops


def per_prompt(limit: int | Sequence[int], n_prompts: int) -> list[int]:
    """One generation limit per prompt."""
    if isinstance(limit, int):
        return [limit] * n_prompts
    limits = list(limit)
    if len(limits) != n_prompts:
        raise ValueError(f"{len(limits)} generation limits for {n_prompts} prompts")
    return limits


@torch.no_grad()
def sample_hf(
    model,
    tokenizer,
    prompts: list[str],
    *,
    n: int,
    temperature: float,
    top_p: float,
    max_new_tokens: int | Sequence[int],
    seed: int,
    batch_size: int,
    desc: str = "sampling",
) -> list[Sample]:
    """`n` sampled responses for each prompt, ordered by (prompt, sample); temperature 0 is greedy.

    max_new_tokens: one limit, or one per prompt (a batch generates up to its largest limit and
    each response is cut at its own). A response ends at its first stop token
    (:func:`stop_token_ids`: end-of-text and the chat template's end-of-turn), which it keeps."""
    stops = stop_token_ids(tokenizer)
    eos = stops[0]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    limits = per_prompt(max_new_tokens, len(prompts))
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
            max_new_tokens=max(limits[i] for i, _ in batch),
            eos_token_id=stops,
            pad_token_id=pad,
        )[:, width:].cpu()
        for r, (i, j) in enumerate(batch):
            tokens = generated[r].tolist()[: limits[i]]
            end = next((k for k, t in enumerate(tokens) if t in stops), None)
            if end is not None:
                tokens = tokens[: end + 1]
                reason = "stop"
            else:
                reason = "length"
            text = tokenizer.decode(tokens, skip_special_tokens=True)
            out.append(Sample(i, j, prompt_ids[i], tokens, text, reason))
        bar.update(len(batch))
    bar.close()
    return out
