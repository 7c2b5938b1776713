"""ICT's readings side by side: what each reading of ICT's reference picks on the base model's
rollouts, beside what the ICT paper reports of its picks (ict_readings .md/.tex/.csv; only when
token_stats.ict_readings is set). From token_stats/size=S/readings.parquet.

Two tables: the picks as the response sees them (its own probability of the token, entropy, ...;
:func:`readings_table`) and as the reference sees them (the group's probability of the picked token
P̄(y), β, the diverged positions; :func:`reference_table`): the paper's "probability 0.18 ± 0.09"
reads either way (docs/science.md)."""

from __future__ import annotations

from pathlib import Path

import polars as pl

from ..config import Config
from ..core.report import reported
from ..core.report.render import MISSING, Table, pct
from .labels import NOT_ICT, size_label
from .load import Loaded
from .registry import register_table
from .write import sources_note, table_files, write_table

ORDER = ("paper", "response_mean", "group_pooled", "group_leave_one_out", "token_id",
         "scope_position", "random10_response", "all_tokens")
"""The rows of a size, in this order (the paper's rule first, the control and every token for
scale last); others after."""
LABELS = {"paper": "ICT (paper's rule)", "random10_response": "random 10% per response (control)",
          "all_tokens": "all tokens (for scale)"}
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
    """A reported number of the paper rule's row: the file's column, else stages.core.report.reported."""
    value = row.get(key)
    return default if value is None else value


def _by_size(cfg: Config, readings: pl.DataFrame):
    """(size, its readings rows in ORDER, possibly none) for every size of the experiment."""
    by_size = {} if readings.is_empty() else {
        size: part.to_dicts() for (size,), part in readings.group_by("size", maintain_order=True)}
    for size in cfg.experiment.sizes:
        yield size, sorted(by_size.get(size, []), key=lambda r: (
            ORDER.index(r["reading"]) if r["reading"] in ORDER else len(ORDER)))


def _spread(row: dict, name: str, *, median: bool = True) -> str:
    """'mean ± sd (median)' of a readings column group (name_mean, name_sd, name_median), two
    decimals; a missing part is left out, a missing mean is MISSING."""
    mean = row.get(f"{name}_mean")
    if mean is None:
        return MISSING
    sd, mid = row.get(f"{name}_sd"), row.get(f"{name}_median")
    return (f"{mean:.2f}" + ("" if sd is None else f" ± {sd:.2f}")
            + ("" if mid is None or not median else f" ({mid:.2f})"))


def readings_table(cfg: Config, readings: pl.DataFrame) -> tuple[Table, pl.DataFrame]:
    ts = cfg.token_stats
    early = ts.early_positions
    columns = ["Size", "Reading", "picks (% of tokens)", "p (mean ± sd)", "max p", "H (nats)",
               "high/low", "at ceiling of u (%)", f"first {early} positions (%)", "end of text (%)",
               REPORTED_LABEL, "p (rep.)", "high/low (rep.)"]
    rows, starts, used = [], [], []
    for size, found in _by_size(cfg, readings):
        starts.append(len(rows))
        if not found:
            rows.append([size_label(cfg, size)] + [MISSING] * (len(columns) - 1))
            continue
        for i, r in enumerate(found):
            paper = r["reading"] == "paper"
            prob = _spread(r, "prob", median=False)
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
        f"How to read it: ICT's picks reportedly have probability {mean} ± {sd}. Read as the "
        "response's own probability of the token (p here), every reading misses by far on these "
        "models; read as the group's probability of the picked token at the step, P̄_t(y) (the next "
        "table), it need not. A random 10% per response also gives a high/low ratio near 1 under "
        "a median split, so a ratio near 1 says little on its own. Only the first row of a size is "
        f"ICT's rule; every other reading is ours, labelled '(ours, {NOT_ICT})' (METHODS §3).",
        f"{REPORTED_LABEL[0].upper() + REPORTED_LABEL[1:]} (the last three columns, on the paper "
        f"rule's row only): the ICT paper's selected tokens, probability {mean} ± {sd} and high/low-"
        f"entropy ratio {ratio['GSM8K']} on GSM8K ({ratio['MATH']} on MATH), with its Qwen2.5 models "
        f"and data, not ours: beside our cells, never in them. Source: {reported.ICT_SOURCE}.",
        sources_note(used, "ict_readings.csv"),
    ]


def reference_table(cfg: Config, readings: pl.DataFrame) -> Table:
    """The picks as their reference sees them: the reference's probability of the picked token
    P̄(y) (ICT's: P̄_t(y)), without the token's response, β, and the same at the diverged
    positions, beside the response's own p and the paper's 0.18 ± 0.09."""
    columns = ["Size", "Reading", "reference", "p (mean; median)", "P̄(y) (mean ± sd (median))",
               "P̄(y) without the response", "β (mean (median))", "P̄(y) > β (%)",
               "diverged picks (% of picks)", "diverged: p", "diverged: P̄(y)",
               "diverged: without the response", "diverged: β", "p or P̄(y) (rep.)"]
    rows, starts, used = [], [], []
    rep_mean, rep_sd = reported.ICT_SELECTED_PROB
    for size, found in _by_size(cfg, readings):
        starts.append(len(rows))
        found = [r for r in found if r.get("reference_of") is not None]  # older files: none
        if not found:
            rows.append([size_label(cfg, size)] + [MISSING] * (len(columns) - 1))
            continue
        for i, r in enumerate(found):
            own = r["reference_of"] == r["reading"]
            rows.append([
                size_label(cfg, size) if i == 0 else "", reading_label(r["reading"], r.get("label")),
                "ICT's P̄_t" if r["reference_of"] == "paper" else (
                    "its own" if own else f"{r['reference_of']}'s"),
                _num(r, "prob_mean", lambda v, r=r: f"{v:.2f}" + (
                    "" if r.get("prob_median") is None else f"; {r['prob_median']:.2f}")),
                _spread(r, "ref_prob"), _spread(r, "ref_prob_out"),
                _num(r, "beta_mean", lambda v, r=r: f"{v:.2f}" + (
                    "" if r.get("beta_median") is None else f" ({r['beta_median']:.2f})")),
                _num(r, "above_beta_share", pct),
                _num(r, "diverged_picks", lambda v, r=r: f"{v:,}" + (
                    "" if r.get("diverged_share") is None else f" ({pct(r['diverged_share'])}%)")),
                _spread(r, "diverged_prob"), _spread(r, "diverged_ref_prob"),
                _spread(r, "diverged_ref_prob_out"), _spread(r, "diverged_beta", median=False),
                f"{rep_mean:.2f} ± {rep_sd:.2f}" if r["reading"] == "paper" else MISSING,
            ])
            used.append(r["source"])
    notes = [
        "Ours: the picks of each reading (as in the previous table) seen from a reference, the "
        "mean distribution the reading's u compares a position with: ICT's P̄_t, the group's mean "
        "at the step; the readings' own (the response's mean, the group's pooled mean, the "
        "group-step mean of the other responses). 'reference' says whose: the token_id and "
        "scope_position readings, the random control and all tokens have none of their own and "
        "use ICT's (readings.parquet's reference_of). p: the response's own probability of the "
        "token it sampled. P̄(y): the reference's probability of that token (mean ± sample sd "
        "(median)); without the response: the same mean with the token's response left out "
        "(at a step, the other active responses; none for the response's own mean; picks alone "
        "at their step have none and are left out). β = Σ_a P̄(a)², the reference's collision "
        "probability; P̄(y) > β: the share of picks above it (in the paper's theory, read with "
        "π = P̄, raising such a token's logit lowers the Rényi-2 entropy). Diverged: picks at "
        "positions whose response prefix no other response of the group active at the step shares "
        "(there P̄_t(y) = p(y)/n_t + the others' share); the diverged columns restrict the picks "
        "to them.",
        f"How to read it: ICT's paper reports its picks' probability as {rep_mean} ± {rep_sd}, "
        "without saying whose (last column, on ICT's row only: it may be p, as in the previous "
        "table, or P̄(y)). A token that no other response active at the step gives any "
        "probability has P̄_t(y) = p(y)/n_t, 1/8 of its own p with n_t = 8; one that another "
        "response gives probability q has (p(y) + q)/n_t. In a group whose responses diverge "
        "early, as long chains of thought do, even confident picks then have P̄_t(y) near 1/8 to "
        "2/8 while their own p stays high; the diverged columns show how much of this table's "
        "numbers comes from such positions. "
        f"Source: {reported.ICT_SOURCE}.",
        sources_note(used, "ict_readings.csv"),
    ]
    return Table("ICT's readings: the reference's probability of the picked token (P̄(y)), its β, "
                 "and the diverged positions", columns, rows, None, starts, notes,
                 align="lll" + "r" * 11)


@register_table("ict_readings", order=44, files=lambda cfg: table_files("ict_readings"),
                applies=lambda cfg: cfg.token_stats.ict_readings)
def write_ict_readings(cfg: Config, data: Loaded, folder: Path) -> list[Table]:
    table, frame = readings_table(cfg, data.readings)
    second = reference_table(cfg, data.readings)
    write_table([(table, "tab:ict-readings"), (second, "tab:ict-readings-reference")], frame,
                folder / "ict_readings")
    return [table, second]
