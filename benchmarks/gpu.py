"""The trainer's head numerics on one GPU, at Qwen2.5-0.5B and 1.5B dimensions (METHODS §2–§4).

    python benchmarks/gpu.py --json gpu.json             # a GPU, a few minutes
    python benchmarks/gpu.py --tiny --json out.json      # CPU, tiny dimensions, seconds

Needs torch and transformers only (no network, no weights): the models are random-initialised
Qwen2ForCausalLM with the published configs' dimensions (0.5B: hidden 896, 24 layers, 14 heads,
2 KV heads, intermediate 4,864; 1.5B: hidden 1,536, 28 layers, 12 heads, 2 KV heads,
intermediate 8,960; both V = 151,936, tied embeddings), in bf16, with a batch of 4 × 2,048
response tokens after a 64-token prompt. From `stages` it imports only stages.core.statistics.stats,
stages.core.statistics.scorer (and through it scoring and progress: tqdm, which transformers requires) and
stages.core.training.losses; not stages.core.training.selectors, which imports pydantic, so the 20-Entropy top-ρ
selection is written out below (the same rule: ceil(ρN) highest entropies, ties earliest first).

Rows, per model, each a ratio candidate / baseline measured in this process (below 1: better):

- token_statistics: stats.chunked_token_statistics from the trunk's hidden states vs the naive
  computation (benchmarks/token_stats.py's naive_statistics: all logits materialised in float32,
  softmax, reductions);
- token_statistics_to_matmul: the same chunked statistics (the same measurement) against the
  chunked logits matmul alone at the same chunk sizes (harness.chunked_matmul), their limit: a
  ratio that does not move with the naive path's memory traffic;
- selective_rho_0.1 / chunked_rho_1: one step, forward and backward of trunk and head, of the
  trainer's path (chunked statistics without gradient, top-ρ entropy selection, then
  scorer.head_logprob at the selected rows; ρ = 1: every row, the chunked head) against the full
  head (bf16 logits of every position, float32 log-softmax with gradient, entropies from those
  logits as TRL's entropy_from_logits, then the mask on the per-token loss), as in
  benchmarks/train_step.py; no optimizer step;
- gradient_checkpointing: the trunk's forward and backward (loss: mean square of the final
  hidden states) with non-reentrant gradient checkpointing vs without.

Memory: torch.cuda.max_memory_allocated after reset_peak_memory_stats, minus the memory
allocated before the call (model, inputs): what the call itself needed; parameter gradients are
set to None before each call, so both paths include them. Time: wall-clock between
torch.cuda.synchronize() calls, the minimum over --repeats calls after a warm-up call. On the CPU
(--tiny) memory is the resident-set high-water mark above the RSS before the call, as the other
benchmarks (glibc's dynamic mmap threshold is switched off so freed blocks go back to the
kernel); those numbers only show that the code runs.

Numerics (second table), on the trunk's hidden states of the same batch:

- bf16 first ratio: max |Δ log p| and the share of tokens with |exp(Δ) − 1| > 1% between the
  naive bf16 head (logits = head(hidden) in bf16, then log_softmax in float32) and the scorer's
  log-probs (float32 blocks and reductions from the bf16 inputs), at the model's own logit scale
  (a random-initialised model's logits are small) and with the hidden states scaled so that the
  logits have standard deviation 3 (closer to a trained model's);
- our on-policy first ratio: max |log p of scorer.score_scope (no gradient) − log p of
  scorer.head_logprob (trunk and head with gradient)| on the same rows, which must be exactly 0;
  and, for information, the same at only the selected rows (ρ = 0.1), where the head runs on a
  different set of rows than the scoring pass.

A cell that runs out of memory reads OOM; cells left when --budget-s has passed read skipped.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import logging
import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from fractions import Fraction
from pathlib import Path

import torch
from harness import ROOT, chunked_matmul, measured  # benchmarks/harness.py, beside this script
from token_stats import naive_statistics  # the naive baseline, one implementation

sys.path.insert(0, str(ROOT))
from stages.core.statistics.scorer import (  # noqa: E402
    Chunks,
    Scope,
    head_logprob,
    response_rows,
    score_scope,
    trunk_hidden,
)
from stages.core.statistics.stats import chunked_token_statistics  # noqa: E402
from stages.core.training.losses import clipped_surrogate  # noqa: E402  (pure torch)

log = logging.getLogger("benchmarks.gpu")
OOM_ERRORS = (getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError),)
TEMPERATURE = 1.0
PAD_ID = 0
EPS_LOW, EPS_HIGH = 0.2, 0.28
LOGIT_STD = 3.0


@dataclass(frozen=True)
class Dims:
    """A Qwen2 architecture's dimensions."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int = 151_936


QWEN = [Dims("Qwen2.5-0.5B", 896, 24, 14, 2, 4864), Dims("Qwen2.5-1.5B", 1536, 28, 12, 2, 8960)]
TINY = [Dims("tiny-a", 64, 2, 4, 2, 128, vocab=1024), Dims("tiny-b", 96, 3, 6, 2, 192, vocab=1536)]
ROWS = ("token_statistics", "token_statistics_to_matmul", "selective_rho_0.1", "chunked_rho_1",
        "gradient_checkpointing")


def is_oom(error: BaseException) -> bool:
    return isinstance(error, OOM_ERRORS) or (
        isinstance(error, RuntimeError) and "out of memory" in str(error).lower())


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# Measuring
# ---------------------------------------------------------------------------------------------
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_once(call: Callable[[], object], device: torch.device) -> dict:
    """{'peak_mb', 'seconds'} of one call: the memory it needed above what was allocated before."""
    if device.type != "cuda":
        _, result = measured(call)
        return {"peak_mb": result["peak_mb"], "seconds": result["seconds"]}
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    start = time.perf_counter()
    out = call()
    sync(device)
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(device) - before
    del out
    return {"peak_mb": peak / 2**20, "seconds": seconds}


def measure(call: Callable[[], object], device: torch.device, repeats: int,
            reset: Callable[[], None]) -> dict | str:
    """Warm-up, then min over repeats of peak and time; 'OOM' if the call runs out of memory."""
    runs, oom = [], False
    reset()
    release(device)
    try:
        for i in range(repeats + 1):
            reset()
            result = measure_once(call, device)
            if i:  # the first call pays for library initialisation and kernel selection
                runs.append(result)
    except Exception as error:  # noqa: BLE001  only OOM is handled
        if not is_oom(error):
            raise
        oom = True  # leave the except block first: the traceback holds the tensors
    reset()
    release(device)
    if oom:
        return "OOM"
    return {k: min(r[k] for r in runs) for k in ("peak_mb", "seconds")}


def ratio_row(model: str, row: str, names: tuple[str, str], base, cand) -> dict:
    out = {"model": model, "row": row, "baseline": names[0], "candidate": names[1]}
    for side, m in (("baseline", base), ("candidate", cand)):
        ok = isinstance(m, dict)
        out[f"{side}_peak_mb"] = m["peak_mb"] if ok else None
        out[f"{side}_s"] = m["seconds"] if ok else None
        out[f"{side}_status"] = "ok" if ok else m
    both = isinstance(base, dict) and isinstance(cand, dict)
    # nothing measurable (tiny CPU cells; the matmul alone allocates one block, which can read as
    # 0 MB): no ratio rather than a division by 0
    out["peak_mem_ratio"] = (out["candidate_peak_mb"] / out["baseline_peak_mb"]
                             if both and base["peak_mb"] > 0 else None)
    out["time_ratio"] = out["candidate_s"] / out["baseline_s"] if both and base["seconds"] > 0 else None
    return out


# ---------------------------------------------------------------------------------------------
# The model and the batch
# ---------------------------------------------------------------------------------------------
def build_model(dims: Dims, device: torch.device, dtype: torch.dtype, max_len: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=dims.vocab, hidden_size=dims.hidden,
                         intermediate_size=dims.intermediate, num_hidden_layers=dims.layers,
                         num_attention_heads=dims.heads, num_key_value_heads=dims.kv_heads,
                         max_position_embeddings=max(32768, max_len),
                         tie_word_embeddings=True, use_cache=False)
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it runs: no 1.5B-parameter CPU init
        model = Qwen2ForCausalLM(config)
    model.to(dtype)
    model.eval()  # no dropout, as the trainer
    return model


@dataclass
class Batch:
    prompts: list[list[int]]
    responses: list[list[int]]
    targets: torch.Tensor  # (N,) response tokens in (sequence, position) order, on the device
    advantages: torch.Tensor  # (N,) each response's advantage at each of its tokens


def make_batch(vocab: int, responses: int, prompt_tokens: int, response_tokens: int,
               device: torch.device) -> Batch:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (responses, prompt_tokens + response_tokens), generator=g)
    adv = torch.randn(responses, generator=g).repeat_interleave(response_tokens)
    return Batch(ids[:, :prompt_tokens].tolist(), ids[:, prompt_tokens:].tolist(),
                 ids[:, prompt_tokens:].reshape(-1).to(device), adv.to(device))


def rows_of(model, batch: Batch, device: torch.device) -> torch.Tensor:
    """Hidden states (N, D) predicting each response token (with gradient if enabled)."""
    hidden, flat = trunk_hidden(model, batch.prompts, batch.responses, PAD_ID, device)
    return response_rows(hidden, flat)


def top_entropy(entropy: torch.Tensor, rho: float) -> torch.Tensor:
    """Indices (k,) of the ceil(ρN) highest entropies, ties earliest first (selectors'
    entropy_top, written out so that pydantic need not be installed)."""
    k = min(entropy.numel(), math.ceil(Fraction(str(float(rho))) * entropy.numel()))
    return torch.sort(-entropy, stable=True).indices[:k].sort().values


# ---------------------------------------------------------------------------------------------
# The paths
# ---------------------------------------------------------------------------------------------
def full_step(model, batch: Batch, rho: float, device, chunks: Chunks) -> torch.Tensor:
    """The head at every position: bf16 logits, float32 log-softmax with gradient."""
    rows = rows_of(model, batch, device)  # (N, D)
    logits = model.get_output_embeddings()(rows).float()  # (N, V)
    logp = logits.gather(-1, batch.targets[:, None]).squeeze(-1) - torch.logsumexp(logits, -1)
    with torch.no_grad():  # TRL's entropy_from_logits
        entropy = torch.cat([-(lp.exp() * lp).sum(-1)
                             for lp in (c.log_softmax(-1) for c in logits.split(128))])
    mask = torch.zeros_like(logp, dtype=torch.bool)
    mask[top_entropy(entropy, rho)] = True
    token_loss, _ = clipped_surrogate(logp, logp.detach(), batch.advantages, EPS_LOW, EPS_HIGH)
    loss = (torch.where(mask, token_loss, torch.zeros_like(token_loss)) / mask.sum()).sum()
    loss.backward()
    return loss.detach()


def selective_step(model, batch: Batch, rho: float, device, chunks: Chunks) -> torch.Tensor:
    """The trainer's path: chunked statistics without gradient, then the chunked head at the
    selected rows only."""
    head = model.get_output_embeddings()
    rows = rows_of(model, batch, device)  # (N, D)
    stats = chunked_token_statistics(rows.detach(), head.weight, batch.targets, TEMPERATURE,
                                     head_bias=head.bias, jsd=False,
                                     chunk_positions=chunks.positions, chunk_vocab=chunks.vocab)
    pick = top_entropy(stats["entropy"], rho)  # (n_sel,)
    logp = head_logprob(head, rows[pick], batch.targets[pick], TEMPERATURE, chunks)
    token_loss, _ = clipped_surrogate(logp, logp.detach(), batch.advantages[pick], EPS_LOW,
                                      EPS_HIGH)
    loss = token_loss.sum() / pick.numel()
    loss.backward()
    return loss.detach()


def trunk_step(model, batch: Batch, device) -> torch.Tensor:
    rows = rows_of(model, batch, device)
    loss = rows.float().square().mean()
    loss.backward()
    return loss.detach()


@torch.no_grad()
def naive_stats(model, rows, batch: Batch):
    return naive_statistics(rows, model.get_output_embeddings().weight, batch.targets, TEMPERATURE)


def chunked_stats(model, rows, batch: Batch, chunks: Chunks):
    return chunked_token_statistics(rows, model.get_output_embeddings().weight, batch.targets,
                                    TEMPERATURE, jsd=False, chunk_positions=chunks.positions,
                                    chunk_vocab=chunks.vocab)


# ---------------------------------------------------------------------------------------------
# Numerics
# ---------------------------------------------------------------------------------------------
@torch.no_grad()
def bf16_first_ratio(head, rows: torch.Tensor, targets: torch.Tensor, chunks: Chunks) -> dict:
    """Naive bf16 head vs the scorer's float32 reductions on the same rows."""
    logits = head(rows).float()  # (N, V): bf16 logits, float32 log-softmax
    naive = logits.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(logits, -1)
    logit_std = float(logits.std())
    del logits
    ours = chunked_token_statistics(rows, head.weight, targets, TEMPERATURE, head_bias=head.bias,
                                    jsd=False, chunk_positions=chunks.positions,
                                    chunk_vocab=chunks.vocab)["logprob"]
    delta = (naive - ours).double()
    return {"logit_std": logit_std, "max_abs_dlogp": float(delta.abs().max()),
            "share_ratio_off_1pct": float(((delta.exp() - 1).abs() > 0.01).double().mean())}


def on_policy(model, batch: Batch, device, chunks: Chunks, rho: float) -> dict:
    """max |score_scope log p − head_logprob log p|: all rows, and the selected rows only."""
    head = model.get_output_embeddings()
    scope = Scope(batch.prompts, batch.responses, list(range(len(batch.prompts))))
    scored = score_scope(model, scope, PAD_ID, TEMPERATURE, frozenset(), device=device,
                         max_sequences=len(batch.prompts), chunks=chunks)
    rows = rows_of(model, batch, device)  # with gradient, as the actor's
    every = head_logprob(head, rows, batch.targets, TEMPERATURE, chunks).detach().cpu()
    pick = top_entropy(scored["entropy"], rho).to(device)
    some = head_logprob(head, rows[pick], batch.targets[pick], TEMPERATURE, chunks).detach().cpu()
    del rows
    return {"on_policy_max_abs": float((scored["logprob"] - every).abs().max()),
            "selected_rows_max_abs": float((scored["logprob"][pick.cpu()] - some).abs().max())}


# ---------------------------------------------------------------------------------------------
# One model
# ---------------------------------------------------------------------------------------------
def run_model(dims: Dims, args, device: torch.device, dtype: torch.dtype, chunks: Chunks,
              deadline: float) -> tuple[list[dict], dict]:
    name = dims.name
    try:
        model = build_model(dims, device, dtype, args.prompt_tokens + args.response_tokens)
    except Exception as error:  # noqa: BLE001
        if not is_oom(error):
            raise
        model = None
    if model is None:
        release(device)
        return ([ratio_row(name, r, ("", ""), "OOM", "OOM") for r in ROWS],
                {"model": name, "status": "OOM"})
    batch = make_batch(dims.vocab, args.responses, args.prompt_tokens, args.response_tokens,
                       device)

    def reset():
        model.zero_grad(set_to_none=True)

    def cell(call):
        if time.monotonic() > deadline:
            return "skipped"
        return measure(call, device, args.repeats, reset)

    rows = []
    log.info("%s: token statistics", name)
    with torch.no_grad():
        hidden = rows_of(model, batch, device)  # (N, D)
    chunked = cell(lambda: chunked_stats(model, hidden, batch, chunks))
    rows.append(ratio_row(name, "token_statistics", ("naive", "chunked"),
                          cell(lambda: naive_stats(model, hidden, batch)), chunked))
    weight = model.get_output_embeddings().weight
    rows.append(ratio_row(name, "token_statistics_to_matmul", ("matmul", "chunked"),
                          cell(lambda: chunked_matmul(hidden, weight, chunks.positions,
                                                      chunks.vocab, TEMPERATURE)), chunked))
    numerics = {"model": name}
    head = model.get_output_embeddings()
    try:
        log.info("%s: numerics", name)
        numerics["own_scale"] = bf16_first_ratio(head, hidden, batch.targets, chunks)
        scale = LOGIT_STD / max(numerics["own_scale"]["logit_std"], 1e-12)
        numerics[f"logit_std_{LOGIT_STD:g}"] = bf16_first_ratio(
            head, (hidden.float() * scale).to(hidden.dtype), batch.targets, chunks)
        numerics |= on_policy(model, batch, device, chunks, rho=0.1)
        numerics["status"] = "ok"
    except Exception as error:  # noqa: BLE001
        if not is_oom(error):
            raise
        numerics["status"] = "OOM"
    hidden = None  # the statistics' inputs are not needed by the steps
    release(device)
    for row, rho in (("selective_rho_0.1", 0.1), ("chunked_rho_1", 1.0)):
        log.info("%s: %s", name, row)
        rows.append(ratio_row(name, row, ("full", "chunked_head"),
                              cell(lambda r=rho: full_step(model, batch, r, device, chunks)),
                              cell(lambda r=rho: selective_step(model, batch, r, device, chunks))))
    log.info("%s: gradient checkpointing", name)
    plain = cell(lambda: trunk_step(model, batch, device))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()  # checkpointing is active only in training mode; dropout is 0
    checkpointed = cell(lambda: trunk_step(model, batch, device))
    model.gradient_checkpointing_disable()
    model.eval()
    rows.append(ratio_row(name, "gradient_checkpointing", ("plain", "checkpointed"), plain,
                          checkpointed))
    return rows, numerics  # the model goes with this frame; main releases its memory


# ---------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------
def fmt(value) -> str:
    """Three significant digits; from 100 up, one decimal and thousands separated."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.1f}" if abs(value) >= 100 else f"{value:.3g}"
    return str(value)


def print_tables(rows: list[dict], numerics: list[dict], memory: str) -> None:
    print(f"memory: {memory}")
    header = ("model", "row", "baseline_peak_mb", "candidate_peak_mb", "peak_mem_ratio",
              "baseline_s", "candidate_s", "time_ratio")
    print(" | ".join(header))
    for r in rows:
        cells = []
        for h in header:
            side = h.split("_")[0]
            status = r.get(f"{side}_status")
            if h.endswith(("_peak_mb", "_s")) and status not in (None, "ok"):
                cells.append(status)
            elif h.endswith("_ratio") and r[h] is None:
                cells.append("-")
            else:
                cells.append(fmt(r[h]))
        print(" | ".join(cells))
    print()
    print("model | logit scale | logit std | max |dlogp| naive bf16 vs scorer | share |ratio-1|>1%"
          " | on-policy max |dlogp| (same rows) | selected rows only")
    for n in numerics:
        if n.get("status") != "ok":
            print(f"{n['model']} | {n.get('status')}")
            continue
        for key in ("own_scale", f"logit_std_{LOGIT_STD:g}"):
            v = n[key]
            print(f"{n['model']} | {key} | {v['logit_std']:.3f} | {v['max_abs_dlogp']:.3e} | "
                  f"{v['share_ratio_off_1pct']:.4f} | {n['on_policy_max_abs']:.3e} | "
                  f"{n['selected_rows_max_abs']:.3e}")


def disable_dynamic_mmap() -> None:
    """glibc: a fixed mmap threshold, so large freed blocks return to the kernel and the RSS
    high-water mark sees each call's own allocations (CPU measurements only)."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 16 * 1024)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true",
                        help="tiny dimensions on the CPU (or the GPU if there is one): seconds")
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--responses", type=int, default=None, help="default 4 (tiny: 2)")
    parser.add_argument("--response-tokens", type=int, default=None, help="default 2048 (tiny 96)")
    parser.add_argument("--prompt-tokens", type=int, default=None, help="default 64 (tiny 8)")
    parser.add_argument("--models", nargs="+", default=None,
                        help="model names (default: every one of the mode)")
    parser.add_argument("--repeats", type=int, default=2, help="timed calls per cell; min kept")
    parser.add_argument("--budget-s", type=float, default=420.0,
                        help="cells that would start after this many seconds read 'skipped'")
    parser.add_argument("--json", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    start = time.monotonic()
    tiny = args.tiny
    args.responses = args.responses or (2 if tiny else 4)
    args.response_tokens = args.response_tokens or (96 if tiny else 2048)
    args.prompt_tokens = args.prompt_tokens or (8 if tiny else 64)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16
    chunks = Chunks(positions=32, vocab=256) if tiny else Chunks()
    models = [d for d in (TINY if tiny else QWEN) if args.models is None or d.name in args.models]
    if device.type == "cpu":
        disable_dynamic_mmap()
        if tiny:  # tiny blocks gain nothing from threads, and lose much when the cores are shared
            torch.set_num_threads(1)
    memory = ("torch.cuda.max_memory_allocated - memory_allocated before the call"
              if device.type == "cuda" else "VmHWM - RSS before the call (CPU)")
    meta = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "dtype": str(dtype), "responses": args.responses,
            "response_tokens": args.response_tokens, "prompt_tokens": args.prompt_tokens,
            "chunks": asdict(chunks), "repeats": args.repeats, "memory": memory,
            "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
            "models": [asdict(d) for d in models]}
    try:
        import transformers
        meta["transformers"] = transformers.__version__
    except ImportError:
        raise SystemExit("benchmarks/gpu.py needs transformers") from None
    print(f"{meta['device']}, {dtype}, {args.responses} x {args.response_tokens} response tokens "
          f"after {args.prompt_tokens}, chunks {chunks.positions} x {chunks.vocab}, torch "
          f"{torch.__version__}, transformers {meta['transformers']}", flush=True)
    rows, numerics = [], []
    for dims in models:
        r, n = run_model(dims, args, device, dtype, chunks, start + args.budget_s)
        rows += r
        numerics.append(n)
        release(device)
    meta["seconds"] = time.monotonic() - start
    print_tables(rows, numerics, memory)
    print(f"total {meta['seconds']:.1f} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"meta": meta, "rows": rows, "numerics": numerics},
                                        indent=2))


if __name__ == "__main__":
    main()
