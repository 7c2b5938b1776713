"""The `hub` section: where the snapshots of hub models and data sets and every tool's caches
live (stages.core.common.hub)."""

from __future__ import annotations

from pydantic import Field

from .base import Strict


class Hub(Strict):
    """Where the fetch puts hub snapshots and where jobs keep their caches."""

    # ours: one root for every cache, so that a site points them all away from a $HOME quota
    cache_dir: str | None = Field(
        None, description="root of the snapshot store (<root>/hub, the hub cache's layout, shared "
        "by runs) and of datasets', vLLM's, Triton's, torch's and the CUDA driver's caches, for the "
        "fetch and every job (None: $ICT_RLVR_CACHE_DIR, else each tool's default under "
        "~/.cache); relative to the working folder. Not a result key")
