"""Stage 3b: exact per-token statistics of base-model rollouts, and what each selector would pick.

    python -m stages.token_stats --config CFG --size NAME --model .../base.json \
        --rollouts results/<run>/rollouts/size=NAME/rollouts.parquet \
        --out-dir results/<run>/token_stats/size=NAME

Every rollout is teacher-forced through the model at the rollout temperature, exactly as the
trainer scores it (stages.core.scoring), and the statistics come from stages.core.stats. The
whole file is one selection scope: `jsd` is the deviation from the file's mean distribution and
the `sel_*` columns are the tokens each selector would update.
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
from .core.selectors import SelectionInput, linear_quantile, select_tokens
from .core.stats import chunked_token_statistics, mean_distribution, pooled_id_scores
from .rollout import ROLLOUT_SCHEMA

STAGE_VERSION = "1"

# The three selectors the stage reports, by the column they fill; parameters are METHODS §3's
# defaults unless the experiment's methods configure that selector.
REPORTED = {"entropy20": "entropy_top", "stapo": "stapo", "ict": "ict"}
DEFAULT_PARAMS = {
    "entropy_top": {"rho": 0.2},
    "stapo": {"tau_p": 0.002, "q": 0.75},
    "ict": {"rho": 0.1, "variant": "token_id"},
}
TOP_TOKENS = 10

TOKEN_SCHEMA = pa.schema(
    [
        pa.field("sample_id", pa.string(), nullable=False),
        pa.field("position", pa.int32(), nullable=False),
        pa.field("token_id", pa.int32(), nullable=False),
        pa.field("token", pa.string(), nullable=False),
        pa.field("logprob", pa.float32(), nullable=False),
        pa.field("entropy", pa.float32(), nullable=False),
        pa.field("renyi2", pa.float32(), nullable=False),
        pa.field("jsd", pa.float32(), nullable=False),
        pa.field("max_prob", pa.float32(), nullable=False),
        pa.field("advantage", pa.float32(), nullable=False),
        pa.field("sel_entropy20", pa.bool_(), nullable=False),
        pa.field("sel_stapo", pa.bool_(), nullable=False),
        pa.field("sel_ict", pa.bool_(), nullable=False),
    ]
)


def selector_params(cfg: Config, selector: str) -> dict:
    """Parameters of the first experiment method that uses `selector`, else METHODS' defaults."""
    for name in cfg.experiment.methods:
        if cfg.methods[name].selector == selector:
            return cfg.methods[name].selector_params()
    return dict(DEFAULT_PARAMS[selector])


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


def to_grid(values: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Flat per-token values (N,) → right-padded (B, T) grid (0 where padded)."""
    grid = torch.zeros((len(lengths), max(lengths)), dtype=values.dtype)
    valid = torch.arange(max(lengths))[None, :] < torch.tensor(lengths)[:, None]
    grid[valid] = values
    return grid


def jaccard(a: torch.Tensor, b: torch.Tensor) -> float:
    union = int((a | b).sum())
    return int((a & b).sum()) / union if union else 1.0


def compute(cfg: Config, model, tokenizer, frame: pl.DataFrame) -> tuple[pl.DataFrame, dict]:
    """The per-token table and the summary of one rollout file."""
    temperature = cfg.rollout.temperature
    ts = cfg.token_stats
    prompts = frame["prompt_token_ids"].to_list()
    responses = frame["response_token_ids"].to_list()
    lengths = [len(r) for r in responses]
    _, weight, bias = trunk_and_head(model)
    hidden = response_hidden(model, prompts, responses, tokenizer.pad_token_id,
                             desc="teacher forcing")  # (N, D)
    device = hidden.device
    token_ids = torch.tensor(list(itertools.chain.from_iterable(responses)), device=device)  # (N,)
    stats = chunked_token_statistics(hidden, weight, token_ids, temperature, head_bias=bias,
                                      chunk_positions=ts.chunk_positions,
                                      chunk_vocab=ts.chunk_vocab, jsd=True)
    stats = {k: v.float().cpu() for k, v in stats.items()}

    rewards = torch.tensor(frame["reward"].to_list(), dtype=torch.float64)
    groups = torch.tensor(frame["problem_id"].cast(pl.Categorical).to_physical().to_list())
    adv = group_advantages(rewards, groups).float()  # (B,)
    valid = to_grid(torch.ones(len(token_ids), dtype=torch.bool), lengths)  # (B, T)
    inp = SelectionInput(
        valid=valid,
        entropy=to_grid(stats["entropy"], lengths),
        logprob=to_grid(stats["logprob"], lengths),
        jsd=to_grid(stats["jsd"], lengths),
        token_ids=to_grid(token_ids.cpu(), lengths),
        advantages=adv,
    )
    params = {col: selector_params(cfg, sel) for col, sel in REPORTED.items()}
    if params["ict"].get("variant") == "pooled":
        # pooled scores ids by their mean distribution against the file's p̄ (exact, U × V)
        mean_dist = mean_distribution(hidden, weight, temperature, head_bias=bias,
                                      chunk_positions=ts.chunk_positions, chunk_vocab=ts.chunk_vocab)
        ids, scores = pooled_id_scores(hidden, weight, token_ids, mean_dist, temperature,
                                       head_bias=bias, chunk_positions=ts.chunk_positions,
                                       chunk_vocab=ts.chunk_vocab)
        inp.id_scores = (ids.cpu(), scores.float().cpu())
    masks = {col: select_tokens(REPORTED[col], inp, **params[col])[valid] for col in REPORTED}

    flat_ids = token_ids.cpu()
    texts = {i: tokenizer.decode([i]) for i in flat_ids.unique().tolist()}
    n = len(flat_ids)
    table = pl.DataFrame({
        "sample_id": [s for s, k in zip(frame["sample_id"], lengths, strict=True) for _ in range(k)],
        "position": [t for k in lengths for t in range(k)],
        "token_id": flat_ids.tolist(),
        "token": [texts[i] for i in flat_ids.tolist()],
        "logprob": stats["logprob"].tolist(),
        "entropy": stats["entropy"].tolist(),
        "renyi2": stats["renyi2"].tolist(),
        "jsd": stats["jsd"].tolist(),
        "max_prob": stats["max_prob"].tolist(),
        "advantage": adv.repeat_interleave(torch.tensor(lengths)).tolist(),
        **{f"sel_{col}": masks[col].tolist() for col in REPORTED},
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
        "jsd_mean": float(stats["jsd"].mean()),
        "logprob_mean": float(stats["logprob"].mean()),
        "selector_params": params,
        **{f"selected_fraction_{col}": float(masks[col].float().mean()) for col in REPORTED},
        **{f"jaccard_{a}_{b}": jaccard(masks[a], masks[b])
           for a, b in itertools.combinations(REPORTED, 2)},
        "top_tokens": {
            col: [[texts[i], c] for i, c in Counter(flat_ids[masks[col]].tolist()).most_common(TOP_TOKENS)]
            for col in REPORTED
        },
    }
    return table, summary


SUMMARY_SCALARS = ["samples", "tokens", "rollout_accuracy", "temperature", "frac_entropy_below_0.01",
                   "entropy_p80", "entropy_mean", "renyi2_mean", "jsd_mean", "logprob_mean"]


def summary_schema() -> pa.Schema:
    fields = [pa.field("size", pa.string(), nullable=False)]
    for key in SUMMARY_SCALARS:
        kind = pa.int64() if key in ("samples", "tokens") else pa.float64()
        fields.append(pa.field(key, kind, nullable=False))
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
    samples = []
    for row in first.iter_rows(named=True):
        toks = [dict(zip(("text", "entropy", "jsd", "logprob", "sel_entropy20", "sel_stapo", "sel_ict"), v, strict=True))
                for v in zip(row["token"], row["entropy"], row["jsd"], row["logprob"],
                             row["sel_entropy20"], row["sel_stapo"], row["sel_ict"], strict=True)]
        samples.append({"header": f"{row['sample_id']} (advantage {row['advantage'][0]:+.2f})",
                        "tokens": toks})
    top = max(float(table["entropy"].max()), 1e-6)
    plots.token_page(samples, out_dir / "tokens.html", top, f"Token statistics of {label}")


def main(args, cfg: Config) -> None:
    if args.size not in cfg.models:
        raise ConfigError(f"--size {args.size!r}: not a key of 'models' ({sorted(cfg.models)})")
    frame = read_parquet(args.rollouts, ROLLOUT_SCHEMA)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tokenizer = load_model_and_tokenizer(args.model, device=device)
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
    cli.log.info("%s: %d tokens, H<0.01 %.3f, p80 H %.3f, selected: %s", args.size,
                 summary["tokens"], summary["frac_entropy_below_0.01"], summary["entropy_p80"],
                 ", ".join(f"{c} {summary[f'selected_fraction_{c}']:.3f}" for c in REPORTED))


if __name__ == "__main__":
    p = cli.parser(__doc__.splitlines()[0])
    p.add_argument("--size", required=True, help="a key of 'models'")
    p.add_argument("--model", required=True, help="base.json of that size")
    p.add_argument("--rollouts", required=True, help="rollouts Parquet of that size")
    p.add_argument("--out-dir", required=True, help="folder for tokens/summary Parquet and figures")
    cli.run(main, p)
