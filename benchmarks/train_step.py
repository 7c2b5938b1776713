"""One RLVR optimizer step with the selective, chunked head vs the head at every position
(METHODS §4).

    python benchmarks/train_step.py                        # rho 0.1, 0.2 and 1, 8 x 512 tokens
    python benchmarks/train_step.py --rho 1.0 --responses 2 --response-tokens 256   # quick
    python benchmarks/train_step.py --json results/bench/train_step.json

The model is a Qwen2ForCausalLM with Qwen2.5's vocabulary (151,936, tied embeddings, as in
Qwen2.5-0.5B/1.5B) and a small trunk (hidden 256, 2 layers), so the language-model head dominates
as it does in RLVR on small models. The batch is 8 responses of 512 sampled tokens after a
32-token prompt. Both paths do the whole step: trunk forward with gradient
(stages.core.statistics.scorer.trunk_hidden), per-token entropy without gradient, the 20-Entropy selector
(top ρ of the entropies; ρ = 1 selects every token: GRPO), the clipped surrogate over the
selected tokens (denominator `selected`), backward, gradient clipping and an AdamW step.

- full: the head and log-softmax at every response position with gradient, the entropy from
  those logits, then the mask applied to the per-token loss (what TRL and verl do);
- selective: the trainer's numerics (stages.core.statistics.scorer): chunked statistics of every position
  without gradient (stats.chunked_token_statistics), selection, then the chunked head with
  gradient (scorer.head_logprob) at the selected positions only. At ρ = 1 that is every
  position, so the row compares the chunked head (forward and backward in blocks of
  positions × vocabulary) with the unchunked one; both paths still compute the entropies there
  (TRL logs them; the trainer's sampling pass scores them).

Before timing, both paths run once in this process on the same inputs and their losses and
gradients (every parameter) are compared; the script stops if they disagree.

How memory and time are measured: as benchmarks/token_stats.py. Each measurement runs in a
fresh subprocess; after a warm-up step on a few tokens the kernel's resident-set high-water mark
is reset (/proc/self/clear_refs) and the current RSS taken as baseline; peak = VmHWM - baseline
after one timed step (the memory the step needed above the model, optimizer state and inputs).
Time is the wall-clock of that one step. Ratios are selective / full: below 1 is better.
*_to_matmul are each path's time over the chunked logits matmul alone at every response
position (harness.chunked_matmul, the head's blocks at the library's chunk sizes, in a fresh
process too): how many head passes a step costs, a ratio that moves with the machine's matmul
speed only, where the full path's time moves with its memory as well.
--vocab, --hidden and --layers shrink the model (the tests run it in seconds).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from harness import (  # benchmarks/harness.py, beside this script
    ROOT,
    chunked_matmul,
    measured,
    ratio_row,
    report,
    run_worker,
)

PROMPT = 32
TEMPERATURE = 1.0
PAD_ID = 0
EPS_LOW, EPS_HIGH = 0.2, 0.28
sys.path.insert(0, str(ROOT))


@dataclass(frozen=True)
class Dims:
    """The model's size: Qwen2.5's vocabulary and a small trunk by default."""

    vocab: int = 151_936
    hidden: int = 256
    layers: int = 2


def build(dims: Dims, responses: int, response_tokens: int, seed: int = 0):
    """The model, its optimizer and one batch: (prompt ids, response ids, targets (B, T),
    advantages (B,))."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=dims.vocab, hidden_size=dims.hidden,
                         intermediate_size=4 * dims.hidden, num_hidden_layers=dims.layers,
                         num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=PROMPT + response_tokens + 8,
                         tie_word_embeddings=True)
    model = Qwen2ForCausalLM(config).eval()  # eval: no dropout, as the trainer
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.1)
    ids = torch.randint(0, dims.vocab, (responses, PROMPT + response_tokens))  # (B, L)
    targets = ids[:, PROMPT:]  # (B, T)
    advantages = torch.randn(responses)  # (B,)
    return model, optimizer, (ids[:, :PROMPT].tolist(), targets.tolist(), targets, advantages)


def response_hidden(model, prompts, responses):
    """Hidden states (N, D) predicting every response token, with gradient."""
    from stages.core.statistics.scorer import response_rows, trunk_hidden

    hidden, flat = trunk_hidden(model, prompts, responses, PAD_ID, "cpu")
    return response_rows(hidden, flat)


def entropy_mask(entropy, rho):
    """The 20-Entropy selection (B, T) at ρ (every token at ρ = 1)."""
    from stages.core.training.selectors import SelectionInput, select_tokens

    valid = torch.ones_like(entropy, dtype=torch.bool)
    return select_tokens("entropy_top", SelectionInput(valid=valid, entropy=entropy), rho=rho)


def full_step(model, prompts, responses, targets, advantages, rho, mask=None):
    """Head at every response position with gradient; returns (loss, mask)."""
    from stages.core.training.losses import aggregate_loss, clipped_surrogate

    hidden = response_hidden(model, prompts, responses)  # (N, D)
    logits = model.get_output_embeddings()(hidden).float()  # (N, V); float32 model: no copy
    logp = (logits.gather(-1, targets.reshape(-1, 1)).squeeze(-1)
            - torch.logsumexp(logits, -1)).reshape(targets.shape)  # (B, T)
    with torch.no_grad():  # TRL's entropy_from_logits: row chunks, so no third (N, V) tensor
        entropy = torch.cat([
            -(logps.exp() * logps).sum(-1)
            for logps in (chunk.log_softmax(-1) for chunk in logits.split(128))
        ]).reshape(targets.shape)
    if mask is None:
        mask = entropy_mask(entropy, rho)
    adv = advantages[:, None].expand_as(logp)
    token_loss, _ = clipped_surrogate(logp, logp.detach(), adv, EPS_LOW, EPS_HIGH)
    valid = torch.ones_like(mask)
    return aggregate_loss(token_loss, mask, valid, "selected"), mask


def selective_step(model, prompts, responses, targets, advantages, rho, mask=None):
    """The trainer's numerics: chunked statistics without gradient, then the chunked head with
    gradient only where selected."""
    from stages.core.statistics.scorer import head_logprob
    from stages.core.statistics.stats import chunked_token_statistics
    from stages.core.training.losses import clipped_surrogate, loss_weights

    head = model.get_output_embeddings()
    rows = response_hidden(model, prompts, responses)  # (N, D)
    ids = targets.reshape(-1)  # (N,)
    stats = chunked_token_statistics(rows.detach(), head.weight, ids, TEMPERATURE,
                                     head_bias=head.bias, jsd=False)
    if mask is None:
        mask = entropy_mask(stats["entropy"].reshape(targets.shape), rho)
    pick = mask.reshape(-1).nonzero().squeeze(1)  # (n_sel,)
    logp = head_logprob(head, rows[pick], ids[pick], TEMPERATURE)  # (n_sel,)
    adv = advantages[:, None].expand_as(targets).reshape(-1)[pick]
    token_loss, _ = clipped_surrogate(logp, logp.detach(), adv, EPS_LOW, EPS_HIGH)
    weights = loss_weights(mask, torch.ones_like(mask), "selected").reshape(-1)[pick]
    return (weights * token_loss).sum(), mask


STEPS = {"full": full_step, "selective": selective_step}


def one_step(path, model, optimizer, batch, rho):
    optimizer.zero_grad(set_to_none=True)
    loss, mask = STEPS[path](model, *batch, rho)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return loss.detach(), mask


def check_agreement(dims: Dims, responses: int, response_tokens: int, rho: float) -> dict:
    """Loss and every parameter's gradient of the two paths on the same inputs and mask.

    Each path also selects on its own entropies (float32 full logits vs chunked): the share of
    tokens both pick is reported, since near-ties may fall either way."""
    out = {}
    for path in STEPS:
        model, _, batch = build(dims, responses, response_tokens)
        _, own = STEPS[path](model, *batch, rho)
        model.zero_grad(set_to_none=True)
        shared = out["full"][1] if out else None
        loss, mask = STEPS[path](model, *batch, rho, mask=shared)
        loss.backward()
        out[path] = (loss.detach(), mask, {n: p.grad.clone() for n, p in model.named_parameters()},
                     own)
    (lf, _, gf, own_f), (ls, _, gs, own_s) = out["full"], out["selective"]
    overlap = float((own_f & own_s).sum() / (own_f | own_s).sum())
    grad_err = max(float((gf[n] - gs[n]).abs().max() / gf[n].abs().max().clamp_min(1e-30)) for n in gf)
    loss_err = float((lf - ls).abs() / lf.abs().clamp_min(1e-30))
    if loss_err > 1e-4 or grad_err > 1e-3:
        raise SystemExit(f"the paths disagree: loss rel. error {loss_err:.1e}, grad {grad_err:.1e}")
    return {"loss_rel_err": loss_err, "grad_rel_err": grad_err, "mask_jaccard": overlap}


def matmul_worker(dims: Dims, responses: int, response_tokens: int) -> dict:
    """The chunked logits matmul alone at every response position, in this (fresh) process."""
    from stages.core.statistics.blocks import CHUNK_POSITIONS, CHUNK_VOCAB

    torch.manual_seed(0)
    weight = torch.randn(dims.vocab, dims.hidden)  # (V, D) as the tied embeddings
    hidden = torch.randn(responses * response_tokens, dims.hidden)  # (N, D)
    with torch.no_grad():
        chunked_matmul(hidden[:8], weight, CHUNK_POSITIONS, CHUNK_VOCAB)  # initialisation
        _, result = measured(lambda: chunked_matmul(hidden, weight, CHUNK_POSITIONS, CHUNK_VOCAB))
    return result


def worker(path: str, dims: Dims, rho: float, responses: int, response_tokens: int) -> dict:
    """One measurement in this (fresh) process: {'peak_mb', 'seconds', 'method'}."""
    if path == "matmul":
        return matmul_worker(dims, responses, response_tokens)
    model, optimizer, (prompts, resp, targets, adv) = build(dims, responses, response_tokens)
    # warm-up: library initialisation and AdamW state, on a few tokens
    one_step(path, model, optimizer, (prompts[:1], [resp[0][:8]], targets[:1, :8], adv[:1]), rho)
    batch = (prompts, resp, targets, adv)
    (loss, _), result = measured(lambda: one_step(path, model, optimizer, batch, rho))
    assert torch.isfinite(loss)
    return result


def dims_args(dims: Dims) -> list[str]:
    return ["--vocab", str(dims.vocab), "--hidden", str(dims.hidden), "--layers", str(dims.layers)]


def measure(path: str, dims: Dims, rho: float, responses: int, response_tokens: int) -> dict:
    return run_worker(__file__, ["--_worker", path, "--rho", str(rho), "--responses", str(responses),
                                 "--response-tokens", str(response_tokens), *dims_args(dims)],
                      f"{path} at rho {rho}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rho", type=float, nargs="+", default=[0.1, 0.2, 1.0])
    parser.add_argument("--responses", type=int, default=8)
    parser.add_argument("--response-tokens", type=int, default=512)
    parser.add_argument("--check-tokens", type=int, default=64,
                        help="response tokens per sequence of the agreement check")
    parser.add_argument("--vocab", type=int, default=Dims.vocab)
    parser.add_argument("--hidden", type=int, default=Dims.hidden)
    parser.add_argument("--layers", type=int, default=Dims.layers)
    parser.add_argument("--repeats", type=int, default=1, help="measurements per path; min kept")
    parser.add_argument("--json", type=Path, default=None, help="write the rows as JSON here")
    parser.add_argument("--_worker", choices=[*STEPS, "matmul"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    dims = Dims(args.vocab, args.hidden, args.layers)
    if args._worker:
        print(json.dumps(worker(args._worker, dims, args.rho[0], args.responses,
                                args.response_tokens)))
        return

    print(f"V = {dims.vocab:,}, hidden = {dims.hidden}, {dims.layers} layers, {args.responses} x "
          f"{args.response_tokens} response tokens, float32, torch threads = "
          f"{torch.get_num_threads()}")
    rows = []
    matmul = min(measure("matmul", dims, 1.0, args.responses, args.response_tokens)["seconds"]
                 for _ in range(args.repeats))
    for rho in args.rho:
        err = check_agreement(dims, 2, args.check_tokens, rho)
        print(f"rho {rho}: selective vs full on 2 x {args.check_tokens} tokens: loss rel. error "
              f"{err['loss_rel_err']:.1e}, max gradient rel. error {err['grad_rel_err']:.1e}; "
              f"own selections agree (Jaccard) {err['mask_jaccard']:.3f}")
        full = [measure("full", dims, rho, args.responses, args.response_tokens)
                for _ in range(args.repeats)]
        sel = [measure("selective", dims, rho, args.responses, args.response_tokens)
               for _ in range(args.repeats)]
        row = ratio_row("rho", rho, full, sel, ("full", "selective")) | err
        row |= {"matmul_s": matmul, "full_to_matmul": row["full_s"] / matmul,
                "selective_to_matmul": row["selective_s"] / matmul}
        rows.append(row)
    header = ("rho", "full_peak_mb", "selective_peak_mb", "peak_mem_ratio", "full_s",
              "selective_s", "time_ratio", "matmul_s", "full_to_matmul", "selective_to_matmul")
    report(rows, header, full[0]["method"], args.json, 17, lambda h, v: f"{v:.3f}")


if __name__ == "__main__":
    main()
