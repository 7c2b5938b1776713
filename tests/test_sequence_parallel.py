"""Sequence parallelism (DeepSpeed Ulysses, `train.sequence_parallel`) against none.

Fast: the groups of ranks, the layout checks, the data-parallel slots. Slow: one job of one
process (sequence parallelism 1) and one of two gloo processes (sequence parallelism 2, one
data-parallel rank) run the same cases on the same mini-batch of a two-layer Qwen2 with real
components, and must agree: the sampling pass's statistics (ICT's u among them), the selector's
mask, the loss, the gradients (ZeRO-0, float32, within 1e-5, and float64 without DeepSpeed,
within 1e-10) and the update (ZeRO-3), on padded and padding-free micro-batches, with the KL term
(the reference sequence-parallel too) and with the micro-batch selection scope; the first update
is on-policy (ratio 1, KL 0) under both. The two ranks of the group sample half of the prompts
each (hf generation on the policy, after its sequence-parallel forwards) and train on the same
groups, those one rank samples. Under ZeRO-3 the policy is partitioned as it loads: no rank holds
a whole parameter.
"""

from __future__ import annotations

import copy
import os
import subprocess
import types

import pytest
import torch
import yaml

from stages.config import ConfigError, validate
from stages.core.common import numerics
from stages.core.models.parallel import parallel_groups
from stages.core.training import rollouts
from stages.train import check_layout
from tests.conftest import ROOT
from tests.helpers import FakeEngine, start_ranks, wait_ranks, worker_argv
from tests.test_train import PAD, VOCAB, random_batch

pytestmark = pytest.mark.slow  # trainings across two processes: scripts/test.sh --all

ARCH = types.SimpleNamespace(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=1,
                             max_position_embeddings=128)


def test_sequence_parallel_groups_are_blocks_and_data_parallel_groups_strides():
    assert parallel_groups(4, 2) == ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    assert parallel_groups(4, 1) == ([[0], [1], [2], [3]], [[0, 1, 2, 3]])
    assert parallel_groups(4, 4) == ([[0, 1, 2, 3]], [[0], [1], [2], [3]])
    with pytest.raises(ConfigError, match="train.sequence_parallel: 3 does not divide"):
        parallel_groups(4, 3)


def test_mini_batches_split_over_the_data_parallel_ranks(test_raw):
    raw = copy.deepcopy(test_raw)
    raw["models"]["tiny-s"]["train_processes"] = 4
    raw["train"].update(sequence_parallel=2, mini_batch_prompts=2, prompts_per_step=4)
    cfg = validate(raw, "sp.yaml")
    check_layout(cfg, None, "grpo", 4)  # 2 data-parallel ranks of 2 sequence-parallel ones
    raw["train"].update(sequence_parallel=1)
    with pytest.raises(ConfigError, match="mini_batch_prompts: 2 does not split over 4 processes"):
        check_layout(validate(raw, "sp.yaml"), None, "grpo", 4)
    raw["train"].update(sequence_parallel=2, mini_batch_prompts=1, prompts_per_step=4)
    with pytest.raises(ConfigError, match=r"over the 2 data-parallel ranks of 4 processes"):
        check_layout(validate(raw, "sp.yaml"), None, "grpo", 4)
    with pytest.raises(ConfigError, match="sequence_parallel: 2 does not divide the job's 3"):
        check_layout(cfg, None, "grpo", 3)
    # the slots of a data-parallel rank: its sequence-parallel ranks share them
    assert rollouts.rank_slots(4, 2, 2, 1) == [1, 3]


# ---------------------------------------------------------------------------------------------
# One process against two
# ---------------------------------------------------------------------------------------------
CASES = {  # method, ZeRO stage, padding-free, KL β, the reference's seed (0: the policy), checkpointing
    "ict": ({"selector": "ict", "rho": 0.3}, 0, False, 0.05, 0, True),
    "micro-packed": ({"selector": "entropy_top", "rho": 0.3, "selection_scope": "microbatch"},
                     2, True, 0.0, None, False),
    "ict-zero3-packed": ({"selector": "ict", "rho": 0.3}, 3, True, 0.05, 1, False),
}
EXACT = {  # float64, without DeepSpeed
    "ict-float64": ({"selector": "ict", "rho": 0.3}, 0, False, 0.05, 1, False),
    "micro-packed-float64": CASES["micro-packed"][:1] + (0, True, 0.0, None, False),
}


def _config(world: int, method: dict, zero: int, padding_free: bool, kl: float,
            checkpointing: bool = False):
    """The job's config for one case (sequence parallelism = the world)."""
    raw = yaml.safe_load((ROOT / "config" / "test.yaml").read_text())
    raw["models"]["tiny-s"]["train_processes"] = world
    raw["train"].update(micro_batch_size=3, micro_batch_tokens=30, mini_batch_prompts=2,
                        prompts_per_step=2, group_size=4, zero_stage=zero, lr=1e-30, grad_clip=1e9,
                        sequence_parallel=world, padding_free=padding_free,
                        gradient_checkpointing=checkpointing,
                        loss={"kl_beta": kl, "denominator": "sequence"})
    raw["methods"]["case"] = method
    if method.get("selection_scope") == "microbatch":  # verl's layout of 2 ranks; its token-mean
        raw["train"].update(virtual_layout={"world_size": 2, "sequence_parallel": 1,
                                            "max_token_len_per_gpu": 20},
                            loss={"kl_beta": kl, "denominator": "selected"})
    return validate(raw, "sp.yaml")


class PlainEngine(FakeEngine):
    """The actor's view of an engine without DeepSpeed: step adds the gradients up over the
    sequence-parallel group (as DeepSpeed does, over one data-parallel rank)."""

    def __init__(self, module, sp):
        super().__init__(module)
        self.sp = sp

    def reduce(self, grad):
        return self.sp.sum(grad)


def _two_updates(engine, cfg, dist, ref, noise) -> dict:
    """The sampling pass and an on-policy update, then a rescoring and an off-policy update
    (old log-probs moved by `noise`, so that ratios clip) on one mini-batch of 2 groups of 4.
    The learning rate is 1e-30 (the parameters do not move), so that the second update's
    gradients compare as the first's do, not through AdamW's amplification of tiny gradients."""
    from deepspeed.utils import safe_get_full_grad

    from stages import train
    from stages.core.training.actor import actor_step

    p_ids, r_ids, adv, _ = random_batch(seed=1)
    mb = rollouts.Rollouts(p_ids, r_ids, [i // 4 for i in range(len(r_ids))], adv)
    method = cfg.methods["case"]
    scope = None
    if method.selection_scope == "microbatch":  # verl's order, moved within the data-parallel group
        (mb,), (scope,), _ = rollouts.virtual_minibatches(mb, cfg, dist)
    needs = train.scorer_needs(method, False) | {"jsd"}
    out = {}
    for k, on_policy in enumerate((True, False)):
        engine.module.eval()
        stats = train.rescore(engine.module, mb, needs, cfg, PAD, dist)
        engine.module.train()
        mb.stats = dict(stats)
        if not on_policy:
            mb.stats["logprob"] = stats["logprob"] + noise
        grads: dict = {}
        step = engine.step

        def snapshot(step=step, grads=grads):  # the reduced gradients, before AdamW
            for n, p in engine.module.lm.named_parameters():  # ZeRO-3: gathered, collectively
                g = safe_get_full_grad(p)
                if g is not None:
                    grads[n] = g.detach().clone()
            step()

        engine.step = snapshot
        u = actor_step(engine, mb, method, cfg, dist, torch.Generator().manual_seed(7), PAD,
                       stats=stats, on_policy=on_policy, ref_model=ref, scope=scope)
        engine.step = step
        grads = getattr(engine, "reduced", grads)
        out[k] = {"stats": stats, "loss": u.loss, "norm": u.grad_norm, "mask": u.mask,
                  "clipped": u.n_clipped,
                  "kl": u.kl_sum, "selected": u.n_selected, "calls": u.micro_batches,
                  "grads": grads}
    return out


def _sp_worker(out: str) -> None:
    """Every case of CASES and EXACT on this job's ranks (sequence parallelism = the world), then
    the sampling of a step's groups; each rank saves what it saw."""
    from transformers import AutoModelForCausalLM

    from stages.core.models import engine as engine_glue
    from stages.core.models.modeling import build_scratch_model, build_tokenizer
    from stages.core.models.policy import Policy
    from stages.core.models.samplers import HfPolicySampler
    from tests.test_trainer_dapo import PoolSampler, pool_of

    torch.set_num_threads(1)
    world = int(os.environ["WORLD_SIZE"])
    first = _config(world, *CASES["ict"][:4])
    dist = engine_glue.init_distributed(engine_glue.resolve_launch(first, "tiny-s"), world)
    report: dict = {"dp": (dist.rank, dist.world), "sp": (dist.sp.rank, dist.sp.world)}
    noise = 0.3 * torch.randn(sum(map(len, random_batch(seed=1)[1])),
                              generator=torch.Generator().manual_seed(2))
    for name, (method, zero, padding_free, kl, ref_seed, checkpointing) in CASES.items():
        cfg = _config(world, method, zero, padding_free, kl)
        model = build_scratch_model(ARCH, VOCAB, PAD, seed=0)
        if zero == 3:  # the same model from disk, partitioned as it loads
            with engine_glue.partitioned_loading(cfg.train):
                model = AutoModelForCausalLM.from_pretrained(os.path.join(os.path.dirname(out), "base"))
            engine_glue.float32_rotary(model)
            report["loaded"] = {n: (p.numel(), p.ds_tensor.numel(), p.ds_numel)
                                for n, p in model.named_parameters()}
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        engine = engine_glue.build_engine(model, cfg.train, dist.world, sp=dist.sp)
        ref = None
        if kl:
            ref = engine_glue.build_reference(build_scratch_model(ARCH, VOCAB, PAD, seed=ref_seed),
                                              cfg.train, sp=dist.sp)
        report[name] = _two_updates(engine, cfg, dist, ref, noise)
    for name, (method, zero, padding_free, kl, ref_seed, _) in EXACT.items():
        cfg = _config(world, method, zero, padding_free, kl)

        def policy(seed, cfg=cfg):
            p = Policy(build_scratch_model(ARCH, VOCAB, PAD, seed=seed).double())
            p.layout = engine_glue.layout(p, cfg.train, dist.sp)
            return p

        ref = policy(ref_seed).requires_grad_(False).eval() if kl else None
        report[name] = _two_updates(PlainEngine(policy(0), dist.sp), cfg, dist, ref, noise.double())

    # a step's groups: each rank of the group samples half of them, all train on all of them
    raw = yaml.safe_load((ROOT / "config" / "test.yaml").read_text())
    raw["models"]["tiny-s"]["train_processes"] = world
    raw["train"].update(prompts_per_step=4, mini_batch_prompts=4, group_size=2,
                        max_response_tokens=6, sequence_parallel=world)
    cfg = validate(raw, "sp.yaml")
    tok = build_tokenizer()
    lm = build_scratch_model(ARCH, len(tok), tok.eos_token_id, seed=0)
    lm.set_attn_implementation("sdpa")  # through the Ulysses front of sdpa, inactive here
    pool = rollouts.PromptPool([f"Q: {i}+0=? A:" for i in range(6)], [str(i) for i in range(6)],
                               ["math"] * 6, [6] * 6)
    sampled = rollouts.Sampled()
    roll, consumed = rollouts.collect(0, 0, cfg, 3, HfPolicySampler(lm, tok, 4), pool, dist, sampled)
    fake = PoolSampler(pool_of(["mixed", "right", "mixed", "wrong", "mixed", "right"]))
    fake_roll, _ = rollouts.collect(1, 0, cfg, 3, fake, fake.pool, dist, rollouts.Sampled())
    report["sampling"] = {"roll": roll, "consumed": consumed, "sampled": sampled,
                          "fake": fake_roll, "asked": fake.calls}
    torch.save(report, f"{out}.{dist.job.rank}")
    dist.job.barrier()
    torch.distributed.destroy_process_group()


def _start(world: int, out) -> list[subprocess.Popen]:
    return start_ranks(world, worker_argv("tests.test_sequence_parallel", "_sp_worker", out),
                       env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})


def max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a − b| / max |b| (0 when both are 0)."""
    scale = float(b.abs().max()) if b.numel() else 0.0
    return float((a - b).abs().max()) / scale if scale else float((a - b).abs().max() if a.numel() else 0)


def stat_bound(key: str, tol: float, float32: bool) -> float:
    """The max_rel bound of a scored statistic between two layouts of the same float32 (or
    float64) computation: tol, but at least 1e-4 for the float32 divergences. Those (jsd,
    group_jsd: at most a few 1e-3 here) are small differences between distributions whose
    float32 log-probs round differently in each layout, so their error is absolute, a few 1e-8:
    1.0-2.5e-5 of their maximum on an AVX-512 Xeon, while a wrong layout moves them by their own
    size. The entropies and log-probs keep tol (they agree to about 1e-7)."""
    return max(tol, 1e-4) if float32 and key in ("jsd", "group_jsd") else tol


@pytest.mark.slow
def test_sequence_parallel_2_gives_the_scores_loss_and_gradients_of_none(tmp_path):
    from stages.core.models.modeling import build_scratch_model

    build_scratch_model(ARCH, VOCAB, PAD, seed=0).save_pretrained(tmp_path / "base")
    wait_ranks(_start(1, tmp_path / "one.pt") + _start(2, tmp_path / "two.pt"))
    one = torch.load(tmp_path / "one.pt.0", weights_only=False)
    two = [torch.load(tmp_path / f"two.pt.{r}", weights_only=False) for r in range(2)]
    assert one["sp"] == (0, 1) and [r["sp"] for r in two] == [(0, 2), (1, 2)]
    assert [r["dp"] for r in two] == [(0, 1), (0, 1)]  # one data-parallel rank: the same sequences
    # ZeRO-3 loading: each of two ranks holds half of every parameter, none the whole
    for r in two:
        assert all(n == 0 and part == -(-whole // 2) for n, part, whole in r["loaded"].values())
    check_cases(one, two)
    check_sampling(one, two)


def check_cases(one: dict, two: list[dict]) -> None:
    for name, (_, _, _, kl, ref_seed, _) in (CASES | EXACT).items():
        exact = name in EXACT
        tol = 1e-10 if exact else 1e-5
        for k in (0, 1):  # the on-policy update, the off-policy one
            a = one[name][k]
            for r in two:
                b = r[name][k]
                what = (name, k, r["sp"])
                assert torch.equal(b["mask"], a["mask"]), what
                assert 0 < b["selected"], what
                assert b["calls"] == a["calls"] and a["calls"] >= 2, what
                for key, value in a["stats"].items():
                    assert max_rel(b["stats"][key], value) <= stat_bound(key, tol, not exact), (*what, key)
                assert b["loss"] == pytest.approx(a["loss"], rel=tol), what
                assert b["clipped"] == a["clipped"] and (a["clipped"] > 0) == (k == 1), what
                assert b["kl"] == pytest.approx(a["kl"], rel=tol, abs=1e-12), what
                if kl:  # the reference is the policy (exactly 0) or another model
                    assert (a["kl"] == b["kl"] == 0.0) if ref_seed == 0 else a["kl"] > 0, what
                assert b["grads"].keys() == a["grads"].keys() and len(a["grads"]) > 5, what
                for n, g in a["grads"].items():
                    assert max_rel(b["grads"][n], g) <= tol, (*what, n)
                if not exact:
                    assert b["norm"] == pytest.approx(a["norm"], rel=tol) and a["norm"] > 0, what


def check_sampling(one: dict, two: list[dict]) -> None:
    a = one["sampling"]
    for r in two:
        b = r["sampling"]
        assert b["roll"].prompt_ids == a["roll"].prompt_ids
        assert b["roll"].response_ids == a["roll"].response_ids
        assert torch.equal(b["roll"].advantages, a["roll"].advantages)
        # each rank scores half the step's batch: another matrix shape. MKL's pinned AVX2 branch,
        # strict, gives the same bits for it on Intel; on AMD MKL runs its own branch (no strict
        # mode), and a Zen 4 pinned gave other last bits here (native: the same, by chance)
        if numerics.processor().get("vendor") == "GenuineIntel":
            assert torch.equal(b["roll"].sampler_logprobs, a["roll"].sampler_logprobs)
        else:
            torch.testing.assert_close(b["roll"].sampler_logprobs, a["roll"].sampler_logprobs,
                                       rtol=1e-5, atol=1e-6)
        counts = {k: v for k, v in vars(a["sampled"]).items() if not k.endswith("_s")}  # not timings
        assert b["consumed"] == a["consumed"]
        assert {k: v for k, v in vars(b["sampled"]).items() if not k.endswith("_s")} == counts
        assert b["fake"].prompt_ids == a["fake"].prompt_ids
    assert a["sampled"].responses == 8 and len(set(map(tuple, a["roll"].response_ids))) > 1
    # each rank of the group sampled half of the step's prompts, with the seeds one rank used
    (prompts, seeds), = a["asked"]
    halves = [r["sampling"]["asked"][0] for r in two]
    assert halves[0][0] == prompts[0::2] and halves[1][0] == prompts[1::2]
    assert halves[0][1] == seeds[0::2] and halves[1][1] == seeds[1::2]
