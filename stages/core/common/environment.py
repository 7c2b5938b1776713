"""Which lock the running environment was installed from (scripts/setup.sh writes its name and
sha256 into the environment's folder), and whether what is installed still matches it.

Every provenance record names the lock (`record`), so two results from the same lock and the
same inputs are comparable, and a result from another lock says so (sources.csv prints it). A job
checks, as it starts, that the installed distributions have the lock's versions (`check`): a
package installed or upgraded by hand since is a warning naming it, not an error, as the job may
still be what the user wants.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import sys
from importlib import metadata
from pathlib import Path

MARK = ".ict-rlvr-lock"
"""The file in an environment's folder (sys.prefix) that names its lock."""
ROOT = Path(__file__).resolve().parents[3]
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s\\;]+)", re.M)

log = logging.getLogger("stages")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@functools.cache
def record() -> dict | None:
    """{"lock": "locks/<name>.txt", "sha256": ...} of the running environment, or None where it
    was not installed by scripts/setup.sh from a lock."""
    try:
        return json.loads((Path(sys.prefix) / MARK).read_text())
    except (OSError, ValueError):
        return None


def pins(lock_text: str) -> dict[str, str]:
    """{canonical name: version} of a lock's `name==version` lines."""
    return {canonical(m[1]): m[2] for m in PIN.finditer(lock_text)}


def mismatches(pinned: dict[str, str], installed: dict[str, str]) -> list[str]:
    """The pinned distributions that are missing or at another version, as 'name: lock V, installed W'."""
    out = []
    for name, version in sorted(pinned.items()):
        have = installed.get(name)
        if have != version:
            out.append(f"{name}: lock {version}, installed {have or 'none'}")
    return out


def installed_versions() -> dict[str, str]:
    return {canonical(d.metadata["Name"]): d.version for d in metadata.distributions()
            if d.metadata["Name"]}


@functools.cache
def check() -> list[str]:
    """Compare the installed distributions with the environment's lock, once per process; log a
    warning naming each that differs. Returns them ([] where they match, or where there is no
    lock to compare with)."""
    rec = record()
    if rec is None:
        return []
    lock = ROOT / rec["lock"]
    if not lock.exists():
        log.warning("this environment was installed from %s, which this checkout does not have",
                    rec["lock"])
        return []
    found = mismatches(pins(lock.read_text()), installed_versions())
    if found:
        log.warning("the installed packages differ from %s (%d): %s; results name the lock they "
                    "were installed from, which these no longer are", rec["lock"], len(found),
                    "; ".join(found[:8]) + (" …" if len(found) > 8 else ""))
    return found
