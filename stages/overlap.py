"""Stage 4b: where the forks are after training — the 80/20 paper's overlap (its Table 1).

    python -m stages.overlap --config CFG --size S --method M --seed K \
        --model results/<run>/train/size=S/method=M/seed=K/model.json \
        --rollouts results/<run>/rollouts/size=S/rollouts.parquet \
        --tokens results/<run>/token_stats/size=S/tokens.parquet \
        --out results/<run>/overlap/size=S/method=M/seed=K/overlap.parquet

The base model's rollouts are teacher-forced through the trained model at the rollout temperature,
exactly as the token-statistics stage forced them through the base model (stages.core.statistics.scoring.
stream_statistics: group by group, one pass, in token_stats.dtype, reductions in float32). A = the
top `token_stats.overlap_top` fraction of the file's positions by the base model's entropy (its
tokens.parquet), B = the same fraction by the trained model's entropy; both are ceil(ρN) positions (ties: the earliest, as the selectors),
and the overlap is |A ∩ B| / |A| — not the Jaccard index |A ∩ B| / |A ∪ B|, which is written
beside it (the paper's 86.67% overlap is a Jaccard of about 0.76). One row per trained model.
"""

from __future__ import annotations

import itertools

import polars as pl
import pyarrow as pa
import torch

from . import cli
from .config import Config, ConfigError
from .core.common.io import ArtifactError, provenance, read_parquet, write_parquet
from .core.models.modeling import load_model_and_tokenizer
from .core.statistics.scoring import stream_statistics
from .core.training.selectors import count, top_k_first
from .keys import STAGE_VERSIONS, result_hash
from .keys import overlap_config_keys as config_keys
from .rollout import ROLLOUT_SCHEMA

STAGE_VERSION = STAGE_VERSIONS["overlap"]

OVERLAP_SCHEMA = pa.schema(
    [
        pa.field("top", pa.float64(), nullable=False),  # the fraction ρ of positions compared
        pa.field("tokens", pa.int64(), nullable=False),  # N: response tokens of the rollout file
        pa.field("positions", pa.int64(), nullable=False),  # |A| = |B| = ceil(ρN)
        pa.field("overlap", pa.float64(), nullable=False),  # |A ∩ B| / |A|
        pa.field("jaccard", pa.float64(), nullable=False),  # |A ∩ B| / |A ∪ B|
        pa.field("entropy_mean_base", pa.float64(), nullable=False),  # nats, over all N tokens
        pa.field("entropy_mean_trained", pa.float64(), nullable=False),
    ]
)


def top_positions(entropy: torch.Tensor, rho: float) -> torch.Tensor:
    """(N,) bool: the ceil(ρN) positions of highest entropy, ties to the earliest."""
    return top_k_first(entropy, count(rho, entropy.numel()))


def overlap_row(base: torch.Tensor, trained: torch.Tensor, rho: float) -> dict:
    """The overlap of the top-ρ entropy positions of two (N,) entropies of the same tokens."""
    if base.shape != trained.shape or base.dim() != 1:
        raise ValueError(f"entropies of shapes {tuple(base.shape)} and {tuple(trained.shape)}")
    a, b = top_positions(base, rho), top_positions(trained, rho)
    both = int((a & b).sum())
    k = int(a.sum())
    return {"top": rho, "tokens": base.numel(), "positions": k,
            "overlap": both / k if k else 1.0,
            "jaccard": both / int((a | b).sum()) if k else 1.0,
            "entropy_mean_base": float(base.double().mean()) if base.numel() else 0.0,
            "entropy_mean_trained": float(trained.double().mean()) if trained.numel() else 0.0}


def trained_entropy(cfg: Config, model_path: str, frame: pl.DataFrame) -> torch.Tensor:
    """Entropy (N,) of every response token of `frame` under the model at `model_path`."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tokenizer = load_model_and_tokenizer(model_path, dtype=getattr(torch, cfg.token_stats.dtype),
                                                device=device)
    prompts = frame["prompt_token_ids"].to_list()
    responses = frame["response_token_ids"].to_list()
    vocab = model.get_output_embeddings().weight.shape[0]
    ids = torch.tensor(list(itertools.chain.from_iterable(responses)))
    if ids.numel() and int(ids.max()) >= vocab:
        raise ArtifactError(f"{model_path}: the rollouts hold token id {int(ids.max())}, outside this "
                            f"model's vocabulary of {vocab}: rollouts of another model?")
    # one pass, group by group, as the token-statistics stage's first
    stats = stream_statistics(model, prompts, responses, frame["problem_id"].to_list(),
                              tokenizer.pad_token_id, cfg.rollout.temperature,
                              chunk_positions=cfg.token_stats.chunk_positions,
                              chunk_vocab=cfg.token_stats.chunk_vocab,
                              batch_tokens=cfg.token_stats.batch_tokens,
                              desc="teacher forcing (trained)")
    # float32, as tokens.parquet stores the base model's: both rankings see the same rounding
    return stats["entropy"].float()


def main(args, cfg: Config) -> None:
    if args.size not in cfg.models:
        raise ConfigError(f"--size {args.size!r}: not a key of 'models' ({sorted(cfg.models)})")
    rho = cfg.token_stats.overlap_top
    if rho is None:
        raise ConfigError("token_stats.overlap_top: not set, so there is no overlap to compute")
    frame = read_parquet(args.rollouts, ROLLOUT_SCHEMA)
    tokens = read_parquet(args.tokens)
    if "entropy" not in tokens.columns:
        raise ArtifactError(f"{args.tokens}: no 'entropy' column (not a token-statistics file?)")
    expected = int(frame["response_token_ids"].list.len().sum())
    if tokens.height != expected:
        raise ArtifactError(f"{args.tokens}: {tokens.height} tokens, but {args.rollouts} has "
                            f"{expected}: the two files are of different rollouts")
    base = torch.tensor(tokens["entropy"].to_numpy(), dtype=torch.float32)
    trained = trained_entropy(cfg, args.model, frame)
    row = overlap_row(base, trained, rho)
    prov = provenance("overlap", STAGE_VERSION, result_hash(cfg, *config_keys(cfg, args.size)), cfg.seed,
                      size=args.size, method=args.method, run_seed=args.seed, model=str(args.model))
    write_parquet([row], args.out, OVERLAP_SCHEMA, prov)
    cli.log.info("%s/%s seed %d: top-%g entropy positions overlap %.1f%% (Jaccard %.3f) of %d",
                 args.size, args.method, args.seed, rho, 100 * row["overlap"], row["jaccard"],
                 row["positions"])


if __name__ == "__main__":
    p = cli.parser(__doc__.splitlines()[0])
    p.add_argument("--size", required=True, help="a key of 'models'")
    p.add_argument("--method", required=True, help="the trained model's method")
    p.add_argument("--seed", required=True, type=int, help="the trained model's run seed")
    p.add_argument("--model", required=True, help="the trained model's model.json")
    p.add_argument("--rollouts", required=True, help="the size's base-model rollouts (Parquet)")
    p.add_argument("--tokens", required=True, help="the size's token statistics (tokens.parquet)")
    p.add_argument("--out", required=True, help="output overlap.parquet")
    cli.run(main, p)
