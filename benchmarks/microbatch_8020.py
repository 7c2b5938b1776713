"""The 80/20 study's micro-batches, simulated at its sizes: how the loss weighs a response by its
length, and how many of the released code's top-20% picks another scope reproduces.

    python benchmarks/microbatch_8020.py                   # medians 1.5k, 4k and 8k tokens
    python benchmarks/microbatch_8020.py --medians 4000 --seeds 1   # a quick run

One rollout step of the study: 512 prompts of 150 tokens × 16 responses, response lengths
lognormal (median m, sigma --sigma) capped at 20,480, mini-batches of 32 prompts (16 optimizer
steps). Three ways of forming the micro-batches whose tokens are ranked and averaged:

- before: the package's micro-batches until this change (and what the review measured):
  consecutive sequences of a rank's mini-batch of whole groups (the mini-batch's 32 prompts split
  over our data-parallel ranks: 8B on 8 ranks, 14B on 4 ranks with sequence parallelism 2, 32B on 8
  with 2), within 22,528 tokens counted with padding (stages.core.statistics.batching.micro_batches); a
  micro-batch's weight |m| / B_rank / n_sel(m) / ranks.
- minibatch: `selection_scope: minibatch` (the review's stop-gap): the whole mini-batch of 512
  sequences ranks its tokens, weights 1 / n_sel(mini-batch).
- after (and the released code): verl's micro-batches in the released 14B script's layout
  (stages.core.statistics.batching.virtual_step: 128 GPUs, sequence parallelism 8, 22,528 × 8 unpadded tokens),
  weights |P| / 32 / n_sel(P) / 16 — what `selection_scope: microbatch` now trains with.

Columns:
- exponent: the slope of log(a response's total loss weight) on log(its length) under DAPO
  (every token selected), least squares over the step's responses: 1 is DAPO's token-mean (every
  token weighs the same), 0 a per-sequence mean (GRPO's: every response weighs the same);
- seqs / prompts: sequences and distinct prompts per micro-batch (means), single: the share of
  micro-batches holding one sequence;
- agree: the share of the released code's top-20% picks (ρ = 0.2 per verl micro-batch) that the
  layout's own top-20% picks reproduce, on synthetic entropies: token t of response i has
  H = s_i · E_t, s_i ~ lognormal(0, --spread) (responses differ in how uncertain they are),
  E_t ~ Exp(1). The released code ranks by the current policy's entropies; within one optimizer
  step those are fixed here, so the picks compare directly. "after" agrees by construction (the
  same rule, tests/test_trainer_dapo.py checks it against verl's definition); the last row ranks
  the released side on entropies rounded to bfloat16, as verl's gradient forward computes them
  from bf16 logits while ours come from a float32 rescoring pass: what rounding alone moves.

The numbers depend on the length and entropy models (synthetic: no rollout of the study is
public); the review's "before" (exponent 0.59 / 0.36 / 0.20, agreement 77-91%) used its own.
Rows are means over --seeds steps.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stages.core.statistics.batching import micro_batches, virtual_step  # noqa: E402

PROMPTS, GROUP, MINI, PROMPT_TOKENS, CAP, RHO = 512, 16, 32, 150, 20480, 0.2
BUDGET = 22528  # the script's ppo_max_token_len_per_gpu; the package's former micro_batch_tokens
LAYOUTS = {"8B": (8, 1), "14B": (4, 2), "32B": (8, 2)}  # ours: data-parallel ranks, sequence parallelism
VERL = {"world_size": 128, "sequence_parallel": 8, "budget": BUDGET * 8}


def top_k(n: int) -> int:
    return math.ceil(RHO * n)  # verl's max(1, int(n ρ + 0.9999)) for every n here


def picks_of(parts: list[list[int]], entropy: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """(N,) bool over the step's tokens (flat, sequence by sequence): the top ρ of each part's
    tokens by entropy."""
    picked = np.zeros(len(entropy), dtype=bool)
    for part in parts:
        idx = np.concatenate([np.arange(offsets[i], offsets[i + 1]) for i in part])
        k = top_k(len(idx))
        picked[idx[np.argpartition(-entropy[idx], k - 1)[:k]]] = True
    return picked


def bf16(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to bfloat16's 8-bit mantissa (round to nearest even)."""
    u = x.astype(np.float32).view(np.uint32)
    rounded = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
    return rounded.view(np.float32)


def exponent(parts: list[list[int]], weight_of: list[float], lengths: np.ndarray) -> float:
    """Slope of log(total weight) on log(length): each response's tokens weigh its part's
    per-token weight (DAPO: every token selected)."""
    total = np.zeros(len(lengths))
    for part, w in zip(parts, weight_of, strict=True):
        for i in part:
            total[i] = w * lengths[i]
    x, y = np.log(lengths), np.log(total)
    return float(np.polyfit(x, y, 1)[0])


def describe(parts: list[list[int]]) -> tuple[float, float, float]:
    sizes = [len(p) for p in parts]
    prompts = [len({i // GROUP for i in p}) for p in parts]
    return float(np.mean(sizes)), float(np.mean(prompts)), float(np.mean([s == 1 for s in sizes]))


def before_parts(lengths: np.ndarray, ranks: int) -> tuple[list[list[int]], list[float]]:
    """The package's former micro-batches and DAPO per-token weights of one step."""
    parts, weights = [], []
    per_rank = MINI // ranks * GROUP
    totals = (lengths + PROMPT_TOKENS).tolist()
    for a in range(0, PROMPTS * GROUP, MINI * GROUP):  # a mini-batch: 32 whole groups in order
        for r in range(ranks):
            seqs = list(range(a + r * per_rank, a + (r + 1) * per_rank))
            for m in micro_batches([totals[i] for i in seqs], 512, BUDGET):
                part = [seqs[i] for i in m]
                parts.append(part)
                weights.append(len(part) / per_rank / lengths[part].sum() / ranks)
    return parts, weights


def after_parts(lengths: np.ndarray) -> tuple[list[list[int]], list[float]]:
    """verl's micro-batches of the released layout and their DAPO per-token weights."""
    step = virtual_step((lengths + PROMPT_TOKENS).tolist(), world_size=VERL["world_size"],
                        sequence_parallel=VERL["sequence_parallel"],
                        group_batch=MINI * GROUP // (VERL["world_size"] // VERL["sequence_parallel"]),
                        budget=VERL["budget"])
    parts = [part for per_group in step.micro for group in per_group for part in group]
    group_batch = MINI * GROUP // step.groups
    return parts, [len(p) / group_batch / lengths[p].sum() / step.groups for p in parts]


def minibatch_parts(lengths: np.ndarray) -> tuple[list[list[int]], list[float]]:
    parts = [list(range(a, a + MINI * GROUP)) for a in range(0, PROMPTS * GROUP, MINI * GROUP)]
    return parts, [1.0 / lengths[p].sum() for p in parts]


def simulate(median: float, sigma: float, spread: float, seed: int, layout: str) -> dict[str, dict]:
    rng = np.random.default_rng(seed)
    lengths = np.minimum(np.round(median * np.exp(sigma * rng.standard_normal(PROMPTS * GROUP))),
                         CAP).clip(1).astype(np.int64)
    scale = np.exp(spread * rng.standard_normal(PROMPTS * GROUP))
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    entropy = (np.repeat(scale, lengths) * rng.exponential(1.0, int(offsets[-1]))).astype(np.float32)
    after, w_after = after_parts(lengths)
    released = picks_of(after, entropy, offsets)
    rows = {}
    dp, sp = LAYOUTS[layout]
    layouts = {f"before ({layout}: {dp} ranks, SP {sp})": before_parts(lengths, dp),
               "minibatch scope": minibatch_parts(lengths),
               "after = the released code's": (after, w_after)}
    # verl takes its entropies from bf16 logits in the gradient forward, ours come from a float32
    # rescoring pass: the same picks but where rounding reorders near-equal entropies
    layouts["after, released picks on bf16-rounded entropies"] = (after, w_after)
    for name, (parts, weights) in layouts.items():
        if name.startswith("after, released picks on bf16"):
            mine = picks_of(after, bf16(entropy), offsets)
        else:
            mine = released if parts is after else picks_of(parts, entropy, offsets)
        seqs, prompts, single = describe(parts)
        rows[name] = {"exponent": exponent(parts, weights, lengths), "seqs": seqs,
                      "prompts": prompts, "single": single,
                      "agree": float((mine & released).sum() / released.sum())}
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--medians", type=float, nargs="+", default=[1500, 4000, 8000],
                   help="median response lengths, tokens")
    p.add_argument("--sigma", type=float, default=0.8, help="lognormal sigma of response lengths")
    p.add_argument("--spread", type=float, default=0.5,
                   help="lognormal sigma of a response's entropy scale")
    p.add_argument("--seeds", type=int, default=2, help="steps simulated per median")
    p.add_argument("--layout", choices=sorted(LAYOUTS), default="8B",
                   help="our former layout of the 'before' row (all three give the same "
                   "micro-batches of whole groups to 2 digits)")
    args = p.parse_args()
    print(f"512 prompts x 16 responses, prompts of {PROMPT_TOKENS} tokens, lengths lognormal "
          f"(sigma {args.sigma}) capped at {CAP:,}; entropy scale spread {args.spread}; "
          f"means over {args.seeds} steps\n")
    print("| median response | layout | exponent | seqs / prompts per micro-batch | single | "
          "agree with the released picks |")
    print("|---|---|--:|--:|--:|--:|")
    for median in args.medians:
        runs = [simulate(median, args.sigma, args.spread, seed, args.layout)
                for seed in range(args.seeds)]
        for name in runs[0]:
            mean = {k: float(np.mean([r[name][k] for r in runs])) for k in runs[0][name]}
            print(f"| {median:,.0f} | {name} | {mean['exponent']:.2f} | {mean['seqs']:.1f} / "
                  f"{mean['prompts']:.1f} | {mean['single']:.0%} | {mean['agree']:.1%} |", flush=True)


if __name__ == "__main__":
    main()
