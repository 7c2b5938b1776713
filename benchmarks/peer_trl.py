"""Our trainer against TRL's GRPOTrainer: a few GRPO steps of each on the same CPU (issue 36).

    python benchmarks/peer_trl.py                                  # Tiny-S and SmolLM2-135M
    python benchmarks/peer_trl.py --models tiny-s --steps 6
    python benchmarks/peer_trl.py --check-only --models tiny-s     # the equality check alone
    python benchmarks/peer_trl.py --json results/bench/peer_trl.json

Inputs: each model's base.json and its training prompts, as the workflow makes them
(`snakemake --cores 2 <model>/base.json <data>/dataset=<name>/problems.parquet`, below), or
--tiny-s-model/--tiny-s-data and --smollm2-model/--smollm2-data. TRL 1.16.0 (the dev extra).
One torch thread per process by default (--threads): the machine may be shared, and one thread
never spin-waits for another.

Both trainers get one config: the model's own (config/config.yaml for Tiny-S, config/smollm2.yaml
for SmolLM2) with the benchmark's batch laid on it (:func:`bench_raw`): P prompts x G responses a
step, all trained in one forward/backward and one optimizer step, the loss normalised by every
valid token, constant learning rate, float32, no gradient checkpointing, no KL. :func:`trl_args`
maps it onto GRPOConfig (docs/performance.md has the table); `--trl-override KEY=VALUE` changes
one TRL option, to see what it governs (the equality check then fails where it should).

1. The equality check (a fresh process): one fixed batch — the first P_check prompts of step 0,
   G responses each from our sampler, the last of each group replaced by the problem's worked
   solution so that every group's rewards differ even for an untrained model, the rewards of our
   grader (also through the function TRL calls, which must give the same), our advantages, and
   old log-probs off the current ones by N(0, 0.2²) so that clipping acts — goes through TRL's
   `_compute_loss` and through our actor step. Per case (GRPO; TRL's top_entropy_quantile 0.2,
   against our actor given TRL's rule and TRL's entropies, :func:`trl_rule`, so that both train
   on the same tokens) the loss and the gradient norm before clipping must agree within
   |a − b| ≤ 1e-6 + 1e-4·|b|, and the selections must be identical; otherwise the script exits
   with status 1. Also reported: our own 20-Entropy rule on our own entropies against TRL's
   selection, and how far apart the entropies, log-probs and advantages each computes are.
2. The runs, each trainer in a fresh process of its own (peak RSS is its own), one after another
   under the same thread count and CPU settings (numerics.cpu_isa of the model's config):
   TRL GRPO, ours GRPO, TRL top_entropy_quantile 0.2, our 20-Entropy, our ICT (ρ = 0.1, selective
   from the first step). Ours is the stage itself (stages.train's main, as `python -m
   stages.train` runs it); TRL's GRPOTrainer is timed from outside (a subclass that times its
   generation and reward calls, a callback at each optimizer step).

Per step: generation, reward and training seconds (training = the step's wall time less
generation and reward: for ours the sampling pass and the actor, for TRL the forward, backward,
clipping and optimizer step), the response tokens generated and per second of the step, and the
resident-set high-water mark of the step (reset after each step; the first step's includes the
process's start). Ratios are ours / TRL over the steps after the first (their warm-ups), peak
memory over all steps: below 1 is better.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
from harness import ROOT, report, rss_kb  # benchmarks/harness.py, beside this script

sys.path.insert(0, str(ROOT))

TRL_VERSION = "1.16.0"  # the check calls TRL's private _compute_loss
RTOL, ATOL = 1e-4, 1e-6
OLD_NOISE = 0.2  # nats: the old log-probs' offset from the current ones in the check
OURS = {  # our variant: its methods.<name> entry
    "grpo": {"selector": "all", "label": "GRPO"},
    "entropy20": {"selector": "entropy_top", "rho": 0.2, "label": "20-Entropy"},
    "ict": {"selector": "ict", "variant": "paper", "rho": 0.1, "warmup_steps": 0, "rescore": False,
            "label": "ICT"},
}
TRL = {"grpo": 1.0, "entropy20": 0.2}  # TRL's variant: its top_entropy_quantile
PAIRS = (("GRPO, full (equal work)", "grpo", "grpo"),
         ("20-Entropy / top_entropy_quantile 0.2 (equal work)", "entropy20", "entropy20"),
         ("ICT rho 0.1 / TRL full GRPO", "ict", "grpo"))


@dataclass(frozen=True)
class Spec:
    """A model of the comparison: its config, size key, default inputs and batch."""

    config: str
    size: str
    model: str
    data: str
    prompts: int  # P: prompts per step
    limit: int  # response tokens
    steps: int
    check_prompts: int


MODELS = {
    "tiny-s": Spec("config/config.yaml", "tiny-s", "results/default/models/size=tiny-s/base.json",
                   "results/default/data", 16, 64, 10, 4),
    "smollm2": Spec("config/smollm2.yaml", "smollm2-135m",
                    "results/smollm2/models/size=smollm2-135m/base.json", "results/smollm2/data", 2, 48, 3, 2),
}


# ---------------------------------------------------------------------------------------------
# The one config, and TRL's options from it
# ---------------------------------------------------------------------------------------------
def bench_raw(spec: Spec, steps: int, prompts: int, limit: int) -> dict:
    """The model's config with the benchmark's batch and loss: one generation batch, one
    micro-batch and one optimizer step per rollout step, as TRL makes them with
    steps_per_generation = gradient_accumulation_steps = 1."""
    from stages.config.load import load_yaml, merge

    raw = load_yaml(ROOT / spec.config)
    g = raw["train"]["group_size"]
    return merge(raw, {
        "experiment": {"sizes": [spec.size], "methods": list(OURS)},
        "methods": OURS,
        "evaluate": {"main_methods": list(OURS)},
        "datasets": {name: {"max_response_tokens": limit} for name in raw["experiment"]["train_datasets"]},
        "train": {"steps": steps, "prompts_per_step": prompts, "mini_batch_prompts": prompts,
                  "micro_batch_size": prompts * g, "micro_batch_tokens": None,
                  "generation_batch_size": prompts * g, "max_response_tokens": limit,
                  "ppo_epochs": 1, "warmup_steps": 0, "weight_decay": 0.0, "grad_clip": 1.0,
                  "loss": {"eps_low": 0.2, "eps_high": 0.28, "denominator": "all", "kl_beta": 0.0},
                  "gradient_checkpointing": False, "dtype": "float32", "zero_stage": 0,
                  "dynamic_sampling": False, "overlong_buffer": None, "tis_cap": None,
                  "checkpoint_every": 10**6, "checkpoint_every_minutes": None, "save_every": None,
                  "loggers": [], "backend": "hf", "attn_implementation": "sdpa"},
    })


def trl_loss_type(denominator: str, full: bool) -> str:
    """TRL's loss_type that normalises as our loss.denominator: dapo divides by every valid token
    of the batch (ours: all; selected too when every token is selected), grpo by each sequence's
    then by B (ours: sequence, when every token is selected: TRL's entropy mask keeps each
    sequence's count of valid tokens as the divisor)."""
    if denominator == "all" or (denominator == "selected" and full):
        return "dapo"
    if denominator == "sequence" and full:
        return "grpo"
    raise ValueError(f"loss.denominator {denominator!r} has no TRL loss_type with a selection")


def trl_args(cfg, size: str, variant: str, out_dir: str, overrides: dict | None = None) -> dict:
    """GRPOConfig's arguments for the same run as our cfg (cfg.for_method applied)."""
    t = cfg.train
    quantile = TRL[variant]
    batch = t.prompts_per_step * t.group_size
    args = {
        "output_dir": out_dir, "seed": cfg.seed, "max_steps": t.steps,
        "per_device_train_batch_size": batch, "gradient_accumulation_steps": 1,
        "steps_per_generation": 1, "num_generations": t.group_size, "num_iterations": t.ppo_epochs,
        "shuffle_dataset": False,  # the dataset is already in our trainer's prompt order
        "learning_rate": cfg.models[size].lr or t.lr, "lr_scheduler_type": "constant",
        "warmup_steps": t.warmup_steps, "weight_decay": t.weight_decay,
        "max_grad_norm": t.grad_clip, "optim": "adamw_torch",  # torch AdamW, as build_engine's
        "adam_beta1": 0.9, "adam_beta2": 0.999, "adam_epsilon": 1e-8,
        "loss_type": trl_loss_type(t.loss.denominator, quantile == 1.0),
        "epsilon": t.loss.eps_low, "epsilon_high": t.loss.eps_high, "beta": t.loss.kl_beta,
        "scale_rewards": "group", "top_entropy_quantile": quantile,
        "temperature": t.temperature, "top_p": t.top_p, "top_k": 0, "min_p": None,
        "repetition_penalty": 1.0, "max_completion_length": t.max_response_tokens,
        "mask_truncated_completions": False,  # ours trains on responses cut at the limit too
        "bf16": t.dtype == "bfloat16", "fp16": False,  # TRL 1.16 defaults to bf16 = True on CPU
        "gradient_checkpointing": t.gradient_checkpointing,  # TRL 1.16 defaults to True
        "use_vllm": False, "use_cpu": True, "disable_dropout": True,
        "report_to": "none", "save_strategy": "no", "logging_steps": 1, "log_completions": False,
        "dataloader_num_workers": 0,
    }
    return args | (overrides or {})


def reward_function(cfg, pool):
    """Our grader as a TRL reward function: stages.core.training.rollouts.rewards_of, the function
    our trainer grades with, on the completions of pool prompts `pool_index` (a dataset column)."""
    from stages.core.training.rollouts import rewards_of

    def our_grader(prompts, completions, completion_ids, pool_index, **_) -> list[float]:
        samples = [SimpleNamespace(prompt_idx=k, response=text, response_token_ids=ids)
                   for k, (text, ids) in enumerate(zip(completions, completion_ids, strict=True))]
        return rewards_of(cfg, pool, list(pool_index), samples)[1].tolist()

    return our_grader


def load_inputs(job: dict):
    """(config for the job's method, the prompt pool, the run seed) of a worker's job."""
    from stages.config import load_config
    from stages.core.training.rollouts import seed_of
    from stages.train import prompt_pool

    cfg = load_config(job["config"])
    pool = prompt_pool(cfg, job["prompts"])
    return cfg.for_method(job["method"], job["size"]), pool, seed_of(cfg.seed, 0)


def trl_dataset(pool, order: list[int]):
    from datasets import Dataset

    return Dataset.from_list([{"prompt": pool.prompts[i], "pool_index": i} for i in order])


def step_order(pool, run_seed: int, steps: int, prompts: int) -> list[int]:
    """The pool indices our trainer trains on, step after step (rollouts.prompt_stream)."""
    from stages.core.training.rollouts import prompt_stream

    return prompt_stream(len(pool), 0, steps * prompts, run_seed)


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS


# ---------------------------------------------------------------------------------------------
# 1. The equality check on one fixed batch
# ---------------------------------------------------------------------------------------------
def fixed_batch(cfg, job: dict, pool, run_seed: int, model, tokenizer):
    """(samples, the pool index of each prompt) of the check: G sampled responses to each of the
    first job['check_prompts'] prompts of step 0, the last of each group replaced by the
    problem's worked solution (and end-of-text) where the data has one."""
    import polars as pl

    from stages.core.models.generation import Sample, sample_hf, stop_token_ids
    from stages.core.training.rollouts import rollout_seeds

    t, size = cfg.train, job["size"]
    order = step_order(pool, run_seed, 1, job["check_prompts"])
    samples = sample_hf(model, tokenizer, [pool.prompts[i] for i in order], n=t.group_size,
                        temperature=t.temperature, top_p=t.top_p,
                        max_new_tokens=[pool.limits[i] for i in order],
                        prompt_seeds=rollout_seeds(run_seed, 0, order), batch_size=len(order) * t.group_size,
                        stop_tokens=cfg.models[size].stop_tokens)
    solutions = pl.concat([pl.read_parquet(p, columns=["prompt", "solution"]) for p in job["prompts"]])
    by_prompt = dict(zip(solutions["prompt"], solutions["solution"], strict=True))
    eos = stop_token_ids(tokenizer, cfg.models[size].stop_tokens)[0]
    for k, i in enumerate(order):
        worked = by_prompt.get(pool.prompts[i])
        if worked is None:
            continue
        text = worked if pool.prompts[i][-1:].isspace() else " " + worked
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][: pool.limits[i] - 1] + [eos]
        slot = (k + 1) * t.group_size - 1
        old = samples[slot]
        samples[slot] = Sample(k, old.sample_idx, old.prompt_token_ids, ids,
                               tokenizer.decode(ids, skip_special_tokens=True), "stop")
    return samples, order


def padded(rows: list[list[int]], pad: int, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for r, row in enumerate(rows):
        span = slice(width - len(row), width) if left else slice(0, len(row))
        ids[r, span], mask[r, span] = torch.tensor(row, dtype=torch.long), 1
    return ids, mask


def trl_case(job, cfg, pool, variant: str, batch: dict, overrides: dict) -> dict:
    """TRL's loss, gradient norm, entropies, log-probs and selection on the fixed batch."""
    from trl import GRPOConfig, GRPOTrainer

    from stages.core.models.modeling import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(job["model"], dtype=torch.float32)
    model.set_attn_implementation(cfg.train.attn_implementation)
    with tempfile.TemporaryDirectory() as out:
        trainer = GRPOTrainer(model=model, reward_funcs=reward_function(cfg, pool),
                              args=GRPOConfig(**trl_args(cfg, job["size"], variant, out, overrides)),
                              train_dataset=trl_dataset(pool, batch["order"]), processing_class=tokenizer)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer's loop, read by _compute_loss
    inputs = {k: batch[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask",
                                    "advantages", "old_per_token_logps", "num_items_in_batch")}
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    width = batch["completion_ids"].shape[1]
    with torch.no_grad():
        logp, entropy, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, ids, attention, width, compute_entropy=True)
    mask = batch["completion_mask"].bool()
    quantile = trainer.top_entropy_quantile
    chosen = (trainer.get_high_entropy_mask(entropy, batch["completion_mask"], 1 - quantile)
              if quantile < 1.0 else mask)
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    grads = [p.grad for p in trainer.model.parameters() if p.grad is not None]
    # TRL's own advantages of the same rewards (its epsilon 1e-4, float32)
    rewards = batch["rewards"].float().view(-1, cfg.train.group_size)
    own = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)).reshape(-1)
    return {"loss": float(loss.detach()), "grad_norm": float(torch.nn.utils.get_total_norm(grads)),
            "entropy": entropy[mask], "logprob": logp[mask], "mask": chosen[mask],
            "advantages": own}


def our_case(engine, initial: dict, roll, cfg, method, dist, pad: int, stats: dict) -> dict:
    """Our actor step's loss and gradient norm (before clipping) on the fixed batch, from the
    initial weights; `stats` are what the selector reads, stats['logprob'] the old log-probs."""
    from stages.core.training.actor import actor_step

    engine.module.lm.load_state_dict(initial)
    mb = copy.copy(roll)
    mb.stats = stats
    gen = torch.Generator().manual_seed(0)
    update = actor_step(engine, mb, method, cfg, dist, gen, pad, stats=stats, on_policy=False)
    return {"loss": update.loss, "grad_norm": update.grad_norm, "mask": update.mask}


def trl_rule(method):
    """`method` with TRL's selection rule in place of ours: get_high_entropy_mask, every valid
    token whose entropy is at or above the (1 − ρ) quantile (linear interpolation) of the batch's
    valid tokens, registered as one of our selectors. Ours (entropy_top) takes exactly ceil(ρN),
    the earliest first among equal entropies; TRL keeps every token tied with the quantile, and
    the G responses of a prompt share their first positions' entropies. With TRL's rule and TRL's
    entropies both trainers train on the same tokens, so their losses can be compared."""
    from stages.core.training.selectors import SELECTORS, EntropyParams, register_selector

    name = "trl_top_entropy_quantile"
    if name not in SELECTORS:
        @register_selector(name, needs=("entropy",), params=EntropyParams)
        def select(inp, rho: float = 0.2):
            entropy = inp.need("entropy")
            return (entropy >= torch.quantile(entropy[inp.valid].float(), 1 - rho)) & inp.valid
    return method.model_copy(update={"selector": name})


def agree(a: float, b: float) -> bool:
    return abs(a - b) <= ATOL + RTOL * abs(b)


def check(job: dict) -> dict:
    """The equality check in this (fresh) process: one row per case, and whether all agree."""
    from stages import train
    from stages.core.models.engine import (
        build_engine,
        float32_rotary,
        init_distributed,
        resolve_launch,
    )
    from stages.core.models.modeling import load_model_and_tokenizer
    from stages.core.training.losses import group_advantages
    from stages.core.training.rollouts import Rollouts, rewards_of
    from stages.core.training.selectors import grid, valid_grid

    cfg, pool, run_seed = load_inputs(job | {"method": "grpo"})
    torch.manual_seed(0)
    model, tokenizer = load_model_and_tokenizer(job["model"], dtype=torch.float32)
    float32_rotary(model).set_attn_implementation(cfg.train.attn_implementation)
    pad, g = tokenizer.pad_token_id, cfg.train.group_size
    samples, order = fixed_batch(cfg, job, pool, run_seed, model, tokenizer)
    prompts_of = [order[s.prompt_idx] for s in samples]
    _, rewards = rewards_of(cfg, pool, order, samples)
    through_trl = reward_function(cfg, pool)(
        prompts=[pool.prompts[i] for i in prompts_of], completions=[s.response for s in samples],
        completion_ids=[s.response_token_ids for s in samples], pool_index=prompts_of)
    if through_trl != rewards.tolist():
        raise SystemExit("the reward function TRL calls grades differently from our trainer's")
    groups = torch.arange(len(samples)) // g
    advantages = group_advantages(rewards, groups).float()
    if not advantages.abs().sum() > 0:
        raise SystemExit("the check's batch carries no signal: every group's rewards are equal")
    responses = [s.response_token_ids for s in samples]
    lengths = [len(r) for r in responses]
    roll = Rollouts([s.prompt_token_ids for s in samples], responses, groups.tolist(), advantages)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    # the old log-probs: our scorer's, the same for both, moved so that ratios differ from 1
    scored = train.rescore(model, roll, frozenset({"entropy"}), cfg, pad,
                           SimpleNamespace(world=1, device=torch.device("cpu")))
    noise = torch.randn(sum(lengths), generator=torch.Generator().manual_seed(1)) * OLD_NOISE
    old = scored["logprob"].float() + noise
    prompt_ids, prompt_mask = padded(roll.prompt_ids, pad, left=True)
    completion_ids, completion_mask = padded(responses, pad, left=False)
    batch = {"order": order, "rewards": rewards, "prompt_ids": prompt_ids, "prompt_mask": prompt_mask,
             "completion_ids": completion_ids, "completion_mask": completion_mask,
             "advantages": advantages, "old_per_token_logps": grid(old, lengths),
             "num_items_in_batch": torch.tensor(float(sum(lengths)))}
    theirs = {v: trl_case(job, cfg, pool, v, batch, job["overrides"]) for v in TRL}

    dist = init_distributed(resolve_launch(cfg, job["size"]))
    engine = build_engine(model, cfg.train, dist.world)
    engine.train()
    rows, ok = [], True
    valid = valid_grid(lengths)
    for variant, trl in theirs.items():
        method = cfg.methods[variant]
        stats = {"logprob": old, "entropy": trl["entropy"].float(), "renyi2": scored["renyi2"]}
        rule = method if TRL[variant] == 1.0 else trl_rule(method)
        ours = our_case(engine, initial, roll, cfg, rule, dist, pad, stats)
        own = ours if rule is method else our_case(engine, initial, roll, cfg, method, dist, pad,
                                                   scored | {"logprob": old})
        same = bool(torch.equal(ours["mask"][valid], trl["mask"]))
        mine = own["mask"][valid]
        row = {"case": variant, "tokens": sum(lengths), "selected": int(trl["mask"].sum()),
               "ours_loss": ours["loss"], "trl_loss": trl["loss"],
               "loss_diff": abs(ours["loss"] - trl["loss"]),
               "ours_grad_norm": ours["grad_norm"], "trl_grad_norm": trl["grad_norm"],
               "grad_norm_rel_diff": abs(ours["grad_norm"] - trl["grad_norm"]) / trl["grad_norm"],
               "same_selection": same,
               "own_rule_selected": int(mine.sum()),
               "own_rule_jaccard": float((mine & trl["mask"]).sum() / (mine | trl["mask"]).sum()),
               "own_rule_loss": own["loss"], "own_rule_grad_norm": own["grad_norm"],
               "entropy_max_diff": float((scored["entropy"].double() - trl["entropy"].double()).abs().max()),
               "logprob_max_diff": float((scored["logprob"].double() - trl["logprob"].double()).abs().max()),
               "trl_advantage_max_diff": float((trl["advantages"] - advantages).abs().max())}
        row["agree"] = same and agree(ours["loss"], trl["loss"]) and agree(ours["grad_norm"], trl["grad_norm"])
        ok &= row["agree"]
        rows.append(row)
    return {"rows": rows, "ok": ok, "rewards": rewards.tolist()}


# ---------------------------------------------------------------------------------------------
# 2. The runs, each in a fresh process
# ---------------------------------------------------------------------------------------------
class StepPeaks(logging.Handler):
    """The resident-set high-water mark at each of our trainer's step lines ("step k/n: ...", which
    stages.train logs as a step ends), reset after reading, so that each is one step's."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.peaks_mb: list[float] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.name == "stages" and record.getMessage().startswith("step "):
            self.peaks_mb.append(rss_kb("VmHWM") / 1024)
            reset_peak()


def ours_run(job: dict) -> dict:
    """Our trainer's stage (what `python -m stages.train` runs) in this process; its metrics."""
    import polars as pl

    from stages import cli, train

    peaks = StepPeaks()
    logging.getLogger("stages").addHandler(peaks)
    with tempfile.TemporaryDirectory() as out:
        sys.argv = ["stages.train", "--config", job["config"], "--size", job["size"],
                    "--method", job["method"], "--seed", "0", "--model", job["model"],
                    "--prompts", *job["prompts"], "--out-dir", f"{out}/run", "--threads", str(job["threads"])]
        cli.run(train.main, train.build_parser())
        metrics = pl.read_parquet(f"{out}/run/metrics.parquet").to_dicts()
    batch = job["prompts_per_step"] * job["group_size"]
    rows = [{"step": m["step"] + 1, "generation_s": m["time_generation_s"], "reward_s": m["time_reward_s"],
             "step_s": m["time_s"], "tokens": round(m["response_length_mean"] * batch),
             "peak_mb": peak, "reward": m["reward_mean"], "grad_norm": m["grad_norm"],
             "selected": m["selected_fraction"], "scoring_s": m["time_scoring_s"]}
            for m, peak in zip(metrics, peaks.peaks_mb, strict=True)]
    return {"rows": rows, "threads": torch.get_num_threads(), "isa": torch.backends.cpu.get_cpu_capability()}


def check_prompt_ids(tokenizer, prompts: list[str]) -> None:
    """TRL tokenizes a plain prompt with the tokenizer's special tokens, we without: the same
    prompts must come out the same, or the two would not train on the same sequences."""
    theirs = tokenizer(text=prompts)["input_ids"]
    ours = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    if theirs != ours:
        raise SystemExit("TRL's prompt tokens differ from ours (a BOS token?): not the same work")


def trl_run(job: dict) -> dict:
    """TRL's GRPOTrainer on the same model, prompts (in our trainer's order), grader and
    settings, timed from outside: its generation and reward calls, and each optimizer step."""
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from stages.core.models.modeling import load_model_and_tokenizer

    torch.set_num_threads(job["threads"])
    cfg, pool, run_seed = load_inputs(job)
    t = cfg.train
    model, tokenizer = load_model_and_tokenizer(job["model"], dtype=torch.float32)
    model.set_attn_implementation(t.attn_implementation)
    order = step_order(pool, run_seed, t.steps, t.prompts_per_step)
    check_prompt_ids(tokenizer, sorted({pool.prompts[i] for i in order}))
    clock: dict = {}
    rows: list[dict] = []

    class Timed(GRPOTrainer):
        def _generate_single_turn(self, *args, **kwargs):
            began = time.perf_counter()
            out = super()._generate_single_turn(*args, **kwargs)
            clock["generation_s"] += time.perf_counter() - began
            clock["tokens"] += sum(len(ids) for ids in out[0])
            return out

        def _calculate_rewards(self, *args, **kwargs):
            began = time.perf_counter()
            out = super()._calculate_rewards(*args, **kwargs)
            clock["reward_s"] += time.perf_counter() - began
            return out

    class Steps(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            clock.update(generation_s=0.0, reward_s=0.0, tokens=0, began=time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            rows.append({"step": state.global_step, "generation_s": clock["generation_s"],
                         "reward_s": clock["reward_s"], "step_s": time.perf_counter() - clock["began"],
                         "tokens": clock["tokens"], "peak_mb": rss_kb("VmHWM") / 1024})
            reset_peak()

        def on_log(self, args, state, control, logs=None, **kwargs):
            if rows and logs and "reward" in logs:
                rows[-1].update(reward=logs["reward"], grad_norm=logs.get("grad_norm"))

    with tempfile.TemporaryDirectory() as out:
        trainer = Timed(model=model, reward_funcs=reward_function(cfg, pool),
                        args=GRPOConfig(**trl_args(cfg, job["size"], job["method"], out, job["overrides"])),
                        train_dataset=trl_dataset(pool, order), processing_class=tokenizer,
                        callbacks=[Steps()])
        trainer.train()
    return {"rows": rows, "threads": torch.get_num_threads(), "isa": torch.backends.cpu.get_cpu_capability()}


WORKERS = {"check": check, "ours": ours_run, "trl": trl_run}


def run_job(job: dict, what: str) -> dict:
    """A worker in a fresh interpreter (its log on this stderr); its result, the last stdout line."""
    print(f"... {what}", file=sys.stderr, flush=True)
    done = subprocess.run([sys.executable, __file__, "--_worker", json.dumps(job)], cwd=ROOT,
                          stdout=subprocess.PIPE, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{what} failed (exit status {done.returncode}; its log is above)")
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------
# Tables
# ---------------------------------------------------------------------------------------------
def step_rows(name: str, trainer: str, variant: str, result: dict) -> list[dict]:
    out = []
    for r in result["rows"]:
        train_s = r["step_s"] - r["generation_s"] - r["reward_s"]
        out.append({"model": name, "trainer": trainer, "variant": variant, "scoring_s": None, **r,
                    "train_s": train_s,
                    "tok_per_s": r["tokens"] / r["step_s"]})
    return out


def steady(rows: list[dict]) -> list[dict]:
    """The steps after the first (its warm-ups: allocations, first calls), when there are any."""
    return rows[1:] if len(rows) > 1 else rows


def ratio_rows(name: str, runs: dict) -> list[dict]:
    """Ours / TRL of each pair: sums over the steady steps, peaks over every step."""
    out = []
    for label, mine, theirs in PAIRS:
        a, b = runs[("ours", mine)], runs[("trl", theirs)]
        sa, sb = steady(a), steady(b)

        def total(rows, key):
            return sum(r[key] for r in rows)

        row = {"model": name, "pair": label, "steps": len(sa),
               "ours_step_s": total(sa, "step_s") / len(sa), "trl_step_s": total(sb, "step_s") / len(sb)}
        for key in ("step_s", "generation_s", "train_s", "tokens"):
            row[f"{key.removesuffix('_s')}_ratio"] = total(sa, key) / total(sb, key)
        row["tok_per_s_ratio"] = row["tokens_ratio"] / row["step_ratio"]
        row["ours_peak_mb"] = max(r["peak_mb"] for r in a)
        row["trl_peak_mb"] = max(r["peak_mb"] for r in b)
        row["peak_ratio"] = row["ours_peak_mb"] / row["trl_peak_mb"]
        row["goal"] = "met" if row["step_ratio"] <= 0.5 and row["peak_ratio"] <= 1.0 else "not met"
        out.append(row)
    return out


def fmt(key: str, value) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool) or not isinstance(value, float):
        return str(value)
    if key.endswith(("_diff", "_loss")) or key.startswith(("ours_loss", "trl_loss")):
        return f"{value:.3e}"
    if "grad_norm" in key:
        return f"{value:.7g}"
    return f"{value:.3f}" if abs(value) < 100 else f"{value:.1f}"


# ---------------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------------
def override(text: str) -> tuple[str, object]:
    import yaml

    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"{text!r}: KEY=VALUE")
    return key, yaml.safe_load(value)


def jobs_for(name: str, spec: Spec, args, folder: Path) -> dict:
    """What every worker of one model needs: the benchmark's config written to `folder`, the
    inputs, the threads."""
    import yaml

    model = Path(getattr(args, f"{name.replace('-', '_')}_model") or ROOT / spec.model)
    data = Path(getattr(args, f"{name.replace('-', '_')}_data") or ROOT / spec.data)
    steps = args.steps or spec.steps
    prompts, limit = args.prompts or spec.prompts, args.response_tokens or spec.limit
    raw = bench_raw(spec, steps, prompts, limit)
    files = [str(data / f"dataset={d}" / "problems.parquet") for d in raw["experiment"]["train_datasets"]]
    if missing := [p for p in [str(model), *files] if not Path(p).exists()]:
        targets = " ".join(str(Path(p).relative_to(ROOT)) if Path(p).is_relative_to(ROOT) else p
                           for p in [spec.model, *files])
        raise SystemExit(f"benchmarks/peer_trl.py: missing {', '.join(missing)}: make them with "
                         f"`snakemake --cores 2 --configfile {spec.config} {targets}`, or pass "
                         f"--{name}-model and --{name}-data")
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False, allow_unicode=True))
    return {"config": str(path), "size": spec.size, "model": str(model), "prompts": files,
            "threads": args.threads, "check_prompts": args.check_prompts or spec.check_prompts,
            "overrides": dict(args.trl_override), "prompts_per_step": prompts,
            "group_size": raw["train"]["group_size"], "steps": steps, "limit": limit,
            "cpu_isa": raw.get("numerics", {}).get("cpu_isa", "avx2")}


def environment(job: dict) -> None:
    """The workers' environment: offline, the config's CPU code paths, `threads` threads."""
    from stages.core.common import numerics

    for var in numerics.PINNED:
        os.environ.pop(var, None)
    os.environ.update(numerics.settings(job["cpu_isa"]))
    threads = str(job["threads"])
    os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
                      OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads, DS_ACCELERATOR="cpu")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default 10 Tiny-S, 3 SmolLM2)")
    parser.add_argument("--prompts", type=int, default=None,
                        help="prompts per step (default 16 Tiny-S, as its config; 2 SmolLM2)")
    parser.add_argument("--response-tokens", type=int, default=None,
                        help="response limit (default 64 Tiny-S, as its config; 48 SmolLM2)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads of each process (default 1: the machine is shared, and "
                        "one thread cannot spin-wait for another)")
    parser.add_argument("--check-prompts", type=int, default=None,
                        help="prompts of the check's batch (default 4 Tiny-S, 2 SmolLM2)")
    parser.add_argument("--check-only", action="store_true", help="the equality check alone")
    parser.add_argument("--trl-override", type=override, action="append", default=[],
                        metavar="KEY=VALUE", help="change one of TRL's options (to see what it governs)")
    for name in MODELS:
        parser.add_argument(f"--{name}-model", default=None, help=f"{name}'s base.json")
        parser.add_argument(f"--{name}-data", default=None, help=f"{name}'s data folder (dataset=<name>/)")
    parser.add_argument("--json", type=Path, default=None, help="write everything as JSON here")
    parser.add_argument("--_worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args._worker:
        job = json.loads(args._worker)
        print(json.dumps(WORKERS[job["kind"]](job)))
        return
    import trl

    if trl.__version__ != TRL_VERSION:
        raise SystemExit(f"TRL {trl.__version__} installed; the check reads TRL {TRL_VERSION}'s private "
                         f"loss method: pip install trl=={TRL_VERSION}")
    from stages.core.common.numerics import processor

    out: dict = {"processor": processor(), "threads": args.threads, "trl": TRL_VERSION,
                 "date": time.strftime("%Y-%m-%d"), "models": {}}
    failed = False
    with tempfile.TemporaryDirectory() as folder:
        for name in args.models:
            job = jobs_for(name, MODELS[name], args, Path(folder))
            environment(job)
            print(f"\n{name}: {job['prompts_per_step']} prompts x {job['group_size']} responses a step, "
                  f"up to {job['limit']} tokens, {job['steps']} steps, {args.threads} thread(s), "
                  f"cpu_isa {job['cpu_isa']}; TRL overrides {job['overrides'] or 'none'}")
            result = run_job(job | {"kind": "check", "method": "grpo"}, f"{name}: the equality check")
            print(f"equality check on {job['check_prompts']} prompts x {job['group_size']} responses "
                  f"(|a - b| <= {ATOL:g} + {RTOL:g}|b|; old log-probs off by N(0, {OLD_NOISE}^2)):")
            report(result["rows"], ("case", "tokens", "selected", "ours_loss", "trl_loss", "loss_diff",
                                    "ours_grad_norm", "trl_grad_norm", "grad_norm_rel_diff",
                                    "same_selection", "agree"), None, None, 14, fmt)
            print("our own rule (entropy_top on our entropies) against TRL's selection, and what each "
                  "computes of the same batch (max |ours - TRL|):")
            report(result["rows"], ("case", "own_rule_selected", "own_rule_jaccard", "own_rule_loss",
                                    "own_rule_grad_norm", "entropy_max_diff", "logprob_max_diff",
                                    "trl_advantage_max_diff"), None, None, 22, fmt)
            entry = out["models"][name] = {"job": {k: job[k] for k in ("steps", "limit", "prompts_per_step",
                                                                     "group_size", "overrides")},
                                           "check": result}
            if not result["ok"]:
                print(f"{name}: the equality check FAILED: the trainers do not compute the same thing")
                failed = True
                continue
            if args.check_only:
                continue
            runs, steps = {}, []
            for trainer, variant in (("trl", "grpo"), ("ours", "grpo"), ("trl", "entropy20"),
                                     ("ours", "entropy20"), ("ours", "ict")):
                result = run_job(job | {"kind": trainer, "method": variant}, f"{name}: {trainer} {variant}")
                runs[(trainer, variant)] = step_rows(name, trainer, variant, result)
                steps += runs[(trainer, variant)]
            print(f"\n{name}: per step (train_s = step_s - generation_s - reward_s, of which scoring_s "
                  "our sampling pass; peak_mb: the step's resident-set high-water mark)")
            report(steps, ("trainer", "variant", "step", "generation_s", "reward_s", "train_s", "scoring_s",
                           "step_s", "tokens", "tok_per_s", "peak_mb", "reward"), None, None, 12, fmt)
            ratios = ratio_rows(name, runs)
            print(f"\n{name}: ours / TRL (means of steps 2..; peaks over all steps; goal: step <= 0.5 "
                  "and peak <= 1)")
            report(ratios, ("pair", "ours_step_s", "trl_step_s", "step_ratio", "generation_ratio",
                            "train_ratio", "tokens_ratio", "tok_per_s_ratio", "ours_peak_mb",
                            "trl_peak_mb", "peak_ratio", "goal"), None, None, 16, fmt)
            entry |= {"steps": steps, "ratios": ratios}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2))
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
