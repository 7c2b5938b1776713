"""One RLVR optimizer step with the selective head vs the head at every position (METHODS §4).

    python benchmarks/train_step.py                        # rho 0.1 and 0.2, 8 x 512 tokens
    python benchmarks/train_step.py --responses 2 --response-tokens 256   # a quick run
    python benchmarks/train_step.py --json results/bench/train_step.json

The model is a Qwen2ForCausalLM with Qwen2.5's vocabulary (151,936, tied embeddings, as in
Qwen2.5-0.5B/1.5B) and a small trunk (hidden 256, 2 layers), so the language-model head dominates
as it does in RLVR on small models. The batch is 8 responses of 512 sampled tokens after a
32-token prompt. Both paths do the whole step: trunk forward with gradient, per-token entropy
without gradient, the 20-Entropy selector (top ρ of the entropies), the clipped surrogate over
the selected tokens (denominator `selected`), backward, gradient clipping and an AdamW step.

- full: the head and log-softmax at every response position with gradient, the entropy from
  those logits, then the mask applied to the per-token loss (what TRL and verl do);
- selective: the trainer's path (stages.core.policy): chunked scoring of every position without
  gradient, selection, then the head and log-softmax with gradient at the selected positions only.

Before timing, both paths run once in this process on the same inputs and their losses and
gradients (every parameter) are compared; the script stops if they disagree.

How memory and time are measured: as benchmarks/token_stats.py. Each measurement runs in a
fresh subprocess; after a warm-up step on a few tokens the kernel's resident-set high-water mark
is reset (/proc/self/clear_refs) and the current RSS taken as baseline; peak = VmHWM - baseline
after one timed step (the memory the step needed above the model, optimizer state and inputs).
Time is the wall-clock of that one step. Ratios are selective / full: below 1 is better.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from harness import (  # benchmarks/harness.py, beside this script
    ROOT,
    measured,
    ratio_row,
    report,
    run_worker,
)

VOCAB = 151_936
HIDDEN = 256
LAYERS = 2
PROMPT = 32
TEMPERATURE = 1.0
EPS_LOW, EPS_HIGH = 0.2, 0.28
sys.path.insert(0, str(ROOT))


def build(responses: int, response_tokens: int, seed: int = 0):
    """The model, its optimizer and one batch: ids (B, L), response positions, advantages."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=4 * HIDDEN,
                         num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=PROMPT + response_tokens + 8,
                         tie_word_embeddings=True)
    model = Qwen2ForCausalLM(config).eval()  # eval: no dropout, as the trainer
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.1)
    ids = torch.randint(0, VOCAB, (responses, PROMPT + response_tokens))  # (B, L)
    # the output at position PROMPT + j - 1 predicts response token j
    cols = torch.arange(PROMPT - 1, PROMPT + response_tokens - 1)
    targets = ids[:, PROMPT:]  # (B, T)
    advantages = torch.randn(responses)  # (B,)
    return model, optimizer, ids, cols, targets, advantages


def full_step(model, ids, cols, targets, advantages, rho, mask=None):
    """Head at every response position with gradient; returns (loss, mask)."""
    from stages.core.losses import aggregate_loss, clipped_surrogate
    from stages.core.selectors import SelectionInput, select_tokens

    hidden = model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state[:, cols]
    logits = model.get_output_embeddings()(hidden).float()  # (B, T, V); T = 1: no copy
    logp = logits.gather(-1, targets[..., None]).squeeze(-1) - torch.logsumexp(logits, -1)
    with torch.no_grad():  # TRL's entropy_from_logits: row chunks, so no third (N, V) tensor
        rows = logits.reshape(-1, VOCAB)
        entropy = torch.cat([
            -(logps.exp() * logps).sum(-1)
            for logps in (chunk.log_softmax(-1) for chunk in rows.split(128))
        ]).reshape(targets.shape)
    valid = torch.ones_like(targets, dtype=torch.bool)
    if mask is None:
        mask = select_tokens("entropy_top", SelectionInput(valid=valid, entropy=entropy), rho=rho)
    adv = advantages[:, None].expand_as(logp)
    token_loss, _ = clipped_surrogate(logp, logp.detach(), adv, EPS_LOW, EPS_HIGH)
    return aggregate_loss(token_loss, mask, valid, "selected"), mask


def selective_step(model, ids, cols, targets, advantages, rho, mask=None):
    """The trainer's path: chunked scoring without gradient, head only where selected."""
    from stages.core.losses import clipped_surrogate, loss_weights
    from stages.core.policy import head_logprobs, score_scope
    from stages.core.selectors import SelectionInput, select_tokens

    head = model.get_output_embeddings()
    hidden = model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state[:, cols]
    flat = hidden.reshape(-1, hidden.shape[-1])  # (N, D)
    stats = score_scope(flat.detach(), head.weight, head.bias, targets.reshape(-1), TEMPERATURE)
    valid = torch.ones_like(targets, dtype=torch.bool)
    entropy = stats["entropy"].reshape(targets.shape)
    if mask is None:
        mask = select_tokens("entropy_top", SelectionInput(valid=valid, entropy=entropy), rho=rho)
    pick = mask.reshape(-1).nonzero().squeeze(1)
    logp = head_logprobs(head, flat[pick], targets.reshape(-1)[pick], TEMPERATURE)  # (n_sel,)
    adv = advantages[:, None].expand_as(targets).reshape(-1)[pick]
    token_loss, _ = clipped_surrogate(logp, logp.detach(), adv, EPS_LOW, EPS_HIGH)
    weights = loss_weights(mask, valid, "selected").reshape(-1)[pick]
    return (weights * token_loss).sum(), mask


STEPS = {"full": full_step, "selective": selective_step}


def one_step(path, model, optimizer, batch, rho):
    optimizer.zero_grad(set_to_none=True)
    loss, mask = STEPS[path](model, *batch, rho)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return loss.detach(), mask


def check_agreement(responses: int, response_tokens: int, rho: float) -> dict:
    """Loss and every parameter's gradient of the two paths on the same inputs and mask.

    Each path also selects on its own entropies (float32 full logits vs chunked): the share of
    tokens both pick is reported, since near-ties may fall either way."""
    out = {}
    for path in STEPS:
        model, _, ids, cols, targets, adv = build(responses, response_tokens)
        _, own = STEPS[path](model, ids, cols, targets, adv, rho)
        model.zero_grad(set_to_none=True)
        shared = out["full"][1] if out else None
        loss, mask = STEPS[path](model, ids, cols, targets, adv, rho, mask=shared)
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


def worker(path: str, rho: float, responses: int, response_tokens: int) -> dict:
    """One measurement in this (fresh) process: {'peak_mb', 'seconds', 'method'}."""
    model, optimizer, ids, cols, targets, adv = build(responses, response_tokens)
    # warm-up: library initialisation and AdamW state, on a few tokens
    one_step(path, model, optimizer, (ids[:1, : PROMPT + 8], cols[:8], targets[:1, :8], adv[:1]), rho)
    (loss, _), result = measured(lambda: one_step(path, model, optimizer, (ids, cols, targets, adv), rho))
    assert torch.isfinite(loss)
    return result


def measure(path: str, rho: float, responses: int, response_tokens: int) -> dict:
    return run_worker(__file__, ["--_worker", path, "--rho", str(rho), "--responses", str(responses),
                                 "--response-tokens", str(response_tokens)], f"{path} at rho {rho}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rho", type=float, nargs="+", default=[0.1, 0.2])
    parser.add_argument("--responses", type=int, default=8)
    parser.add_argument("--response-tokens", type=int, default=512)
    parser.add_argument("--check-tokens", type=int, default=64,
                        help="response tokens per sequence of the agreement check")
    parser.add_argument("--repeats", type=int, default=1, help="measurements per path; min kept")
    parser.add_argument("--json", type=Path, default=None, help="write the rows as JSON here")
    parser.add_argument("--_worker", choices=list(STEPS), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args._worker:
        print(json.dumps(worker(args._worker, args.rho[0], args.responses, args.response_tokens)))
        return

    print(f"V = {VOCAB:,}, hidden = {HIDDEN}, {LAYERS} layers, {args.responses} x "
          f"{args.response_tokens} response tokens, float32, torch threads = {torch.get_num_threads()}")
    rows = []
    for rho in args.rho:
        err = check_agreement(2, args.check_tokens, rho)
        print(f"rho {rho}: selective vs full on 2 x {args.check_tokens} tokens: loss rel. error "
              f"{err['loss_rel_err']:.1e}, max gradient rel. error {err['grad_rel_err']:.1e}; "
              f"own selections agree (Jaccard) {err['mask_jaccard']:.3f}")
        full = [measure("full", rho, args.responses, args.response_tokens) for _ in range(args.repeats)]
        sel = [measure("selective", rho, args.responses, args.response_tokens)
               for _ in range(args.repeats)]
        rows.append(ratio_row("rho", rho, full, sel, ("full", "selective")))
    header = ("rho", "full_peak_mb", "selective_peak_mb", "peak_mem_ratio", "full_s",
              "selective_s", "time_ratio")
    report(rows, header, full[0]["method"], args.json, 17, lambda h, v: f"{v:.3f}")


if __name__ == "__main__":
    main()
