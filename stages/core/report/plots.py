"""Figures (PNG through matplotlib's Agg backend) and the token-shading HTML page."""

from __future__ import annotations

import html
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from stages.core.common.io import atomic_path  # noqa: E402


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


LN2 = math.log(2)  # the largest uniqueness u of the ICT paper (nats): two equally likely sources

_TOKEN_STYLE = """
body { font-family: sans-serif; margin: 2em; max-width: 70em; }
.resp { font-family: monospace; white-space: pre-wrap; overflow-wrap: anywhere; line-height: 2.1;
        margin: 0.3em 0 1.5em; }
.tok { padding: 1px 0; background: var(--h); }
body.show-u .resp .tok { background: var(--u, #e0e0e0); }
.ict { outline: 2px solid #1565c0; }
.ent { border-bottom: 3px solid #2e7d32; }
.silenced { text-decoration: line-through; text-decoration-color: #c62828; }
.nl::before { content: "↵"; color: #9e9e9e; }
.legend span, .legend label { margin-right: 1.5em; }
.legend .tok { font-family: monospace; background: none; }
.legend .scale { display: inline-block; width: 8em; height: 0.9em; vertical-align: middle;
         border: 1px solid #999; margin: 0 0.3em; }
.stats { font-size: 85%; color: #555; margin: 0; }
h3 { margin-bottom: 0.2em; }
"""

# the page-wide switch between entropy and u shading (only on pages whose tokens carry u)
_SHADE_SCRIPT = """<script>
for (const r of document.querySelectorAll("input[name=shade]"))
  r.addEventListener("change", () => document.body.classList.toggle("show-u", r.value === "u"));
</script>"""


def _shade(x: float, top: tuple[int, int, int]) -> str:
    """The colour `x` (0..1) of the way from white to `top`."""
    x = min(1.0, max(0.0, x))
    return "rgb({},{},{})".format(*(round(255 - x * (255 - c)) for c in top))


H_TOP = (255, 0, 0)  # entropy max_entropy: red
U_TOP = (123, 87, 255)  # u = ln 2: violet, away from the red, green and blue of the marks


def _ict_u(tok: dict, where: str) -> float | None:
    """The token's ICT uniqueness u (nats) or None where it has none; out of [0, ln 2] is an error."""
    u = tok.get("ict_u")
    if u is None or math.isnan(u):
        return None
    if not -1e-6 <= u <= LN2 + 1e-6:
        raise ValueError(f"{where}: ict_u = {u!r} is outside [0, ln 2] nats")
    return float(u)


def token_page(samples: list[dict], path: str | Path, max_entropy: float, title: str) -> None:
    """HTML page: each response as running text, its tokens shaded by entropy; marks show what each
    selector picks, and each token's tooltip its values.

    `samples`: dicts with `header` (str) and `tokens`: list of dicts with `text`, `entropy` (nats),
    optional `jsd` and `logprob`, booleans `sel_entropy20`, `sel_stapo` (False: STAPO silences the
    token), `sel_ict`, and optional `ict_u`, the ICT paper's uniqueness score (nats, 0..ln 2; None
    or NaN where unknown). When any token has `ict_u`, a switch shades by u instead of entropy.
    Tokens are concatenated without separators, so their own spaces and newlines lay the text out.
    """
    has_u = any(tok.get("ict_u") is not None for s in samples for tok in s["tokens"])
    head = html.escape(title)
    out = [f"<!doctype html><html><head><meta charset='utf-8'><title>{head}</title>",
           f"<style>{_TOKEN_STYLE}</style></head><body><h1>{head}</h1>",
           "<div class='legend' id='legend'><p>background: entropy H, 0"
           f"<span class='scale' style='background: linear-gradient(to right, white, {_shade(1, H_TOP)})'>"
           f"</span>{max_entropy:.2f} nats"]
    if has_u:
        out.append(f" · or ICT uniqueness u, 0<span class='scale' style='background: linear-gradient("
                   f"to right, white, {_shade(1, U_TOP)})'></span>ln 2 = {LN2:.3f} nats (grey: no u)")
    out.append("</p><p><span class='tok ict'>ICT pick</span><span class='tok ent'>20-Entropy pick</span>"
               "<span class='tok silenced'>silenced by STAPO</span><span class='tok nl'> newline</span>"
               "· hover a token for its values</p>")
    if has_u:
        out.append("<p id='shade'>shade by: <label><input type='radio' name='shade' value='h' checked>"
                   " entropy H</label><label><input type='radio' name='shade' value='u'>"
                   " ICT uniqueness u</label></p>")
    out.append("</div>")
    for n, sample in enumerate(samples):
        spans, us = [], []
        for k, tok in enumerate(sample["tokens"]):
            u = _ict_u(tok, f"sample {n} ({sample['header']!r}), token {k}")
            classes = ["tok"]
            picks = []
            if tok["sel_ict"]:
                classes.append("ict")
                picks.append("ICT")
            if tok["sel_entropy20"]:
                classes.append("ent")
                picks.append("20-Entropy")
            if not tok["sel_stapo"]:
                classes.append("silenced")
                picks.append("silenced by STAPO")
            values = [f"H = {tok['entropy']:.3f} nats"]
            if tok.get("jsd") is not None:  # the scope-mean JSD: only when a selector needs it
                values.append(f"JSD = {tok['jsd']:.4f}")
            if tok.get("logprob") is not None:
                values.append(f"log p = {tok['logprob']:.3f}")
            tip = [repr(tok["text"]), ", ".join(values)]
            shading = f"--h: {_shade(tok['entropy'] / max_entropy if max_entropy > 0 else 0.0, H_TOP)}"
            if u is not None:
                us.append(u)
                tip[1] += f", u = {u:.3f} nats"
                shading += f"; --u: {_shade(u / LN2, U_TOP)}"
            if picks:
                tip.append(", ".join(picks))
            text = html.escape(tok["text"]).replace("\n", "<span class='nl'></span>\n")
            spans.append(f"<span class='{' '.join(classes)}' style='{shading}'"
                         f" title='{html.escape(chr(10).join(tip))}'>{text}</span>")
        toks = sample["tokens"]
        stats = [f"{len(toks)} tokens"]
        if toks:
            stats.append(f"mean H {sum(t['entropy'] for t in toks) / len(toks):.3f} nats")
        if us:
            stats.append(f"mean u {sum(us) / len(us):.3f} nats ({len(us)} tokens with u)")
        stats.append(f"ICT picks {sum(bool(t['sel_ict']) for t in toks)}, 20-Entropy "
                     f"{sum(bool(t['sel_entropy20']) for t in toks)}, STAPO silences "
                     f"{sum(not t['sel_stapo'] for t in toks)}")
        # one line: a newline between the div and its first span would show under pre-wrap
        out.append(f"<h3>{html.escape(sample['header'])}</h3><p class='stats'>{' · '.join(stats)}</p>"
                   f"<div class='resp'>{''.join(spans)}</div>")
    if has_u:
        out.append(_SHADE_SCRIPT)
    out.append("</body></html>\n")
    with atomic_path(path, ".html") as tmp:
        tmp.write_text("\n".join(out))
