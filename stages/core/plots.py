"""Figures (PNG through matplotlib's Agg backend) and the token-shading HTML page."""

from __future__ import annotations

import html
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from .io import atomic_path  # noqa: E402


def save(fig, path: str | Path) -> None:
    with atomic_path(path, ".png") as tmp:
        fig.savefig(tmp, dpi=120, bbox_inches="tight", format="png")
    plt.close(fig)


def entropy_histogram(series: dict[str, list[float]], path: str | Path, vocab_size: int,
                      title: str = "Token entropy") -> None:
    """Histogram of per-token entropy on a log axis, one outline per series, with H = 0.01 and
    each series' 80th percentile marked (the 20-Entropy paper's reference points)."""
    import numpy as np

    fig, ax = plt.subplots(figsize=(7, 4))
    floor = 1e-6
    edges = np.logspace(math.log10(floor), math.log10(max(math.log(vocab_size), 1e-3)), 60)
    for i, (label, values) in enumerate(series.items()):
        h = np.clip(np.asarray(values, dtype=float), floor, None)
        color = f"C{i}"
        ax.hist(h, bins=edges, histtype="step", linewidth=1.5, color=color,
                label=f"{label} (n={len(h):,})")
        p80 = float(np.quantile(h, 0.8))
        ax.axvline(p80, color=color, linestyle=":", linewidth=1)
    ax.axvline(0.01, color="grey", linestyle="--", linewidth=1, label="H = 0.01")
    ax.set_xscale("log")
    ax.set_xlabel(f"entropy H (nats, values below {floor:g} drawn at {floor:g}); dotted: 80th pct")
    ax.set_ylabel("tokens")
    ax.set_title(title)
    ax.legend(fontsize=8)
    save(fig, path)


def top_tokens(tables: dict[str, list[tuple[str, int]]], path: str | Path,
               title: str = "Most frequent tokens among each selector's picks") -> None:
    """One horizontal bar chart per selector: its picks' most frequent tokens and their counts."""
    fig, axes = plt.subplots(1, len(tables), figsize=(4 * len(tables), 4), squeeze=False)
    for ax, (name, rows) in zip(axes[0], tables.items(), strict=True):
        labels = [repr(t)[1:-1].replace(" ", "␣") or "∅" for t, _ in rows][::-1]
        ax.barh(range(len(rows)), [c for _, c in rows][::-1], color="C0")
        ax.set_yticks(range(len(rows)), labels, fontfamily="monospace")
        ax.set_title(name)
        ax.set_xlabel("count")
    fig.suptitle(title)
    save(fig, path)


def token_page(samples: list[dict], path: str | Path, max_entropy: float, title: str) -> None:
    """HTML page: each response's tokens shaded by entropy; marks show what each selector picks.

    `samples`: dicts with `header` (str) and `tokens`: list of dicts with `text`, `entropy`,
    and booleans `sel_entropy20`, `sel_stapo`, `sel_ict`.
    """
    style = """
body { font-family: sans-serif; margin: 2em; max-width: 70em; }
.resp { font-family: monospace; white-space: pre-wrap; line-height: 2.1; margin-bottom: 1.5em; }
.tok { padding: 1px 0; }
.ict { outline: 2px solid #1565c0; }
.ent { border-bottom: 3px solid #2e7d32; }
.silenced { text-decoration: line-through; text-decoration-color: #c62828; }
.legend span { margin-right: 1.5em; font-family: monospace; }
"""
    out = [f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>",
           f"<style>{style}</style></head><body><h1>{html.escape(title)}</h1>",
           "<p class='legend'>background: entropy (white = 0, red = "
           f"{max_entropy:.2f} nats) · <span class='tok ict'>ICT pick</span>"
           "<span class='tok ent'>20-Entropy pick</span>"
           "<span class='tok silenced'>silenced by STAPO</span> · hover a token for its values</p>"]
    for sample in samples:
        out.append(f"<h3>{html.escape(sample['header'])}</h3><div class='resp'>")
        for tok in sample["tokens"]:
            shade = min(1.0, tok["entropy"] / max_entropy) if max_entropy > 0 else 0.0
            g = int(255 * (1 - shade))
            classes = ["tok"]
            if tok["sel_ict"]:
                classes.append("ict")
            if tok["sel_entropy20"]:
                classes.append("ent")
            if not tok["sel_stapo"]:
                classes.append("silenced")
            tip = f"H={tok['entropy']:.3f} JSD={tok.get('jsd', 0.0):.4f} logp={tok.get('logprob', 0.0):.3f}"
            out.append(f"<span class='{' '.join(classes)}' style='background: rgb(255,{g},{g})'"
                       f" title='{tip}'>{html.escape(tok['text'])}</span>")
        out.append("</div>")
    out.append("</body></html>")
    with atomic_path(path, ".html") as tmp:
        tmp.write_text("\n".join(out))
