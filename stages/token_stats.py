"""Stage 3b: exact per-token statistics of base-model rollouts, and what each selector would pick.

    python -m stages.token_stats --config CFG --size NAME --model .../base.json \
        --rollouts results/<run>/rollouts/size=NAME/rollouts.parquet \
        --out-dir results/<run>/token_stats/size=NAME

Every rollout is teacher-forced through the model (in token_stats.dtype) at the rollout
temperature, exactly as the trainer scores it (stages.core.scoring), and the statistics come from
stages.core.stats. The hidden states stay on the CPU; the statistics move them to the head's
device block by block. `ict_u` is ICT's uniqueness u_{i,t} = JSD(p_{i,t} ‖ P̄_t), the groups being
the responses of one problem_id and t the response position (METHODS §3). The whole file is one
selection scope: `jsd` is the deviation from the file's mean distribution (computed, and non-null,
only when a reported selector needs it) and the `sel_*` columns are the tokens each selector would
update, with the experiment's parameters.
"""

from __future__ import annotations

import itertools
from collections import Counter
from pathlib import Path

import polars as pl
import pyarrow as pa
import torch

from . import cli
from .config import Config, ConfigError
from .core import plots
from .core.io import ArtifactError, provenance, read_parquet, write_json, write_parquet
from .core.losses import group_advantages
from .core.modeling import load_model_and_tokenizer
from .core.scoring import response_hidden, trunk_and_head
from .core.selectors import (
    SelectionInput,
    grid,
    linear_quantile,
    select_tokens,
    spec_of,
    valid_grid,
)
from .core.stats import chunked_token_statistics, group_step_jsd
from .rollout import ROLLOUT_SCHEMA

STAGE_VERSION = "2"

# The three selectors the stage reports, by the column they fill; parameters are those of the
# first experiment method using that selector, else the selector's registered defaults.
REPORTED = {"entropy20": "entropy_top", "stapo": "stapo", "ict": "ict"}
TOP_TOKENS = 20

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
        pa.field("max_prob", pa.float32(), nullable=False),
        pa.field("advantage", pa.float32(), nullable=False),
        pa.field("sel_entropy20", pa.bool_(), nullable=False),
        pa.field("sel_stapo", pa.bool_(), nullable=False),
        pa.field("sel_ict", pa.bool_(), nullable=False),
    ]
)


def selector_params(cfg: Config, selector: str) -> dict:
    """Parameters of the first experiment method that uses `selector`, else the defaults of the
    selector's registered parameter model (METHODS §3)."""
    for name in cfg.experiment.methods:
        if cfg.methods[name].selector == selector:
            return cfg.methods[name].selector_params()
    return spec_of(selector).validate({}).model_dump()


def reported_params(cfg: Config) -> dict[str, dict]:
    """The parameters of each reported selector, by column."""
    return {col: selector_params(cfg, sel) for col, sel in REPORTED.items()}


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
    _, weight, bias = trunk_and_head(model)
    chunks = {"chunk_positions": ts.chunk_positions, "chunk_vocab": ts.chunk_vocab}
    hidden = response_hidden(model, prompts, responses, tokenizer.pad_token_id,
                             desc="teacher forcing")  # (N, D) on the CPU, model dtype
    token_ids = torch.tensor(list(itertools.chain.from_iterable(responses)))  # (N,)
    stats = chunked_token_statistics(hidden, weight, token_ids, temperature, head_bias=bias,
                                      jsd="jsd" in needed, **chunks)
    # ICT's groups: the responses of one problem; its steps: the response positions
    group = group_index(frame)  # (B,)
    width = max(lengths)
    positions = torch.cat([torch.arange(k) for k in lengths])  # (N,)
    keys = group.repeat_interleave(torch.tensor(lengths)) * width + positions  # (N,)
    ict_u = group_step_jsd(hidden, weight, keys, temperature, head_bias=bias,
                           logsumexp=stats["logsumexp"], **chunks).float().cpu()  # (N,)
    del hidden
    stats = {k: v.float().cpu() for k, v in stats.items()}

    rewards = torch.tensor(frame["reward"].to_list(), dtype=torch.float64)
    adv = group_advantages(rewards, group).float()  # (B,)
    valid = valid_grid(lengths)  # (B, T)
    # exactly what the reported selectors read
    per_token = {**stats, "group_jsd": ict_u, "token_ids": token_ids}
    inp = SelectionInput(valid=valid, **{
        name: adv if name == "advantages" else grid(per_token[name], lengths) for name in needed
    })
    masks = {col: select_tokens(REPORTED[col], inp, **params[col])[valid] for col in REPORTED}

    texts = {i: tokenizer.decode([i]) for i in token_ids.unique().tolist()}
    n = len(token_ids)
    jsd = stats["jsd"].numpy() if "jsd" in stats else [None] * n
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
        "max_prob": stats["max_prob"].numpy(),
        "advantage": adv.repeat_interleave(torch.tensor(lengths)).numpy(),
        **{f"sel_{col}": masks[col].numpy() for col in REPORTED},
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
        **{f"selected_fraction_{col}": float(masks[col].float().mean()) for col in REPORTED},
        **{f"jaccard_{a}_{b}": jaccard(masks[a], masks[b])
           for a, b in itertools.combinations(REPORTED, 2)},
        "top_tokens": {
            col: [[texts[i], c] for i, c in Counter(token_ids[masks[col]].tolist()).most_common(TOP_TOKENS)]
            for col in REPORTED
        },
    }
    return table, summary


def ict_profile(entropy: torch.Tensor, logprob: torch.Tensor, picked: torch.Tensor,
                quantile: float) -> dict:
    """What the ICT paper reports of its picks: the share of high- and low-entropy tokens among
    them (about half each; ratio 1.03 on GSM8K) and their probability (0.18 ± 0.09).

    entropy, logprob, picked (N,) over the file's tokens. High-entropy: H above the `quantile` of
    H over all N tokens (the threshold is ours). sd is the sample standard deviation; a value
    without the tokens it needs is None."""
    threshold = float(linear_quantile(entropy.double(), quantile))
    k = int(picked.sum())
    high = int((entropy[picked] > threshold).sum())
    prob = logprob[picked].double().exp()
    return {
        "high_entropy_quantile": quantile,
        "high_entropy_threshold": threshold,
        "ict_high_entropy_share": high / k if k else None,
        "ict_low_entropy_share": (k - high) / k if k else None,
        "ict_high_low_ratio": high / (k - high) if k - high else None,
        "ict_prob_mean": float(prob.mean()) if k else None,
        "ict_prob_sd": float(prob.std()) if k > 1 else None,
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
    if "group_jsd" in reported_needs(reported_params(cfg))["ict"]:
        check_groups(frame, args.rollouts)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tokenizer = load_model_and_tokenizer(args.model, dtype=getattr(torch, cfg.token_stats.dtype),
                                                device=device)
    vocab_size = model.get_output_embeddings().weight.shape[0]
    check_rollouts(frame, args.rollouts, vocab_size)
    table, summary = compute(cfg, model, tokenizer, frame)
    out_dir = Path(args.out_dir)
    prov = provenance("token_stats", STAGE_VERSION,
                      cfg.section_hash("rollout", "token_stats", "methods", "experiment/methods",
                                       f"models/{args.size}", "seed"),
                      cfg.seed, size=args.size)
    figures(cfg, args.size, table, summary, out_dir, vocab_size)
    write_parquet(table, out_dir / "tokens.parquet", TOKEN_SCHEMA, prov)
    row = {"size": args.size, **{k: summary[k] for k in summary_schema().names if k != "size"}}
    write_parquet([row], out_dir / "summary.parquet", summary_schema(), prov)
    write_json(out_dir / "summary.json", {"size": args.size, **summary, "provenance": prov})
    cli.log.info("%s: %d tokens, H<0.01 %.3f, p80 H %.3f, mean u %.4f, selected: %s", args.size,
                 summary["tokens"], summary["frac_entropy_below_0.01"], summary["entropy_p80"],
                 summary["ict_u_mean"],
                 ", ".join(f"{c} {summary[f'selected_fraction_{c}']:.3f}" for c in REPORTED))


if __name__ == "__main__":
    p = cli.parser(__doc__.splitlines()[0])
    p.add_argument("--size", required=True, help="a key of 'models'")
    p.add_argument("--model", required=True, help="base.json of that size")
    p.add_argument("--rollouts", required=True, help="rollouts Parquet of that size")
    p.add_argument("--out-dir", required=True, help="folder for tokens/summary Parquet and figures")
    cli.run(main, p)
