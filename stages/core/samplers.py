"""Rollouts from the policy being trained, with the rollout stage's backends (`hf`, `vllm`).

The rollout stage (stages.core.backends) samples from a model on disk once; the trainer samples
from a policy that changes after every step. :class:`HfPolicySampler` generates with the live
training module itself. :class:`VllmPolicySampler` keeps a vLLM engine in the training process
and loads the policy's weights into it in place after each step (TRL's "colocate" mode); vLLM is
imported only when that class is built, and needs a GPU.

Both return the sampler's own log-prob of every sampled token (Sample.logprobs), at the sampling
temperature, so the trainer can measure how far the sampler's policy is from its own.
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
               max_new_tokens: int | list[int], prompt_seeds: list[int],
               desc: str = "rollout") -> list[Sample]:
        # eval mode for generate(): with gradient checkpointing, a module in train mode turns the
        # KV cache off (dropout is 0 either way, so the samples do not depend on the mode)
        training = self.model.training
        self.model.eval()
        try:
            return sample_hf(self.model, self.tokenizer, prompts, n=n, temperature=temperature,
                             top_p=top_p, max_new_tokens=max_new_tokens, prompt_seeds=prompt_seeds,
                             batch_size=self.batch_size, desc=desc)  # runs without gradient
        finally:
            self.model.train(training)


class VllmPolicySampler:
    """A vLLM engine in this process whose weights follow the policy's (one engine per rank).

    The engine runs in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0; under torchrun with the
    `external_launcher` executor), so :meth:`sync` can hand the policy's tensors to the engine's
    model with its own `load_weights`, which also fuses q/k/v and gate/up projections.

    Numerics: the engine returns the log-prob of each sampled token after temperature and top-p
    (logprobs_mode="processed_logprobs"); when the policy trains in bf16 the engine is asked for a
    float32 LM head (hf_overrides head_dtype), and the live head module is checked after start,
    since an engine that ignores the override would sample from a bf16 head.

    Sleep mode: after sampling, the engine sleeps at level 2 (weights and KV cache discarded: the
    next sync loads every weight anyway, so copying them to host memory, as level 1 does, is
    wasted), so training has the GPU's memory; :meth:`sync` wakes the weights' memory, loads the
    policy's weights, checks the LM head (a tied head is the embedding and must come back with
    it), then wakes the KV cache, so the two are never both allocated next to a step's activations.
    """

    def __init__(self, model_ref, model, tokenizer, *, world_size: int, seed: int,
                 gpu_memory_utilization: float, max_model_len: int, dtype: str,
                 batch_invariant: bool = False) -> None:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if batch_invariant:
            os.environ["VLLM_BATCH_INVARIANT"] = "1"  # read when the engine is built
        from vllm import LLM  # optional GPU extra: imported only here

        where, revision = vllm_source(model_ref)
        self.model = model
        self.tokenizer = tokenizer
        self.fp32_head = dtype != "float32"
        extra = {"hf_overrides": {"head_dtype": "float32"}} if self.fp32_head else {}
        self.llm = LLM(
            model=where, revision=revision, tokenizer_revision=revision, seed=seed,
            tensor_parallel_size=1, dtype=dtype, max_model_len=max_model_len,
            gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=True,
            logprobs_mode="processed_logprobs",
            distributed_executor_backend="external_launcher" if world_size > 1 else None,
            **extra,
        )
        self.asleep = False
        self.check_head_dtype()
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

    def _engine_head(self):
        head = getattr(self._engine_model(), "lm_head", None)
        if head is None or getattr(head, "weight", None) is None:
            raise RuntimeError("the vLLM engine's model has no lm_head weight to check")
        return head.weight

    def check_head_dtype(self) -> None:
        """The live LM head computes in float32 when the policy trains in bf16."""
        if not self.fp32_head:
            return
        dtype = self._engine_head().dtype
        if dtype != torch.float32:
            raise RuntimeError(
                f"the vLLM engine's LM head is {dtype}, although it was built with "
                "hf_overrides={'head_dtype': 'float32'}: this vLLM ignores the override for "
                "generation models, and sampling from a bf16 head puts its log-probs up to "
                "~0.1 nats off the trainer's. Use a vLLM that honours it, train.dtype: float32, "
                "or train.backend: hf")

    def check_head_loaded(self) -> None:
        """The engine's LM head holds the policy's head after a load (a tied head is the
        embedding: it must come back with it after a level-2 sleep). vLLM pads the vocabulary
        to a multiple of its tile, so the policy's rows are compared; a tensor-parallel shard
        holds only some rows and is not checked here."""
        policy = self.model.get_output_embeddings().weight
        engine = self._engine_head()
        rows = policy.shape[0]
        if engine.shape[1] != policy.shape[1] or engine.shape[0] < rows:
            return
        if not torch.equal(engine[:rows], policy.detach().to(engine.device, engine.dtype)):
            raise RuntimeError("the vLLM engine's LM head differs from the policy's after loading "
                               "the weights (a tied head not reloaded after the engine slept?)")

    def sync(self) -> None:
        """Wake the engine's weights, load the policy's current ones, check the head, wake the KV
        cache, and drop the cached prefixes (computed with the old weights)."""
        if self.asleep:
            self.llm.wake_up(tags=["weights"])
        with torch.no_grad():
            weights = ((name, p.detach()) for name, p in self.model.state_dict().items())
            self._engine_model().load_weights(weights)
            self.check_head_loaded()
        if self.asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False
        self.llm.reset_prefix_cache()

    def sample(self, prompts: list[str], *, n: int, temperature: float, top_p: float,
               max_new_tokens: int | list[int], prompt_seeds: list[int],
               desc: str = "rollout") -> list[Sample]:
        """Sample (the engine must be awake: call sync() after each update), then sleep."""
        if self.asleep:
            raise RuntimeError("the vLLM engine is asleep: sync() the policy's weights first")
        out = sample_vllm(self.llm, self.tokenizer, prompts, n=n, temperature=temperature,
                          top_p=top_p, max_new_tokens=max_new_tokens, prompt_seeds=prompt_seeds,
                          logprobs=True, use_tqdm=False)
        self.llm.sleep(level=2)
        self.asleep = True
        return out
