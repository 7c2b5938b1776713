"""The hf backend's decode loop against transformers' generate(), on the embedded default's model
and batches (stages.core.models.generation).

    bash scripts/run_default.sh                     # once: the base model and the data
    .venv/bin/python benchmarks/generation.py       # --repeats 3, one thread
    .venv/bin/python benchmarks/generation.py --model PATH --data DIR --json out.json

Both paths draw every sequence with the same seeded sampler (inverse CDF in float64, one uniform
per position from the sequence's own stream):

- loop: :func:`stages.core.models.generation.sample_hf`, whose decode loop drops a sequence from
  the batch, and from its KV cache, once it stops or reaches its own limit;
- generate: transformers' generate() with the same sampler as a logits processor (how sample_hf
  sampled until 2026-12-02): finished rows ride along, padded, until the batch's longest
  response ends.

The batches are the default's: a training step (16 prompts of the RL pool x 8 samples, T = 1,
up to 64 tokens, one batch of 128) and each benchmark's evaluation (all problems x 4 samples,
T = 0.6, top-p 0.95, up to 96 tokens, batches of 512). Both run in one process, in turn, the order
rotating (harness.interleaved); the table gives each path's fastest round and loop / generate of
the fastest rounds, in wall and in CPU time, and whether the two drew the same tokens.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from harness import ROOT, interleaved, report  # benchmarks/harness.py, beside this script

sys.path.insert(0, str(ROOT))

CASES = {  # name: (dataset, prompts (None: all), n, temperature, top_p, max new tokens, batch)
    "train step": ("rl", 16, 8, 1.0, 1.0, 64, 128),
    "Arith-2/3": ("arith-easy", None, 4, 0.6, 0.95, 96, 512),
    "Arith-2..4": ("arith-mid", None, 4, 0.6, 0.95, 96, 512),
    "Arith-5/6": ("arith-hard", None, 4, 0.6, 0.95, 96, 512),
}


class Picker:
    """generate()'s logits processor: picks each row's token with the loop's seeded sampler."""

    def __init__(self, sampler, start: int):
        self.sampler, self.start = sampler, start

    def __call__(self, input_ids, scores):
        chosen, _ = self.sampler(torch.arange(scores.shape[0]), input_ids.shape[1] - self.start, scores)
        return torch.full_like(scores, -torch.inf).scatter_(1, chosen[:, None], 0.0)


@torch.no_grad()
def with_generate(model, tokenizer, prompts, *, n, temperature, top_p, max_new_tokens, batch_size):
    """Every sequence's tokens through transformers' generate() and the same seeded sampler."""
    from transformers import LogitsProcessorList

    from stages.core.models.generation import (
        SeededSampler,
        left_padded,
        prompt_seed,
        sequence_seed,
        stop_token_ids,
    )

    stops = stop_token_ids(tokenizer)
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    jobs = [(i, j) for i in range(len(prompts)) for j in range(n)]
    out = []
    for start in range(0, len(jobs), batch_size):
        batch = jobs[start : start + batch_size]
        x, att = left_padded([ids[i] for i, _ in batch], stops[0])
        width = x.shape[1]
        sampler = SeededSampler([sequence_seed(prompt_seed(0, i), j) for i, j in batch],
                                max_new_tokens, temperature, top_p)
        rows = model.generate(input_ids=x, attention_mask=att, do_sample=False,
                              logits_processor=LogitsProcessorList([Picker(sampler, width)]),
                              max_new_tokens=max_new_tokens, eos_token_id=stops,
                              pad_token_id=stops[0])[:, width:].tolist()
        for row in rows:
            end = next((k + 1 for k, t in enumerate(row) if t in stops), len(row))
            out.append(row[:end])
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path,
                        default=ROOT / "results/default/models/size=tiny-s/base.json",
                        help="a model reference (base.json) or checkpoint folder")
    parser.add_argument("--data", type=Path, default=ROOT / "results/default/data",
                        help="the folder of dataset=<name>/problems.parquet")
    parser.add_argument("--repeats", type=int, default=3, help="rounds; each path's fastest kept")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    import polars as pl

    from stages.core.models.generation import sample_hf
    from stages.core.models.modeling import load_model_and_tokenizer

    files = {name: args.data / f"dataset={spec[0]}" / "problems.parquet" for name, spec in CASES.items()}
    missing = [str(p) for p in [args.model, *files.values()] if not p.exists()]
    if missing:
        sys.exit(f"benchmarks/generation.py: missing {', '.join(missing)}: run "
                 "`bash scripts/run_default.sh` first, or pass --model and --data")
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model_and_tokenizer(str(args.model), dtype=torch.float32, device="cpu")
    model.eval()
    rows = []
    for name, (_, count, n, temperature, top_p, limit, batch) in CASES.items():
        prompts = pl.read_parquet(files[name])["prompt"].to_list()[:count]
        kw = {"n": n, "temperature": temperature, "top_p": top_p, "max_new_tokens": limit,
              "batch_size": batch}
        got: dict[str, list] = {}
        calls = {
            "loop": lambda kw=kw, prompts=prompts, got=got: got.__setitem__("loop", [
                s.response_token_ids for s in sample_hf(model, tokenizer, prompts, seed=0, **kw)]),
            "generate": lambda kw=kw, prompts=prompts, got=got: got.__setitem__(
                "generate", with_generate(model, tokenizer, prompts, **kw)),
        }
        for call in calls.values():  # warm-up, and the tokens to compare
            call()
        times = interleaved(calls, args.repeats)
        loop, gen = times["loop"], times["generate"]
        rows.append({"batches": name, "sequences": len(prompts) * n,
                     "tokens": sum(map(len, got["loop"])),
                     "generate_s": min(gen["wall"]), "loop_s": min(loop["wall"]),
                     "loop_to_generate": min(loop["wall"]) / min(gen["wall"]),
                     "loop_to_generate_cpu": min(loop["cpu"]) / min(gen["cpu"]),
                     "same_tokens": got["loop"] == got["generate"]})
    header = ("batches", "sequences", "tokens", "generate_s", "loop_s", "loop_to_generate",
              "loop_to_generate_cpu", "same_tokens")

    def fmt(key, value):
        return f"{value:.3f}" if isinstance(value, float) else str(value)

    print(f"{args.model}, {args.threads} thread(s), fastest of {args.repeats} rounds")
    report(rows, header, None, args.json, 12, fmt)


if __name__ == "__main__":
    main()
