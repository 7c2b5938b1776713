"""Our code around vLLM, against a stand-in `vllm` module where the real engine cannot go.

The real engine runs in tests/test_vllm_engine.py (vLLM's CPU build, the same Python code as the
GPU wheel): sampling, log-probs, seeds, the weight reload and a whole training through it. What
stays here is what the CPU build cannot show: sleep mode and its ordering around the weight
reload (vLLM's CPU build has no sleep mode), dynamic sampling over several generation batches with
an engine that sleeps, tensor-parallel engine groups and ZeRO-3 gathering in two processes
(tests/test_zero3.py uses this stand-in), and a vLLM that ignores the float32 head. The stand-in
refuses every keyword the pinned vLLM refuses; tests/test_vllm_engine.py checks its keyword sets
against the installed vLLM's signatures.
"""

from __future__ import annotations

import json
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from stages.config import ConfigError
from stages.core.models.backends import SamplingSettings, generate, prompt_seed
from stages.core.models.generation import Sample


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
# (tests/test_vllm_engine.py: each is an argument of the installed vLLM's.)
LLM_KEYWORDS = {"model", "revision", "tokenizer_revision", "seed", "tensor_parallel_size", "dtype",
                "max_model_len", "gpu_memory_utilization", "enable_sleep_mode",
                "distributed_executor_backend", "hf_overrides", "logprobs_mode", "enforce_eager",
                "kv_cache_memory_bytes"}
SAMPLING_KEYWORDS = {"n", "temperature", "top_p", "max_tokens", "seed", "stop_token_ids",
                     "skip_special_tokens", "logprobs"}
LOGPROBS_MODES = {"raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"}


class FakePlatform:
    """vllm.platforms.current_platform: a GPU's (sleep mode) unless the stand-in says CPU."""

    @staticmethod
    def is_sleep_mode_available() -> bool:
        return FakeLLM.sleep_mode

    @staticmethod
    def is_cpu() -> bool:
        return not FakeLLM.sleep_mode


class FakeLLM:
    built: list = []
    head_dtype_honoured = True  # the stand-in of a vLLM that ignores hf_overrides head_dtype: False
    reload_tied_head = True  # the stand-in of a level-2 sleep that loses a tied head: False
    sleep_mode = True  # a GPU's platform; vLLM's CPU build refuses enable_sleep_mode

    def __init__(self, **kwargs):
        unknown = set(kwargs) - LLM_KEYWORDS
        if unknown:
            raise TypeError(f"LLM() got unexpected keyword arguments {sorted(unknown)}")
        if kwargs.get("logprobs_mode", "raw_logprobs") not in LOGPROBS_MODES:
            raise ValueError(f"unknown logprobs_mode {kwargs['logprobs_mode']!r}")
        if kwargs.get("enable_sleep_mode") and not self.sleep_mode:
            raise ValueError("Sleep mode is not supported on current platform.")
        self.kwargs = kwargs
        self.calls = []
        self.loaded: list[str] = []
        self.resets = 0
        self.events: list[str] = []  # sleep / wake-up calls and weight reloads, in order
        FakeLLM.built.append(self)
        # as vLLM 0.31: the head's weight stays in the model's dtype, the override sets the dtype
        # its logits processor computes in
        model_dtype = torch.float32 if kwargs.get("dtype") == "float32" else torch.bfloat16
        fp32 = (kwargs.get("hf_overrides") or {}).get("head_dtype") == "float32"
        self.lm_head = types.SimpleNamespace(weight=torch.zeros(3, 2, dtype=model_dtype))
        processor = types.SimpleNamespace(
            head_dtype=torch.float32 if fp32 and self.head_dtype_honoured else model_dtype)
        model = types.SimpleNamespace(lm_head=self.lm_head, logits_processor=processor)
        self.worker = types.SimpleNamespace(model_runner=types.SimpleNamespace(model=model),
                                            reload_weights=self._reload)
        self.llm_engine = types.SimpleNamespace(
            model_executor=types.SimpleNamespace(driver_worker=types.SimpleNamespace(worker=self.worker)),
            engine_core=types.SimpleNamespace(shutdown=lambda: self.events.append("shutdown")))

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        return [getattr(self.worker, method)(*args, **(kwargs or {}))]

    def _reload(self, weights_iterator=None, weights_path=None, is_checkpoint_format=True):
        for name, tensor in weights_iterator:
            self.loaded.append(name)
            if name == "weight" and (self.reload_tied_head or "sleep2" not in self.events):
                self.lm_head.weight.copy_(tensor[:3].to(self.lm_head.weight.dtype))
        self.events.append("load")

    def sleep(self, level=1):
        assert self.kwargs.get("enable_sleep_mode"), "sleep() on an engine built without sleep mode"
        self.events.append(f"sleep{level}")

    def wake_up(self, tags=None):
        self.events.append(f"wake:{','.join(tags)}")

    def get_tokenizer(self):
        return FakeTokenizer()

    def reset_prefix_cache(self):
        self.resets += 1

    def generate(self, requests, params, use_tqdm=True):
        assert "sleep2" not in self.events[-1:], "generate() on a sleeping engine"
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


def fake_vllm_modules(llm_class=None) -> dict[str, types.SimpleNamespace]:
    """sys.modules entries that make `from vllm import LLM, SamplingParams` and
    `from vllm.platforms import current_platform` find the stand-in."""
    platforms = types.SimpleNamespace(current_platform=FakePlatform)
    return {"vllm": types.SimpleNamespace(LLM=llm_class or FakeLLM, SamplingParams=FakeParams,
                                          platforms=platforms),
            "vllm.platforms": platforms}


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
    monkeypatch.setattr(FakeLLM, "sleep_mode", True)
    for name, module in fake_vllm_modules().items():
        monkeypatch.setitem(sys.modules, name, module)
    return FakeLLM


def test_the_stand_in_refuses_what_vllm_refuses(fake_vllm):
    with pytest.raises(TypeError, match="unexpected keyword"):
        FakeLLM(model="m", head_dtype="float32")  # only through hf_overrides
    with pytest.raises(TypeError, match="unexpected keyword"):
        FakeParams(n=1, return_logprobs=True)
    with pytest.raises(ValueError, match="logprobs_mode"):
        FakeLLM(model="m", logprobs_mode="processed")


def hub_ref(tmp_path, monkeypatch, commit: str = "abc123") -> Path:
    """base.json of a fetched hub model: its commit's snapshot in a store of its own (HF_HUB_CACHE),
    as python -m stages.fetch leaves it."""
    store = tmp_path / "store"
    monkeypatch.setenv("HF_HUB_CACHE", str(store))
    snap = store / "models--Qwen--Qwen2.5-0.5B" / "snapshots" / commit
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    ref = tmp_path / "base.json"
    ref.write_text(json.dumps({"kind": "hub", "model_id": "Qwen/Qwen2.5-0.5B", "revision": "main",
                               "commit": commit, "files": {"config.json": 2}}))
    return ref


def test_rollout_backend_rows_and_engine(tmp_path, fake_vllm, monkeypatch):
    ref = hub_ref(tmp_path, monkeypatch)
    s = SamplingSettings(n=3, temperature=0.6, top_p=0.95, max_new_tokens=7, seed=5, tensor_parallel_size=2)
    out = generate("vllm", ref, ["ab", "c"], s)
    (llm,) = fake_vllm.built
    # the engine gets the snapshot folder, never a hub id (which would send it to the network)
    assert llm.kwargs["model"] == str(tmp_path / "store/models--Qwen--Qwen2.5-0.5B/snapshots/abc123")
    assert llm.kwargs["revision"] is None and llm.kwargs["tokenizer_revision"] is None
    assert llm.kwargs["tensor_parallel_size"] == 2
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
    ref = hub_ref(tmp_path, monkeypatch)
    settings = SamplingSettings(n=1, temperature=1.0, top_p=1.0, max_new_tokens=2, seed=0,
                                batch_invariant=True)
    generate("vllm", ref, ["a"], settings)
    import os

    assert os.environ["VLLM_BATCH_INVARIANT"] == "1"
    # GPU (Triton) kernels: on vLLM's CPU build the key is an error naming it, before any engine
    monkeypatch.delenv("VLLM_BATCH_INVARIANT")
    fake_vllm.sleep_mode = False  # the CPU build's platform
    fake_vllm.built = []
    with pytest.raises(ConfigError, match=r"evaluate.batch_invariant: .*CPU build"):
        generate("vllm", ref, ["a"], settings)
    assert fake_vllm.built == [] and "VLLM_BATCH_INVARIANT" not in os.environ


def test_engine_kwargs_reach_the_engine(tmp_path, fake_vllm, monkeypatch):
    ref = hub_ref(tmp_path, monkeypatch)
    generate("vllm", ref, ["a"], SamplingSettings(
        n=1, temperature=1.0, top_p=1.0, max_new_tokens=2, seed=0,
        engine_kwargs={"enforce_eager": True, "gpu_memory_utilization": 0.5}))
    (llm,) = fake_vllm.built
    assert llm.kwargs["enforce_eager"] is True and llm.kwargs["gpu_memory_utilization"] == 0.5
    sampler, _ = policy_sampler(tmp_path, engine_kwargs={"kv_cache_memory_bytes": 1 << 20})
    assert fake_vllm.built[-1].kwargs["kv_cache_memory_bytes"] == 1 << 20


def policy_sampler(tmp_path, dtype="float32", policy=None, **extra):
    from stages.core.models.samplers import VllmPolicySampler

    ref = tmp_path / "base.json"
    ref.write_text(json.dumps({"kind": "scratch", "path": "checkpoint"}))
    policy = policy if policy is not None else HeadPolicy(2, 3)
    return VllmPolicySampler(ref, policy, FakeTokenizer(), world_size=1, seed=3,
                             gpu_memory_utilization=0.3, max_model_len=64, dtype=dtype,
                             **extra), policy


def test_policy_sampler_loads_weights_and_samples(tmp_path, fake_vllm, monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")  # a site's export: overridden
    sampler, policy = policy_sampler(tmp_path)
    import os

    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # the engine must stay in-process
    (llm,) = fake_vllm.built
    assert llm.kwargs["model"] == str(tmp_path / "checkpoint") and llm.kwargs["revision"] is None
    assert llm.kwargs["distributed_executor_backend"] is None and llm.kwargs["max_model_len"] == 64
    assert llm.kwargs["enable_sleep_mode"] is True  # the platform has it
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
    # a second generation batch of the same step (dynamic sampling): still awake
    sampler.sample(["x"], n=1, temperature=1.0, top_p=1.0, max_new_tokens=4, prompt_seeds=[1])
    sampler.release()  # the step's rollouts are in: asleep while the step trains
    with pytest.raises(RuntimeError, match="asleep"):
        sampler.sample(["x"], n=1, temperature=1.0, top_p=1.0, max_new_tokens=4, prompt_seeds=[1])
    with torch.no_grad():
        policy.weight += 1.0
    sampler.sync()
    assert llm.loaded == ["weight", "bias"] * 2 and llm.resets == 2
    assert torch.equal(llm.lm_head.weight, policy.weight.detach())  # the head came back
    # level 2: nothing copied to host memory; weights woken before they are loaded, the KV cache
    # only after: never both next to training; one sleep per step, however many batches
    assert llm.events == ["load", "generate", "generate", "sleep2", "wake:weights", "load",
                          "wake:kv_cache"]
    sampler.sample(["x"], n=1, temperature=1.0, top_p=1.0, max_new_tokens=4, prompt_seeds=[1])
    sampler.release()
    sampler.release()  # once asleep, nothing more
    assert llm.events[-2:] == ["generate", "sleep2"]
    sampler.close()  # the engine shuts down before the trainer's process group goes
    assert llm.events[-1] == "shutdown"


def test_without_sleep_mode_the_engine_stays_awake(tmp_path, fake_vllm):
    """vLLM's CPU build has no sleep mode (it refuses enable_sleep_mode): the sampler builds its
    engine without it, release() is a no-op and sync() reloads the weights of an awake engine."""
    fake_vllm.sleep_mode = False
    sampler, policy = policy_sampler(tmp_path)
    (llm,) = fake_vllm.built
    assert "enable_sleep_mode" not in llm.kwargs
    sampler.sample(["x"], n=1, temperature=1.0, top_p=1.0, max_new_tokens=4, prompt_seeds=[1])
    sampler.release()
    sampler.sample(["x"], n=1, temperature=1.0, top_p=1.0, max_new_tokens=4, prompt_seeds=[1])
    sampler.sync()
    assert llm.events == ["load", "generate", "generate", "load"]


def test_bf16_training_asks_for_a_float32_head_and_checks_the_live_one(tmp_path, fake_vllm):
    sampler, _ = policy_sampler(tmp_path, dtype="bfloat16")
    (llm,) = fake_vllm.built
    assert llm.kwargs["hf_overrides"] == {"head_dtype": "float32"} and llm.kwargs["dtype"] == "bfloat16"
    # as vLLM 0.31 does it: the weight stays bf16, the logits are computed in float32
    assert llm.lm_head.weight.dtype == torch.bfloat16 and sampler.head_dtype() == torch.float32
    # an engine that accepts the override but keeps computing in bf16 is refused
    fake_vllm.head_dtype_honoured = False
    with pytest.raises(RuntimeError, match="computes its LM head in torch.bfloat16"):
        policy_sampler(tmp_path, dtype="bfloat16")
    # asked not to (train.vllm_float32_head: false): no override, nothing to check
    sampler, _ = policy_sampler(tmp_path, dtype="bfloat16", float32_head=False)
    assert "hf_overrides" not in fake_vllm.built[-1].kwargs
    assert sampler.head_dtype() == torch.bfloat16


def test_a_tied_head_lost_in_sleep_is_caught(tmp_path, fake_vllm):
    sampler, policy = policy_sampler(tmp_path)
    fake_vllm.reload_tied_head = False
    sampler.sample(["x"], n=1, temperature=1.0, top_p=1.0, max_new_tokens=4, prompt_seeds=[1])
    sampler.release()
    with torch.no_grad():
        policy.weight += 1.0
    with pytest.raises(RuntimeError, match="LM head differs"):
        sampler.sync()


def test_policy_sampler_hands_the_whole_state_dict_once_per_update(tmp_path, fake_vllm):
    """A causal LM with a tied head: every name of its state dict (the head under both of its
    names, as vLLM's loader expects them) exactly once when built and once per sync, in one
    reload call each."""
    from stages.core.models.modeling import build_scratch_model
    from tests.conftest import TINY_ARCH

    lm = build_scratch_model(TINY_ARCH, 259, 256, seed=0)
    sampler, _ = policy_sampler(tmp_path, policy=lm)
    (llm,) = fake_vllm.built
    names = list(lm.state_dict())
    assert "lm_head.weight" in names and "model.embed_tokens.weight" in names
    assert sorted(llm.loaded) == sorted(names)
    sampler.sample(["x"], n=1, temperature=1.0, top_p=1.0, max_new_tokens=4, prompt_seeds=[1])
    sampler.release()
    sampler.sync()
    assert sorted(llm.loaded) == sorted(names * 2) and llm.events.count("load") == 2


def test_a_decoder_layer_split_over_groups_is_copied():
    """engine_weights: the tensors of a decoder layer whose parameters fall into two groups are
    copies (vLLM keeps them until the layer's last tensor arrives, after their group is
    released); a layer inside one group goes as it is. Names only here: the groups of a
    partitioned module come from stages.core.models.policy.state_groups (tests/test_vllm_engine.py runs
    it under ZeRO-3 with the real engine)."""
    from stages.core.models.samplers import layer_of

    assert layer_of("model.layers.12.mlp.up_proj.weight") == "model.layers.12"
    assert layer_of("model.layers.3.self_attn.q_proj.bias") == "model.layers.3"
    assert layer_of("model.embed_tokens.weight") == "model.embed_tokens.weight"
    assert layer_of("lm_head.weight") == "lm_head.weight"


def test_dynamic_sampling_runs_several_generation_batches_on_an_engine_that_sleeps(
        tmp_path, fake_vllm, test_raw):
    """Dynamic sampling samples one generation batch after another within a step; the engine
    sleeps once, after the last (stages.train calls release() after collect()). The stand-in's
    responses are never correct, so every batch keeps nothing and the step runs out of batches:
    max_sampling_rounds generation batches, none refused as asleep."""
    from stages.config import validate
    from stages.core.models.engine import Dist
    from stages.core.training.rollouts import PromptPool, Sampled, SamplingExhausted, collect

    test_raw["train"].update(dynamic_sampling=True, max_sampling_rounds=3,
                             generation_batch_multiple=2)
    cfg = validate(test_raw, "test.yaml")
    sampler, _ = policy_sampler(tmp_path)
    pool = PromptPool([f"q{i}" for i in range(16)], ["7"] * 16, ["math"] * 16, [4] * 16)
    sampled = Sampled()
    with pytest.raises(SamplingExhausted, match="after 3 generation batches"):
        collect(0, 0, cfg, 0, sampler, pool, Dist(0, 1, torch.device("cpu")), sampled)
    (llm,) = fake_vllm.built
    assert llm.events == ["load", "generate", "generate", "generate"]
    assert sampled.generation_batches == 3
    sampler.release()
    assert llm.events[-1] == "sleep2"


def test_engine_groups_must_divide_the_ranks(tmp_path, fake_vllm):
    from stages.core.models.samplers import VllmPolicySampler

    with pytest.raises(ValueError, match="tensor_parallel_size 2 does not divide the 3 ranks"):
        VllmPolicySampler(tmp_path / "base.json", HeadPolicy(2, 3), FakeTokenizer(), world_size=3,
                          seed=0, gpu_memory_utilization=0.3, max_model_len=64, dtype="float32",
                          tensor_parallel_size=2)
    assert fake_vllm.built == []


def test_the_heads_float64_sum_is_built_only_where_the_check_runs(tmp_path, fake_vllm, monkeypatch):
    """check_head_loaded compares one engine's whole head; a tensor-parallel engine's shard is not
    checked, so no sync builds the float64 sum of the head (GBs at 8B-32B) for it."""
    from stages.core.models.samplers import VllmPolicySampler

    sampler, _ = policy_sampler(tmp_path)
    sums = []
    monkeypatch.setattr(VllmPolicySampler, "check_head_loaded",
                        lambda self, rows, picked, total, vocab: sums.append(total))
    sampler.sync()
    assert len(sums) == 1
    sampler.tp = 2
    sampler.sync()
    assert len(sums) == 1
