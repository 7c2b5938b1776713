"""Our code around vLLM, against a stand-in `vllm` module (vLLM itself needs a GPU).

What is checked is ours: the engine is built from the model reference, prompts go in as token
ids, completions come back as the `hf` backend's Sample rows in (prompt, sample) order with
their finish reasons, and the trainer's sampler loads the policy's weights into the engine and
drops its prefix cache. Whether vLLM samples correctly is vLLM's business (and the GPU test's).
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


class FakeLLM:
    built: list = []

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.calls = []
        self.loaded: list[str] = []
        self.resets = 0
        self.events: list[str] = []  # sleep / wake-up calls and weight loads, in order
        FakeLLM.built.append(self)
        model = types.SimpleNamespace(load_weights=self._load)
        worker = types.SimpleNamespace(model_runner=types.SimpleNamespace(model=model))
        self.llm_engine = types.SimpleNamespace(model_executor=types.SimpleNamespace(driver_worker=worker))

    def _load(self, weights):
        self.loaded.extend(name for name, _ in weights)
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
        # sample j of prompt i: tokens (i, j); the last one of each prompt runs out of tokens
        return [types.SimpleNamespace(outputs=[
            Completion((i, j, 0), f"r{i}.{j}", "length" if j == p.n - 1 else "stop")
            for j in range(p.n)]) for i, p in enumerate(params)]


class FakeParams:
    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)


@pytest.fixture
def fake_vllm(monkeypatch):
    FakeLLM.built = []
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=FakeLLM, SamplingParams=FakeParams))
    return FakeLLM


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
    # one seed per prompt: a prompt's samples do not depend on the other prompts of the call
    assert [p.seed for p in params] == [prompt_seed(5, 0), prompt_seed(5, 1)]
    assert len({p.seed for p in params}) == 2
    assert all(p.skip_special_tokens is True for p in params)
    assert [(x.prompt_idx, x.sample_idx) for x in out] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert out[1] == Sample(0, 1, [97, 98], [0, 1, 0], "r0.1", "stop")
    assert [x.finish_reason for x in out[3:]] == ["stop", "stop", "length"]


def test_policy_sampler_loads_weights_and_samples(tmp_path, fake_vllm):
    from stages.core.samplers import VllmPolicySampler

    ref = tmp_path / "base.json"
    ref.write_text(json.dumps({"kind": "scratch", "path": "checkpoint"}))
    policy = torch.nn.Linear(2, 2)
    sampler = VllmPolicySampler(ref, policy, FakeTokenizer(), world_size=1, seed=3,
                                gpu_memory_utilization=0.3, max_model_len=64, dtype="float32")
    (llm,) = fake_vllm.built
    assert llm.kwargs["model"] == str(tmp_path / "checkpoint") and llm.kwargs["revision"] is None
    assert llm.kwargs["distributed_executor_backend"] is None and llm.kwargs["max_model_len"] == 64
    assert llm.kwargs["enable_sleep_mode"] is True
    assert llm.loaded == ["weight", "bias"] and llm.resets == 1  # synced once when built
    out = sampler.sample(["x", "yz"], n=2, temperature=1.0, top_p=1.0, max_new_tokens=[4, 6], seed=9)
    assert out[:2] == [Sample(0, 0, [120], [0, 0, 0], "r0.0", "stop"), Sample(0, 1, [120], [0, 1, 0], "r0.1", "length")]
    _, params, progress_bar = llm.calls[0]
    assert progress_bar is False  # no progress bar inside the training loop
    assert [p.max_tokens for p in params] == [4, 6]  # each prompt's own limit
    assert all(p.stop_token_ids == [1, 2] for p in params)  # end-of-text and end-of-turn
    # asleep while the step trains: sampling again before the weights are synced is refused
    with pytest.raises(RuntimeError, match="asleep"):
        sampler.sample(["x"], n=1, temperature=1.0, top_p=1.0, max_new_tokens=4, seed=9)
    sampler.sync()
    assert llm.loaded == ["weight", "bias"] * 2 and llm.resets == 2
    # weights woken before they are loaded, the KV cache only after: never both next to training
    assert llm.events == ["load", "generate", "sleep1", "wake:weights", "load", "wake:kv_cache"]
    sampler.sample(["x"], n=1, temperature=1.0, top_p=1.0, max_new_tokens=4, seed=9)
    assert llm.events[-2:] == ["generate", "sleep1"]
