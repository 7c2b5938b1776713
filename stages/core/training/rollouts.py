"""Rollout collection of the trainer: prompts, sampling, grading, DAPO filtering, advantages.

Each rollout step takes the next prompts of a seeded shuffle of the prompt pool (one shuffle per
epoch), samples `group_size` responses for each from the current policy, grades them with each
prompt's dataset's grader, and turns rewards into group-relative advantages (METHODS §4),
optionally with DAPO's overlong penalty and dynamic sampling.

Seeds: prompt i of a step is sampled with a seed hashed from (run seed, step, i's index in the
prompt pool), never from its slot or the rank, so a prompt's responses do not depend on which
rank samples it or on the other prompts of the call (both backends; stages.core.models.generation).

Dynamic sampling (`train.dynamic_sampling`) keeps a group only when its responses' correctness
varies (not their reward: the overlong penalty makes equal answers differ); a constant group has
no advantage. A generation batch is `generation_batch_multiple` × prompts_per_step prompts.
- `dynamic_sampling_pool: ranks` (verl's DAPO trainer): every rank samples its share of each
  generation batch, kept groups are counted over all ranks and accumulate, in the order of the
  prompt stream, until prompts_per_step are kept; those are trained and the surplus is dropped,
  each kept group moving to the rank that trains its mini-batch slot. A step still short after
  `max_sampling_rounds` generation batches stops the run (:class:`SamplingExhausted`).
- `dynamic_sampling_pool: rank`: each rank refills its own slots from further generation batches,
  and after `max_sampling_rounds` every rank trains on as many groups as the rank that kept
  fewest (the step may be short).
"""

from __future__ import annotations

import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from stages.core.models.engine import Dist
from stages.core.models.generation import hashed_seed
from stages.core.statistics.batching import MicroScope, VirtualStep, group_owner, virtual_step
from stages.core.statistics.scorer import Scope
from stages.core.training.losses import group_advantages, overlong_penalty

if TYPE_CHECKING:  # the config sits above the library: types only
    from stages.config import Config


class SamplingExhausted(ValueError):
    """Dynamic sampling found too few groups with varying correctness within its budget."""


def seed_of(*parts) -> int:
    """A 32-bit seed from any parts: the same parts, the same seed, on every rank and run."""
    return hashed_seed(*parts) >> 31


def rollout_seeds(run_seed: int, step: int, indices: list[int]) -> list[int]:
    """The sampling seed of each prompt of a step, from (run seed, step, its pool index); a prompt
    drawn again within the step (a pool smaller than the step's prompts) gets another one."""
    seen: Counter[int] = Counter()
    seeds = []
    for i in indices:
        parts = ("rollout", run_seed, step, i) + ((seen[i],) if seen[i] else ())
        seeds.append(hashed_seed(*parts))
        seen[i] += 1
    return seeds


def prompt_stream(n: int, start: int, count: int, seed: int) -> list[int]:
    """Items start..start+count of an endless sequence of seeded shuffles of range(n), one per epoch."""
    out: list[int] = []
    pos = start
    while len(out) < count:
        epoch, offset = divmod(pos, n)
        order = list(range(n))
        random.Random(f"prompts:{seed}:{epoch}").shuffle(order)
        take = min(count - len(out), n - offset)
        out += order[offset : offset + take]
        pos += take
    return out


def rank_slots(prompts: int, mini_batch_prompts: int, world: int, rank: int) -> list[int]:
    """Positions of a step's prompt list that data-parallel rank `rank` of `world` samples and
    trains on (the ranks of a sequence-parallel group share one data-parallel rank).

    Every mini-batch of `mini_batch_prompts` consecutive prompts is split evenly across the
    ranks, so the prompts of a mini-batch are the same for any number of processes, and the G
    responses of a prompt (its group) always stay on one rank."""
    share = mini_batch_prompts // world
    return [k * mini_batch_prompts + rank * share + i
            for k in range(prompts // mini_batch_prompts) for i in range(share)]


@dataclass
class Rollouts:
    """One rank's training sequences of a step (or of one mini-batch), by (prompt slot, sample).

    `stats` holds the sampling policy's per-token statistics (flat (N,) over the response
    tokens, from the scorer) once the sampling pass has run; `sampler_logprobs` (flat (N,)) the
    sampler's own log-probs of the same tokens, when it gave them."""

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    groups: list[int]
    advantages: Tensor  # (B,) float32
    stats: dict[str, Tensor] = field(default_factory=dict)
    sampler_logprobs: Tensor | None = None  # (N,) float32

    @property
    def lengths(self) -> list[int]:
        return [len(r) for r in self.response_ids]

    def scope(self) -> Scope:
        return Scope(self.prompt_ids, self.response_ids, self.groups)

    def token_ids(self) -> Tensor:
        return torch.tensor([t for r in self.response_ids for t in r], dtype=torch.long)


@dataclass
class Sampled:
    """Totals over every response sampled in a step on this rank (for the metrics)."""

    responses: int = 0
    correct: int = 0
    reward: float = 0.0
    tokens: int = 0
    generation_batches: int = 0  # the same on every rank
    cut: int = 0  # responses that reached their generation limit (finish reason "length")
    generation_s: float = 0.0  # this rank's wall time in the sampler
    reward_s: float = 0.0  # ... and grading


@dataclass
class PromptPool:
    """The training prompts: text, gold answer, answer type, generation limit and grader of each."""

    prompts: list[str]
    answers: list[str]
    answer_types: list[str]
    limits: list[int]
    graders: list[str] | None = None  # None: every prompt 'verify'

    def __len__(self) -> int:
        return len(self.prompts)

    def grader(self, i: int) -> str:
        return "verify" if self.graders is None else self.graders[i]


@dataclass
class Group:
    """The G graded responses of one prompt."""

    prompt_ids: list[int]
    response_ids: list[list[int]]
    rewards: list[float]
    correct: list[bool]
    logprobs: list[list[float]] | None
    cut: int = 0  # responses that reached their generation limit

    def informative(self) -> bool:
        """DAPO: correctness varies within the group (its reward may vary without it)."""
        return len(set(self.correct)) > 1


def rewards_of(cfg: Config, pool: PromptPool, prompts: list[int], samples) -> tuple[Tensor, Tensor]:
    """(correct (n,) bool, rewards (n,) float64) of samples of pool prompts `prompts`.

    A scored grader's score (math_dapo: ±1) is the reward, else train.reward_correct /
    reward_incorrect; DAPO's overlong penalty is added once, to the reward only."""
    from stages.core.reward.registry import grade_many

    t = cfg.train
    by_grader: dict[str, list[int]] = {}
    for k, s in enumerate(samples):
        by_grader.setdefault(pool.grader(prompts[s.prompt_idx]), []).append(k)
    correct = torch.zeros(len(samples), dtype=torch.bool)
    rewards = torch.zeros(len(samples), dtype=torch.float64)
    right, wrong = t.reward_values()
    for grader, ks in by_grader.items():
        grades = grade_many([samples[k].response for k in ks],
                            [pool.answers[prompts[samples[k].prompt_idx]] for k in ks],
                            [pool.answer_types[prompts[samples[k].prompt_idx]] for k in ks],
                            cfg.evaluate.grade_timeout_s, grader=grader)
        for k, g in zip(ks, grades, strict=True):
            correct[k] = g.correct
            rewards[k] = g.score if g.score is not None else (right if g.correct else wrong)
    if t.overlong_buffer is not None:
        lengths = torch.tensor([len(s.response_token_ids) for s in samples])
        limit = torch.tensor([pool.limits[prompts[s.prompt_idx]] for s in samples])
        rewards = rewards + overlong_penalty(lengths, limit, t.overlong_buffer,
                                             t.overlong_penalty_factor)
    return correct, rewards


def sample_groups(step: int, cfg: Config, run_seed: int, sampler, pool: PromptPool,
                  prompts: list[int], sampled: Sampled, sp: Dist | None = None) -> list[Group]:
    """Sample and grade `group_size` responses for each pool prompt in `prompts`.

    sp: the sequence-parallel group (several ranks that train on the same sequences): they share
    the work and its result, rank s of k sampling and grading prompts s, s + k, ... with the
    seeds they have in the whole list, and every rank of the group gets every group, so the
    group trains on identical sequences whatever the backend's determinism."""
    t = cfg.train
    g = t.group_size
    k, me = (1, 0) if sp is None else (sp.world, sp.rank)
    mine = prompts[me::k]
    began = time.perf_counter()
    samples = sampler.sample([pool.prompts[i] for i in mine], n=g, temperature=t.temperature,
                             top_p=t.top_p, max_new_tokens=[pool.limits[i] for i in mine],
                             prompt_seeds=rollout_seeds(run_seed, step, prompts)[me::k],
                             desc=f"step {step}")
    graded = time.perf_counter()
    correct, rewards = rewards_of(cfg, pool, mine, samples)
    sampled.generation_s += graded - began
    sampled.reward_s += time.perf_counter() - graded
    out = []
    for j in range(len(mine)):
        rows = samples[j * g : (j + 1) * g]
        logprobs = [s.logprobs for s in rows]
        out.append(Group(rows[0].prompt_token_ids, [s.response_token_ids for s in rows],
                         rewards[j * g : (j + 1) * g].tolist(), correct[j * g : (j + 1) * g].tolist(),
                         None if any(lp is None for lp in logprobs) else logprobs,
                         cut=sum(s.finish_reason == "length" for s in rows)))
    if k > 1:  # the group's groups in the order of `prompts`
        parts = sp.objects(out)
        out = [parts[i % k][i // k] for i in range(len(prompts))]
    sampled.responses += sum(len(gr.response_ids) for gr in out)
    sampled.correct += sum(sum(gr.correct) for gr in out)
    sampled.reward += float(torch.tensor([r for gr in out for r in gr.rewards], dtype=torch.float64).sum())
    sampled.tokens += sum(len(r) for gr in out for r in gr.response_ids)
    sampled.cut += sum(gr.cut for gr in out)
    return out


def collect(step: int, consumed: int, cfg: Config, run_seed: int, sampler, pool: PromptPool,
            dist: Dist, sampled: Sampled) -> tuple[Rollouts, int]:
    """Sample, grade and keep this rank's groups of a step; returns them and the prompts consumed."""
    t = cfg.train
    if t.dynamic_sampling and t.dynamic_sampling_pool == "ranks":
        groups, consumed = _collect_pooled(step, consumed, cfg, run_seed, sampler, pool, dist, sampled)
        return to_rollouts(groups, t.group_size), consumed
    slots = rank_slots(t.prompts_per_step, t.mini_batch_prompts, dist.world, dist.rank)
    batch = t.prompts_per_step * (t.generation_batch_multiple if t.dynamic_sampling else 1)
    keep: list[Group] = []
    for _ in range(t.max_sampling_rounds if t.dynamic_sampling else 1):
        order = prompt_stream(len(pool), consumed, batch, run_seed)
        consumed += batch
        sampled.generation_batches += 1
        # this rank's slots of each prompts_per_step block of the generation batch
        mine = [order[b + s] for b in range(0, batch, t.prompts_per_step) for s in slots]
        groups = sample_groups(step, cfg, run_seed, sampler, pool, mine, sampled, dist.sp)
        keep += [gr for gr in groups if gr.informative()] if t.dynamic_sampling else groups
        if dist.min(len(keep)) >= len(slots):
            break
    keep = keep[: min(len(slots), dist.min(len(keep)))]  # ranks train on equally many groups
    return to_rollouts(keep, t.group_size), consumed


def _collect_pooled(step: int, consumed: int, cfg: Config, run_seed: int, sampler,
                    pool: PromptPool, dist: Dist, sampled: Sampled) -> tuple[list[Group], int]:
    """verl's dynamic sampling: kept groups counted over every rank until the batch is full."""
    t = cfg.train
    need = t.prompts_per_step
    batch = need * t.generation_batch_multiple
    share = batch // dist.world  # prompts_per_step splits over the ranks (mini-batches do)
    held: dict[int, Group] = {}  # index among the step's kept groups -> a group sampled here
    kept = 0
    for _ in range(t.max_sampling_rounds):
        order = prompt_stream(len(pool), consumed, batch, run_seed)
        consumed += batch
        sampled.generation_batches += 1
        mine = order[dist.rank * share : (dist.rank + 1) * share]
        groups = sample_groups(step, cfg, run_seed, sampler, pool, mine, sampled, dist.sp)
        flags = dist.cat(torch.tensor([g.informative() for g in groups], dtype=torch.long))
        for position in flags.nonzero().squeeze(1).tolist():  # global order of the stream
            if position // share == dist.rank:
                held[kept] = groups[position % share]
            kept += 1
        if kept >= need:
            break
    else:
        raise SamplingExhausted(
            f"train.max_sampling_rounds: after {t.max_sampling_rounds} generation batches of "
            f"{batch} prompts, {kept} groups have responses that differ in correctness, fewer "
            f"than the {need} a step trains on (train.prompts_per_step; dynamic sampling as "
            "verl's DAPO trainer stops here too). Raise train.max_sampling_rounds or "
            "train.generation_batch_multiple, or train on prompts the policy solves sometimes")
    owner = {}  # kept index (= slot of the step's prompt list) -> (rank, position on that rank)
    for r in range(dist.world):
        for i, slot in enumerate(rank_slots(need, t.mini_batch_prompts, dist.world, r)):
            owner[slot] = (r, i)
    outgoing: list[list[tuple[int, Group]]] = [[] for _ in range(dist.world)]
    for q, group in held.items():
        if q < need:  # the surplus is dropped
            outgoing[owner[q][0]].append((owner[q][1], group))
    received = dist.exchange(outgoing)
    return [g for _, g in sorted(received, key=lambda item: item[0])], consumed


def to_rollouts(groups: list[Group], group_size: int) -> Rollouts:
    """This rank's groups as training sequences, with group-relative advantages."""
    prompt_ids, response_ids, index, rewards, logprobs = [], [], [], [], []
    for k, g in enumerate(groups):
        prompt_ids += [g.prompt_ids] * group_size
        response_ids += g.response_ids
        index += [k] * group_size
        rewards += g.rewards
        if g.logprobs is not None:
            logprobs += [lp for seq in g.logprobs for lp in seq]
    rewards_t = torch.tensor(rewards, dtype=torch.float64)
    adv = group_advantages(rewards_t, torch.tensor(index, dtype=torch.long)).float()
    complete = bool(groups) and all(g.logprobs is not None for g in groups)
    return Rollouts(prompt_ids, response_ids, index, adv,
                    sampler_logprobs=torch.tensor(logprobs, dtype=torch.float32) if complete else None)


def split_minibatches(roll: Rollouts, groups_per_minibatch: int, group_size: int) -> list[Rollouts]:
    """This rank's part of each mini-batch: consecutive whole groups, with their token slices."""
    out = []
    starts = torch.tensor([0] + roll.lengths).cumsum(0).tolist()
    per = groups_per_minibatch * group_size
    for a in range(0, len(roll.response_ids), per):
        b = min(a + per, len(roll.response_ids))
        sampler = None if roll.sampler_logprobs is None else roll.sampler_logprobs[starts[a]:starts[b]]
        out.append(Rollouts(roll.prompt_ids[a:b], roll.response_ids[a:b], roll.groups[a:b],
                            roll.advantages[a:b],
                            {k: v[starts[a]:starts[b]] for k, v in roll.stats.items()}, sampler))
    return out


def concat_rollouts(parts: list[Rollouts]) -> Rollouts:
    """Several Rollouts as one, in order (their stats and sampler log-probs concatenated)."""
    if not parts:
        return Rollouts([], [], [], torch.zeros(0))
    keys = set.intersection(*(set(p.stats) for p in parts))
    sampler = (None if any(p.sampler_logprobs is None for p in parts)
               else torch.cat([p.sampler_logprobs for p in parts]))
    return Rollouts([x for p in parts for x in p.prompt_ids], [x for p in parts for x in p.response_ids],
                    [x for p in parts for x in p.groups], torch.cat([p.advantages for p in parts]),
                    {k: torch.cat([p.stats[k] for p in parts]) for k in keys}, sampler)


def virtual_minibatches(roll: Rollouts, cfg: Config, dist: Dist) -> tuple[list[Rollouts], list[MicroScope], VirtualStep]:
    """This rank's part of each mini-batch in verl's layout (train.virtual_layout), with its
    virtual micro-batches, and the step's layout.

    The step's sequences are numbered in verl's batch order: the prompt slots of the step in
    order (the kept groups in stream order), a group's G responses together. Every rank computes
    the same layout from everyone's lengths (prompt + response tokens); a virtual data-parallel
    group is computed by one data-parallel rank (batching.group_owner: consecutive blocks), and
    each sequence moves there with its advantage and sampler log-probs. The ranks of a
    sequence-parallel group make the same exchange in their own data-parallel groups, so they
    hold the same sequences."""
    t, v = cfg.train, cfg.train.virtual_layout
    g = t.group_size
    slots = rank_slots(t.prompts_per_step, t.mini_batch_prompts, dist.world, dist.rank)
    if len(roll.response_ids) != len(slots) * g:
        raise ValueError(f"rank {dist.rank} holds {len(roll.response_ids)} sequences, not its "
                         f"{len(slots)} groups of {g}: verl's layout needs a full step")
    index = [slots[i // g] * g + i % g for i in range(len(roll.response_ids))]  # in the step's order
    totals = [len(p) + len(r) for p, r in zip(roll.prompt_ids, roll.response_ids, strict=True)]
    pairs = dist.cat(torch.tensor([[i, n] for i, n in zip(index, totals, strict=True)],
                                  dtype=torch.long).reshape(-1))
    lengths = [0] * (t.prompts_per_step * g)
    for i, n in pairs.reshape(-1, 2).tolist():
        lengths[i] = n
    layout = virtual_step(lengths, world_size=v.world_size, sequence_parallel=v.sequence_parallel,
                          group_batch=t.mini_batch_prompts * g // v.groups, budget=v.budget,
                          balance=v.balance_batch)
    owner = {i: group_owner(gr, layout.groups, dist.world)
             for gr, seqs in enumerate(layout.order) for i in seqs}
    starts = torch.tensor([0] + roll.lengths).cumsum(0).tolist()
    outgoing: list[list] = [[] for _ in range(dist.world)]
    for k, i in enumerate(index):
        sampler = (None if roll.sampler_logprobs is None
                   else roll.sampler_logprobs[starts[k]:starts[k + 1]])
        outgoing[owner[i]].append((i, roll.prompt_ids[k], roll.response_ids[k], roll.groups[k],
                                   float(roll.advantages[k]), sampler))
    held = {item[0]: item for item in dist.exchange(outgoing)}
    mine = [gr for gr in range(layout.groups) if group_owner(gr, layout.groups, dist.world) == dist.rank]
    minibatches, scopes = [], []
    for per_group in layout.micro:
        seqs = [i for gr in mine for m in per_group[gr] for i in m]
        place = {i: k for k, i in enumerate(seqs)}
        rows = [held[i] for i in seqs]
        sampler = (None if any(r[5] is None for r in rows) or not rows
                   else torch.cat([r[5] for r in rows]))
        minibatches.append(Rollouts([r[1] for r in rows], [r[2] for r in rows], [r[3] for r in rows],
                                    torch.tensor([r[4] for r in rows], dtype=torch.float32),
                                    sampler_logprobs=sampler))
        scopes.append(MicroScope([[place[i] for i in m] for gr in mine for m in per_group[gr]],
                                 t.mini_batch_prompts * g // v.groups, layout.groups))
    return minibatches, scopes, layout
