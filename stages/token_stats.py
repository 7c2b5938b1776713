"""Stage 3b: exact per-token statistics of base-model rollouts, and what each selector would pick.

    python -m stages.token_stats --config CFG --size NAME --model .../base.json \
        --rollouts results/<run>/rollouts/size=NAME/rollouts.parquet \
        --out-dir results/<run>/token_stats/size=NAME

Every rollout is teacher-forced through the model (in token_stats.dtype) at the rollout
temperature, and the statistics come from stages.core.statistics.stats, streamed group by group
(stages.core.statistics.scoring.stream_statistics): the trunk runs in batches of a token budget without a KV
cache, and one group's hidden states (on the CPU; the statistics move them to the head's device
block by block) exist at a time; `jsd` takes a second pass. `ict_u` is ICT's uniqueness
u_{i,t} = JSD(p_{i,t} ‖ P̄_t), the groups being the responses of one problem_id and t the
response position (METHODS §3). The whole file is one selection scope: `jsd` is the deviation
from the file's mean distribution (computed, and non-null, only when a reported selector or the
readings need it) and the `sel_*` columns are the tokens each selector would update, with the
experiment's parameters.

With token_stats.ict_readings (the default) the stage also scores the readings of ICT's reference
that the summaries leave open (ours, labelled, never ICT; METHODS §3): `u_response_mean`,
`u_group_pooled`, `u_group_loo` and their picks `sel_ict_response_mean`, `sel_ict_group_pooled`,
`sel_ict_group_loo` (the top ceil(ρ·T_i) of each response, ρ of the experiment's ICT method), the
picks of our earlier token_id and scope_position readings (`sel_ict_token_id`,
`sel_ict_scope_position`, the file as their scope, by `jsd`), and a random 10% of each response
(`sel_random10_response`, seeded with the config's seed). readings.parquet (and summary.json's
"ict_readings") profiles the picks of every reading beside what the paper reports of its picks
(probability 0.18 ± 0.09, high/low-entropy ratio about 1), and the picks of every token
(`all_tokens`) for scale. Without it the new columns are null and readings.parquet holds the paper's
rule alone.

The probability the paper reports can be read two ways (docs/science.md): the response's own
probability of its token p_{i,t}(y_{i,t}) (prob_*), or the group's, P̄_t(y_{i,t}) (ref_prob_*). So
every row also profiles its reference at the picks, computed in the same pass over the vocabulary
as u (stages.core.statistics.stats.group_step_reference, float64): the reference's probability of the picked
token (ref_prob_*), the same with the token's response left out of the mean (ref_prob_out_*), the
reference's β = Σ_a P̄(a)² (beta_*), and the same restricted to the picks at diverged positions
(whose response prefix no other active response of the group shares; diverged_*). A reading
without a reference of its own (token_id, scope_position, the random control, all tokens) is
profiled against the paper rule's: reference_of says whose. tokens.parquet holds the paper rule's
per token (ict_ref_prob, ict_ref_prob_out, ict_ref_beta) and `diverged`.

Over 600 lines: one stage, which computes the statistics once and then derives from the same
tensors every selector's picks, each reading's profile and the summary; its pieces are the
summary's columns, and the computation they share lives in stages.core.statistics.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from pathlib import Path

import polars as pl
import pyarrow as pa
import torch

from . import cli
from .config import Config, ConfigError
from .core.common import timing
from .core.common.io import ArtifactError, provenance, read_parquet, write_json, write_parquet
from .core.models.modeling import load_model_and_tokenizer
from .core.report import plots
from .core.report.reported import ICT_HIGH_LOW_RATIO, ICT_SELECTED_PROB, ICT_SOURCE
from .core.statistics.ceiling import CEILING_RTOL
from .core.statistics.scorer import DEVIATIONS, reference_key, self_weight, without_response
from .core.statistics.scoring import stream_statistics
from .core.statistics.stats import REFERENCE_FIELDS, at_ceiling, diverged_positions
from .core.training.losses import group_advantages
from .core.training.selectors import (
    ICT_LABELS,
    ICT_SCORES,
    ICT_VARIANTS,
    SelectionInput,
    grid,
    linear_quantile,
    select_tokens,
    spec_of,
    valid_grid,
)
from .keys import (  # noqa: F401  (re-exported)
    REPORTED,
    STAGE_VERSIONS,
    reported_params,
    selector_params,
    token_stats_config_hash,
)
from .rollout import ROLLOUT_SCHEMA

STAGE_VERSION = STAGE_VERSIONS["token_stats"]

TOP_TOKENS = 20
# The readings of ICT's reference beside the paper's rule (ours, never ICT), by variant: the
# statistic each ranks by (its u column: u_<statistic without _jsd>).
READINGS = {v: stat for v, stat in ICT_SCORES.items() if v != "paper"}
RANDOM_CONTROL = "random10_response"
RANDOM_CONTROL_RHO = 0.1  # the paper's "random 10%" control, drawn per response like ICT's picks
RANDOM_CONTROL_LABEL = "random 10% per response (control)"
ALL_TOKENS = "all_tokens"
ALL_TOKENS_LABEL = "all tokens (for scale)"
SPREAD = ("mean", "sd", "median")
"""How a value is summarised over the picks: mean, sample sd, median (linear interpolation)."""
REFERENCE_VALUES = ("ref_prob", "ref_prob_out", "beta")
"""The reference's values at the picks (reference_profile): P̄(y), P̄(y) without the token's
response, β = Σ_a P̄(a)²."""
DIVERGED_VALUES = ("prob", *REFERENCE_VALUES)
"""The values summarised again over the picks at diverged positions (diverged_<value>_<spread>)."""
PICK_COLUMNS = {
    **{v: f"sel_ict_{stat.removesuffix('_jsd')}" for v, stat in READINGS.items()},
    "token_id": "sel_ict_token_id",
    "scope_position": "sel_ict_scope_position",
    RANDOM_CONTROL: f"sel_{RANDOM_CONTROL}",
}
"""The token table's column of each reading's picks but the paper rule's (sel_ict)."""


def u_column(statistic: str) -> str:
    """response_mean_jsd -> u_response_mean: the token table's column of a reading's u."""
    return "u_" + statistic.removesuffix("_jsd")


TOKEN_SCHEMA = pa.schema(
    [
        pa.field("sample_id", pa.string(), nullable=False),
        pa.field("position", pa.int32(), nullable=False),
        pa.field("token_id", pa.int32(), nullable=False),
        pa.field("token", pa.string(), nullable=False),
        pa.field("logprob", pa.float32(), nullable=False),
        pa.field("entropy", pa.float32(), nullable=False),
        pa.field("renyi2", pa.float32(), nullable=False),
        pa.field("jsd", pa.float32(), nullable=True),  # null unless a reported selector needs it
        pa.field("ict_u", pa.float32(), nullable=False),
        # the paper rule's reference at the token: P̄_t(y), the same without the token's response
        # (null where no other response is active at the step), β = Σ_a P̄_t(a)²
        pa.field("ict_ref_prob", pa.float32(), nullable=False),
        pa.field("ict_ref_prob_out", pa.float32(), nullable=True),
        pa.field("ict_ref_beta", pa.float32(), nullable=False),
        pa.field("diverged", pa.bool_(), nullable=False),  # no other active response shares its prefix
        # the readings' deviations and picks: null unless token_stats.ict_readings
        *[pa.field(u_column(s), pa.float32(), nullable=True) for s in READINGS.values()],
        pa.field("max_prob", pa.float32(), nullable=False),
        pa.field("advantage", pa.float32(), nullable=False),
        pa.field("sel_entropy20", pa.bool_(), nullable=False),
        pa.field("sel_stapo", pa.bool_(), nullable=False),
        pa.field("sel_ict", pa.bool_(), nullable=False),
        *[pa.field(column, pa.bool_(), nullable=True) for column in PICK_COLUMNS.values()],
    ]
)

READINGS_SCHEMA = pa.schema(
    [
        pa.field("reading", pa.string(), nullable=False),  # an ict variant, or random10_response
        pa.field("label", pa.string(), nullable=False),  # only the paper's rule is called ICT
        pa.field("rho", pa.float64(), nullable=False),
        pa.field("picks", pa.int64(), nullable=False),
        pa.field("picks_share", pa.float64(), nullable=False),  # of the file's tokens
        pa.field("prob_mean", pa.float64(), nullable=True),  # p of the sampled token
        pa.field("prob_sd", pa.float64(), nullable=True),  # sample sd
        pa.field("prob_median", pa.float64(), nullable=True),
        pa.field("max_prob_mean", pa.float64(), nullable=True),
        pa.field("entropy_mean", pa.float64(), nullable=True),  # nats
        pa.field("high_low_ratio", pa.float64(), nullable=True),  # high- / low-entropy picks
        pa.field("high_share", pa.float64(), nullable=True),
        # whose u and reference the ceiling share uses: the reading's own, or the paper rule's
        # (for the random control and the token_id and scope_position readings)
        pa.field("ceiling_of", pa.string(), nullable=False),
        pa.field("ceiling_share", pa.float64(), nullable=True),  # u ≥ c(w)·(1 − 1e-3)
        pa.field("early_share", pa.float64(), nullable=True),  # among the first early_positions
        pa.field("eot_share", pa.float64(), nullable=True),  # a stopped response's last token
        # the reference at the picks (reference_profile): the reading's own, or the paper rule's
        pa.field("reference_of", pa.string(), nullable=False),
        *[pa.field(f"{value}_{stat}", pa.float64(), nullable=True)
          for value in REFERENCE_VALUES for stat in SPREAD],
        pa.field("ref_prob_out_picks", pa.int64(), nullable=False),  # picks with such a reference
        pa.field("above_beta_share", pa.float64(), nullable=True),  # P̄(y) > β
        pa.field("diverged_picks", pa.int64(), nullable=False),
        pa.field("diverged_share", pa.float64(), nullable=True),  # of the picks
        *[pa.field(f"diverged_{value}_{stat}", pa.float64(), nullable=True)
          for value in DIVERGED_VALUES for stat in SPREAD],
        # what the paper reports of its picks, on the paper rule's row only
        pa.field("reported_prob_mean", pa.float64(), nullable=True),
        pa.field("reported_prob_sd", pa.float64(), nullable=True),
        pa.field("reported_high_low_ratio", pa.float64(), nullable=True),  # GSM8K
        pa.field("reported_high_low_ratio_math", pa.float64(), nullable=True),
        pa.field("reported_source", pa.string(), nullable=True),
    ]
)


def reported_needs(params: dict[str, dict]) -> dict[str, frozenset[str]]:
    """The SelectionInput fields each reported selector reads with its parameters, by column."""
    return {col: spec_of(sel).needs(spec_of(sel).validate(params[col])) for col, sel in REPORTED.items()}


def check_groups(frame: pl.DataFrame, path: str) -> None:
    """Every problem has ≥ 2 responses: ICT's group-step reference P̄_t is a mean over a group."""
    sizes = frame.group_by("problem_id", maintain_order=True).len()
    small = sizes.filter(pl.col("len") < 2)
    if small.height:
        problem, k = small.row(0)
        raise ArtifactError(
            f"{path}: problem_id {problem!r} has {k} response(s); ICT scores each response against "
            "its group's mean at the same step and needs at least 2 responses per problem "
            "(rollout.n >= 2)"
        )


def group_index(frame: pl.DataFrame) -> torch.Tensor:
    """(B,) int64: the index of each response's group (its problem_id), 0 .. groups - 1."""
    return torch.tensor((frame["problem_id"].rank("dense").cast(pl.Int64) - 1).to_list())


def check_rollouts(frame: pl.DataFrame, path: str, vocab_size: int) -> None:
    if frame.height == 0:
        raise ArtifactError(f"{path}: the rollout file is empty")
    lengths = frame["response_token_ids"].list.len()
    if int(lengths.min()) == 0:
        raise ArtifactError(f"{path}: a response has no tokens (sample {frame['sample_id'][int(lengths.arg_min())]})")
    for column in ("prompt_token_ids", "response_token_ids"):
        ids = frame[column].explode()
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= vocab_size:
            raise ArtifactError(
                f"{path}: column {column!r} holds token id {hi if hi >= vocab_size else lo}, outside "
                f"the model's vocabulary [0, {vocab_size}): rollouts of another model?"
            )


def jaccard(a: torch.Tensor, b: torch.Tensor) -> float:
    union = int((a | b).sum())
    return int((a & b).sum()) / union if union else 1.0


def compute(cfg: Config, model, tokenizer, frame: pl.DataFrame) -> tuple[pl.DataFrame, dict]:
    """The per-token table and the summary of one rollout file."""
    temperature = cfg.rollout.temperature
    ts = cfg.token_stats
    params = reported_params(cfg)
    needs = reported_needs(params)
    needed = frozenset().union(*needs.values())
    prompts = frame["prompt_token_ids"].to_list()
    responses = frame["response_token_ids"].to_list()
    lengths = [len(r) for r in responses]
    token_ids = torch.tensor(list(itertools.chain.from_iterable(responses)))  # (N,)
    readings = ts.ict_readings
    # the readings rank by their deviations, and token_id and scope_position by jsd
    reading_needs = {"group_jsd"} | ({*READINGS.values(), "jsd", "token_ids"} if readings else set())
    wanted = needed | reading_needs
    # ICT's groups: the responses of one problem; its steps: the response positions
    group = group_index(frame)  # (B,)
    groups = group.tolist()
    # group by group: one group's hidden states at a time (a second pass when jsd is wanted)
    scored = stream_statistics(model, prompts, responses, groups, tokenizer.pad_token_id,
                               temperature, wanted, chunk_positions=ts.chunk_positions,
                               chunk_vocab=ts.chunk_vocab, batch_tokens=ts.batch_tokens,
                               references=True, desc="teacher forcing")
    # (N,) in the compute dtype (float64 for a float64 model), as ranked
    deviations = {name: scored.pop(name) for name in DEVIATIONS if name in scored}
    # (N,) float64: each deviation's reference at the token (stats.REFERENCE_FIELDS)
    refs = {name: {f: scored.pop(reference_key(name, f)) for f in REFERENCE_FIELDS}
            for name in deviations}
    references = reading_references(refs)
    diverged = diverged_positions(responses, frame["problem_id"].to_list())  # (N,)
    stats = scored
    # what the selectors rank: the compute dtype, so that a float64 run ranks float64 values
    per_token = {**stats, **deviations, "token_ids": token_ids}
    stats = {k: v.float() for k, v in stats.items()}
    ict_u = deviations["group_jsd"].float()
    positions = torch.cat([torch.arange(k) for k in lengths])  # (N,)

    rewards = torch.tensor(frame["reward"].to_list(), dtype=torch.float64)
    adv = group_advantages(rewards, group).float()  # (B,)
    valid = valid_grid(lengths)  # (B, T)
    # exactly what the reported selectors and the readings read
    inp = SelectionInput(valid=valid, **{
        name: adv if name == "advantages" else grid(per_token[name], lengths) for name in wanted
    })
    masks = {col: select_tokens(REPORTED[col], inp, **params[col])[valid] for col in REPORTED}
    rho = params["ict"]["rho"]
    picks = reading_picks(inp, rho, readings, cfg.seed)
    finished = [r == "stop" for r in frame["finish_reason"].to_list()]
    rows = readings_rows(picks, stats, deviations, groups, lengths, finished, rho,
                         quantile=ts.high_entropy_quantile, early_positions=ts.early_positions,
                         references=references, diverged=diverged)

    texts = {i: tokenizer.decode([i]) for i in token_ids.unique().tolist()}
    n = len(token_ids)
    jsd = stats["jsd"].numpy() if "jsd" in stats else [None] * n

    def nullable(values: torch.Tensor | None, name: str, dtype) -> pl.Series:
        return pl.Series(name, [None] * n if values is None else values.numpy(), dtype=dtype)

    paper_ref = references["paper"]

    table = pl.DataFrame({
        "sample_id": [s for s, k in zip(frame["sample_id"], lengths, strict=True) for _ in range(k)],
        "position": positions.numpy(),
        "token_id": token_ids.numpy(),
        "token": [texts[i] for i in token_ids.tolist()],
        "logprob": stats["logprob"].numpy(),
        "entropy": stats["entropy"].numpy(),
        "renyi2": stats["renyi2"].numpy(),
        "jsd": pl.Series("jsd", jsd, dtype=pl.Float32),
        "ict_u": ict_u.numpy(),
        "ict_ref_prob": paper_ref["ref_prob"].float().numpy(),
        # NaN (no other response active at the step) is written as null
        "ict_ref_prob_out": pl.Series("ict_ref_prob_out", paper_ref["ref_prob_out"].float().numpy(),
                                      dtype=pl.Float32, nan_to_null=True),
        "ict_ref_beta": paper_ref["beta"].float().numpy(),
        "diverged": diverged.numpy(),
        **{u_column(s): nullable(deviations[s].float() if s in deviations else None, u_column(s),
                                 pl.Float32)
           for s in READINGS.values()},
        "max_prob": stats["max_prob"].numpy(),
        "advantage": adv.repeat_interleave(torch.tensor(lengths)).numpy(),
        **{f"sel_{col}": masks[col].numpy() for col in REPORTED},
        **{column: nullable(picks.get(name), column, pl.Boolean)
           for name, column in PICK_COLUMNS.items()},
    })

    h = stats["entropy"]
    summary = {
        "samples": frame.height,
        "tokens": n,
        "rollout_accuracy": float(frame["correct"].mean()),
        "temperature": temperature,
        "frac_entropy_below_0.01": float((h < 0.01).float().mean()),
        "entropy_p80": float(linear_quantile(h.double(), 0.8)),
        "entropy_mean": float(h.mean()),
        "renyi2_mean": float(stats["renyi2"].mean()),
        "jsd_mean": float(stats["jsd"].mean()) if "jsd" in stats else None,
        "ict_u_mean": float(ict_u.mean()),
        "logprob_mean": float(stats["logprob"].mean()),
        **ict_profile(h, stats["logprob"], masks["ict"], ts.high_entropy_quantile),
        "selector_params": params,
        "ict_readings": rows,
        "ict_readings_params": {"rho": rho, "random_rho": RANDOM_CONTROL_RHO, "seed": cfg.seed,
                                "early_positions": ts.early_positions,
                                "ceiling_rtol": CEILING_RTOL},
        **{f"selected_fraction_{col}": float(masks[col].float().mean()) for col in REPORTED},
        **{f"jaccard_{a}_{b}": jaccard(masks[a], masks[b])
           for a, b in itertools.combinations(REPORTED, 2)},
        "top_tokens": {
            col: [[texts[i], c] for i, c in Counter(token_ids[masks[col]].tolist()).most_common(TOP_TOKENS)]
            for col in REPORTED
        },
    }
    return table, summary


def reading_picks(inp: SelectionInput, rho: float, readings: bool, seed: int) -> dict[str, torch.Tensor]:
    """(N,) picks of every ICT variant (the paper's rule alone without `readings`) at ρ, of a
    random RANDOM_CONTROL_RHO of each response seeded with `seed`, and every token (ALL_TOKENS,
    for scale), by reading name."""
    valid = inp.valid
    picks = {v: select_tokens("ict", inp, rho=rho, variant=v)[valid]
             for v in (ICT_VARIANTS if readings else ("paper",))}
    if readings:
        picks[RANDOM_CONTROL] = select_tokens("random", inp, rho=RANDOM_CONTROL_RHO,
                                              scope="response", seed=seed)[valid]
        picks[ALL_TOKENS] = valid[valid]
    return picks


def reading_references(refs: dict[str, dict[str, torch.Tensor]]) -> dict[str, dict[str, torch.Tensor]]:
    """REFERENCE_VALUES (N,) float64 of each per-response ICT variant whose deviation was scored,
    by variant: its reference's probability of the token (ref_prob), the same with the token's
    response left out (ref_prob_out; scorer.without_response) and β. refs: the deviations'
    stats.REFERENCE_FIELDS by statistic."""
    return {variant: {"ref_prob": refs[stat]["prob"], "ref_prob_out": without_response(stat, refs),
                      "beta": refs[stat]["beta"]}
            for variant, stat in ICT_SCORES.items() if stat in refs}


def readings_rows(picks: dict[str, torch.Tensor], stats: dict[str, torch.Tensor],
                  deviations: dict[str, torch.Tensor], groups: list[int], lengths: list[int],
                  finished: list[bool], rho: float, *, quantile: float, early_positions: int,
                  references: dict[str, dict[str, torch.Tensor]],
                  diverged: torch.Tensor) -> list[dict]:
    """One READINGS_SCHEMA row per reading of `picks` ((N,) bool each).

    stats: the file's per-token entropy, logprob, max_prob (N,); deviations: u (N,) by
    statistic (group_jsd always, the readings' when scored); finished (B,): the response ended
    on its stop token (finish_reason 'stop'); references: REFERENCE_VALUES (N,) by variant
    (reading_references; the paper's always); diverged (N,) bool (stats.diverged_positions).
    High-entropy: H above the `quantile` of H over the file; early: among a response's first
    `early_positions`. The ceiling share and the reference profile of a reading use its own u,
    reference weight and reference; the random control, all tokens and the token_id and
    scope_position readings, which have no reference of their own, use the paper rule's
    (ceiling_of and reference_of say which)."""
    threshold = float(linear_quantile(stats["entropy"].double(), quantile))
    sizes = torch.tensor(lengths)
    positions = torch.cat([torch.arange(k) for k in lengths])  # (N,)
    eot = (positions == sizes.repeat_interleave(sizes) - 1) & torch.tensor(
        finished, dtype=torch.bool).repeat_interleave(sizes)  # (N,) a stopped response's end
    ceilings = {v: at_ceiling(deviations[s], self_weight(s, groups, lengths))
                for v, s in ICT_SCORES.items() if s in deviations}
    prob = stats["logprob"].double().exp()
    labels = {**ICT_LABELS, RANDOM_CONTROL: RANDOM_CONTROL_LABEL, ALL_TOKENS: ALL_TOKENS_LABEL}
    rhos = {RANDOM_CONTROL: RANDOM_CONTROL_RHO, ALL_TOKENS: 1.0}
    return [
        {"reading": name,
         "label": labels[name],
         "rho": rhos.get(name, rho),
         **pick_profile(picked, prob, stats["max_prob"], stats["entropy"], threshold,
                        ceiling=ceilings.get(name, ceilings["paper"]),
                        early=positions < early_positions, eot=eot),
         "ceiling_of": name if name in ceilings else "paper",
         "reference_of": name if name in references else "paper",
         **reference_profile(picked, prob, references.get(name, references["paper"]), diverged),
         **reported_columns(name)}
        for name, picked in picks.items()
    ]


def pick_profile(picked: torch.Tensor, prob: torch.Tensor, max_prob: torch.Tensor | None,
                 entropy: torch.Tensor, threshold: float, *, ceiling: torch.Tensor | None = None,
                 early: torch.Tensor | None = None, eot: torch.Tensor | None = None) -> dict:
    """What the picks of a rule look like, for comparison with what ICT's paper reports of its
    own (probability 0.18 ± 0.09; about half high-, half low-entropy).

    All (N,) over the file's tokens: picked (bool), prob (p of the sampled token), max_prob,
    entropy (nats), and the bool properties whose share among the picks is reported: ceiling
    (u at its ceiling), early (among a response's first positions), eot (a stopped response's
    final token). High-entropy: H > threshold. sd is the sample standard deviation; a value
    without the picks it needs is None (no high/low ratio without a low-entropy pick)."""
    k = int(picked.sum())
    high = int((entropy[picked] > threshold).sum())

    def share(flags: torch.Tensor | None) -> float | None:
        return int((flags & picked).sum()) / k if k and flags is not None else None

    def mean(values: torch.Tensor | None) -> float | None:
        return float(values[picked].double().mean()) if k and values is not None else None

    return {
        "picks": k,
        "picks_share": k / picked.numel() if picked.numel() else 0.0,
        **spread("prob", prob, picked),
        "max_prob_mean": mean(max_prob),
        "entropy_mean": mean(entropy),
        "high_low_ratio": high / (k - high) if k - high else None,
        "high_share": high / k if k else None,
        "ceiling_share": share(ceiling),
        "early_share": share(early),
        "eot_share": share(eot),
    }


def spread(name: str, values: torch.Tensor, where: torch.Tensor) -> dict[str, float | None]:
    """{name}_mean, {name}_sd (sample sd) and {name}_median (linear) of values (N,) at the
    positions `where` (N,) bool, over the finite ones (NaN: no such value there); None without
    the values a statistic needs (two for the sd)."""
    chosen = values[where].double()
    chosen = chosen[torch.isfinite(chosen)]
    n = chosen.numel()
    return {f"{name}_mean": float(chosen.mean()) if n else None,
            f"{name}_sd": float(chosen.std()) if n > 1 else None,
            f"{name}_median": float(linear_quantile(chosen, 0.5)) if n else None}


def reference_profile(picked: torch.Tensor, prob: torch.Tensor, reference: dict[str, torch.Tensor],
                      diverged: torch.Tensor) -> dict:
    """The picks seen from a reference, for the second reading of ICT's reported probability
    (P̄_t(y), the group's probability of the picked token, not the response's own; METHODS §10).

    All (N,): picked and diverged bool, prob the response's own p(y), reference the
    REFERENCE_VALUES (float64; ref_prob_out NaN where the response's removal leaves no
    reference). Every value is summarised by spread() over the picks, and again (with the own
    p) over the picks at diverged positions; ref_prob_out_picks counts the picks that have a
    reference without their response; above_beta_share is the share of picks whose P̄(y)
    exceeds the reference's β (the side on which raising the token's logit lowers the
    reference's Rényi-2 entropy, in the paper's theory read with π = P̄)."""
    k = int(picked.sum())
    at = picked & diverged
    d = int(at.sum())
    ref_prob, beta = reference["ref_prob"], reference["beta"]
    return {
        **{key: value for name in REFERENCE_VALUES
           for key, value in spread(name, reference[name], picked).items()},
        "ref_prob_out_picks": int(torch.isfinite(reference["ref_prob_out"][picked]).sum()),
        "above_beta_share": int((ref_prob[picked] > beta[picked]).sum()) / k if k else None,
        "diverged_picks": d,
        "diverged_share": d / k if k else None,
        **{key: value for name in DIVERGED_VALUES
           for key, value in spread(f"diverged_{name}",
                                    prob if name == "prob" else reference[name], at).items()},
    }


def reported_columns(reading: str) -> dict:
    """The reported_* columns of a readings row: what ICT's paper reports of its picks, on the
    paper rule's row only (stages.core.report.reported)."""
    mine = reading == "paper"
    prob_mean, prob_sd = ICT_SELECTED_PROB
    return {
        "reported_prob_mean": prob_mean if mine else None,
        "reported_prob_sd": prob_sd if mine else None,
        "reported_high_low_ratio": ICT_HIGH_LOW_RATIO["GSM8K"] if mine else None,
        "reported_high_low_ratio_math": ICT_HIGH_LOW_RATIO["MATH"] if mine else None,
        "reported_source": (f"{ICT_SOURCE}: selected tokens' probability {prob_mean} ± {prob_sd}; "
                            f"high/low-entropy ratio {ICT_HIGH_LOW_RATIO['GSM8K']} (GSM8K), "
                            f"{ICT_HIGH_LOW_RATIO['MATH']} (MATH)") if mine else None,
    }


def ict_profile(entropy: torch.Tensor, logprob: torch.Tensor, picked: torch.Tensor,
                quantile: float) -> dict:
    """What the ICT paper reports of its picks: the share of high- and low-entropy tokens among
    them (about half each; ratio 1.03 on GSM8K) and their probability (0.18 ± 0.09).

    entropy, logprob, picked (N,) over the file's tokens. High-entropy: H above the `quantile` of
    H over all N tokens (the threshold is ours). sd is the sample standard deviation; a value
    without the tokens it needs is None."""
    threshold = float(linear_quantile(entropy.double(), quantile))
    prof = pick_profile(picked, logprob.double().exp(), None, entropy, threshold)
    high = prof["high_share"]
    return {
        "high_entropy_quantile": quantile,
        "high_entropy_threshold": threshold,
        "ict_high_entropy_share": high,
        "ict_low_entropy_share": None if high is None else 1.0 - high,
        "ict_high_low_ratio": prof["high_low_ratio"],
        "ict_prob_mean": prof["prob_mean"],
        "ict_prob_sd": prof["prob_sd"],
    }


SUMMARY_SCALARS = ["samples", "tokens", "rollout_accuracy", "temperature", "frac_entropy_below_0.01",
                   "entropy_p80", "entropy_mean", "renyi2_mean", "jsd_mean", "ict_u_mean",
                   "logprob_mean", "high_entropy_quantile", "high_entropy_threshold",
                   "ict_high_entropy_share", "ict_low_entropy_share", "ict_high_low_ratio",
                   "ict_prob_mean", "ict_prob_sd"]
NULLABLE = {"jsd_mean", "ict_high_entropy_share", "ict_low_entropy_share", "ict_high_low_ratio",
            "ict_prob_mean", "ict_prob_sd"}


def summary_schema() -> pa.Schema:
    fields = [pa.field("size", pa.string(), nullable=False)]
    for key in SUMMARY_SCALARS:
        kind = pa.int64() if key in ("samples", "tokens") else pa.float64()
        fields.append(pa.field(key, kind, nullable=key in NULLABLE))
    fields += [pa.field(f"selected_fraction_{c}", pa.float64(), nullable=False) for c in REPORTED]
    fields += [pa.field(f"jaccard_{a}_{b}", pa.float64(), nullable=False)
               for a, b in itertools.combinations(REPORTED, 2)]
    return pa.schema(fields)


def figures(cfg: Config, size: str, table: pl.DataFrame, summary: dict, out_dir: Path,
            vocab_size: int) -> None:
    label = cfg.models[size].label or size
    plots.entropy_histogram({label: table["entropy"].to_list()}, out_dir / "entropy_hist.png",
                            vocab_size, title=f"Token entropy of {label}'s rollouts")
    plots.top_tokens({c: [(t, k) for t, k in rows] for c, rows in summary["top_tokens"].items()},
                     out_dir / "top_tokens.png")
    # a few responses, correct and incorrect, shaded by entropy
    first = table.group_by("sample_id", maintain_order=True).agg(pl.all()).head(8)
    keys = ("text", "entropy", "jsd", "logprob", "ict_u", "sel_entropy20", "sel_stapo", "sel_ict")
    samples = []
    for row in first.iter_rows(named=True):
        toks = [{k: x for k, x in zip(keys, v, strict=True) if x is not None}  # jsd may be null
                for v in zip(row["token"], row["entropy"], row["jsd"], row["logprob"], row["ict_u"],
                             row["sel_entropy20"], row["sel_stapo"], row["sel_ict"], strict=True)]
        samples.append({"header": f"{row['sample_id']} (advantage {row['advantage'][0]:+.2f})",
                        "tokens": toks})
    top = max(float(table["entropy"].max()), 1e-6)
    plots.token_page(samples, out_dir / "tokens.html", top, f"Token statistics of {label}")


def main(args, cfg: Config) -> None:
    if args.size not in cfg.models:
        raise ConfigError(f"--size {args.size!r}: not a key of 'models' ({sorted(cfg.models)})")
    frame = read_parquet(args.rollouts, ROLLOUT_SCHEMA)
    group_needs = {"group_jsd", "group_pooled_jsd", "group_loo_jsd"}
    if cfg.token_stats.ict_readings or group_needs & reported_needs(reported_params(cfg))["ict"]:
        check_groups(frame, args.rollouts)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tokenizer = load_model_and_tokenizer(args.model, dtype=getattr(torch, cfg.token_stats.dtype),
                                                device=device)
    vocab_size = model.get_output_embeddings().weight.shape[0]
    check_rollouts(frame, args.rollouts, vocab_size)
    clock = time.perf_counter()
    table, summary = compute(cfg, model, tokenizer, frame)
    timing.add(statistics_s=time.perf_counter() - clock, tokens=int(frame['response_token_ids'].list.len().sum()
                                                                     + frame['prompt_token_ids'].list.len().sum()))
    out_dir = Path(args.out_dir)
    prov = provenance("token_stats", STAGE_VERSION,
                      token_stats_config_hash(cfg, args.size),
                      cfg.seed, size=args.size)
    figures(cfg, args.size, table, summary, out_dir, vocab_size)
    write_parquet(table, out_dir / "tokens.parquet", TOKEN_SCHEMA, prov)
    row = {"size": args.size, **{k: summary[k] for k in summary_schema().names if k != "size"}}
    write_parquet([row], out_dir / "summary.parquet", summary_schema(), prov)
    write_parquet(summary["ict_readings"], out_dir / "readings.parquet", READINGS_SCHEMA, prov)
    write_json(out_dir / "summary.json", {"size": args.size, **summary, "provenance": prov})
    cli.log.info("%s: %d tokens, H<0.01 %.3f, p80 H %.3f, mean u %.4f, selected: %s", args.size,
                 summary["tokens"], summary["frac_entropy_below_0.01"], summary["entropy_p80"],
                 summary["ict_u_mean"],
                 ", ".join(f"{c} {summary[f'selected_fraction_{c}']:.3f}" for c in REPORTED))
    for r in summary["ict_readings"]:
        cli.log.info("%s: %d picks, p %s, P̄(y) %s, high/low %s, at the ceiling %s, diverged %s",
                     r["label"], r["picks"], _fmt(r["prob_mean"]) + " ± " + _fmt(r["prob_sd"]),
                     _fmt(r["ref_prob_mean"]) + " ± " + _fmt(r["ref_prob_sd"]),
                     _fmt(r["high_low_ratio"]), _fmt(r["ceiling_share"]),
                     _fmt(r["diverged_share"]))


def _fmt(value: float | None) -> str:
    return "—" if value is None else f"{value:.3f}"


if __name__ == "__main__":
    p = cli.parser(__doc__.splitlines()[0])
    p.add_argument("--size", required=True, help="a key of 'models'")
    p.add_argument("--model", required=True, help="base.json of that size")
    p.add_argument("--rollouts", required=True, help="rollouts Parquet of that size")
    p.add_argument("--out-dir", required=True, help="folder for tokens/summary Parquet and figures")
    cli.run(main, p)
