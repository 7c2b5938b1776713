"""Stage 5: sample n responses per benchmark problem, grade them, and report pass@k (METHODS §5–§6).

    python -m stages.evaluate --config CFG --size NAME --method METHOD --seed K \
        --model results/<run>/models/size=NAME/base.json   (method "base")
                results/<run>/train/size=NAME/method=METHOD/seed=K/model.json   (trained) \
        --bench BENCH [BENCH ...] \
        --data results/<run>/data/dataset=BENCH/problems.parquet [...] \
        --out-dir results/<run>/eval/size=NAME/method=METHOD/seed=K/bench=BENCH [...]

One process evaluates one model on one or more benchmarks (`--bench`, `--data` and `--out-dir`
pair up in order): the model is loaded once, and each benchmark's samples are exactly those a
process of its own would draw. Writes, per benchmark,
`samples.parquet` (one row per response) and `metrics.parquet` (one row per metric). The
size, method, seed and benchmark are the hive keys of the output folder (and are kept in the
provenance), so `pl.scan_parquet("results/<run>/eval/**/metrics.parquet", hive_partitioning=True)`
reads every evaluation as one table. Sampling and the bootstrap are seeded by the run seed plus
K; the bootstrap draws depend only on that seed and the number of problems, so the intervals of
every model on one benchmark are paired.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import polars as pl
import pyarrow as pa

from . import cli
from .config import Config, ConfigError
from .core.common import timing
from .core.common.io import ArtifactError, provenance, read_parquet, write_parquet
from .core.common.metrics import Estimate, bootstrap_ci, summarise
from .core.data.problems import PROBLEM_SCHEMA
from .keys import (
    EVALUATE_KEYS,  # noqa: F401  (re-exported)
    STAGE_VERSIONS,
    result_hash,
)
from .keys import evaluate_config_keys as config_keys

STAGE_VERSION = STAGE_VERSIONS["evaluate"]
INVALID = "[INVALID]"  # math_dapo's prediction when a response has no "Answer:" line

# the parts of the config this stage reads (main_methods, headline and curve_benchmarks only
# shape the tables)

SAMPLE_SCHEMA = pa.schema(
    [
        pa.field("benchmark", pa.string(), nullable=False),
        pa.field("problem_id", pa.string(), nullable=False),
        pa.field("sample_idx", pa.int32(), nullable=False),
        pa.field("response", pa.string(), nullable=False),
        pa.field("extracted", pa.string(), nullable=True),
        pa.field("correct", pa.bool_(), nullable=False),
        pa.field("grade_error", pa.string(), nullable=True),
        pa.field("answer", pa.string(), nullable=False),
        pa.field("answer_type", pa.string(), nullable=False),
        pa.field("finish_reason", pa.string(), nullable=False),
        pa.field("response_tokens", pa.int32(), nullable=False),
        pa.field("grader", pa.string(), nullable=False),  # the benchmark's own (datasets.<b>.grader)
        pa.field("score", pa.float64(), nullable=True),  # a scored grader's reward, else null
        pa.field("other_grades", pa.list_(pa.struct([  # one per evaluate.graders entry
            pa.field("grader", pa.string()), pa.field("correct", pa.bool_()),
            pa.field("extracted", pa.string()), pa.field("error", pa.string()),
            pa.field("score", pa.float64())])), nullable=True),
    ]
)

METRIC_SCHEMA = pa.schema(
    [
        pa.field("metric", pa.string(), nullable=False),  # pass@<k>, avg@n, answered, truncated
        pa.field("k", pa.int32(), nullable=True),  # k of pass@k; null for the others
        pa.field("value", pa.float64(), nullable=False),  # mean over problems, a fraction in [0, 1]
        pa.field("ci_low", pa.float64(), nullable=False),  # 95% percentile bootstrap over problems
        pa.field("ci_high", pa.float64(), nullable=False),
        pa.field("n_problems", pa.int32(), nullable=False),
        pa.field("n_samples", pa.int32(), nullable=False),  # samples per problem
        # whose verdicts: the benchmark's own grader, then each of evaluate.graders
        pa.field("grader", pa.string(), nullable=True),
    ]
)


def max_new_tokens(cfg: Config, method: str) -> int:
    """The generation limit of a method's evaluations (methods.<m>.evaluate, else evaluate's)."""
    if method != "base" and cfg.methods[method].evaluate.max_new_tokens is not None:
        return cfg.methods[method].evaluate.max_new_tokens
    return cfg.evaluate.max_new_tokens


def metric_rows(samples: pl.DataFrame, k_list: list[int], resamples: int, seed: int,
                grader: str | None = None) -> list[dict]:
    """pass@k for each k, avg@n, and the fractions of answered and truncated responses.

    `samples` needs `problem_id`, `correct`, `extracted` and `finish_reason`; problems keep the
    order of their first appearance, so the bootstrap pairs the same problems across models.
    """
    per_problem = samples.group_by("problem_id", maintain_order=True).agg(
        n=pl.len(),
        c=pl.col("correct").sum(),
        answered=pl.col("extracted").is_not_null().mean(),
        truncated=(pl.col("finish_reason") == "length").mean(),
    )
    counts = list(zip(per_problem["n"].to_list(), per_problem["c"].to_list(), strict=True))
    sizes = set(per_problem["n"].to_list())
    if len(sizes) != 1:
        raise ValueError(f"problems have different sample counts: {sorted(sizes)}")
    n = sizes.pop()
    estimates = summarise(counts, k_list, resamples, seed)
    for name in ("answered", "truncated"):  # diagnostics, bootstrapped with the same draws
        values = per_problem[name].to_list()
        low, high = bootstrap_ci(values, resamples, seed)
        estimates[name] = Estimate(sum(values) / len(values), low, high, len(values))
    rows = []
    for name, est in estimates.items():
        k = int(name.split("@")[1]) if name.startswith("pass@") else None
        rows.append({"metric": name, "k": k, "value": est.mean, "ci_low": est.low,
                     "ci_high": est.high, "n_problems": est.n_problems, "n_samples": n,
                     "grader": grader})
    return rows


def graders_of(cfg: Config, bench: str) -> list[str]:
    """The benchmark's own grader, then each other one of evaluate.graders."""
    own = cfg.datasets[bench].grader
    return [own, *(g for g in dict.fromkeys(cfg.evaluate.graders) if g != own)]


def check_args(args, cfg: Config) -> list[tuple[str, str, Path]]:
    """(benchmark, problems file, output folder) of each --bench, in order."""
    if args.size not in cfg.models:
        raise ConfigError(f"--size {args.size!r}: not a key of 'models' ({sorted(cfg.models)})")
    if args.method != "base" and args.method not in cfg.methods:
        raise ConfigError(f"--method {args.method!r}: neither 'base' nor a key of 'methods' "
                          f"({sorted(cfg.methods)})")
    if not len(args.bench) == len(args.data) == len(args.out_dir):
        raise ConfigError(f"{len(args.bench)} --bench, {len(args.data)} --data and "
                          f"{len(args.out_dir)} --out-dir: give one of each per benchmark")
    for bench in args.bench:
        if bench not in cfg.datasets or cfg.datasets[bench].role != "benchmark":
            raise ConfigError(f"--bench {bench!r}: not a dataset with role 'benchmark'")
    return [(b, d, Path(o)) for b, d, o in zip(args.bench, args.data, args.out_dir, strict=True)]


def read_problems(path: str) -> pl.DataFrame:
    problems = read_parquet(path, PROBLEM_SCHEMA)
    if problems.height == 0:
        raise ArtifactError(f"{path}: the benchmark has no problems")
    if problems["problem_id"].n_unique() != problems.height:
        raise ArtifactError(f"{path}: problem ids are not unique")
    return problems


def main(args, cfg: Config) -> None:
    from .core.models.backends import (  # torch: only where sampling happens
        SamplingSettings,
        open_sampler,
    )
    from .core.reward.registry import grade_many

    jobs = check_args(args, cfg)
    problem_sets = [read_problems(data) for _, data, _ in jobs]  # every input checked first
    ev = cfg.evaluate
    seed = cfg.seed + args.seed
    settings = SamplingSettings(
        n=ev.n, temperature=ev.temperature, top_p=ev.top_p,
        max_new_tokens=max_new_tokens(cfg, args.method), seed=seed, batch_size=ev.batch_size,
        tensor_parallel_size=cfg.models[args.size].tensor_parallel_size,
        batch_invariant=ev.batch_invariant, engine_kwargs=ev.engine_kwargs, engine_key="evaluate",
        stop_tokens=cfg.models[args.size].stop_tokens,
    )
    sample = open_sampler(ev.backend, args.model, settings)
    model_ref = json.loads(Path(args.model).read_text())
    for (bench, _, out), problems in zip(jobs, problem_sets, strict=True):
        clock = time.perf_counter()
        samples = sample(problems["prompt"].to_list(), settings,
                         desc=f"eval {args.size}/{args.method}/{bench}")
        timing.add(generation_s=time.perf_counter() - clock, samples=len(samples),
                   tokens=sum(len(s.response_token_ids) for s in samples))
        golds, types = problems["answer"].to_list(), problems["answer_type"].to_list()
        graders = graders_of(cfg, bench)
        verdicts = {g: grade_many([s.response for s in samples], [golds[s.prompt_idx] for s in samples],
                                  [types[s.prompt_idx] for s in samples], ev.grade_timeout_s, grader=g)
                    for g in graders}
        ids = problems["problem_id"].to_list()
        rows = []
        for i, s in enumerate(samples):
            g = verdicts[graders[0]][i]
            rows.append({
                "benchmark": bench, "problem_id": ids[s.prompt_idx], "sample_idx": s.sample_idx,
                "response": s.response, "extracted": g.extracted, "correct": g.correct,
                "grade_error": g.error, "answer": golds[s.prompt_idx],
                "answer_type": types[s.prompt_idx], "finish_reason": s.finish_reason,
                "response_tokens": len(s.response_token_ids), "grader": graders[0],
                "score": g.score,
                "other_grades": [{"grader": name, "correct": verdicts[name][i].correct,
                                  "extracted": verdicts[name][i].extracted,
                                  "error": verdicts[name][i].error, "score": verdicts[name][i].score}
                                 for name in graders[1:]] or None,
            })
        table = pl.from_arrow(pa.Table.from_pylist(rows, schema=SAMPLE_SCHEMA))
        metrics = []
        for name in graders:
            correct = [v.correct for v in verdicts[name]]
            # answered: an answer was found (math_dapo's "[INVALID]" is its word for none)
            found = [None if v.extracted == INVALID else v.extracted for v in verdicts[name]]
            metrics += metric_rows(table.with_columns(correct=pl.Series(correct),
                                                      extracted=pl.Series(found, dtype=pl.String)),
                                   ev.k, ev.bootstrap, seed, grader=name)
        prov = provenance("evaluate", STAGE_VERSION,
                          result_hash(cfg, *config_keys(cfg, args.size, bench, args.method)),
                          seed, size=args.size, method=args.method, run_seed=args.seed, bench=bench,
                          backend=ev.backend, model=str(args.model), model_ref=model_ref)
        write_parquet(table, out / "samples.parquet", SAMPLE_SCHEMA, prov)
        write_parquet(metrics, out / "metrics.parquet", METRIC_SCHEMA, prov)
        cli.log.info("%s/%s/seed=%d/%s: %s", args.size, args.method, args.seed, bench,
                     ", ".join(f"{r['metric']} {r['value']:.3f}" for r in metrics))


if __name__ == "__main__":
    p = cli.parser(__doc__.splitlines()[0])
    p.add_argument("--size", required=True, help="a key of 'models'")
    p.add_argument("--method", required=True, help="'base' or a key of 'methods'")
    p.add_argument("--seed", required=True, type=int, help="the run seed K of the trained model")
    p.add_argument("--model", required=True, help="model reference: base.json or model.json")
    p.add_argument("--bench", required=True, nargs="+", help="benchmark dataset keys")
    p.add_argument("--data", required=True, nargs="+",
                   help="prepared problems (Parquet) of each benchmark, in --bench order")
    p.add_argument("--out-dir", required=True, nargs="+",
                   help="folder for samples.parquet and metrics.parquet of each benchmark")
    cli.run(main, p)
