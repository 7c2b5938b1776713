"""Rollout collection of the trainer: prompts, sampling, grading, DAPO filtering, advantages.

Each rollout step takes the next `prompts_per_step` prompts of a seeded shuffle of the prompt
pool (one shuffle per epoch), samples `group_size` responses for each from the current policy,
grades them, and turns rewards into group-relative advantages (METHODS §4), optionally with
DAPO's overlong penalty and dynamic sampling (groups whose responses are all correct or all
wrong carry no signal and are replaced by groups of the next prompts).
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..config import Config
from .engine import Dist
from .losses import group_advantages, overlong_penalty
from .scorer import Scope


def seed_of(*parts) -> int:
    """A 32-bit seed from any parts: the same parts, the same seed, on every rank and run."""
    return int(hashlib.sha256(":".join(map(str, parts)).encode()).hexdigest()[:8], 16)


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
    """Positions of a step's prompt list that `rank` samples and trains on.

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
    tokens, from the scorer) once the sampling pass has run."""

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    groups: list[int]
    advantages: Tensor  # (B,) float32
    stats: dict[str, Tensor] = field(default_factory=dict)

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


@dataclass
class PromptPool:
    """The training prompts: text, gold answer, answer type and generation limit of each."""

    prompts: list[str]
    answers: list[str]
    answer_types: list[str]
    limits: list[int]

    def __len__(self) -> int:
        return len(self.prompts)


def collect(step: int, consumed: int, cfg: Config, run_seed: int, sampler, pool: PromptPool,
            dist: Dist, sampled: Sampled) -> tuple[Rollouts, int]:
    """Sample, grade and keep this rank's groups of a step; returns them and the prompts consumed."""
    from .grading import grade_many

    t = cfg.train
    g = t.group_size
    slots = rank_slots(t.prompts_per_step, t.mini_batch_prompts, dist.world, dist.rank)
    need = len(slots)
    keep: list[tuple] = []  # (prompt ids, the group's response ids, its rewards)
    for rnd in range(t.max_sampling_rounds if t.dynamic_sampling else 1):
        order = prompt_stream(len(pool), consumed, t.prompts_per_step, run_seed)
        consumed += t.prompts_per_step
        mine = [order[s] for s in slots]
        limits = [pool.limits[i] for i in mine]
        samples = sampler.sample([pool.prompts[i] for i in mine], n=g, temperature=t.temperature,
                                 top_p=t.top_p, max_new_tokens=limits,
                                 seed=seed_of(run_seed, step, rnd, dist.rank), desc=f"step {step}")
        grades = grade_many([s.response for s in samples],
                            [pool.answers[mine[s.prompt_idx]] for s in samples],
                            [pool.answer_types[mine[s.prompt_idx]] for s in samples],
                            cfg.evaluate.grade_timeout_s)
        correct = torch.tensor([gr.correct for gr in grades])
        rewards = torch.where(correct, t.reward_correct, t.reward_incorrect).double()
        lengths = torch.tensor([len(s.response_token_ids) for s in samples])
        if t.overlong_buffer is not None:
            limit = torch.tensor([limits[s.prompt_idx] for s in samples])
            rewards = rewards + overlong_penalty(lengths, limit, t.overlong_buffer)
        sampled.responses += len(samples)
        sampled.correct += int(correct.sum())
        sampled.reward += float(rewards.sum())
        sampled.tokens += int(lengths.sum())
        for k in range(len(mine)):
            right = correct[k * g : (k + 1) * g]
            # DAPO: a group whose responses are all correct or all wrong carries no signal (on
            # correctness, not on the reward: the overlong penalty makes equal answers differ)
            if t.dynamic_sampling and bool((right == right[0]).all()):
                continue
            rows = samples[k * g : (k + 1) * g]
            keep.append((rows[0].prompt_token_ids, [s.response_token_ids for s in rows],
                         rewards[k * g : (k + 1) * g]))
        if dist.min(len(keep)) >= need:
            break
    keep = keep[: min(need, dist.min(len(keep)))]  # ranks train on equally many groups
    prompt_ids, response_ids, groups, rewards = [], [], [], []
    for k, (p, rs, r) in enumerate(keep):
        prompt_ids += [p] * g
        response_ids += rs
        groups += [k] * g
        rewards.append(r)
    rewards_t = torch.cat(rewards) if rewards else torch.zeros(0, dtype=torch.float64)
    adv = group_advantages(rewards_t, torch.tensor(groups, dtype=torch.long)).float()
    return Rollouts(prompt_ids, response_ids, groups, adv), consumed


def split_minibatches(roll: Rollouts, groups_per_minibatch: int, group_size: int) -> list[Rollouts]:
    """This rank's part of each mini-batch: consecutive whole groups, with their token slices."""
    out = []
    starts = torch.tensor([0] + roll.lengths).cumsum(0).tolist()
    per = groups_per_minibatch * group_size
    for a in range(0, len(roll.response_ids), per):
        b = min(a + per, len(roll.response_ids))
        out.append(Rollouts(roll.prompt_ids[a:b], roll.response_ids[a:b], roll.groups[a:b],
                            roll.advantages[a:b],
                            {k: v[starts[a]:starts[b]] for k, v in roll.stats.items()}))
    return out
