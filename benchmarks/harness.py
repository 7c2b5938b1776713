"""What the benchmark scripts share: one measurement per fresh process, peak resident memory
above a baseline, the chunked logits matmul alone (every chunked kernel's limit), and the
printed/JSON table of ratios.

Each script calls itself with `--_worker ...` for every measurement (so one path's allocations
never inflate another's peak); the worker calls :func:`measured` and prints its dict as the last
line of stdout, which :func:`run_worker` reads back.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def rss_kb(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def measured(call: Callable[[], object]) -> tuple[object, dict]:
    """(call's result, {'peak_mb', 'seconds', 'method'}) of one call after the caller's warm-up.

    Resets the resident-set high-water mark (writing "5" to /proc/self/clear_refs), takes the
    current RSS as the baseline, and reports VmHWM − baseline: the memory the call itself needed.
    Where that is not possible, getrusage's ru_maxrss, which includes the inputs (and says so)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        baseline_kb, method = rss_kb("VmRSS"), "VmHWM - baseline RSS"
    except OSError:
        baseline_kb, method = 0, "ru_maxrss (includes inputs)"
    start = time.perf_counter()
    out = call()
    seconds = time.perf_counter() - start
    if method.startswith("VmHWM"):
        peak_kb = rss_kb("VmHWM") - baseline_kb
    else:
        peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return out, {"peak_mb": peak_kb / 1024, "seconds": seconds, "method": method}


def run_worker(script: str, args: list[str], what: str) -> dict:
    """Run `script --_worker ...args` in a fresh interpreter; its last stdout line, as JSON."""
    done = subprocess.run([sys.executable, script, *args], capture_output=True, text=True, cwd=ROOT,
                          check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{what} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


@torch.no_grad()
def chunked_matmul(hidden: torch.Tensor, weight: torch.Tensor, chunk_positions: int,
                   chunk_vocab: int, temperature: float = 1.0) -> None:
    """The logits (h / T) · W^T of every row, formed block by block (chunk_positions ×
    chunk_vocab, in the compute dtype: float32, float64 for float64 inputs, into one reused
    buffer, as blocks.LogitSource.block forms them) and nothing else.

    Every chunked kernel of stages.core.statistics.stats forms these blocks once per pass over the
    vocabulary, so this is their physical limit on a CPU: a kernel's time over this one is its
    number of passes plus the cost of its own work. Unlike a naive baseline it moves with the
    machine's matmul speed only. hidden (N, D), weight (V, D), on the weight's device."""
    dtype = torch.float64 if torch.float64 in (hidden.dtype, weight.dtype) else torch.float32
    n, vocab = hidden.shape[0], weight.shape[0]
    cp, cv = min(chunk_positions, max(n, 1)), min(chunk_vocab, vocab)
    out = torch.empty(cp * cv, dtype=dtype, device=weight.device)
    for a in range(0, n, cp):
        rows = hidden[a:a + cp].to(device=weight.device, dtype=dtype) * (1.0 / temperature)
        for c0 in range(0, vocab, cv):
            w = weight[c0:c0 + cv].to(dtype)  # (v, D); no copy when already in the dtype
            torch.matmul(rows, w.T, out=out[:rows.shape[0] * w.shape[0]].view(rows.shape[0], -1))


def interleaved(calls: dict[str, Callable[[], object]], repeats: int
                ) -> dict[str, dict[str, list[float]]]:
    """Seconds of each call in `repeats` rounds, in one process: every round runs each call once,
    in turn (the order rotating from round to round), so that the machine's other load falls on
    all of them alike. Per call, "wall" (time.perf_counter) and "cpu" (time.process_time: the
    CPU time of all this process's threads, which a job on the same cores slows less, though it
    counts threads spinning while they wait for one another). The caller warms up first."""
    times = {name: {"wall": [], "cpu": []} for name in calls}
    names = list(calls)
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            wall, cpu = time.perf_counter(), time.process_time()
            calls[name]()
            times[name]["cpu"].append(time.process_time() - cpu)
            times[name]["wall"].append(time.perf_counter() - wall)
    return times


def limit_rows(times: dict[str, dict[str, list[float]]], limit: str) -> list[dict]:
    """One row per path of :func:`interleaved`'s times: its fastest and slowest round (wall),
    and its ratio to the limit path: of the fastest of each, and the lowest and highest of each
    round's path / limit (their spread), in wall time and in CPU time."""
    rows = []
    for name, clocks in times.items():
        row = {"path": name, "min_s": min(clocks["wall"]), "max_s": max(clocks["wall"])}
        for clock, suffix in (("wall", ""), ("cpu", "_cpu")):
            seconds, base = clocks[clock], times[limit][clock]
            per_round = [s / m for s, m in zip(seconds, base, strict=True)]
            row |= {f"to_limit{suffix}": min(seconds) / min(base),
                    f"to_limit{suffix}_low": min(per_round),
                    f"to_limit{suffix}_high": max(per_round)}
        rows.append(row)
    return rows


def ratio_row(key: str, value, baseline: list[dict], candidate: list[dict], names: tuple[str, str]) -> dict:
    """One table row: the minimum over repeats of each path's peak and time, and their ratios
    candidate / baseline (below 1: the candidate is smaller or faster)."""
    base, cand = names
    row = {key: value,
           f"{base}_peak_mb": min(m["peak_mb"] for m in baseline),
           f"{cand}_peak_mb": min(m["peak_mb"] for m in candidate),
           f"{base}_s": min(m["seconds"] for m in baseline),
           f"{cand}_s": min(m["seconds"] for m in candidate)}
    row["peak_mem_ratio"] = row[f"{cand}_peak_mb"] / row[f"{base}_peak_mb"]
    row["time_ratio"] = row[f"{cand}_s"] / row[f"{base}_s"]
    return row


def report(rows: list[dict], header: tuple[str, ...], method: str | None, json_path: Path | None,
           width: int, fmt: Callable[[str, object], str]) -> None:
    """Print the table (and how memory was measured, unless method is None); write it as JSON
    when asked."""
    if method is not None:
        print(f"memory: {method}")
    print(" | ".join(f"{h:>{width}}" for h in header))
    for row in rows:
        print(" | ".join(f"{fmt(h, row[h]):>{width}}" for h in header))
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps([{h: row[h] for h in header} for row in rows], indent=2))
