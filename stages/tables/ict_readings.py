"""ICT's readings side by side: what each reading of ICT's reference picks on the base model's
rollouts, beside what the ICT paper reports of its picks (ict_readings .md/.tex/.csv; only when
token_stats.ict_readings is set). From token_stats/size=S/readings.parquet."""

from __future__ import annotations

from pathlib import Path

import polars as pl

from ..config import Config
from ..core import reported
from ..core.render import MISSING, Table, pct
from .labels import NOT_ICT, size_label
from .load import Loaded
from .registry import register_table
from .write import sources_note, table_files, write_table

ORDER = ("paper", "response_mean", "group_pooled", "group_leave_one_out", "token_id",
         "scope_position", "random10_response")
"""The rows of a size, in this order (the paper's rule first, the control last); others after."""
LABELS = {"paper": "ICT (paper's rule)", "random10_response": "random 10% per response (control)"}
"""Printed names where a file has no label column."""
REPORTED_LABEL = "reported (summaries of ICT)"


def reading_label(reading: str, label: str | None) -> str:
    """The printed name: the file's label (else LABELS, else the name); every reading but the
    paper's rule says it is ours and not ICT."""
    text = label or LABELS.get(reading) or f"{reading} reading"
    if reading == "paper" or NOT_ICT.lower() in text.lower():
        return text
    if text.endswith(")"):  # "random 10% per response (control)" -> "(control; ours, not ICT)"
        return f"{text[:-1]}; ours, {NOT_ICT})"
    return f"{text} (ours, {NOT_ICT})"


def _num(row: dict, key: str, fmt) -> str:
    value = row.get(key)
    return MISSING if value is None else fmt(value)


def _paper(row: dict, key: str, default: float) -> float:
    """A reported number of the paper rule's row: the file's column, else stages.core.reported."""
    value = row.get(key)
    return default if value is None else value


def readings_table(cfg: Config, readings: pl.DataFrame) -> tuple[Table, pl.DataFrame]:
    ts = cfg.token_stats
    early = ts.early_positions
    columns = ["Size", "Reading", "picks (% of tokens)", "p (mean ± sd)", "max p", "H (nats)",
               "high/low", "at ceiling of u (%)", f"first {early} positions (%)", "end of text (%)",
               REPORTED_LABEL, "p (rep.)", "high/low (rep.)"]
    by_size = {} if readings.is_empty() else {
        size: part.to_dicts() for (size,), part in readings.group_by("size", maintain_order=True)}
    rows, starts, used = [], [], []
    for size in cfg.experiment.sizes:
        starts.append(len(rows))
        found = sorted(by_size.get(size, []),
                       key=lambda r: ORDER.index(r["reading"]) if r["reading"] in ORDER else len(ORDER))
        if not found:
            rows.append([size_label(cfg, size)] + [MISSING] * (len(columns) - 1))
            continue
        for i, r in enumerate(found):
            paper = r["reading"] == "paper"
            prob = MISSING if r.get("prob_mean") is None else (
                f"{r['prob_mean']:.2f}" + ("" if r.get("prob_sd") is None else f" ± {r['prob_sd']:.2f}"))
            rep_mean, rep_sd = reported.ICT_SELECTED_PROB
            ratio = reported.ICT_HIGH_LOW_RATIO
            rows.append([
                size_label(cfg, size) if i == 0 else "", reading_label(r["reading"], r.get("label")),
                _num(r, "picks", lambda v, r=r: f"{v:,}" + ("" if r.get("picks_share") is None
                                                            else f" ({pct(r['picks_share'])}%)")),
                prob, _num(r, "max_prob_mean", lambda v: f"{v:.2f}"),
                _num(r, "entropy_mean", lambda v: f"{v:.3f}"),
                _num(r, "high_low_ratio", lambda v: f"{v:.2f}"),
                _num(r, "ceiling_share", pct), _num(r, "early_share", pct), _num(r, "eot_share", pct),
                "ICT's picks, Qwen2.5 (GSM8K; MATH)" if paper else MISSING,
                (f"{_paper(r, 'reported_prob_mean', rep_mean):.2f} ± "
                 f"{_paper(r, 'reported_prob_sd', rep_sd):.2f}") if paper else MISSING,
                (f"{_paper(r, 'reported_high_low_ratio', r.get('reported_ratio') or ratio['GSM8K']):.2f} "
                 f"(GSM8K); {_paper(r, 'reported_high_low_ratio_math', ratio['MATH']):.2f} (MATH)")
                if paper else MISSING,
            ])
            used.append(r["source"])
    notes = _notes(cfg, used)
    t = Table("ICT's readings: what each reading of the reference picks on the base models' rollouts",
              columns, rows, None, starts, notes, align="ll" + "r" * 8 + "lrr")
    frame = readings.join(pl.DataFrame({"size": cfg.experiment.sizes}), on="size", how="right") \
        if not readings.is_empty() else pl.DataFrame({"size": cfg.experiment.sizes})
    return t, frame


def _notes(cfg: Config, used: list[str]) -> list[str]:
    ts = cfg.token_stats
    mean, sd = reported.ICT_SELECTED_PROB
    ratio = reported.ICT_HIGH_LOW_RATIO
    return [
        "Ours: the picks of each reading on each size's base-model rollouts (the token-statistics "
        "stage; ρ of the experiment's ICT method, the random control 10% of each response). picks: "
        "their number and share of the tokens. p: the probability of the sampled token at the picked "
        "positions (mean ± sample sd); max p: the distribution's largest probability there; H: its "
        f"entropy. high/low: picks with H above the q = {ts.high_entropy_quantile:g} quantile of H over "
        "the file's tokens over those below (token_stats.high_entropy_quantile; ours: the paper's "
        "split is not known). At ceiling of u: picks whose u lies at its ceiling (within 1e-3, "
        "relative; readings.parquet's ceiling_of says whose u: the random control and the token_id "
        f"and scope_position readings use the paper rule's). First {ts.early_positions} positions: "
        f"picks among each response's first {ts.early_positions} tokens (token_stats.early_positions). "
        "End of text: a stopped response's last token.",
        "How to read it: the probability is the discriminating figure. ICT's picks reportedly have "
        f"p = {mean} ± {sd}; a random 10% per response also gives a high/low ratio near 1 under a "
        "median split, so a ratio near 1 says little on its own. Only the first row of a size is "
        f"ICT's rule; every other reading is ours, labelled '(ours, {NOT_ICT})' (METHODS §3).",
        f"{REPORTED_LABEL[0].upper() + REPORTED_LABEL[1:]} (the last three columns, on the paper "
        f"rule's row only): the ICT paper's selected tokens, probability {mean} ± {sd} and high/low-"
        f"entropy ratio {ratio['GSM8K']} on GSM8K ({ratio['MATH']} on MATH), with its Qwen2.5 models "
        f"and data, not ours: beside our cells, never in them. Source: {reported.ICT_SOURCE}.",
        sources_note(used, "ict_readings.csv"),
    ]


@register_table("ict_readings", order=44, files=lambda cfg: table_files("ict_readings"),
                applies=lambda cfg: cfg.token_stats.ict_readings)
def write_ict_readings(cfg: Config, data: Loaded, folder: Path) -> list[Table]:
    table, frame = readings_table(cfg, data.readings)
    write_table([(table, "tab:ict-readings")], frame, folder / "ict_readings")
    return [table]
