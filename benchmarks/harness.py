"""What the benchmark scripts share: one measurement per fresh process, peak resident memory
above a baseline, and the printed/JSON table of ratios.

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


def report(rows: list[dict], header: tuple[str, ...], method: str, json_path: Path | None,
           width: int, fmt: Callable[[str, object], str]) -> None:
    """Print the table (and how memory was measured); write it as JSON when asked."""
    print(f"memory: {method}")
    print(" | ".join(f"{h:>{width}}" for h in header))
    for row in rows:
        print(" | ".join(f"{fmt(h, row[h]):>{width}}" for h in header))
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps([{h: row[h] for h in header} for row in rows], indent=2))
