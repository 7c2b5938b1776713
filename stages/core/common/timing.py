"""Where a job's time goes, for the cost plan's calibration (python -m stages.calibrate).

Every stage ends its log with one line `timing {...}` (stages.cli): its wall time from the start
of its process, and what the stage noted here while it ran (a sampler's generation seconds and
tokens, the token statistics' seconds, a training's attempts). Provenance holds no times (same
inputs, same bytes), so the times live in the logs.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

PREFIX = "timing "
RECORD: dict = {}
"""What this process's stage noted: keys summed by `add`, or set by `note`."""

_IMPORTED = time.monotonic()


def process_seconds() -> float:
    """Seconds since this process started (Linux: /proc; elsewhere since this module's import)."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.monotonic() - _IMPORTED


def add(**amounts: float) -> None:
    """Add to the record's sums (seconds, tokens, samples)."""
    for key, value in amounts.items():
        RECORD[key] = RECORD.get(key, 0) + value


def note(**fields) -> None:
    RECORD.update(fields)


def line(stage: str, status: int) -> str:
    """The log line of a stage's end: its wall time and its record."""
    return PREFIX + json.dumps({"stage": stage, "status": status,
                                "wall_s": round(process_seconds(), 3), **RECORD})


def read(log: str | Path) -> dict | None:
    """The last timing record of a job's log (None: the log has none, e.g. a job killed)."""
    found = None
    try:
        text = Path(log).read_text(errors="replace")
    except OSError:
        return None
    for raw in text.splitlines():
        at = raw.find(PREFIX + "{")
        if at >= 0:
            try:
                found = json.loads(raw[at + len(PREFIX):])
            except json.JSONDecodeError:
                continue
    return found
