"""Chunked exact token statistics vs the naive full-logits computation, and each against the
chunked logits matmul alone, their limit (METHODS §2–§3).

    python benchmarks/token_stats.py                       # 2,048 and 8,192 positions; 8 x 512
    python benchmarks/token_stats.py --positions 512 --group-steps 64 --repeats 2   # quick
    python benchmarks/token_stats.py --json results/bench/token_stats.json

Both paths compute the same per-position statistics (entropy, Rényi-2, log-prob of the sampled
token, max probability, logsumexp) from hidden states (N, 896) and a random LM head
(151,936, 896) in float32, Qwen2.5-0.5B's shapes:

- naive: logits = h · W^T for all positions (N × V float32), p = softmax(logits), then
  reductions; einsum keeps the reductions from allocating a third N × V tensor, so the naive
  peak is about two N × V float32 tensors — a strong baseline, not a strawman.
- chunked: :func:`stages.core.statistics.stats.chunked_token_statistics` (jsd=False, the same quantities);
- matmul: the chunked logits matmul alone (harness.chunked_matmul: the blocks of h · W^T at the
  same chunk sizes and nothing else), the limit of every chunked kernel on a CPU. Naive baselines
  move between machines (the naive path ran twice as fast on one 2-core machine as on another);
  a ratio to this one moves only with what the kernel does beyond its matmuls.

The second table is ICT's uniqueness u (:func:`stages.core.statistics.stats.group_step_jsd`, without a
precomputed logsumexp, so two passes over the vocabulary: the logsumexp, then the per-key sums
and the divergences, over logits formed once and kept between them, statistics.blocks.CACHE_BLOCKS) and the
token statistics (H, H2, log p: one pass), on one group of --group-responses responses ×
--group-steps steps (keys = the step, every response active at every step), against the chunked
matmul alone, all three in one fresh process and in turn, --repeats rounds. Both run the matmul
once per row; what lies above 1 is their elementwise work (u's: two exps, a log and float64 key
sums per entry).

How memory is measured. Each measurement runs in a fresh subprocess (the parent only
orchestrates), so allocator caches and earlier peaks cannot leak between measurements. The
worker builds its inputs, runs both paths once on 16 positions to pay one-time library
initialisation, then resets the kernel's resident-set high-water mark (writing "5" to
/proc/self/clear_refs) and reads the current RSS as the baseline. After the timed call it reads
VmHWM from /proc/self/status. peak = VmHWM - baseline: the physical memory the computation
itself needed above its inputs (weights, hidden states, imported libraries). RSS is the right
measure for torch on CPU: tracemalloc sees only Python-object allocations, and torch's CPU
allocator keeps no peak statistics. Linux only; elsewhere the worker falls back to
getrusage's ru_maxrss, which includes the inputs and is labelled as such.

Time is wall-clock of one call (time.perf_counter), in the same worker, after the warm-up.
Ratios are chunked / naive; below 1 means the chunked path is smaller or faster; *_to_matmul
are each path's time over the matmul's. The machine's other load adds noise to every one; run
--repeats > 1 to take the per-path minimum (the second table also prints the lowest and highest
ratio of a round, its spread, and the same ratios in process CPU time, which other jobs on the
same cores move less).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from harness import (  # benchmarks/harness.py, beside this script
    chunked_matmul,
    interleaved,
    limit_rows,
    measured,
    ratio_row,
    report,
    run_worker,
)

VOCAB = 151_936
HIDDEN = 896
TEMPERATURE = 1.0


def naive_statistics(hidden, weight, token_ids, temperature=1.0):
    """All-positions baseline: full float32 (float64 for float64 input) logits (N, V), softmax,
    reductions."""
    logits = hidden @ weight.T  # (N, V)
    logits = (logits if logits.dtype == torch.float64 else logits.float()) / temperature
    lse = torch.logsumexp(logits, dim=-1)  # (N,)
    p = torch.softmax(logits, dim=-1)  # (N, V)
    entropy = lse - torch.einsum("nv,nv->n", p, logits)
    renyi2 = -torch.einsum("nv,nv->n", p, p).log()
    return {
        "entropy": entropy,
        "renyi2": renyi2,
        "logsumexp": lse,
        "max_prob": p.amax(dim=-1),
        "logprob": logits.gather(-1, token_ids[:, None]).squeeze(1) - lse,
    }


def _chunked(hidden, weight, token_ids, chunk_positions, chunk_vocab):
    from stages.core.statistics.stats import chunked_token_statistics

    return chunked_token_statistics(
        hidden, weight, token_ids, TEMPERATURE,
        chunk_positions=chunk_positions, chunk_vocab=chunk_vocab, jsd=False,
    )


def worker(path: str, positions: int, chunk_positions: int, chunk_vocab: int) -> dict:
    """One measurement in this (fresh) process: {'peak_mb', 'seconds', 'method'}."""
    torch.manual_seed(0)
    weight = torch.randn(VOCAB, HIDDEN) / math.sqrt(HIDDEN)  # (V, D)
    hidden = torch.randn(positions, HIDDEN) * 3.0  # (N, D): logits of std ~3, a peaked p
    token_ids = torch.randint(0, VOCAB, (positions,))

    def run(h, ids):
        if path == "naive":
            return naive_statistics(h, weight, ids, TEMPERATURE)
        if path == "matmul":
            return chunked_matmul(h, weight, chunk_positions, chunk_vocab, TEMPERATURE)
        return _chunked(h, weight, ids, chunk_positions, chunk_vocab)

    with torch.no_grad():
        run(hidden[:16], token_ids[:16])  # library initialisation, thread pools
        out, result = measured(lambda: run(hidden, token_ids))
    assert path == "matmul" or torch.isfinite(out["entropy"]).all()
    return result


def group_worker(responses: int, steps: int, chunk_positions: int, chunk_vocab: int,
                 repeats: int) -> dict[str, list[float]]:
    """Seconds of the chunked matmul alone, the token statistics and group_step_jsd on one group,
    in this (fresh) process, in turn for `repeats` rounds (harness.interleaved)."""
    from stages.core.statistics.stats import group_step_jsd

    torch.manual_seed(0)
    weight = torch.randn(VOCAB, HIDDEN) / math.sqrt(HIDDEN)  # (V, D)
    hidden = torch.randn(responses * steps, HIDDEN) * 3.0  # (N, D) response-major
    token_ids = torch.randint(0, VOCAB, (responses * steps,))
    keys = torch.arange(steps).repeat(responses)  # (N,) the step: one group, all active
    paths = {  # each (h, ids, keys) -> None
        "matmul": lambda h, ids, k: chunked_matmul(h, weight, chunk_positions, chunk_vocab),
        "token_statistics": lambda h, ids, k: _chunked(h, weight, ids, chunk_positions,
                                                       chunk_vocab),
        "group_step_jsd": lambda h, ids, k: group_step_jsd(
            h, weight, k, TEMPERATURE, chunk_positions=chunk_positions, chunk_vocab=chunk_vocab),
    }
    with torch.no_grad():
        for path in paths.values():  # library initialisation, thread pools
            path(hidden[:16], token_ids[:16], keys[:16])
        return interleaved({name: lambda p=path: p(hidden, token_ids, keys)
                            for name, path in paths.items()}, repeats)


def measure(path: str, positions: int, chunk_positions: int, chunk_vocab: int) -> dict:
    return run_worker(__file__, ["--_worker", path, "--positions", str(positions),
                                 "--chunk-positions", str(chunk_positions), "--chunk-vocab",
                                 str(chunk_vocab)], f"{path} at {positions} positions")


def check_accuracy(positions: int, chunk_positions: int, chunk_vocab: int) -> dict[str, float]:
    """Largest absolute error of each float32 path against the naive path in float64."""
    torch.manual_seed(1)
    weight = torch.randn(VOCAB, HIDDEN) / math.sqrt(HIDDEN)
    hidden = torch.randn(positions, HIDDEN) * 3.0
    ids = torch.randint(0, VOCAB, (positions,))
    with torch.no_grad():
        exact = naive_statistics(hidden.double(), weight.double(), ids, TEMPERATURE)
        paths = {
            "naive": naive_statistics(hidden, weight, ids, TEMPERATURE),
            "chunked": _chunked(hidden, weight, ids, chunk_positions, chunk_vocab),
        }
    return {
        name: max(float((out[k].double() - exact[k]).abs().max()) for k in exact)
        for name, out in paths.items()
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--positions", type=int, nargs="*", default=[2048, 8192],
                        help="positions of the first table's rows (none: no first table)")
    parser.add_argument("--chunk-positions", type=int, default=None, help="default: the library's")
    parser.add_argument("--chunk-vocab", type=int, default=None, help="default: the library's")
    parser.add_argument("--repeats", type=int, default=1, help="measurements per path; min kept")
    parser.add_argument("--group-responses", type=int, default=8,
                        help="responses of the group of the second table")
    parser.add_argument("--group-steps", type=int, default=512,
                        help="steps of each response of the second table (0: no second table)")
    parser.add_argument("--json", type=Path, default=None, help="write the rows as JSON here")
    parser.add_argument("--_worker", choices=["naive", "chunked", "matmul", "group"],
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    from stages.core.statistics import blocks

    cp = args.chunk_positions or blocks.CHUNK_POSITIONS
    cv = args.chunk_vocab or blocks.CHUNK_VOCAB
    if args._worker == "group":
        print(json.dumps(group_worker(args.group_responses, args.group_steps, cp, cv,
                                      args.repeats)))
        return
    if args._worker:
        print(json.dumps(worker(args._worker, args.positions[0], cp, cv)))
        return

    print(f"V = {VOCAB:,}, hidden = {HIDDEN}, float32, torch threads = {torch.get_num_threads()}, "
          f"chunks = {cp} positions x {cv} vocabulary entries")
    errors = check_accuracy(64, cp, cv)
    print("max abs error against float64 on 64 positions: "
          + ", ".join(f"{name} {err:.1e}" for name, err in errors.items()))
    rows = []
    for n in args.positions:
        naive = [measure("naive", n, cp, cv) for _ in range(args.repeats)]
        chunked = [measure("chunked", n, cp, cv) for _ in range(args.repeats)]
        matmul = [measure("matmul", n, cp, cv) for _ in range(args.repeats)]
        row = ratio_row("positions", n, naive, chunked, ("naive", "chunked"))
        row["matmul_s"] = min(m["seconds"] for m in matmul)
        row["naive_to_matmul"] = row["naive_s"] / row["matmul_s"]
        row["chunked_to_matmul"] = row["chunked_s"] / row["matmul_s"]
        rows.append(row)
    header = ("positions", "naive_peak_mb", "chunked_peak_mb", "peak_mem_ratio",
              "naive_s", "chunked_s", "time_ratio", "matmul_s", "naive_to_matmul",
              "chunked_to_matmul")
    if rows:
        report(rows, header, naive[0]["method"], None, 15,
               lambda h, v: f"{v:,}" if h == "positions" else f"{v:.3f}")
    group = []
    if args.group_steps > 0:
        g, t = args.group_responses, args.group_steps
        times = run_worker(__file__, ["--_worker", "group", "--group-responses", str(g),
                                      "--group-steps", str(t), "--repeats", str(args.repeats),
                                      "--chunk-positions", str(cp), "--chunk-vocab", str(cv)],
                           "the group's measurement")
        group = limit_rows(times, "matmul")
        print(f"\nagainst the chunked matmul alone, in one process, {args.repeats} round(s): one "
              f"group of {g} responses x {t} steps ({g * t:,} positions), keys = the step")
        report(group, ("path", "min_s", "max_s", "to_limit", "to_limit_low", "to_limit_high",
                       "to_limit_cpu", "to_limit_cpu_low", "to_limit_cpu_high"),
               None, None, 16, lambda h, v: v if h == "path" else f"{v:.3f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"positions": rows, "group": group}, indent=2))


if __name__ == "__main__":
    main()
