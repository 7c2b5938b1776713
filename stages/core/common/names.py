"""Printed names that light modules need without importing torch: the workflow parses its rules
with them (stages.tables.output_names), and the tables label ICT's readings with them."""

from __future__ import annotations

ICT_LABELS = {
    "paper": "ICT (paper's rule)",
    "response_mean": "response-mean reading (ours, not ICT)",
    "group_pooled": "group-pooled reading (ours, not ICT)",
    "group_leave_one_out": "group leave-one-out reading (ours, not ICT)",
    "token_id": "JSD token-id reading (ours, not ICT)",
    "scope_position": "JSD scope-position reading (ours, not ICT)",
}
"""How each variant is printed: only the paper's rule is called ICT."""
