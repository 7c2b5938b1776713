"""Stage 3a: base-model rollouts on training prompts, scored with the reward (METHODS §5).

    python -m stages.rollout --config CFG --size NAME --model results/<run>/models/size=NAME/base.json \
        --prompts results/<run>/data/dataset=<train>/problems.parquet \
        --out results/<run>/rollouts/size=NAME/rollouts.parquet
"""

from __future__ import annotations

import random
import time

import polars as pl
import pyarrow as pa

from . import cli
from .config import Config, ConfigError
from .core.common import timing
from .core.common.io import provenance, read_parquet, write_parquet
from .core.data.problems import PROBLEM_SCHEMA
from .core.models.backends import SamplingSettings, open_sampler
from .core.reward.registry import grade_many
from .keys import STAGE_VERSIONS, result_hash
from .keys import rollout_config_keys as config_keys

STAGE_VERSION = STAGE_VERSIONS["rollout"]

ROLLOUT_SCHEMA = pa.schema(
    [
        pa.field("sample_id", pa.string(), nullable=False),
        pa.field("problem_id", pa.string(), nullable=False),
        pa.field("sample_idx", pa.int32(), nullable=False),
        pa.field("prompt", pa.string(), nullable=False),
        pa.field("response", pa.string(), nullable=False),
        pa.field("prompt_token_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("response_token_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("finish_reason", pa.string(), nullable=False),
        pa.field("answer", pa.string(), nullable=False),
        pa.field("answer_type", pa.string(), nullable=False),
        pa.field("extracted", pa.string(), nullable=True),
        pa.field("grade_error", pa.string(), nullable=True),
        pa.field("correct", pa.bool_(), nullable=False),
        pa.field("reward", pa.float64(), nullable=False),
    ]
)


def read_prompt_files(paths: list[str], graders: list[str] | None = None) -> pl.DataFrame:
    """The prepared training prompts of one or more files, pooled in the order given; with
    `graders` (one per file: its dataset's), a `grader` column says how each is graded."""
    frames = [read_parquet(p, PROBLEM_SCHEMA) for p in paths]
    if graders is not None:
        frames = [f.with_columns(grader=pl.lit(g)) for f, g in zip(frames, graders, strict=True)]
    return pl.concat(frames, how="vertical")


def pick_prompts(frame, count: int, seed: int):
    """`count` problems drawn without replacement (seeded), in their file order."""
    if frame.height == 0:
        raise ConfigError("the training prompt file is empty")
    rows = sorted(random.Random(f"rollout:{seed}").sample(range(frame.height), min(count, frame.height)))
    return frame[rows]


def main(args, cfg: Config) -> None:
    if args.size not in cfg.models:
        raise ConfigError(f"--size {args.size!r}: not a key of 'models' ({sorted(cfg.models)})")
    r = cfg.rollout
    names = cfg.experiment.train_datasets
    if len(args.prompts) != len(names):
        raise ConfigError(f"experiment.train_datasets: {len(names)} datasets but "
                          f"{len(args.prompts)} --prompts files")
    graders = [cfg.datasets[name].grader for name in names]
    problems = pick_prompts(read_prompt_files(args.prompts, graders), r.prompts, cfg.seed)
    settings = SamplingSettings(
        n=r.n, temperature=r.temperature, top_p=r.top_p, max_new_tokens=r.max_new_tokens,
        seed=cfg.seed, batch_size=r.batch_size,
        tensor_parallel_size=cfg.models[args.size].tensor_parallel_size,
        engine_kwargs=r.engine_kwargs, engine_key="rollout",
        stop_tokens=cfg.models[args.size].stop_tokens,
    )
    sample = open_sampler(r.backend, args.model, settings)  # the model loads here
    clock = time.perf_counter()
    samples = sample(problems["prompt"].to_list(), settings, f"rollouts {args.size}")
    timing.add(generation_s=time.perf_counter() - clock, samples=len(samples),
               tokens=sum(len(s.response_token_ids) for s in samples))
    ids = problems["problem_id"].to_list()
    golds, types = problems["answer"].to_list(), problems["answer_type"].to_list()
    kinds = problems["grader"].to_list()
    grades = grade_many([s.response for s in samples], [golds[s.prompt_idx] for s in samples],
                        [types[s.prompt_idx] for s in samples], cfg.evaluate.grade_timeout_s,
                        grader=[kinds[s.prompt_idx] for s in samples])
    right, wrong = cfg.train.reward_values()
    rows = []
    for s, g in zip(samples, grades, strict=True):
        i = s.prompt_idx
        rows.append({
            "sample_id": f"{ids[i]}-{s.sample_idx}", "problem_id": ids[i], "sample_idx": s.sample_idx,
            "prompt": problems["prompt"][i], "response": s.response,
            "prompt_token_ids": s.prompt_token_ids, "response_token_ids": s.response_token_ids,
            "finish_reason": s.finish_reason, "answer": golds[i], "answer_type": types[i],
            "extracted": g.extracted, "grade_error": g.error, "correct": g.correct,
            "reward": g.score if g.score is not None else (right if g.correct else wrong),
        })
    prov = provenance("rollout", STAGE_VERSION,
                      result_hash(cfg, *config_keys(cfg, args.size)),
                      cfg.seed, size=args.size, backend=r.backend)
    write_parquet(rows, args.out, ROLLOUT_SCHEMA, prov)
    acc = sum(row["correct"] for row in rows) / len(rows)
    cli.log.info("%s: %d rollouts, accuracy %.3f -> %s", args.size, len(rows), acc, args.out)


if __name__ == "__main__":
    p = cli.parser(__doc__.splitlines()[0])
    p.add_argument("--size", required=True, help="a key of 'models'")
    p.add_argument("--model", required=True, help="base.json of that size")
    p.add_argument("--prompts", required=True, nargs="+",
                   help="prepared training prompts (Parquet; several are pooled in order)")
    p.add_argument("--out", required=True, help="output Parquet path")
    cli.run(main, p)
