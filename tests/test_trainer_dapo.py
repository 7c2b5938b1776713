"""The trainer's DAPO recipe and sampler checks: dynamic sampling as verl pools it, the 80/20
code's micro-batch scope, scored graders and the overlong penalty, truncated importance sampling,
the sampler/trainer mismatch, equal micro-batch counts across ranks, and their bad input."""

from __future__ import annotations

import copy
import math
import os

import polars as pl
import pytest
import torch
import yaml

from stages import train
from stages.config import Loss, validate
from stages.core.models import engine as engine_glue
from stages.core.models.generation import Sample
from stages.core.models.modeling import build_scratch_model
from stages.core.models.policy import Policy
from stages.core.statistics.scorer import micro_batches
from stages.core.statistics.scoring import pack
from stages.core.training import rollouts
from stages.core.training.actor import actor_step, micro_loss, truncated_importance_weights
from stages.core.training.losses import overlong_penalty
from stages.keys import train_config_hash
from tests import test_train
from tests.conftest import ROOT, run_stage, write_yaml
from tests.helpers import FakeEngine, run_ranks, worker_argv
from tests.test_train import ARCH, PAD, VOCAB, cli_args, random_batch

job = test_train.job  # the tiny trained-format model and its prompts (module fixture)

CPU = engine_glue.Dist(0, 1, torch.device("cpu"))


def two_ranks(worker: str, out) -> None:
    """Run `worker(out)` of this module on two gloo processes and wait for both."""
    run_ranks(2, worker_argv("tests.test_trainer_dapo", worker, out), timeout=300)


# ---------------------------------------------------------------------------------------------
# Rollout collection
# ---------------------------------------------------------------------------------------------
class PoolSampler:
    """Responses decided by the prompt text: 'mixed' groups answer 7 on odd samples, 'right' always,
    'wrong' never (the gold is 7); the prompt ids carry the pool index the prompt came from."""

    def __init__(self, pool: rollouts.PromptPool, style: str = "####"):
        self.pool, self.style, self.calls = pool, style, []

    def sample(self, prompts, *, n, temperature, top_p, max_new_tokens, prompt_seeds, desc=""):
        self.calls.append((list(prompts), list(prompt_seeds)))
        out = []
        for i, p in enumerate(prompts):
            index = self.pool.prompts.index(p)
            for j in range(n):
                right = p.startswith("right") or (p.startswith("mixed") and j % 2 == 1)
                text = f"{self.style} {'7' if right else '3'}"
                length = min(max_new_tokens[i], 2 + j)
                out.append(Sample(i, j, [index], [5] * length, text, "stop", [-0.1] * length))
        return out


def pool_of(kinds: list[str], grader: str = "verify") -> rollouts.PromptPool:
    prompts = [f"{k}{i}" for i, k in enumerate(kinds)]
    return rollouts.PromptPool(prompts, ["7"] * len(kinds), ["math"] * len(kinds), [8] * len(kinds),
                               [grader] * len(kinds))


def dapo_config(test_raw, **train):
    raw = copy.deepcopy(test_raw)
    raw["train"].update(prompts_per_step=2, mini_batch_prompts=2, group_size=4, dynamic_sampling=True,
                        generation_batch_multiple=2, max_sampling_rounds=3, max_response_tokens=8)
    raw["train"].update(train)
    return validate(raw, "dapo.yaml")


def test_pooled_dynamic_sampling_keeps_the_first_informative_groups(test_raw):
    """verl's DAPO trainer: generation batches of 2 x 2 prompts; groups whose correctness varies
    are kept in stream order until 2 are, the surplus of the last batch is dropped."""
    kinds = ["wrong", "mixed", "right", "mixed", "right", "mixed", "wrong", "mixed"]
    pool = pool_of(kinds)
    cfg = dapo_config(test_raw)
    sampler, sampled = PoolSampler(pool), rollouts.Sampled()
    roll, consumed = rollouts.collect(3, 0, cfg, 7, sampler, pool, CPU, sampled)
    stream = rollouts.prompt_stream(len(pool), 0, 12, 7)
    informative = [i for i in stream if kinds[i] == "mixed"]
    batches = next(b for b in range(1, 4) if sum(kinds[i] == "mixed" for i in stream[: 4 * b]) >= 2)
    assert sampled.generation_batches == batches and consumed == 4 * batches
    assert [p[0] for p in roll.prompt_ids[::4]] == informative[:2]  # the first two, in stream order
    assert roll.groups == [0] * 4 + [1] * 4 and len(roll.sampler_logprobs) == sum(roll.lengths)
    # seeds: hashed from (run seed, step, pool index), the same whoever samples the prompt
    prompts, seeds = sampler.calls[0]
    assert seeds == rollouts.rollout_seeds(7, 3, [pool.prompts.index(p) for p in prompts])


POOL_KINDS = ["wrong", "mixed", "right", "mixed", "right", "mixed", "wrong", "mixed", "mixed",
              "right", "mixed", "wrong"]


def _pooled_worker(out: str) -> None:
    """collect() of one step on this rank, pooled over the process group: its groups' pool indices."""
    torch.set_num_threads(1)
    raw = yaml.safe_load((ROOT / "config" / "test.yaml").read_text())
    cfg = dapo_config(raw, prompts_per_step=4, mini_batch_prompts=2, generation_batch_multiple=2)
    dist = engine_glue.init_distributed(engine_glue.resolve_launch(cfg, "tiny-s"))
    pool = pool_of(POOL_KINDS)
    sampled = rollouts.Sampled()
    roll, consumed = rollouts.collect(1, 0, cfg, 5, PoolSampler(pool), pool, dist, sampled)
    mine = torch.tensor([p[0] for p in roll.prompt_ids[::4]])
    every = dist.gather(mine)
    if dist.rank == 0:
        torch.save({"groups": [g.tolist() for g in every], "consumed": consumed,
                    "batches": sampled.generation_batches}, out)
    dist.barrier()
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_pooled_dynamic_sampling_over_two_ranks_trains_what_one_rank_would(test_raw, tmp_path):
    """Kept groups are counted over both ranks in stream order; the first prompts_per_step go to
    the ranks that train their mini-batch slots (mini-batch k's slots split evenly), whichever rank
    sampled them."""
    two_ranks("_pooled_worker", tmp_path / "two.pt")
    two = torch.load(tmp_path / "two.pt")
    cfg = dapo_config(test_raw, prompts_per_step=4, mini_batch_prompts=2, generation_batch_multiple=2)
    pool = pool_of(POOL_KINDS)
    sampled = rollouts.Sampled()
    roll, consumed = rollouts.collect(1, 0, cfg, 5, PoolSampler(pool), pool, CPU, sampled)
    one = [p[0] for p in roll.prompt_ids[::4]]  # slots 0..3 on one rank
    # two ranks: mini-batch k = slots 2k, 2k+1, one slot of each on each rank
    assert two["groups"] == [[one[0], one[2]], [one[1], one[3]]]
    assert (two["consumed"], two["batches"]) == (consumed, sampled.generation_batches)


def test_pooled_dynamic_sampling_stops_the_run_when_the_budget_is_spent(test_raw):
    pool = pool_of(["right", "wrong", "right", "mixed"])
    cfg = dapo_config(test_raw, max_sampling_rounds=2, generation_batch_multiple=1)
    with pytest.raises(rollouts.SamplingExhausted, match=r"train.max_sampling_rounds: after 2 "
                       r"generation batches of 2 prompts, \d groups"):
        rollouts.collect(0, 0, cfg, 0, PoolSampler(pool), pool, CPU, rollouts.Sampled())


def test_per_rank_dynamic_sampling_trains_on_what_it_kept(test_raw):
    """dynamic_sampling_pool: rank refills each rank's slots and trains short when it runs out."""
    pool = pool_of(["right", "wrong", "right", "mixed"])
    cfg = dapo_config(test_raw, dynamic_sampling_pool="rank", max_sampling_rounds=1,
                      generation_batch_multiple=1)
    sampled = rollouts.Sampled()
    roll, _ = rollouts.collect(0, 0, cfg, 0, PoolSampler(pool), pool, CPU, sampled)
    assert sampled.generation_batches == 1 and len(roll.response_ids) in (0, 4)


def test_rollout_seeds_follow_the_prompt_not_the_slot():
    seeds = rollouts.rollout_seeds(1, 5, [3, 9, 3])
    assert seeds[0] == rollouts.rollout_seeds(1, 5, [3])[0] == rollouts.rollout_seeds(1, 5, [8, 3])[1]
    assert len(set(seeds)) == 3  # a prompt drawn twice in one step is sampled afresh
    assert seeds[0] != rollouts.rollout_seeds(1, 6, [3])[0] != rollouts.rollout_seeds(2, 5, [3])[0]
    # seeds + j of one prompt's samples (vLLM's convention) never meet another prompt's
    many = rollouts.rollout_seeds(0, 0, list(range(2000)))
    assert min(b - a for a, b in zip(sorted(many), sorted(many)[1:], strict=False)) > 64


def test_a_scored_grader_gives_the_reward_and_the_penalty_only_the_reward(test_raw):
    """math_dapo: +1 / -1 replaces reward_correct / reward_incorrect; the overlong penalty
    (factor 0.5) is added once to the reward, never to the correctness that filters groups."""
    pool = pool_of(["mixed"], grader="math_dapo")
    cfg = dapo_config(test_raw, dynamic_sampling=False, prompts_per_step=1, mini_batch_prompts=1,
                      overlong_buffer=4, overlong_penalty_factor=0.5)
    samples = PoolSampler(pool, style="Answer:").sample(pool.prompts, n=4, temperature=1.0, top_p=1.0,
                                                        max_new_tokens=[8], prompt_seeds=[0])
    correct, rewards = rollouts.rewards_of(cfg, pool, [0], samples)
    assert correct.tolist() == [False, True, False, True]
    lengths = torch.tensor([2, 3, 4, 5])  # penalty from 8 - 4 = 4 tokens on: 0 0 0 -0.125
    assert rewards.tolist() == pytest.approx([-1, 1, -1, 1 - 0.125])
    assert overlong_penalty(lengths, 8, 4, 0.5).tolist() == pytest.approx([0, 0, 0, -0.125])


GOOD_LAYOUT = {"world_size": 4, "sequence_parallel": 2, "max_token_len_per_gpu": 20}


@pytest.mark.parametrize("change, message", [
    (lambda r: r["train"].update(generation_batch_multiple=0),
     "train.generation_batch_multiple: Input should be greater than or equal to 1"),
    (lambda r: r["train"].update(max_sampling_rounds=0),
     "train.max_sampling_rounds: Input should be greater than or equal to 1"),
    (lambda r: r["train"].update(overlong_buffer=32),
     "train.overlong_buffer: 32 is not shorter than max_response_tokens (32)"),
    (lambda r: (r["train"].update(overlong_buffer=8), r["datasets"]["rl"].update(max_response_tokens=8)),
     "train.overlong_buffer: 8 is not shorter than datasets.rl.max_response_tokens (8)"),
    (lambda r: (r["models"]["tiny-s"].update(train_processes=3),
                r["train"].update(sequence_parallel=3, mini_batch_prompts=1, prompts_per_step=3)),
     "train.sequence_parallel: 3 does not split models.tiny-s's 2 attention heads"),
    (lambda r: r["datasets"]["rl"].update(grader="dapo"), "datasets.rl.grader: unknown grader 'dapo'"),
    (lambda r: r["evaluate"].update(graders=["x"]), "evaluate.graders.0: unknown grader 'x'"),
    (lambda r: (r["datasets"]["rl"].update(grader="math_dapo"), r["train"].update(reward_incorrect=-1.0)),
     "train.reward_incorrect: grader 'math_dapo' of datasets.rl gives its own reward"),
    (lambda r: (r["datasets"]["rl"].update(grader="math_dapo"),
                r["methods"]["grpo"].update(train={"reward_correct": 2.0})),
     "methods.grpo.train.reward_correct: grader 'math_dapo' of datasets.rl gives its own reward"),
    (lambda r: r["methods"]["grpo"].update(train={"stepz": 3}), "methods.grpo.train.stepz: unknown key"),
    (lambda r: r["methods"]["ict"].update(selection_scope="microbatch"),
     "methods.ict.selection_scope: 'microbatch' ranks positions across one micro-batch"),
    (lambda r: r["methods"]["grpo"].update(selection_scope="microbatch"),
     "train.virtual_layout: methods.grpo has selection_scope 'microbatch': set the layout"),
    (lambda r: (r["methods"]["grpo"].update(selection_scope="microbatch"),
                r["train"].update(virtual_layout=GOOD_LAYOUT, loss={"denominator": "sequence"})),
     "train.loss.denominator: methods.grpo has selection_scope 'microbatch', whose loss is verl's"),
    (lambda r: (r["methods"]["grpo"].update(selection_scope="microbatch", rescore=False),
                r["train"].update(virtual_layout=GOOD_LAYOUT)),
     "methods.grpo.rescore: selection_scope 'microbatch' ranks by the current policy's scores"),
    (lambda r: (r["methods"]["grpo"].update(selection_scope="microbatch"),
                r["train"].update(virtual_layout=GOOD_LAYOUT, dynamic_sampling=True,
                                  dynamic_sampling_pool="rank")),
     "train.dynamic_sampling_pool: methods.grpo has selection_scope 'microbatch'"),
    (lambda r: r["train"].update(virtual_layout={**GOOD_LAYOUT, "sequence_parallel": 3}),
     "train.virtual_layout.sequence_parallel: 3 does not divide world_size (4)"),
    (lambda r: (r["methods"]["grpo"].update(selection_scope="microbatch"),
                r["train"].update(virtual_layout={**GOOD_LAYOUT, "world_size": 6, "sequence_parallel": 1})),
     "train.virtual_layout.world_size: a step's 16 sequences (prompts_per_step x group_size) do not "
     "split into 6 equal chunks"),
    (lambda r: (r["methods"]["grpo"].update(selection_scope="microbatch"),
                r["train"].update(virtual_layout={**GOOD_LAYOUT, "world_size": 16, "sequence_parallel": 1})),
     "train.virtual_layout.world_size: a mini-batch's 8 sequences (mini_batch_prompts x group_size) "
     "do not split over its 16 data-parallel groups"),
    (lambda r: (r["methods"]["grpo"].update(selection_scope="microbatch"),
                r["models"]["tiny-s"].update(train_processes=4), r["train"].update(
                    virtual_layout=GOOD_LAYOUT, mini_batch_prompts=4)),
     "train.virtual_layout.world_size: its 2 data-parallel groups (world_size 4 / sequence_parallel 2) "
     "do not split over the 4 data-parallel ranks of models.tiny-s's training job"),
    (lambda r: (r["methods"]["grpo"].update(selection_scope="microbatch"),
                r["train"].update(virtual_layout=GOOD_LAYOUT, max_prompt_tokens=20)),
     "train.virtual_layout.max_token_len_per_gpu: a micro-batch of 20 x 2 = 40 tokens cannot hold "
     "the longest sequence (52"),
    (lambda r: r["evaluate"].update(headline="pass@16"), "evaluate.headline: pass@16 is not reported"),
    (lambda r: r["evaluate"].update(headline="avg@8"), "evaluate.headline: avg@8: avg@n is the mean"),
])
def test_bad_dapo_settings_name_the_key(test_raw, change, message):
    from stages.config import ConfigError

    raw = copy.deepcopy(test_raw)
    change(raw)
    with pytest.raises(ConfigError) as err:
        validate(raw, "bad.yaml")
    assert message in str(err.value)


def test_a_methods_training_keys_apply_to_it_alone_and_its_hash(test_raw):
    """The 80/20 paper's 29k run changes a training key, not the selector."""
    raw = copy.deepcopy(test_raw)
    base = validate(raw, "x.yaml")
    raw["methods"]["grpo"]["train"] = {"max_response_tokens": 48, "loss": {"eps_high": 0.28}}
    cfg = validate(raw, "x.yaml")
    assert cfg.train_for("grpo").max_response_tokens == 48 and cfg.train_for("ict") is cfg.train
    assert cfg.train_for("grpo").loss.eps_high == 0.28 and cfg.train_for("grpo").loss.eps_low == 0.2
    assert cfg.for_method("grpo").train.max_response_tokens == 48
    assert train_config_hash(cfg, "tiny-s", "grpo") != train_config_hash(base, "tiny-s", "grpo")
    assert train_config_hash(cfg, "tiny-s", "ict") == train_config_hash(base, "tiny-s", "ict")


def test_a_sizes_training_keys_apply_before_the_methods(test_raw):
    """models.<size>.train (ZeRO stage, token budget... per size), then methods.<m>.train."""
    from stages.config import ConfigError

    raw = copy.deepcopy(test_raw)
    raw["models"]["tiny-s"]["train"] = {"micro_batch_size": 3, "lr": 5e-4}
    raw["methods"]["grpo"]["train"] = {"micro_batch_size": 5}
    cfg = validate(raw, "x.yaml")
    assert cfg.train_for("ict", "tiny-s").micro_batch_size == 3
    assert (cfg.train_for("grpo", "tiny-s").micro_batch_size, cfg.train_for("grpo", "tiny-s").lr) == (5, 5e-4)
    assert cfg.train_for("grpo").lr == cfg.train.lr  # no size: the method's changes only
    raw["models"]["tiny-s"]["train"] = {"zero_stage": 2, "offload_params": True}
    with pytest.raises(ConfigError, match="models.tiny-s.train.offload_params: offloading parameters"):
        validate(raw, "x.yaml")


# ---------------------------------------------------------------------------------------------
# The loss: truncated importance sampling
# ---------------------------------------------------------------------------------------------
def test_tis_is_the_plain_loss_where_sampler_and_trainer_agree():
    g = torch.Generator().manual_seed(1)
    logp = torch.randn(9, generator=g, dtype=torch.float64)
    old = logp + 0.3 * torch.randn(9, generator=g, dtype=torch.float64)
    adv, w = torch.randn(9, generator=g, dtype=torch.float64), torch.rand(9, generator=g, dtype=torch.float64)
    loss = Loss(dual_clip=3.0)
    plain = micro_loss(logp, old, adv, w, loss, 1)
    same = micro_loss(logp, old, adv, w, loss, 1, sampling=old, sampler=old.clone(), tis_cap=2.0)
    assert same[1] == plain[1] and same[4] == 0


def test_tis_float64_reference():
    """ψ = min(exp(sampling − sampler), C) multiplies the clipped, dual-clipped policy-gradient
    term only: not the KL, not the normaliser; its gradient flows through the current log-prob."""
    g = torch.Generator().manual_seed(2)
    n = 12
    logp = torch.randn(n, generator=g, dtype=torch.float64).requires_grad_()
    old = logp.detach() + 0.4 * torch.randn(n, generator=g, dtype=torch.float64)
    sampling = old + 0.2 * torch.randn(n, generator=g, dtype=torch.float64)  # the sampling pass
    sampler = sampling + torch.randn(n, generator=g, dtype=torch.float64)  # a distant sampler
    ref = logp.detach() + 0.1 * torch.randn(n, generator=g, dtype=torch.float64)
    adv, w = torch.randn(n, generator=g, dtype=torch.float64), torch.rand(n, generator=g, dtype=torch.float64)
    loss = Loss(eps_low=0.2, eps_high=0.28, dual_clip=3.0, kl_beta=0.05)
    cap = 1.5
    term, value, _, _, cut = micro_loss(logp, old, adv, w, loss, 2, ref, sampling=sampling,
                                        sampler=sampler, tis_cap=cap)
    # by hand, token by token
    expect = 0.0
    truncated = 0
    for i in range(n):
        r = math.exp(float(logp.detach()[i]) - float(old[i]))
        a = float(adv[i])
        pg = max(-a * r, -a * min(max(r, 0.8), 1.28))
        if a < 0:
            pg = min(pg, -a * 3.0)
        ratio = math.exp(float(sampling[i]) - float(sampler[i]))
        truncated += ratio > cap
        delta = float(ref[i]) - float(logp.detach()[i])
        expect += float(w[i]) * (min(ratio, cap) * pg + 0.05 * (math.exp(delta) - delta - 1))
    assert value == pytest.approx(expect, rel=1e-12) and cut == truncated > 0
    assert float(term) == pytest.approx(2 * expect, rel=1e-12)
    psi, trunc = truncated_importance_weights(sampling, sampler, cap)
    assert bool(((psi <= cap) & (psi > 0)).all()) and int(trunc.sum()) == truncated
    with pytest.raises(ValueError, match="needs the sampler"):
        micro_loss(logp, old, adv, w, loss, 1, ref, tis_cap=cap)


# ---------------------------------------------------------------------------------------------
# The released 80/20 code's scope: verl's micro-batches in its own layout, on any physical ranks
# ---------------------------------------------------------------------------------------------
VIRTUAL = {"world_size": 8, "sequence_parallel": 2, "max_token_len_per_gpu": 10}  # 4 groups, 20 tokens
VIRTUAL_METHODS = {"top": {"selector": "entropy_top", "rho": 0.2, "selection_scope": "microbatch"},
                   "dapo": {"selector": "all", "selection_scope": "microbatch"}}
TEMPERATURE, DUAL_CLIP = 0.7, 3.0


def virtual_config(test_raw, processes: int):
    """4 prompts x 8 responses per step, mini-batches of 2 prompts (16 sequences: 4 per virtual
    group), verl's layout of 8 ranks in data-parallel groups of 2, 20 tokens per micro-batch; our
    physical forwards of at most 3 sequences."""
    raw = copy.deepcopy(test_raw)
    raw["models"]["tiny-s"]["train_processes"] = processes
    raw["train"].update(prompts_per_step=4, group_size=8, mini_batch_prompts=2, micro_batch_size=3,
                        temperature=TEMPERATURE, virtual_layout=VIRTUAL,
                        loss={"eps_low": 0.2, "eps_high": 0.28, "dual_clip": DUAL_CLIP})
    raw["methods"].update(copy.deepcopy(VIRTUAL_METHODS))
    return validate(raw, "virtual.yaml")


class ReducingEngine(FakeEngine):
    """The actor's view of an engine, without DeepSpeed: step averages the gradients over the
    ranks (as DeepSpeed does)."""

    def __init__(self, module, dist):
        super().__init__(Policy(module))
        self.dist = dist

    def reduce(self, grad):
        return self.dist.sum(grad) / self.dist.world


def virtual_batch():
    """The step's 32 sequences in slot order (4 groups of 8), their advantages, and log-prob noise
    (N,) that moves the old log-probs off the current ones, so that ratios clip."""
    return random_batch(seed=11, prompts=4, g=8)


def virtual_updates(cfg, dist) -> dict:
    """This rank's groups of the step (rank_slots), moved into verl's layout; one optimizer step
    per mini-batch and method on a float64 model. Returns, per method and mini-batch, every rank's
    sequences (prompt + response ids) with their masks, the loss, the reduced gradients and the
    layout's counts."""
    from stages.core.training.rollouts import virtual_minibatches

    torch.manual_seed(0)
    p_ids, r_ids, adv, noise = virtual_batch()
    starts = [0, *torch.tensor([len(r) for r in r_ids]).cumsum(0).tolist()]
    noise_of = {tuple(p_ids[i] + r_ids[i]): noise[starts[i]:starts[i + 1]] for i in range(len(r_ids))}
    mine = [s * 8 + j for s in rollouts.rank_slots(4, 2, dist.world, dist.rank) for j in range(8)]
    roll = rollouts.Rollouts([p_ids[i] for i in mine], [r_ids[i] for i in mine],
                             [i // 8 for i in mine], adv[mine])
    out = {}
    for name in VIRTUAL_METHODS:
        method = cfg.methods[name]
        engine = ReducingEngine(build_scratch_model(ARCH, VOCAB, PAD, seed=3).double(), dist)
        minibatches, scopes, layout = virtual_minibatches(roll, cfg, dist)
        steps = []
        for k, mb in enumerate(minibatches):
            stats = train.rescore(engine.module, mb, train.scorer_needs(method, False), cfg, PAD, dist)
            keys = [tuple(p + r) for p, r in zip(mb.prompt_ids, mb.response_ids, strict=True)]
            mb.stats = {"logprob": stats["logprob"] + torch.cat([noise_of[key] for key in keys]).double()}
            u = actor_step(engine, mb, method, cfg, dist, torch.Generator(), PAD, stats=stats,
                           on_policy=False, scope=scopes[k])
            every = [key for part in dist.objects(keys) for key in part]  # rank order, as u.mask
            steps.append({"keys": every, "mask": u.mask, "loss": u.loss, "grads": engine.reduced,
                          "calls": u.micro_batches})
        out[name] = {"steps": steps, "counts": layout.counts, "stats": layout.stats}
    return out


def verl_reference(rho: float | None) -> list[dict]:
    """The step's loss and masks as verl's code defines them, per mini-batch, in float64 (from the
    fork: ray_trainer._balance_batch, the dispatch in equal chunks, the Ulysses all-gather of a
    sequence-parallel group, dp_actor.update_policy's data.split(mini-batch) and
    rearrange_micro_batches (count all-reduced to the maximum), get_global_entropy_top_mask, the
    clamped dual-clip surrogate, masked_mean × B_micro / B_mini, and FSDP's mean over ranks).
    rho None: DAPO (every response token)."""
    from stages.core.statistics.batching import balanced_partitions

    p_ids, r_ids, adv, noise = virtual_batch()
    model = build_scratch_model(ARCH, VOCAB, PAD, seed=3).double()
    lengths = [len(p) + len(r) for p, r in zip(p_ids, r_ids, strict=True)]
    starts = [0, *torch.tensor([len(r) for r in r_ids]).cumsum(0).tolist()]
    world, sp, budget = VIRTUAL["world_size"], VIRTUAL["sequence_parallel"], 20
    batch = [i for part in balanced_partitions(lengths, world, equal_size=True) for i in part]
    chunk = len(batch) // world
    ranks = [batch[r * chunk:(r + 1) * chunk] for r in range(world)]
    groups = [sum(ranks[d * sp:(d + 1) * sp], []) for d in range(world // sp)]
    mini = 2 * 8 // len(groups)  # ppo_mini_batch_size x n / data-parallel groups
    out = []
    for j in range(len(groups[0]) // mini):
        minis = [g[j * mini:(j + 1) * mini] for g in groups]
        count = max(min(len(m), -(-sum(lengths[i] for i in m) // budget)) for m in minis)
        model.zero_grad()
        total, masks = torch.zeros((), dtype=torch.float64), {}
        for m in minis:
            for part in balanced_partitions([lengths[i] for i in m], count, equal_size=False):
                seqs = [m[i] for i in part]
                ids, att, rows, cols = pack([p_ids[i] for i in seqs], [r_ids[i] for i in seqs], PAD)
                logp_all = (model(input_ids=ids, attention_mask=att).logits[rows, cols]
                            / TEMPERATURE).log_softmax(-1)
                tokens = torch.tensor([t for i in seqs for t in r_ids[i]])
                logp = logp_all.gather(1, tokens[:, None]).squeeze(1)
                entropy = -(logp_all.exp() * logp_all).sum(-1).detach()
                pick = torch.zeros(len(tokens), dtype=torch.bool)
                if rho is None:
                    pick[:] = True
                else:
                    top_k = max(1, int(len(tokens) * rho + 0.9999))
                    pick[torch.topk(entropy, k=top_k).indices] = True
                old = logp.detach() + torch.cat([noise[starts[i]:starts[i + 1]] for i in seqs]).double()
                a = torch.cat([adv[i].double().repeat(len(r_ids[i])) for i in seqs])
                ratio = torch.exp((logp - old).clamp(-20.0, 20.0))
                clip1 = torch.maximum(-a * ratio, -a * ratio.clamp(1 - 0.2, 1 + 0.28))
                pg = torch.where(a < 0, torch.minimum(-a * DUAL_CLIP, clip1), clip1)
                total = total + pg[pick].mean() * len(seqs) / mini / len(groups)
                at = 0
                for i in seqs:
                    masks[tuple(p_ids[i] + r_ids[i])] = pick[at:at + len(r_ids[i])]
                    at += len(r_ids[i])
        total.backward()
        out.append({"loss": float(total.detach()), "masks": masks, "count": count,
                    "grads": {n: p.grad.clone() for n, p in model.named_parameters()}})
    return out


def check_against_verl(result: dict) -> None:
    for name, rho in (("top", 0.2), ("dapo", None)):
        ref = verl_reference(rho)
        got = result[name]
        assert got["counts"] == [r["count"] for r in ref] and max(got["counts"]) > 1
        for step, r in zip(got["steps"], ref, strict=True):
            lengths = [len(r_) for r_ in r["masks"].values()]
            assert sorted(step["keys"]) == sorted(r["masks"])  # the mini-batch's sequences
            rows = [step["mask"][b, : len(r["masks"][key])] for b, key in enumerate(step["keys"])]
            for key, row in zip(step["keys"], rows, strict=True):
                assert torch.equal(row, r["masks"][key]), name
            assert int(step["mask"].sum()) == sum(int(m.sum()) for m in r["masks"].values())
            assert len(lengths) == 16
            assert step["loss"] == pytest.approx(r["loss"], rel=1e-9, abs=1e-12), name
            for param, g in r["grads"].items():
                assert torch.allclose(step["grads"][param], g, rtol=1e-7, atol=1e-12), (name, param)


def test_virtual_micro_batches_are_verls_on_one_process(test_raw):
    """One physical rank computes all 4 of verl's data-parallel groups: masks, loss and gradients
    of each mini-batch equal verl's definition on sequences of unequal length. The trainer's step
    logs the layout: verl's micro-batch count and its global_seqlen statistics."""
    cfg = virtual_config(test_raw, 1)
    result = virtual_updates(cfg, CPU)
    check_against_verl(result)
    p_ids, r_ids, adv, _ = virtual_batch()
    roll = rollouts.Rollouts(p_ids, r_ids, [i // 8 for i in range(32)], adv)
    engine = ReducingEngine(build_scratch_model(ARCH, VOCAB, PAD, seed=3).double(), CPU)
    updates, trained, layout = train.train_step(0, engine, roll, cfg.methods["top"], cfg, CPU, 0, PAD, None)
    assert layout.counts == result["top"]["counts"] and len(updates) == 2
    assert sorted(map(tuple, trained.response_ids)) == sorted(map(tuple, r_ids))
    row = train.step_metrics(0, rollouts.Sampled(responses=32, tokens=1, cut=8), trained, updates,
                             CPU, 1.0, kl_on=False, layout=layout,
                             phases={"generation": 0.5, "training": 0.25})
    assert row["virtual_micro_batches"] == sum(layout.counts) and row["skipped_steps"] == 0
    # 8 of the 32 responses cut at the length limit; the phases timed, the others 0
    assert row["length_limit_fraction"] == 0.25
    assert (row["time_generation_s"], row["time_training_s"], row["time_weight_sync_s"]) == (0.5, 0.25, 0.0)
    lengths = [len(p) + len(r) for p, r in zip(p_ids, r_ids, strict=True)]
    assert row["global_seqlen_mean"] == sum(lengths) / 8
    assert row["global_seqlen_balanced_max"] <= row["global_seqlen_max"]
    assert row["global_seqlen_min"] == min(sum(lengths[a:a + 4]) for a in range(0, 32, 4))
    assert set(row) == set(train.METRICS_SCHEMA.names)


def _virtual_worker(out: str) -> None:
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    dist = engine_glue.Dist(rank, world, torch.device("cpu"))
    raw = yaml.safe_load((ROOT / "config" / "test.yaml").read_text())
    result = virtual_updates(virtual_config(raw, world), dist)
    if rank == 0:
        torch.save(result, out)
    dist.barrier()
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_virtual_micro_batches_are_verls_on_two_processes(tmp_path):
    """Two physical ranks, each computing 2 of verl's 4 data-parallel groups (its sequences moved
    there from the ranks that sampled them): the same masks, loss and averaged gradients as
    verl's definition."""
    two_ranks("_virtual_worker", tmp_path / "out.pt")
    check_against_verl(torch.load(tmp_path / "out.pt"))


# ---------------------------------------------------------------------------------------------
# verl's smaller rules: the warm-up, a non-finite gradient norm
# ---------------------------------------------------------------------------------------------
def test_warm_up_as_verl_steps_it(test_raw):
    """verl's constant schedule with 10 warm-up steps, stepped after each update: rollout step 0
    at lr 0, 1-9 at 0.1-0.9 of it, full from step 10; ours by default 0.1-1.0 over steps 0-9."""
    raw = copy.deepcopy(test_raw)
    raw["train"].update(warmup_steps=10, lr=1e-6)
    ours = validate(raw, "w.yaml").train
    raw["train"].update(warmup_from_zero=True)
    verl = validate(raw, "w.yaml").train
    assert [train.lr_at(s, verl) for s in range(12)] == pytest.approx([s / 10 * 1e-6 for s in range(10)] + [1e-6] * 2)
    assert [train.lr_at(s, ours) for s in range(12)] == pytest.approx([(s + 1) / 10 * 1e-6 for s in range(10)] + [1e-6] * 2)
    assert train.lr_at(0, verl) == 0.0 and train.lr_at(3, verl, lr=2e-6) == pytest.approx(6e-7)


@pytest.mark.parametrize("zero", [0])
def test_a_non_finite_gradient_norm_skips_the_step(test_raw, zero):
    """verl zeroes the gradients and skips the optimizer step when the norm is not finite. Under
    ZeRO-0 the actor checks the norm before engine.step() (ZeRO-1 to 3: DeepSpeed's own overflow
    check, whose skipped_steps the actor reads, passes this test too: add 1 to see it, ~10 s).
    The parameters and the optimizer's state do not move; the next finite step trains as usual."""
    raw = copy.deepcopy(test_raw)
    raw["train"].update(zero_stage=zero, lr=1e-2, micro_batch_size=4)
    cfg = validate(raw, "skip.yaml")
    dist = engine_glue.init_distributed(engine_glue.resolve_launch(cfg, "tiny-s"))
    engine = engine_glue.build_engine(build_scratch_model(ARCH, VOCAB, PAD, seed=0), cfg.train, dist.world)
    engine.train()
    p_ids, r_ids, adv, _ = random_batch(seed=2)
    before = {n: p.detach().clone() for n, p in engine.module.lm.named_parameters()}
    updates = []
    for bad in (True, False):
        mb = rollouts.Rollouts(p_ids, r_ids, [i // 4 for i in range(len(r_ids))],
                               torch.where(torch.arange(len(r_ids)) == 1, float("nan"), adv) if bad else adv)
        mb.stats = train.rescore(engine.module, mb, frozenset(), cfg, PAD, dist)
        updates.append(actor_step(engine, mb, cfg.methods["grpo"], cfg, dist, torch.Generator(), PAD,
                                  stats=mb.stats, on_policy=True))
        if bad:
            assert updates[0].skipped and not math.isfinite(updates[0].grad_norm)
            assert engine.skipped_steps == 1
            assert all(torch.equal(p, before[n]) for n, p in engine.module.lm.named_parameters())
            assert all(p.grad is None or not p.grad.any() for p in engine.module.lm.parameters())
            assert not engine.optimizer.state or zero > 0  # ZeRO-0: AdamW never stepped
    assert not updates[1].skipped and math.isfinite(updates[1].grad_norm) and updates[1].grad_norm > 0
    assert any(not torch.equal(p, before[n]) for n, p in engine.module.lm.named_parameters())
    row = train.step_metrics(0, rollouts.Sampled(responses=1), _scored(mb), updates, dist, 1.0, kl_on=False)
    assert row["skipped_steps"] == 1 and row["virtual_micro_batches"] is None


def _scored(mb):
    mb.stats = {k: torch.zeros(sum(mb.lengths)) for k in ("entropy", "renyi2", "logprob")}
    return mb


# ---------------------------------------------------------------------------------------------
# The sampler/trainer mismatch, end to end
# ---------------------------------------------------------------------------------------------
MISMATCH = ("rollout_logprob_diff_mean", "rollout_logprob_diff_max", "rollout_kl")


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_sampler_and_the_trainer_agree_in_float32_and_are_measured_in_bf16(job, dtype):
    """hf backend: the sampler's log-probs (from the logits it sampled with) against the trainer's
    sampling pass. float32: ≤ 1e-5 nats; bf16 (ZeRO 1): finite and in the metrics."""
    d, raw = job
    cfg = copy.deepcopy(raw)
    cfg["train"].update(steps=2, dtype=dtype, zero_stage=1 if dtype == "bfloat16" else 0,
                        tis_cap=2.0)
    write_yaml(d / f"mm-{dtype}.yaml", cfg)
    proc = run_stage("train", *cli_args(d, f"mm-{dtype}", method="grpo", config=f"mm-{dtype}.yaml"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = pl.read_parquet(d / f"mm-{dtype}" / "metrics.parquet")
    for column in (*MISMATCH, "tis_truncated_fraction"):
        assert metrics[column].null_count() == 0 and metrics[column].is_finite().all(), column
    print(f"\n{dtype}: " + ", ".join(f"{c} {metrics[c].to_list()}" for c in (*MISMATCH, "tis_truncated_fraction")))
    if dtype == "float32":
        assert metrics["rollout_logprob_diff_max"].max() <= 1e-5
        assert metrics["rollout_kl"].max() <= 1e-9 and metrics["tis_truncated_fraction"].max() == 0.0
    else:
        assert metrics["rollout_logprob_diff_max"].max() > 1e-5  # the bf16 head the sampler used
    assert metrics["generation_batches"].to_list() == [1, 1]


# ---------------------------------------------------------------------------------------------
# Ranks agree on their number of backward calls (ZeRO-2 reduces in every one)
# ---------------------------------------------------------------------------------------------
def _unequal_worker(out: str) -> None:
    """Rank 0 holds short responses, rank 1 long ones; a token budget gives them different
    micro-batch counts. Under ZeRO-2 the step must complete on both."""
    torch.set_num_threads(1)
    raw = yaml.safe_load((ROOT / "config" / "test.yaml").read_text())
    raw["train"].update(micro_batch_size=8, micro_batch_tokens=40, mini_batch_prompts=2,
                        prompts_per_step=2, group_size=4, zero_stage=2, lr=1e-2)
    cfg = validate(raw, "unequal")
    dist = engine_glue.init_distributed(engine_glue.resolve_launch(cfg, "tiny-s"))
    model = build_scratch_model(ARCH, VOCAB, PAD, seed=0)
    engine = engine_glue.build_engine(model, cfg.train, dist.world)
    engine.train()
    g = torch.Generator().manual_seed(dist.rank)
    width = 2 if dist.rank == 0 else 30
    r_ids = [torch.randint(0, 256, (width,), generator=g).tolist() for _ in range(4)]
    mb = rollouts.Rollouts([[1, 2, 3]] * 4, r_ids, [0] * 4, torch.tensor([1.0, -1.0, 0.5, -0.5]))
    mb.stats = train.rescore(engine.module, mb, frozenset(), cfg, PAD, dist)
    update = actor_step(engine, mb, cfg.methods["grpo"], cfg, dist, torch.Generator(), PAD,
                        stats=mb.stats, on_policy=True)
    local = len(micro_batches([3 + len(r) for r in r_ids], 8, 40))
    counts = dist.gather(torch.tensor([local]))
    if dist.rank == 0:
        torch.save({"loss": update.loss, "calls": update.micro_batches,
                    "counts": [int(c) for c in counts], "norm": update.grad_norm}, out)
    dist.barrier()
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_unequal_lengths_under_zero2_complete_on_two_processes(tmp_path):
    two_ranks("_unequal_worker", tmp_path / "out.pt")
    result = torch.load(tmp_path / "out.pt")
    assert result["counts"][0] < result["counts"][1]  # the budget split them unequally
    assert result["calls"] == max(result["counts"]) and result["norm"] > 0
