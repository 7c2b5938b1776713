"""The `hf` rollout backend: batched, left-padded, KV-cache sampling with transformers.

Every sequence (prompt i, sample j) is drawn from its own random stream, seeded
(prompt seed + j) mod 2^63 as vLLM seeds the j-th sample of a request, so a sequence's tokens do
not depend on the batch it shares or on the batch size (up to the float rounding of batched
kernels). The draw is by inverse CDF in float64 over p = softmax(z / T) (nucleus-truncated and
renormalised when top_p < 1), one uniform per position from the sequence's stream, which also
records the log-probability of each sampled token under the distribution it was drawn from: the
sampler's own log-prob, which the trainer compares with its own (the sampler/trainer mismatch).

The loop is our own (:func:`decode`), not transformers' generate(): the same forward calls (left
padding, position ids from the attention mask, a DynamicCache), but a sequence leaves the batch
as soon as it stops or reaches its own limit, so the batch does not carry its finished rows to
the longest response's end (the embedded default's evaluation batches: 0.31x generate()'s time
on Arith-5/6, whose few long responses held the batch, and 0.83-0.86x elsewhere). The tokens
equal generate()'s in our checks (tests/test_generation.py; 2,816 of the default's sequences),
and the log-probs up to the float rounding of the smaller batches' kernels, which could in
principle also move a draw that falls on a boundary between two tokens."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from stages.core.common.progress import progress


@dataclass(frozen=True)
class Sample:
    prompt_idx: int
    sample_idx: int
    prompt_token_ids: list[int]
    response_token_ids: list[int]
    response: str
    finish_reason: str  # "stop" (eos sampled) or "length" (max_new_tokens reached)
    # the sampler's log p of each response token under the distribution it was drawn from
    # (temperature and nucleus applied), nats; None when the backend was not asked for them
    logprobs: list[float] | None = None


END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>")
"""End-of-turn tokens of the chat formats we know (ChatML, Llama 3, Gemma)."""

SEED_BITS = 63


def hashed_seed(*parts) -> int:
    """A 63-bit seed from any parts (sha256): unrelated parts give unrelated seeds, so the
    consecutive seeds s + j of one prompt's samples never run into another prompt's."""
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "big") >> (64 - SEED_BITS)


def prompt_seed(seed: int, index: int) -> int:
    """The sampling seed of prompt `index` of a call seeded with `seed` (both backends)."""
    return hashed_seed("prompt", seed, index)


def sequence_seed(seed_of_prompt: int, sample_idx: int) -> int:
    """The seed of sample `sample_idx` of a prompt: vLLM's convention, the prompt's seed + j."""
    return (seed_of_prompt + sample_idx) % (1 << SEED_BITS)


STOP_RULES = ("end_of_turn", "generation_config")
"""Where responses stop (models.<size>.stop_tokens; :func:`stop_token_ids`)."""


def stop_token_ids(tokenizer, rule: str = "end_of_turn", generation_config=None) -> list[int]:
    """The ids a response stops at, end-of-text first.

    rule end_of_turn: end-of-text, then the chat template's end-of-turn token when the tokenizer
    has a chat template that uses one (Qwen2.5 base models write `<|im_end|>` after a ChatML
    prompt; a tokenizer without a template stops at eos only).
    rule generation_config: verl's, which gives vLLM no stop list: end-of-text and every
    eos_token_id (an int or a list) of the model's `generation_config` (a transformers
    GenerationConfig or a dict; None: end-of-text alone, for vLLM, which adds its model's
    generation-config ids itself)."""
    if rule not in STOP_RULES:
        raise ValueError(f"unknown stop rule {rule!r}; known: {list(STOP_RULES)}")
    stops = [tokenizer.eos_token_id]
    if rule == "generation_config":
        listed = (generation_config.get("eos_token_id") if isinstance(generation_config, dict)
                  else getattr(generation_config, "eos_token_id", None))
        for tid in [listed] if isinstance(listed, int) else list(listed or []):
            if tid not in stops:
                stops.append(int(tid))
        return stops
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


def nucleus(logp: torch.Tensor, top_p: float) -> torch.Tensor:
    """log p (B, V) truncated to each row's nucleus and renormalised: the likeliest tokens whose
    mass reaches top_p (a token stays when the mass strictly ahead of it, in descending order,
    is below top_p, so the likeliest token always stays)."""
    ordered, order = torch.sort(logp, dim=-1, descending=True)
    p = ordered.exp()
    ahead = p.cumsum(dim=-1) - p  # (B, V) mass of the likelier tokens
    drop = torch.zeros_like(logp, dtype=torch.bool).scatter_(1, order, ahead >= top_p)
    kept = logp.masked_fill(drop, -torch.inf)
    return kept - torch.logsumexp(kept, dim=-1, keepdim=True)


class SeededSampler:
    """Samples each row from its own random stream and records the log-prob of what it sampled.

    seeds (B,): one per row; steps: the most tokens a row draws."""

    def __init__(self, seeds: Sequence[int], steps: int, temperature: float, top_p: float) -> None:
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0 to sample, got {temperature}")
        # one uniform per position of each row, drawn up front from the row's own stream
        self.uniforms = torch.stack([
            torch.rand(steps, generator=torch.Generator().manual_seed(s), dtype=torch.float64)
            for s in seeds])  # (B, steps)
        self.temperature, self.top_p = temperature, top_p

    def __call__(self, rows: torch.Tensor, step: int, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(token (b,), its log-prob (b,) float32 on the CPU) of each of the rows `rows` (b,)
        (indices among the B) at position `step`, from their float32 logits (b, V)."""
        logp = torch.log_softmax(logits.double() / self.temperature, dim=-1)  # (b, V)
        if self.top_p < 1.0:
            logp = nucleus(logp, self.top_p)
        cdf = logp.exp().cumsum(dim=-1)  # (b, V)
        u = self.uniforms[rows, step].to(cdf.device)[:, None] * cdf[:, -1:]  # (b, 1)
        # the first token whose cumulative mass exceeds u: never one of probability 0
        chosen = torch.searchsorted(cdf, u, right=True).clamp_(max=cdf.shape[1] - 1)  # (b, 1)
        return chosen.squeeze(1), logp.gather(1, chosen).squeeze(1).float().cpu()


def greedy(rows: torch.Tensor, step: int, logits: torch.Tensor) -> tuple[torch.Tensor, None]:
    """The likeliest token of each row (temperature 0), without a log-prob."""
    return logits.argmax(dim=-1), None


def left_padded(seqs: Sequence[Sequence[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids (B, W), attention mask (B, W)) of token-id sequences, padded on the left with
    `pad` to the longest, W: their generated tokens then line up on the right."""
    width = max(map(len, seqs))
    input_ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    attention = torch.zeros((len(seqs), width), dtype=torch.long)
    for r, s in enumerate(seqs):
        input_ids[r, width - len(s) :] = torch.tensor(s)
        attention[r, width - len(s) :] = 1
    return input_ids, attention


@torch.no_grad()
def decode(model, input_ids: torch.Tensor, attention: torch.Tensor, limits: Sequence[int],
           stops: Sequence[int], pad: int, pick, rank_max: Callable[[int], int] | None = None
           ) -> tuple[torch.Tensor, torch.Tensor | None, list[int]]:
    """Generates from the left-padded batch input_ids (B, W) with its attention mask: row r draws
    until it samples one of `stops` (which it keeps) or has limits[r] tokens.

    pick(rows, step, logits (b, V) float32) gives the tokens (b,) and their log-probs (b,) or
    None of the rows `rows` still generating. Each forward runs only those rows: a finished row
    leaves the batch and its KV cache. Returns (tokens (B, max limit) padded with `pad`,
    log-probs (B, max limit) or None, each row's length). rank_max (the maximum of an int over
    the ranks; None: one process): a ZeRO-3 model, whose every forward gathers parameters from
    all ranks: a rank keeps running forwards (on one finished row whose output it discards) until
    every rank's rows are done."""
    from transformers import DynamicCache

    if min(limits) < 1:
        raise ValueError(f"every row needs a limit of at least one token, got {min(limits)}")
    device = input_ids.device
    B, steps = input_ids.shape[0], max(limits)
    tokens = torch.full((B, steps), pad, dtype=torch.long)
    logprobs: torch.Tensor | None = None
    lengths = torch.zeros(B, dtype=torch.long)
    limit = torch.tensor(list(limits), device=device)
    stop_ids = torch.tensor(list(stops), device=device)
    position = attention.long().cumsum(-1) - 1  # as generate(): left padding does not count
    position.masked_fill_(attention == 0, 1)
    cache = DynamicCache(config=model.config)
    out = model(input_ids=input_ids, attention_mask=attention, position_ids=position,
                past_key_values=cache, use_cache=True, logits_to_keep=1)
    rows = torch.arange(B, device=device)  # the batch's rows, as indices among the B
    last = position[:, -1]
    live = True  # this rank has rows still generating
    step = 0
    while True:
        if live:
            host = rows.cpu()
            chosen, lp = pick(host, step, out.logits[:, -1].float())
            tokens[host, step] = chosen.cpu()
            if lp is not None:
                logprobs = torch.zeros((B, steps)) if logprobs is None else logprobs
                logprobs[host, step] = lp
            lengths[host] = step + 1
            going = ~torch.isin(chosen, stop_ids) & (limit[rows] > step + 1)
            live = bool(going.any())
        step += 1
        if not (rank_max(int(live)) if rank_max is not None else live):
            break
        if live:
            keep = going.nonzero().squeeze(1)
            if len(keep) < len(rows):  # the finished rows leave the batch and the cache
                rows, chosen, last = rows[keep], chosen[keep], last[keep]
                attention = attention[keep]
                cache.batch_select_indices(keep)
            feed = chosen
        else:  # synced: one finished row's forward keeps this rank in step with the others
            if len(rows) > 1:
                rows, last, attention = rows[:1], last[:1], attention[:1]
                cache.batch_select_indices(torch.zeros(1, dtype=torch.long, device=device))
            feed = torch.full((1,), pad, dtype=torch.long, device=device)
        attention = torch.cat([attention, attention.new_ones((len(rows), 1))], dim=1)
        last = last + 1
        out = model(input_ids=feed[:, None], attention_mask=attention, position_ids=last[:, None],
                    past_key_values=cache, use_cache=True)
    return tokens, logprobs, lengths.tolist()


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
    seed: int = 0,
    prompt_seeds: Sequence[int] | None = None,
    batch_size: int,
    desc: str = "sampling",
    rank_max: Callable[[int], int] | None = None,
    stop_tokens: str = "end_of_turn",
) -> list[Sample]:
    """`n` sampled responses for each prompt, ordered by (prompt, sample); temperature 0 is greedy.

    Prompt i's seed is prompt_seeds[i] (the trainer's: a hash of the run seed, the step and the
    prompt's index in its pool), else prompt_seed(seed, i); its sample j is drawn from the stream
    seeded sequence_seed(that, j), whatever batch it lands in. Each Sample carries the sampler's
    log-prob of every response token (None when greedy).
    max_new_tokens: one limit, or one per prompt (each response stops at its own). A response
    ends at its first stop token
    (:func:`stop_token_ids` by rule `stop_tokens`, the model's generation config at hand), which
    it keeps.
    rank_max (the maximum of an int over the ranks, e.g. Dist.max): a ZeRO-3 model, whose every
    forward gathers parameters from all ranks: each batch runs forwards until every rank's batch
    is done (as transformers' synced_gpus); the ranks must generate equally many batches.
    Sampling is temperature and nucleus only: none of the logits processors that generate()
    would add from a model's generation_config (a repetition penalty, say) applies."""
    stops = stop_token_ids(tokenizer, stop_tokens, getattr(model, "generation_config", None))
    eos = stops[0]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    limits = per_prompt(max_new_tokens, len(prompts))
    seeds = (list(prompt_seeds) if prompt_seeds is not None
             else [prompt_seed(seed, i) for i in range(len(prompts))])
    if len(seeds) != len(prompts):
        raise ValueError(f"{len(seeds)} prompt seeds for {len(prompts)} prompts")
    prompt_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    jobs = [(i, j) for i in range(len(prompts)) for j in range(n)]
    device = next(model.parameters()).device
    out: list[Sample] = []
    bar = progress(total=len(jobs), desc=desc, unit="seq", leave=False)
    for start in range(0, len(jobs), batch_size):
        batch = jobs[start : start + batch_size]
        input_ids, attention = left_padded([prompt_ids[i] for i, _ in batch], pad)
        own = [limits[i] for i, _ in batch]
        pick = (SeededSampler([sequence_seed(seeds[i], j) for i, j in batch], max(own),
                              temperature, top_p) if temperature > 0 else greedy)
        generated, logprobs, lengths = decode(model, input_ids.to(device), attention.to(device),
                                              own, stops, pad, pick, rank_max=rank_max)
        for r, (i, j) in enumerate(batch):
            tokens = generated[r, : lengths[r]].tolist()
            reason = "stop" if tokens and tokens[-1] in stops else "length"
            text = tokenizer.decode(tokens, skip_special_tokens=True)
            lp = logprobs[r, : len(tokens)].tolist() if logprobs is not None else None
            out.append(Sample(i, j, prompt_ids[i], tokens, text, reason, lp))
        bar.update(len(batch))
    bar.close()
    return out
