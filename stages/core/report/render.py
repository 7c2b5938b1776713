"""Tables as Markdown, LaTeX (booktabs) and HTML from one description, written atomically.

A :class:`Table` holds formatted cells (strings; "—" where there is no data), which cells are
bold, where row groups start, and notes printed under the table. The numbers behind the cells go
to CSV separately (unformatted, with the files they came from).
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass, field
from pathlib import Path

from stages.core.common.io import atomic_path

MISSING = "—"


@dataclass
class Table:
    title: str
    columns: list[str]
    rows: list[list[str]]
    bold: list[list[bool]] | None = None
    group_starts: list[int] = field(default_factory=list)  # row indices that open a new group
    notes: list[str] = field(default_factory=list)
    left_columns: int = 1  # leading text columns (left-aligned); the rest are numbers
    align: str | None = None  # "l"/"r" per column, overriding left_columns

    def __post_init__(self) -> None:
        if self.align is None:
            self.align = "l" * self.left_columns + "r" * (len(self.columns) - self.left_columns)
        if len(self.align) != len(self.columns) or set(self.align) - {"l", "r"}:
            raise ValueError(f"align {self.align!r} does not fit {len(self.columns)} columns")
        if self.bold is None:
            self.bold = [[False] * len(r) for r in self.rows]
        for i, row in enumerate(self.rows):
            if len(row) != len(self.columns) or len(self.bold[i]) != len(row):
                raise ValueError(f"row {i} of {self.title!r} has {len(row)} cells, "
                                 f"expected {len(self.columns)}")


# ----- cells ---------------------------------------------------------------------------------
def pct(x: float | None, signed: bool = False) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return MISSING
    return f"{100 * x:+.1f}" if signed else f"{100 * x:.1f}"


def mean_or_none(values: list[float | None]) -> float | None:
    """The mean when every value is present (an average over part of the benchmarks misleads)."""
    if not values or any(v is None for v in values):
        return None
    return sum(values) / len(values)


def bold_best(block: list[list[float | None]]) -> list[list[bool]]:
    """Per column of a block of rows: True where the value shown (1 decimal, in %) is the maximum
    (every tied maximum; nothing when the column has fewer than two different values)."""
    shown = [[None if v is None else round(100 * v, 1) for v in row] for row in block]
    marks = [[False] * len(row) for row in block]
    for j in range(len(block[0]) if block else 0):
        column = [row[j] for row in shown if row[j] is not None]
        if len(set(column)) < 2:  # a lone value, or all equal: nothing is best
            continue
        best = max(column)
        for i, row in enumerate(shown):
            marks[i][j] = row[j] == best
    return marks


def glob_of(paths: list[str]) -> str:
    """One pattern for a set of hive paths: the keys whose values differ become key=*."""
    if not paths:
        return "(none)"
    split = [Path(p).parts for p in paths]
    if len({len(s) for s in split}) != 1:
        return f"{len(paths)} files"
    parts = []
    for column in zip(*split, strict=True):
        if len(set(column)) == 1:
            parts.append(column[0])
        else:
            key = column[0].split("=", 1)[0]
            parts.append(f"{key}=*" if all("=" in c for c in column) else "*")
    return str(Path(*parts))


# ----- formats -------------------------------------------------------------------------------
def markdown(t: Table) -> str:
    def cell(text: str, bold: bool) -> str:
        text = text.replace("|", "\\|")
        return f"**{text}**" if bold and text != MISSING else text

    out = [f"### {t.title}", ""]
    out.append("| " + " | ".join(cell(c, False) for c in t.columns) + " |")
    out.append("|" + "|".join(":--" if a == "l" else "--:" for a in t.align) + "|")
    for row, bold in zip(t.rows, t.bold, strict=True):
        out.append("| " + " | ".join(cell(c, b) for c, b in zip(row, bold, strict=True)) + " |")
    if t.notes:
        out.append("")
        out += [f"{note}  " for note in t.notes]
    return "\n".join(out) + "\n"


# characters of our labels and notes that LaTeX text mode needs spelt out
_LATEX = {
    "\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_",
    "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}",
    "—": "---", "–": "--", "−": "$-$", "Δ": r"$\Delta$", "ρ": r"$\rho$", "τ": r"$\tau$",
    "≈": r"$\approx$", "×": r"$\times$", "≥": r"$\geq$", "≤": r"$\leq$", "<": r"$<$",
    ">": r"$>$", "…": r"\ldots{}", "·": r"$\cdot$", "±": r"$\pm$",
}


def latex_escape(text: str) -> str:
    return "".join(_LATEX.get(ch, ch) for ch in text)


def latex(t: Table, label: str) -> str:
    """A booktabs table (needs \\usepackage{booktabs}); notes follow the tabular."""
    spec = t.align

    def cell(text: str, bold: bool) -> str:
        text = latex_escape(text)
        return f"\\textbf{{{text}}}" if bold and text != "---" else text

    out = [r"\begin{table}[t]", r"\centering", r"\small",
           f"\\caption{{{latex_escape(t.title)}}}", f"\\label{{{label}}}",
           f"\\begin{{tabular}}{{{spec}}}", r"\toprule",
           " & ".join(cell(c, False) for c in t.columns) + r" \\", r"\midrule"]
    for i, (row, bold) in enumerate(zip(t.rows, t.bold, strict=True)):
        if i in t.group_starts and i > 0:
            out.append(r"\midrule")
        out.append(" & ".join(cell(c, b) for c, b in zip(row, bold, strict=True)) + r" \\")
    out += [r"\bottomrule", r"\end{tabular}"]
    for note in t.notes:
        out.append(f"\\par\\smallskip\\footnotesize {latex_escape(note)}")
    out.append(r"\end{table}")
    return "\n".join(out) + "\n"


def html_table(t: Table) -> str:
    def cell(tag: str, text: str, bold: bool, left: bool) -> str:
        text = html.escape(text)
        if bold and text != MISSING:
            text = f"<b>{text}</b>"
        return f"<{tag} style='text-align:{'left' if left else 'right'}'>{text}</{tag}>"

    out = [f"<h3>{html.escape(t.title)}</h3>", "<table>", "<thead><tr>"]
    out += [cell("th", c, False, t.align[i] == "l") for i, c in enumerate(t.columns)]
    out.append("</tr></thead><tbody>")
    for r, (row, bold) in enumerate(zip(t.rows, t.bold, strict=True)):
        top = " class='group'" if r in t.group_starts and r > 0 else ""
        out.append(f"<tr{top}>" + "".join(cell("td", c, b, t.align[i] == "l")
                                          for i, (c, b) in enumerate(zip(row, bold, strict=True)))
                   + "</tr>")
    out.append("</tbody></table>")
    out += [f"<p class='note'>{html.escape(note)}</p>" for note in t.notes]
    return "\n".join(out)


HTML_STYLE = """
body { font-family: sans-serif; margin: 2em; max-width: 80em; }
table { border-collapse: collapse; margin: 0.5em 0; }
th, td { padding: 2px 10px; }
thead tr { border-top: 2px solid black; border-bottom: 1px solid black; }
tbody tr:last-child { border-bottom: 2px solid black; }
tr.group { border-top: 1px solid #888; }
p.note { font-size: 85%; color: #333; margin: 0.2em 0; max-width: 70em; }
"""


def html_page(tables: list[Table], title: str) -> str:
    body = "\n".join(html_table(t) for t in tables)
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{HTML_STYLE}</style></head><body><h1>{html.escape(title)}</h1>\n{body}\n"
            "</body></html>\n")


def write_text(path: str | Path, text: str) -> None:
    with atomic_path(path, Path(path).suffix) as tmp:
        tmp.write_text(text)
