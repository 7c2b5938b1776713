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
               max_new_tokens: int | list[int], seed: int, desc: str = "rollout") -> list[Sample]:
        # eval mode for generate(): with gradient checkpointing, a module in train mode turns the
        # KV cache off (dropout is 0 either way, so the samples do not depend on the mode)
        training = self.model.training
        self.model.eval()
        try:
            return sample_hf(self.model, self.tokenizer, prompts, n=n, temperature=temperature,
                             top_p=top_p, max_new_tokens=max_new_tokens, seed=seed,
                             batch_size=self.batch_size, desc=desc)  # runs without gradient
        finally:
            self.model.train(training)


class VllmPolicySampler:
    """A vLLM engine in this process whose weights follow the policy's (one engine per rank).

    The engine runs in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0; under torchrun with the
    `external_launcher` executor), so :meth:`sync` can hand the policy's tensors to the engine's
    model with its own `load_weights`, which also fuses q/k/v and gate/up projections.

    Sleep mode: after sampling, the engine sleeps (level 1: weights offloaded to CPU memory, KV
    cache freed), so training has the GPU's memory; :meth:`sync` wakes the weights, loads the
    policy's, then wakes the KV cache, so the two are never both allocated next to a step's
    activations.
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
            gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=True,
            distributed_executor_backend="external_launcher" if world_size > 1 else None,
        )
        self.asleep = False
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
        """Wake the engine's weights, load the policy's current ones, wake the KV cache, and
        drop the cached prefixes (computed with the old weights)."""
        if self.asleep:
            self.llm.wake_up(tags=["weights"])
        with torch.no_grad():
            weights = ((name, p.detach()) for name, p in self.model.state_dict().items())
            self._engine_model().load_weights(weights)
        if self.asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False
        self.llm.reset_prefix_cache()

    def sample(self, prompts: list[str], *, n: int, temperature: float, top_p: float,
               max_new_tokens: int | list[int], seed: int, desc: str = "rollout") -> list[Sample]:
        """Sample (the engine must be awake: call sync() after each update), then sleep."""
        if self.asleep:
            raise RuntimeError("the vLLM engine is asleep: sync() the policy's weights first")
        out = sample_vllm(self.llm, self.tokenizer, prompts, n=n, temperature=temperature,
                          top_p=top_p, max_new_tokens=max_new_tokens, seed=seed, use_tqdm=False)
        self.llm.sleep(level=1)
        self.asleep = True
        return out
