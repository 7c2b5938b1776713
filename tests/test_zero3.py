"""ZeRO-3: the trainer on partitioned parameters equals ZeRO-2 at the same world size.

Real DeepSpeed on CPU processes (gloo), the tiny models of tests/test_train.py. Through the stage
(two processes started by stages.launch): ZeRO-3 against ZeRO-2 on a tied head in float32 (within
1e-5, gradient checkpointing on) and an untied head in bf16 (exactly), with the KL term on (the
reference partitioned too), ICT's selector (the scorer's deviations), a token budget that gives
the ranks unequal numbers of micro-batches, and DeepSpeed's CPU offload of parameters and
optimizer states against none. In one two-process job of real components: the actor of ZeRO-3
against ZeRO-2 with unequal micro-batches per rank; the resume state saved from the shards
continues the run exactly; the vLLM stand-in, one engine for both ranks, receives exactly the
full state dict once per update, gathered group by group; hf generation runs in step with
unequal work per rank and samples what the unpartitioned model samples.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest
import torch
import yaml
from safetensors.torch import load_file

from stages.core.models.modeling import build_scratch_model
from stages.core.models.policy import Policy, gathered_state
from stages.train import TIME_COLUMNS
from tests.conftest import ROOT, write_yaml
from tests.helpers import run_ranks, worker_argv
from tests.test_train import ARCH, PAD, VOCAB, cli_args, job, random_batch  # noqa: F401

pytestmark = pytest.mark.slow  # DeepSpeed ZeRO-3 across processes, through the stage: scripts/test.sh --all


# ---------------------------------------------------------------------------------------------
# One process: the module and its gathering without DeepSpeed
# ---------------------------------------------------------------------------------------------
def untied(model):
    """A copy of a tied Qwen2 whose head is its own parameter (equal to the embedding at first)."""
    from transformers import Qwen2ForCausalLM

    config = copy.deepcopy(model.config)
    config.tie_word_embeddings = False
    out = Qwen2ForCausalLM(config).to(model.dtype)
    out.load_state_dict(model.state_dict(), strict=False)
    with torch.no_grad():
        out.lm_head.weight.copy_(model.lm_head.weight)
    return out


@pytest.mark.parametrize("tied", [True, False])
def test_the_policy_owns_trunk_and_head_and_hands_out_the_whole_state(tied):
    lm = build_scratch_model(ARCH, VOCAB, PAD, seed=0)
    lm = lm if tied else untied(lm)
    policy = Policy(lm)
    assert policy.trunk is lm.model and policy.head is lm.lm_head
    assert (policy.head.weight is lm.model.embed_tokens.weight) == tied
    groups = list(gathered_state(lm))  # unpartitioned: one group, the live tensors
    assert len(groups) == 1 and list(groups[0]) == list(lm.state_dict())
    calls = []
    out = policy(torch.ones(2), fn=lambda head, x, scale: calls.append(head) or x * scale, scale=3.0)
    assert calls == [lm.lm_head] and out.tolist() == [3.0, 3.0]


# ---------------------------------------------------------------------------------------------
# Through the stage: ZeRO-3 (and offload) against ZeRO-2, two processes
# ---------------------------------------------------------------------------------------------
def launch_train(d, out: str, config: str, model: str = "base.json") -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "stages.launch", "--gpus", "0", "--nodes", "1", "--procs-per-node",
           "2", "--", sys.executable, "-m", "stages.train",
           *cli_args(d, out, config=config, model=model)]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def stage_config(d, raw, name: str, **train) -> str:
    cfg = copy.deepcopy(raw)
    cfg["models"]["tiny-s"]["train_processes"] = 2
    cfg["train"].update(steps=2, checkpoint_every=1, micro_batch_size=4, micro_batch_tokens=40,
                        loss={"kl_beta": 0.05, "denominator": "sequence"}, **train)
    write_yaml(d / f"{name}.yaml", cfg)
    return f"{name}.yaml"


def untied_base(d) -> str:
    """The job's base model with an untied head, saved beside it."""
    from stages.core.models.modeling import load_model_and_tokenizer
    from tests.conftest import save_scratch_model

    folder = d / "untied"
    if not (folder / "base.json").exists():
        model, tok = load_model_and_tokenizer(d / "base.json")
        folder.mkdir(exist_ok=True)
        save_scratch_model(folder, untied(model), tok)
    return "untied/base.json"


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_zero3_equals_zero2_through_the_stage(job, dtype):  # noqa: F811
    """float32 on the tied head: ZeRO-3 within 1e-5 of ZeRO-2 (metrics and final weights);
    bf16 on an untied head: ZeRO-3 equal to ZeRO-2, and offloading parameters and optimizer states
    to the CPU equal to not offloading, bit for bit (the final weights and every metric; the
    gradient norm, which DeepSpeed sums in another precision under ZeRO-3, to 1e-6)."""
    d, raw = job
    model = "base.json" if dtype == "float32" else untied_base(d)
    extra = {"gradient_checkpointing": True} if dtype == "float32" else {}
    runs = {"zero2": {"zero_stage": 2, **extra}, "zero3": {"zero_stage": 3, **extra}}
    if dtype == "bfloat16":
        runs["offload"] = {"zero_stage": 3, "offload_params": True, "offload_optimizer": True}
    metrics, weights = {}, {}
    for name, train in runs.items():
        out = f"z-{dtype}-{name}"
        proc = launch_train(d, out, stage_config(d, raw, out, dtype=dtype, **train), model)
        assert proc.returncode == 0, proc.stderr[-4000:]
        metrics[name] = pl.read_parquet(d / out / "metrics.parquet").drop(TIME_COLUMNS)
        weights[name] = load_file(d / out / "final" / "model.safetensors")
        assert not (d / f"{out}-resume").exists()
    base = metrics["zero2"]
    assert base["micro_batches"].min() >= 2 and base["kl"][1] > 0 and base["grad_norm"].min() > 0
    assert base["selected_fraction"][1] < 1.0  # ICT selects on the scorer's group_jsd
    tied = dtype == "float32"
    assert ("lm_head.weight" in weights["zero2"]) != tied  # the original architecture, as saved
    for name in runs:
        if name == "zero2":
            continue
        other = metrics[name]
        assert other.columns == base.columns and other["step"].to_list() == [0, 1]
        assert set(weights[name]) == set(weights["zero2"])
        if dtype == "bfloat16":
            # DeepSpeed reports ZeRO-2's gradient norm in float32, ZeRO-3's in float64
            assert other["grad_norm"].to_list() == pytest.approx(base["grad_norm"].to_list(), rel=1e-6)
            assert other.drop("grad_norm").equals(base.drop("grad_norm")), name
            for key, value in weights["zero2"].items():
                assert torch.equal(weights[name][key], value), (name, key)
        else:
            for column in base.columns:
                for a, b in zip(base[column].to_list(), other[column].to_list(), strict=True):
                    assert (a is None) == (b is None), (name, column)
                    assert a is None or b == pytest.approx(a, rel=1e-5, abs=1e-5), (name, column)
            for key, value in weights["zero2"].items():
                assert torch.allclose(weights[name][key], value, rtol=0, atol=1e-5), (name, key)
    moved = weights["zero2"]["model.embed_tokens.weight"]
    start = load_file(next((d / ("checkpoint" if tied else "untied/checkpoint")).glob("*.safetensors")))
    assert not torch.equal(moved, start["model.embed_tokens.weight"].to(moved.dtype))


# ---------------------------------------------------------------------------------------------
# One two-process job: actor, scorer, reference, resume, vLLM weights and groups, hf generation
# ---------------------------------------------------------------------------------------------
def _recording_llm():
    """The vLLM stand-in of test_vllm_glue, recording every reload call: for each tensor it
    receives, its name, a copy, which of the policy's parameters were whole (gathered) meanwhile,
    and whether it shares storage with a parameter's gathered data (not copied)."""
    from tests.test_vllm_glue import FakeLLM

    class RecordingLLM(FakeLLM):
        policy = None  # the partitioned module whose gathering is watched

        def __init__(self, **kwargs):
            self.loads: list[list[tuple[str, torch.Tensor, list[str], bool]]] = []
            super().__init__(**kwargs)

        def _reload(self, weights_iterator=None, **kwargs):
            seen = []
            for name, tensor in weights_iterator:
                params = dict(self.policy.named_parameters())
                whole = [n for n, p in params.items() if p.data.numel() == p.ds_numel]
                shared = any(p.data.numel() and tensor.untyped_storage().data_ptr()
                             == p.data.untyped_storage().data_ptr() for p in params.values())
                seen.append((name, tensor.clone(), whole, shared))
            self.loads.append(seen)
            super()._reload(iter([(n, t) for n, t, _, _ in seen]), **kwargs)

    return RecordingLLM


def _zero3_worker(out: str) -> None:
    from stages import train
    from stages.config import validate
    from stages.core.models import engine as engine_glue
    from stages.core.models import policy as policy_mod
    from stages.core.models.generation import sample_hf
    from stages.core.models.modeling import build_tokenizer
    from stages.core.models.policy import full_state_dict
    from stages.core.models.samplers import HfPolicySampler, VllmPolicySampler
    from stages.core.statistics.scorer import micro_batches
    from stages.core.training.actor import actor_step
    from stages.core.training.rollouts import Rollouts
    from tests.test_vllm_glue import FakeTokenizer, fake_vllm_modules

    torch.set_num_threads(1)
    base = yaml.safe_load((ROOT / "config" / "test.yaml").read_text())
    base["train"].update(micro_batch_size=8, micro_batch_tokens=40, mini_batch_prompts=2,
                         prompts_per_step=2, group_size=4, lr=1e-2, grad_clip=1e9,
                         loss={"kl_beta": 0.05, "denominator": "sequence"})
    configs = {}
    for stage in (2, 3):
        raw = copy.deepcopy(base)
        raw["train"]["zero_stage"] = stage
        configs[stage] = validate(raw, f"zero{stage}")
    dist = engine_glue.init_distributed(engine_glue.resolve_launch(configs[3], "tiny-s"))
    rank = dist.rank
    report: dict = {}

    # rank 0 holds short responses, rank 1 long ones: the token budget splits them unequally
    g = torch.Generator().manual_seed(rank)
    width = 2 if rank == 0 else 25
    r_ids = [torch.randint(0, 256, (width + k,), generator=g).tolist() for k in range(4)]
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    report["local_micro_batches"] = len(micro_batches([3 + len(r) for r in r_ids], 8, 40))
    method = configs[3].methods["ict"]  # needs ICT's u: the scorer's deviations, with the head

    def step(engine, cfg, ref, on_policy, stats=None):
        mb = Rollouts([[1, 2, 3]] * 4, r_ids, [0] * 4, adv)
        mb.stats = train.rescore(engine.module, mb, train.scorer_needs(method, False), cfg, PAD, dist)
        if stats is not None:
            mb.stats["logprob"] = stats
        update = actor_step(engine, mb, method, cfg, dist, torch.Generator().manual_seed(5), PAD,
                            stats=mb.stats, on_policy=on_policy, ref_model=ref)
        return mb.stats, update

    def fresh(cfg):
        lm = untied(build_scratch_model(ARCH, VOCAB, PAD, seed=0))
        engine = engine_glue.build_engine(lm, cfg.train, dist.world)
        engine.train()
        return engine

    ckpt = os.path.join(os.path.dirname(out), "resume")
    for stage, cfg in configs.items():
        engine = fresh(cfg)
        ref = engine_glue.build_reference(untied(build_scratch_model(ARCH, VOCAB, PAD, seed=0)), cfg.train)
        stats, first = step(engine, cfg, ref, on_policy=True)
        report[stage] = {"stats": stats, "loss": first.loss, "norm": first.grad_norm,
                         "kl": first.kl_sum, "mask": first.mask, "calls": first.micro_batches,
                         "params": full_state_dict(engine.module.lm, keep=True)}
    # resume from the shards: a checkpoint after the first update, the second update continued
    # in this engine and in a fresh one loaded from the checkpoint
    train.save_state(engine, Path(ckpt), {"step": 1}, dist)
    old = stats["logprob"] - 0.1
    step(engine, cfg, ref, on_policy=False, stats=old)
    report["continued"] = full_state_dict(engine.module.lm, keep=True)
    again = fresh(cfg)
    path, _ = again.load_checkpoint(ckpt, tag="step000001", load_optimizer_states=True,
                                    load_lr_scheduler_states=False)
    assert path is not None
    step(again, cfg, ref, on_policy=False, stats=old)
    report["resumed"] = full_state_dict(again.module.lm, keep=True)

    # vLLM: the stand-in engine of a group of both ranks (tensor parallelism 2)
    llm_class = _recording_llm()
    llm_class.policy = engine.module.lm
    sys.modules.update(fake_vllm_modules(llm_class))
    policy_mod.GATHER_ELEMENTS = 3000  # the tiny model in several groups, layers split
    ref_json = os.path.join(os.path.dirname(out), "base.json")
    sampler = VllmPolicySampler(ref_json, engine.module.lm, FakeTokenizer(), world_size=2, seed=3,
                                gpu_memory_utilization=0.3, max_model_len=64, dtype="float32",
                                tensor_parallel_size=2)
    prompts = [["ab"], ["c", "de"]][rank]
    samples = sampler.sample(prompts, n=2, temperature=1.0, top_p=1.0,
                             max_new_tokens=[[4], [5, 6]][rank], prompt_seeds=[[11], [12, 13]][rank])
    sampler.release()
    sampler.sync()  # the next update's weights
    (llm,) = llm_class.built
    report["vllm"] = {"kwargs": llm.kwargs, "loads": llm.loads, "events": llm.events,
                      "groups": policy_mod.state_groups(engine.module.lm),
                      "requests": llm.calls[0][0],
                      "params": [(p.seed, p.max_tokens) for p in llm.calls[0][1]],
                      "samples": samples, "state": full_state_dict(engine.module.lm, keep=True)}

    # hf generation in step: rank 0 one batch of a short limit, rank 1 two batches
    tok = build_tokenizer()
    prompts = [["Q: 1+0=? A:"], ["Q: 2*1=? A:", "Q: 7+0=? A:"]][rank]
    limits = [[3], [6, 9]][rank]
    seeds = [[1], [2, 3]][rank]
    synced = HfPolicySampler(engine.module.lm, tok, batch_size=2, dist=dist)
    got = synced.sample(prompts, n=2, temperature=1.0, top_p=1.0, max_new_tokens=limits,
                        prompt_seeds=seeds)
    plain = untied(build_scratch_model(ARCH, VOCAB, PAD, seed=0))
    plain.load_state_dict(full_state_dict(engine.module.lm, keep=True))
    want = sample_hf(plain.eval(), tok, prompts, n=2, temperature=1.0, top_p=1.0,
                     max_new_tokens=limits, prompt_seeds=seeds, batch_size=2)
    report["hf"] = {"got": got, "want": want}
    torch.save(report, f"{out}.{rank}")
    dist.barrier()
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_zero3_actor_resume_vllm_and_generation_on_two_processes(tmp_path):
    (tmp_path / "base.json").write_text('{"kind": "scratch", "path": "checkpoint"}')
    run_ranks(2, worker_argv("tests.test_zero3", "_zero3_worker", tmp_path / "out.pt"))
    check_reports([torch.load(tmp_path / f"out.pt.{rank}", weights_only=False) for rank in range(2)])


def check_reports(reports: list[dict]) -> None:
    """What _zero3_worker's ranks saw."""
    from stages.core.models.samplers import layer_of

    one = reports[0]

    # the actor: ZeRO-3 = ZeRO-2 (untied head, KL on, ICT's u scored, unequal micro-batches)
    assert one["local_micro_batches"] < reports[1]["local_micro_batches"]
    z2, z3 = one[2], one[3]
    assert z3["calls"] == z2["calls"] == reports[1]["local_micro_batches"]
    assert z2["kl"] == z3["kl"] == 0.0  # on-policy: the partitioned reference equals the policy
    assert torch.equal(z2["mask"], z3["mask"]) and 0 < int(z2["mask"].sum())
    for key in ("entropy", "logprob", "group_jsd"):
        for r in reports:
            assert torch.allclose(r[3]["stats"][key], r[2]["stats"][key], rtol=1e-6, atol=1e-7), key
    assert z3["loss"] == pytest.approx(z2["loss"], rel=1e-5) and z2["norm"] > 0
    assert z3["norm"] == pytest.approx(z2["norm"], rel=1e-5)
    assert "lm_head.weight" in z2["params"]  # untied
    for name, value in z2["params"].items():
        assert torch.allclose(z3["params"][name], value, rtol=0, atol=1e-5), name
    # resume from the shards: bit for bit
    for name, value in one["continued"].items():
        assert torch.equal(one["resumed"][name], value), name

    # vLLM: one engine for both ranks, the same prompts and seeds, each rank its own rows
    names = list(one["vllm"]["state"])
    for rank, r in enumerate(reports):
        v = r["vllm"]
        assert v["kwargs"]["tensor_parallel_size"] == 2
        assert v["kwargs"]["distributed_executor_backend"] == "external_launcher"
        assert v["requests"] == [{"prompt_token_ids": ids} for ids in ([97, 98], [99], [100, 101])]
        assert v["params"] == [(11, 4), (12, 5), (13, 6)]
        mine = [(0, "ab")] if rank == 0 else [(1, "c"), (2, "de")]
        assert [(s.prompt_idx, s.sample_idx, s.response_token_ids) for s in v["samples"]] == [
            (k, j, [i, j, 0]) for k, (i, _) in enumerate(mine) for j in range(2)]
        assert v["events"] == reports[0]["vllm"]["events"]
        # twice (built, then the update) the full state dict in one reload call each, each name
        # once, group by group: while a tensor is read only its group's parameters are whole; a
        # decoder layer split over groups arrives as copies (vLLM holds them until its last
        # tensor), the others as the gathered tensors themselves
        groups = v["groups"]
        assert len(groups) > 2
        group_of = {n: k for k, names in enumerate(groups) for n in names}
        layer_groups: dict = {}
        for n, k in group_of.items():
            layer_groups.setdefault(layer_of(n), set()).add(k)
        split = {layer for layer, ks in layer_groups.items() if len(ks) > 1}
        assert split  # the test's point: some layer spans two groups
        assert len(v["loads"]) == 2
        for sync in v["loads"]:
            assert sorted(n for n, _, _, _ in sync) == sorted(names)
            for name, _, whole, shared in sync:
                assert set(whole) <= set(groups[group_of[name]]) and whole
                if name in dict(r["vllm"]["state"]) and "layers." in name:
                    assert shared == (layer_of(name) not in split), name
        for name, tensor, _, _ in v["loads"][1]:
            assert torch.equal(tensor, one["vllm"]["state"][name]), name

    # hf generation in step under ZeRO-3 = the unpartitioned model's samples
    for r in reports:
        assert len(r["hf"]["got"]) == len(r["hf"]["want"]) > 0
        for a, b in zip(r["hf"]["got"], r["hf"]["want"], strict=True):
            assert a.response_token_ids == b.response_token_ids
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


def test_engine_groups_are_consecutive_ranks():
    from stages.core.models.samplers import tp_groups

    assert tp_groups(2, 4) == [[0, 1], [2, 3]]
    assert tp_groups(1, 2) == [[0], [1]] and tp_groups(4, 4) == [[0, 1, 2, 3]]
