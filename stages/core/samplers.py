"""Rollouts from the policy being trained, with the rollout stage's backends (`hf`, `vllm`).

The rollout stage (stages.core.backends) samples from a model on disk once; the trainer samples
from a policy that changes after every step. :class:`HfPolicySampler` generates with the live
training module itself. :class:`VllmPolicySampler` keeps a vLLM engine in the training process
and loads the policy's weights into it in place after each step (TRL's "colocate" mode); vLLM is
imported only when that class is built, and needs a GPU.
"""

from __future__ import annotations

import os

import torch

from .backends import sample_vllm, vllm_source
from .generation import Sample, sample_hf


class HfPolicySampler:
    """Sampling with transformers' generate() on the training module."""

    def __init__(self, model, tokenizer, batch_size: int) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size

    def sync(self) -> None:
        """Nothing to do: generation reads the live parameters."""

    def sample(self, prompts: list[str], *, n: int, temperature: float, top_p: float,
               max_new_tokens: int, seed: int, desc: str = "rollout") -> list[Sample]:
        return sample_hf(self.model, self.tokenizer, prompts, n=n, temperature=temperature,
                         top_p=top_p, max_new_tokens=max_new_tokens, seed=seed,
                         batch_size=self.batch_size, desc=desc)  # sample_hf runs without gradient


class VllmPolicySampler:
    """A vLLM engine in this process whose weights follow the policy's (one engine per rank).

    The engine runs in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0; under torchrun with the
    `external_launcher` executor), so :meth:`sync` can hand the policy's tensors to the engine's
    model with its own `load_weights`, which also fuses q/k/v and gate/up projections.
    """

    def __init__(self, model_ref, model, tokenizer, *, world_size: int, seed: int,
                 gpu_memory_utilization: float, max_model_len: int, dtype: str) -> None:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM  # optional GPU extra: imported only here

        where, revision = vllm_source(model_ref)
        self.model = model
        self.tokenizer = tokenizer
        self.llm = LLM(
            model=where, revision=revision, tokenizer_revision=revision, seed=seed,
            tensor_parallel_size=1, dtype=dtype, max_model_len=max_model_len,
            gpu_memory_utilization=gpu_memory_utilization,
            distributed_executor_backend="external_launcher" if world_size > 1 else None,
        )
        self.sync()

    def _engine_model(self):
        executor = self.llm.llm_engine.model_executor
        worker = executor.driver_worker
        for path in ("worker.model_runner.model", "model_runner.model"):
            obj = worker
            try:
                for part in path.split("."):
                    obj = getattr(obj, part)
            except AttributeError:
                continue
            return obj
        raise RuntimeError(
            "cannot reach the vLLM engine's model to load the policy's weights; this vLLM version "
            "is not supported (use train.backend: hf)"
        )

    def sync(self) -> None:
        """Load the policy's current weights into the engine and drop its cached prefixes."""
        with torch.no_grad():
            weights = ((name, p.detach()) for name, p in self.model.state_dict().items())
            self._engine_model().load_weights(weights)
        self.llm.reset_prefix_cache()

    def sample(self, prompts: list[str], *, n: int, temperature: float, top_p: float,
               max_new_tokens: int, seed: int, desc: str = "rollout") -> list[Sample]:
        return sample_vllm(self.llm, self.tokenizer, prompts, n=n, temperature=temperature,
                           top_p=top_p, max_new_tokens=max_new_tokens, seed=seed, use_tqdm=False)
