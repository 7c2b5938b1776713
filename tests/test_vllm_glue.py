"""Our code around vLLM, against a stand-in `vllm` module (vLLM itself needs a GPU).

What is checked is ours: the engine is built from the model reference, prompts go in as token
ids, completions come back as the `hf` backend's Sample rows in (prompt, sample) order with
their finish reasons, and the trainer's sampler loads the policy's weights into the engine (the
whole state dict once per update) and drops its prefix cache. Engine groups of several ranks
(tensor parallelism) and the weights gathered from ZeRO-3 shards: tests/test_zero3.py, with this
stand-in in two processes. Whether vLLM samples correctly is vLLM's business (and the GPU test's).
"""

from __future__ import annotations

import json
import sys
import types
from dataclasses import dataclass

import pytest
import torch

from stages.core.backends import SamplingSettings, generate, prompt_seed
from stages.core.generation import Sample


class FakeTokenizer:
    """Characters as ids; a ChatML template whose end-of-turn token is id 2 (eos is id 1)."""

    eos_token_id = 1
    unk_token_id = None
    chat_template = "{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}"

    def __call__(self, text, add_special_tokens=True):
        assert add_special_tokens is False
        return {"input_ids": [ord(c) for c in text]}

    def convert_tokens_to_ids(self, token):
        return {"<|im_end|>": 2}.get(token, self.unk_token_id)


@dataclass
class Completion:
    token_ids: tuple
    text: str
    finish_reason: str
    logprobs: list | None = None


# The keywords our code may pass, as the pinned vLLM's LLM / EngineArgs and SamplingParams accept
# them; anything else is refused, as the real constructors refuse an unknown keyword (TypeError).
LLM_KEYWORDS = {"model", "revision", "tokenizer_revision", "seed", "tensor_parallel_size", "dtype",
                "max_model_len", "gpu_memory_utilization", "enable_sleep_mode",
                "distributed_executor_backend", "hf_overrides", "logprobs_mode"}
SAMPLING_KEYWORDS = {"n", "temperature", "top_p", "max_tokens", "seed", "stop_token_ids",
                     "skip_special_tokens", "logprobs"}
LOGPROBS_MODES = {"raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"}


class FakeLLM:
    built: list = []
    head_dtype_honoured = True  # the stand-in of a vLLM that ignores hf_overrides head_dtype: False
    reload_tied_head = True  # the stand-in of a level-2 sleep that loses a tied head: False

    def __init__(self, **kwargs):
        unknown = set(kwargs) - LLM_KEYWORDS
        if unknown:
            raise TypeError(f"LLM() got unexpected keyword arguments {sorted(unknown)}")
        if kwargs.get("logprobs_mode", "raw_logprobs") not in LOGPROBS_MODES:
            raise ValueError(f"unknown logprobs_mode {kwargs['logprobs_mode']!r}")
        self.kwargs = kwargs
        self.calls = []
        self.loaded: list[str] = []
        self.resets = 0
        self.events: list[str] = []  # sleep / wake-up calls and weight loads, in order
        FakeLLM.built.append(self)
        fp32 = (kwargs.get("hf_overrides") or {}).get("head_dtype") == "float32"
        dtype = torch.float32 if (fp32 and self.head_dtype_honoured) or kwargs.get("dtype") == "float32" \
            else torch.bfloat16
        self.lm_head = types.SimpleNamespace(weight=torch.zeros(3, 2, dtype=dtype))
        model = types.SimpleNamespace(load_weights=self._load, lm_head=self.lm_head)
        worker = types.SimpleNamespace(model_runner=types.SimpleNamespace(model=model))
        self.llm_engine = types.SimpleNamespace(model_executor=types.SimpleNamespace(driver_worker=worker))

    def _load(self, weights):
        for name, tensor in weights:
            self.loaded.append(name)
            if name == "weight" and (self.reload_tied_head or "sleep2" not in self.events):
                self.lm_head.weight.copy_(tensor[:3].to(self.lm_head.weight.dtype))
        self.events.append("load")

    def sleep(self, level=1):
        self.events.append(f"sleep{level}")

    def wake_up(self, tags=None):
        self.events.append(f"wake:{','.join(tags)}")

    def get_tokenizer(self):
        return FakeTokenizer()

    def reset_prefix_cache(self):
        self.resets += 1

    def generate(self, requests, params, use_tqdm=True):
        self.calls.append((requests, params, use_tqdm))
        self.events.append("generate")
        assert isinstance(params, list) and len(params) == len(requests)  # one per prompt

        def logprobs(p, tokens):  # logprobs=0: the sampled token's only, one dict per position
            if getattr(p, "logprobs", None) is None:
                return None
            return [{t: types.SimpleNamespace(logprob=-0.5 * (k + 1))} for k, t in enumerate(tokens)]

        # sample j of prompt i: tokens (i, j); the last one of each prompt runs out of tokens
        return [types.SimpleNamespace(outputs=[
            Completion((i, j, 0), f"r{i}.{j}", "length" if j == p.n - 1 else "stop",
                       logprobs(p, (i, j, 0)))
            for j in range(p.n)]) for i, p in enumerate(params)]


class FakeParams:
    def __init__(self, **kwargs):
        unknown = set(kwargs) - SAMPLING_KEYWORDS
        if unknown:
            raise TypeError(f"SamplingParams() got unexpected keyword arguments {sorted(unknown)}")
        self.__dict__.update(kwargs)


class HeadPolicy(torch.nn.Linear):
    """A policy whose output embedding is itself (a tied head), as the sampler reads it."""

    def get_output_embeddings(self):
        return self


@pytest.fixture
def fake_vllm(monkeypatch):
    FakeLLM.built = []
    monkeypatch.setattr(FakeLLM, "head_dtype_honoured", True)
    monkeypatch.setattr(FakeLLM, "reload_tied_head", True)
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=FakeLLM, SamplingParams=FakeParams))
    return FakeLLM


def test_the_stand_in_refuses_what_vllm_refuses(fake_vllm):
    with pytest.raises(TypeError, match="unexpected keyword"):
        FakeLLM(model="m", head_dtype="float32")  # only through hf_overrides
    with pytest.raises(TypeError, match="unexpected keyword"):
        FakeParams(n=1, return_logprobs=True)
    with pytest.raises(ValueError, match="logprobs_mode"):
        FakeLLM(model="m", logprobs_mode="processed")


def test_rollout_backend_rows_and_engine(tmp_path, fake_vllm):
    ref = tmp_path / "base.json"
    ref.write_text(json.dumps({"kind": "hub", "model_id": "Qwen/Qwen2.5-0.5B", "revision": "abc123"}))
    s = SamplingSettings(n=3, temperature=0.6, top_p=0.95, max_new_tokens=7, seed=5, tensor_parallel_size=2)
    out = generate("vllm", ref, ["ab", "c"], s)
    (llm,) = fake_vllm.built
    assert llm.kwargs["model"] == "Qwen/Qwen2.5-0.5B" and llm.kwargs["revision"] == "abc123"
    assert llm.kwargs["tokenizer_revision"] == "abc123" and llm.kwargs["tensor_parallel_size"] == 2
    requests, params, _ = llm.calls[0]
    assert requests == [{"prompt_token_ids": [97, 98]}, {"prompt_token_ids": [99]}]
    assert [(p.n, p.temperature, p.top_p, p.max_tokens) for p in params] == [(3, 0.6, 0.95, 7)] * 2
    # one hashed seed per prompt: a prompt's samples do not depend on the other prompts of the
    # call, and the seeds + j of its samples never run into a neighbour's (no base + i)
    assert [p.seed for p in params] == [prompt_seed(5, 0), prompt_seed(5, 1)]
    assert abs(params[0].seed - params[1].seed) > 1_000_000
    assert all(p.skip_special_tokens is True and not hasattr(p, "logprobs") for p in params)
    assert [(x.prompt_idx, x.sample_idx) for x in out] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert out[1] == Sample(0, 1, [97, 98], [0, 1, 0], "r0.1", "stop")
    assert [x.finish_reason for x in out[3:]] == ["stop", "stop", "length"]


def test_batch_invariance_is_set_before_the_engine_starts(tmp_path, fake_vllm, monkeypatch):
    monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)
    ref = tmp_path / "base.json"
    ref.write_text(json.dumps({"kind": "hub", "model_id": "Qwen/Qwen2.5-0.5B", "revision": "abc"}))
    generate("vllm", ref, ["a"], SamplingSettings(n=1, temperature=1.0, top_p=1.0,
                                                  max_new_tokens=2, seed=0, batch_invariant=True))
    import os

    assert os.environ["VLLM_BATCH_INVARIANT"] == "1"


def policy_sampler(tmp_path, dtype="float32", policy=None):
    from stages.core.samplers import VllmPolicySampler

    ref = tmp_path / "base.json"
    ref.write_text(json.dumps({"kind": "scratch", "path": "checkpoint"}))
    policy = policy if policy is not None else HeadPolicy(2, 3)
    return VllmPolicySampler(ref, policy, FakeTokenizer(), world_size=1, seed=3,
                             gpu_memory_utilization=0.3, max_model_len=64, dtype=dtype), policy


def test_policy_sampler_loads_weights_and_samples(tmp_path, fake_vllm):
    sampler, policy = policy_sampler(tmp_path)
    (llm,) = fake_vllm.built
    assert llm.kwargs["model"] == str(tmp_path / "checkpoint") and llm.kwargs["revision"] is None
    assert llm.kwargs["distributed_executor_backend"] is None and llm.kwargs["max_model_len"] == 64
    assert llm.kwargs["enable_sleep_mode"] is True
    # log-probs after temperature and top-p (the distribution sampled from); float32 training: no
    # head override needed
    assert llm.kwargs["logprobs_mode"] == "processed_logprobs" and "hf_overrides" not in llm.kwargs
    assert llm.loaded == ["weight", "bias"] and llm.resets == 1  # synced once when built
    out = sampler.sample(["x", "yz"], n=2, temperature=1.0, top_p=1.0, max_new_tokens=[4, 6],
                         prompt_seeds=[11, 12])
    assert out[:2] == [Sample(0, 0, [120], [0, 0, 0], "r0.0", "stop", [-0.5, -1.0, -1.5]),
                       Sample(0, 1, [120], [0, 1, 0], "r0.1", "length", [-0.5, -1.0, -1.5])]
    _, params, progress_bar = llm.calls[0]
    assert progress_bar is False  # no progress bar inside the training loop
    assert [p.max_tokens for p in params] == [4, 6]  # each prompt's own limit
    assert [p.seed for p in params] == [11, 12]  # the trainer's seeds, from the prompts' pool indices
    assert all(p.logprobs == 0 for p in params)  # the sampled token's log-prob only
    assert all(p.stop_token_ids == [1, 2] for p in params)  # end-of-text and end-of-turn
    # asleep while the step trains: sampling again before the weights are synced is refused
    with pytest.raises(RuntimeError, match="asleep"):
        sampler.sample(["x"], n=1, temperature=1.0, top_p=1.0, max_new_tokens=4, prompt_seeds=[1])
    with torch.no_grad():
        policy.weight += 1.0
    sampler.sync()
    assert llm.loaded == ["weight", "bias"] * 2 and llm.resets == 2
    assert torch.equal(llm.lm_head.weight, policy.weight.detach())  # the head came back
    # level 2: nothing copied to host memory; weights woken before they are loaded, the KV cache
    # only after: never both next to training
    assert llm.events == ["load", "generate", "sleep2", "wake:weights", "load", "wake:kv_cache"]
    sampler.sample(["x"], n=1, temperature=1.0, top_p=1.0, max_new_tokens=4, prompt_seeds=[1])
    assert llm.events[-2:] == ["generate", "sleep2"]


def test_bf16_training_asks_for_a_float32_head_and_checks_the_live_one(tmp_path, fake_vllm):
    policy_sampler(tmp_path, dtype="bfloat16")
    (llm,) = fake_vllm.built
    assert llm.kwargs["hf_overrides"] == {"head_dtype": "float32"} and llm.kwargs["dtype"] == "bfloat16"
    assert llm.lm_head.weight.dtype == torch.float32
    # an engine that accepts the override but keeps a bf16 head is refused
    fake_vllm.head_dtype_honoured = False
    with pytest.raises(RuntimeError, match="LM head is torch.bfloat16"):
        policy_sampler(tmp_path, dtype="bfloat16")


def test_a_tied_head_lost_in_sleep_is_caught(tmp_path, fake_vllm):
    sampler, policy = policy_sampler(tmp_path)
    fake_vllm.reload_tied_head = False
    sampler.sample(["x"], n=1, temperature=1.0, top_p=1.0, max_new_tokens=4, prompt_seeds=[1])
    with torch.no_grad():
        policy.weight += 1.0
    with pytest.raises(RuntimeError, match="LM head differs"):
        sampler.sync()


def test_policy_sampler_hands_the_whole_state_dict_once_per_update(tmp_path, fake_vllm):
    """A causal LM with a tied head: every name of its state dict (the head under both of its
    names, as vLLM's loader expects them) exactly once when built and once per sync."""
    from stages.core.modeling import build_scratch_model
    from tests.conftest import TINY_ARCH

    lm = build_scratch_model(TINY_ARCH, 259, 256, seed=0)
    sampler, _ = policy_sampler(tmp_path, policy=lm)
    (llm,) = fake_vllm.built
    names = list(lm.state_dict())
    assert "lm_head.weight" in names and "model.embed_tokens.weight" in names
    assert sorted(llm.loaded) == sorted(names)
    sampler.sample(["x"], n=1, temperature=1.0, top_p=1.0, max_new_tokens=4, prompt_seeds=[1])
    sampler.sync()
    assert sorted(llm.loaded) == sorted(names * 2) and llm.events.count("load") == 2


def test_engine_groups_must_divide_the_ranks(tmp_path, fake_vllm):
    from stages.core.samplers import VllmPolicySampler

    with pytest.raises(ValueError, match="tensor_parallel_size 2 does not divide the 3 ranks"):
        VllmPolicySampler(tmp_path / "base.json", HeadPolicy(2, 3), FakeTokenizer(), world_size=3,
                          seed=0, gpu_memory_utilization=0.3, max_model_len=64, dtype="float32",
                          tensor_parallel_size=2)
    assert fake_vllm.built == []
