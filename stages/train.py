"""Stage 4: masked RLVR training of one size × method × seed (METHODS §3–§4), on DeepSpeed.

    python -m stages.train --config CFG --size S --method M --seed K \
        --model results/<run>/models/size=S/base.json \
        --prompts results/<run>/data/dataset=<train>/problems.parquet \
        --out-dir results/<run>/train/size=S/method=M/seed=K \
        [--resume-dir results/<run>/resume/size=S/method=M/seed=K] [--threads N]

Several processes (one per GPU, or CPU processes with gloo): put
`torchrun --standalone --nproc_per_node N -m stages.train` (or the `deepspeed` launcher) in
front of the same arguments; `models.S.gpus.train` says how many GPUs the job must see.

Each rollout step: take the next `prompts_per_step` prompts of a seeded shuffle of the prompt
file (one shuffle per epoch), sample `group_size` responses for each from the current policy,
grade them, and turn rewards into group-relative advantages (optionally with DAPO's overlong
penalty and dynamic sampling). A no-gradient pass records the sampling policy's log-probs
(and entropy, Rényi-2 for the metrics). Then, for each mini-batch of `mini_batch_prompts`
prompts (`ppo_epochs` passes), one optimizer step:

1. score every valid position of the mini-batch without gradient (chunked statistics of the
   current policy; ranks share p̄ and ICT's per-id sums through all-reduces);
2. select tokens with the method's selector over the whole mini-batch (all micro-batches and
   ranks together, so the mask does not depend on how the batch is split);
3. per micro-batch, run the trunk with gradient, gather the hidden states of the *selected*
   positions only, and run the head and log-softmax there; the clipped surrogate (+ β·k3 KL)
   weighted by `loss.denominator` over the whole mini-batch is back-propagated;
4. DeepSpeed reduces the gradients across ranks, clips them and steps the client AdamW.

Dropout is off (the module stays in eval mode), so the same config gives the same metrics.
DeepSpeed runs ZeRO stage 0, 1 or 2 (`train.zero_stage`; 3 is refused, see check_layout).
Outputs in --out-dir: `final/` (Hugging Face layout, tokenizer, resolved config), `metrics.parquet`
(one row per step), `summary.json`, and `model.json` last ({"kind": "scratch", "path": "final"}).
Every `checkpoint_every` steps the DeepSpeed state goes to --resume-dir, a folder Snakemake does
not delete; the same command continues from it and reaches the same final metrics. It is
removed once the outputs are written.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import random
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import torch
import torch.distributed
from torch import Tensor

from . import cli
from .base_model import RESOLVED_CONFIG
from .config import Config, ConfigError, Method, Train
from .core.io import (
    ArtifactError,
    atomic_dir,
    provenance,
    read_parquet,
    write_json,
    write_parquet,
)
from .core.losses import clipped_surrogate, group_advantages, k3_kl, loss_weights, overlong_penalty
from .core.policy import (
    deviation_for,
    grid,
    head_logprobs,
    score_scope,
    valid_grid,
)
from .core.problems import PROBLEM_SCHEMA
from .core.scoring import pack
from .core.selectors import SelectionInput, select_tokens
from .core.stats import chunked_token_statistics

STAGE_VERSION = "1"
STATE_FILE = "state.json"

METRICS_SCHEMA = pa.schema(
    [
        pa.field("step", pa.int64(), nullable=False),
        pa.field("reward_mean", pa.float64(), nullable=False),
        pa.field("accuracy", pa.float64(), nullable=False),
        pa.field("entropy_mean", pa.float64(), nullable=False),
        pa.field("renyi2_mean", pa.float64(), nullable=False),
        pa.field("entropy_selected_mean", pa.float64(), nullable=True),
        pa.field("renyi2_selected_mean", pa.float64(), nullable=True),
        pa.field("selected_fraction", pa.float64(), nullable=False),
        pa.field("clip_fraction", pa.float64(), nullable=True),
        pa.field("kl", pa.float64(), nullable=True),
        pa.field("grad_norm", pa.float64(), nullable=False),
        pa.field("loss", pa.float64(), nullable=False),
        pa.field("response_length_mean", pa.float64(), nullable=False),
        pa.field("tokens_per_second", pa.float64(), nullable=False),
        pa.field("time_s", pa.float64(), nullable=False),
    ]
)
"""Per step. Means over the sampled responses / tokens of the step (the sampling policy's H, H2);
`*_selected_mean`, `selected_fraction`, `clip_fraction` and `kl` (k3 to the base model, null when
β = 0) over the tokens the selector picked in the step's mini-batches (null when none);
`grad_norm` (before clipping) and `loss` are means over the step's optimizer steps;
`tokens_per_second` is sampled response tokens per second of the step's wall time `time_s`."""

TIME_COLUMNS = ("tokens_per_second", "time_s")


def config_keys(size: str, method: str) -> tuple[str, ...]:
    """The parts of the config this stage reads (rule train's config_hash lists the same)."""
    return ("train", f"methods/{method}", f"models/{size}", "seed", "token_stats",
            "evaluate/grade_timeout_s")


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
    ranks, so the prompts of a mini-batch are the same for any number of processes."""
    share = mini_batch_prompts // world
    return [k * mini_batch_prompts + rank * share + i
            for k in range(prompts // mini_batch_prompts) for i in range(share)]


def lr_at(step: int, tcfg: Train) -> float:
    """Linear warm-up over `warmup_steps` rollout steps, then constant (METHODS §8)."""
    if step < tcfg.warmup_steps:
        return tcfg.lr * (step + 1) / tcfg.warmup_steps
    return tcfg.lr


# ---------------------------------------------------------------------------------------------
# Processes
# ---------------------------------------------------------------------------------------------
class Dist:
    """The data-parallel ranks of this job; with one process every collective is the identity."""

    def __init__(self, rank: int, world: int, device: torch.device) -> None:
        self.rank, self.world, self.device = rank, world, device

    def sum(self, t: Tensor) -> Tensor:
        if self.world == 1:
            return t
        import torch.distributed as dist

        buf = t.to(self.device).clone()
        dist.all_reduce(buf)
        return buf.to(t.device)

    def min(self, value: int) -> int:
        if self.world == 1:
            return value
        import torch.distributed as dist

        buf = torch.tensor([value], dtype=torch.long, device=self.device)
        dist.all_reduce(buf, op=dist.ReduceOp.MIN)
        return int(buf.item())

    def gather(self, t: Tensor) -> list[Tensor]:
        """Every rank's 1-D tensor (lengths may differ), in rank order."""
        if self.world == 1:
            return [t]
        import torch.distributed as dist

        n = torch.tensor([t.numel()], dtype=torch.long, device=self.device)
        sizes = [torch.zeros_like(n) for _ in range(self.world)]
        dist.all_gather(sizes, n)
        sizes = [int(s.item()) for s in sizes]
        padded = torch.zeros(max(sizes), dtype=t.dtype, device=self.device)
        padded[: t.numel()] = t.to(self.device)
        parts = [torch.empty_like(padded) for _ in range(self.world)]
        dist.all_gather(parts, padded)
        return [p[:k].to(t.device) for p, k in zip(parts, sizes, strict=True)]

    def cat(self, t: Tensor) -> Tensor:
        return torch.cat(self.gather(t))

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()



def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Launch:
    """Where this process sits: read from the launcher's environment (none: a group of one)."""

    rank: int
    world: int
    local: int
    device: torch.device
    backend: str


def resolve_launch(cfg: Config, size: str) -> Launch:
    """This process's rank and device; checks the GPUs the config asks for before anything runs."""
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_RANK", rank))
    gpus = cfg.models[size].gpus.train
    if gpus == 0:
        return Launch(rank, world, local, torch.device("cpu"), "gloo")
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if visible < gpus:
        raise ConfigError(
            f"models.{size}.gpus.train: {gpus} GPUs requested but {visible} visible "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})"
        )
    if world != gpus:
        raise ConfigError(
            f"models.{size}.gpus.train: {gpus} GPUs requested but started as {world} process(es);"
            f" launch with torchrun --nproc_per_node {gpus}"
        )
    return Launch(rank, world, local, torch.device("cuda", local), "nccl")


def init_distributed(launch: Launch) -> Dist:
    """Start (or join) the process group through DeepSpeed."""
    if "RANK" not in os.environ:  # a plain `python -m stages.train`
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    os.environ.setdefault("DS_ACCELERATOR", launch.device.type)
    if launch.device.type == "cuda":
        torch.cuda.set_device(launch.device)
    import deepspeed

    if launch.device.type == "cpu":
        # On its CPU accelerator DeepSpeed would probe every op with compiler subprocesses and
        # JIT-compile a shared-memory all-reduce (minutes on 2 cores); gloo is all CPU ranks need.
        # An explicit "not compatible" for every op is what it reads when no compiler exists.
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__ = {}
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend=launch.backend, verbose=False)
    return Dist(launch.rank, launch.world, launch.device)


def build_engine(model, tcfg: Train, world: int):
    """DeepSpeed around the policy with a client torch AdamW (DeepSpeed's own would JIT-compile)."""
    import deepspeed

    optimizer = torch.optim.AdamW(model.parameters(), lr=tcfg.lr, weight_decay=tcfg.weight_decay)
    ds_config = {
        "train_micro_batch_size_per_gpu": tcfg.micro_batch_size,
        "gradient_accumulation_steps": 1,  # the trainer marks the boundary of each mini-batch
        "gradient_clipping": tcfg.grad_clip,
        "zero_optimization": {"stage": tcfg.zero_stage},
        "bf16": {"enabled": tcfg.dtype == "bfloat16"},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    return engine


# ---------------------------------------------------------------------------------------------
# Rollouts
# ---------------------------------------------------------------------------------------------
@dataclass
class Rollouts:
    """One rank's training sequences of a step, ordered by (prompt slot, sample)."""

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    groups: list[int]
    advantages: Tensor  # (B,) float32
    old_logprob: Tensor | None = None  # (N,) flat over response tokens
    ref_logprob: Tensor | None = None  # (N,)

    @property
    def lengths(self) -> list[int]:
        return [len(r) for r in self.response_ids]


@dataclass
class Sampled:
    """Totals over every response sampled in a step on this rank (for the metrics)."""

    responses: int = 0
    correct: int = 0
    reward: float = 0.0
    tokens: int = 0


def collect(step: int, consumed: int, cfg: Config, run_seed: int, sampler, problems, dist: Dist,
            sampled: Sampled) -> tuple[Rollouts, int]:
    """Sample, grade and keep this rank's groups of a step; returns them and the prompts consumed."""
    from .core.grading import grade_many

    t = cfg.train
    g = t.group_size
    slots = rank_slots(t.prompts_per_step, t.mini_batch_prompts, dist.world, dist.rank)
    need = len(slots)
    keep: list[tuple] = []  # (prompt ids, the group's response ids, its rewards)
    golds, types = problems["answer"].to_list(), problems["answer_type"].to_list()
    prompts = problems["prompt"].to_list()
    for rnd in range(t.max_sampling_rounds if t.dynamic_sampling else 1):
        order = prompt_stream(len(prompts), consumed, t.prompts_per_step, run_seed)
        consumed += t.prompts_per_step
        mine = [order[s] for s in slots]
        samples = sampler.sample([prompts[i] for i in mine], n=g, temperature=t.temperature,
                                 top_p=t.top_p, max_new_tokens=t.max_response_tokens,
                                 seed=seed_of(run_seed, step, rnd, dist.rank), desc=f"step {step}")
        grades = grade_many([s.response for s in samples], [golds[mine[s.prompt_idx]] for s in samples],
                            [types[mine[s.prompt_idx]] for s in samples], cfg.evaluate.grade_timeout_s)
        correct = torch.tensor([gr.correct for gr in grades])
        rewards = torch.where(correct, t.reward_correct, t.reward_incorrect).double()
        lengths = torch.tensor([len(s.response_token_ids) for s in samples])
        if t.overlong_buffer is not None:
            rewards = rewards + overlong_penalty(lengths, t.max_response_tokens, t.overlong_buffer)
        sampled.responses += len(samples)
        sampled.correct += int(correct.sum())
        sampled.reward += float(rewards.sum())
        sampled.tokens += int(lengths.sum())
        for k in range(len(mine)):
            r = rewards[k * g : (k + 1) * g]
            if t.dynamic_sampling and bool((r == r[0]).all()):
                continue  # DAPO: a group whose rewards are all equal carries no signal
            rows = samples[k * g : (k + 1) * g]
            keep.append((rows[0].prompt_token_ids, [s.response_token_ids for s in rows], r))
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


# ---------------------------------------------------------------------------------------------
# Forward passes
# ---------------------------------------------------------------------------------------------
def trunk_hidden(model, prompt_ids, response_ids, pad_id: int, device) -> tuple[Tensor, Tensor]:
    """(final hidden states (b, L, D) of prompt+response, flat index (N,) of the positions that
    predict each response token into the (b·L) positions), with gradient if enabled."""
    ids, attention, rows, cols = pack(prompt_ids, response_ids, pad_id)
    out = model.get_decoder()(input_ids=ids.to(device), attention_mask=attention.to(device),
                              use_cache=False)
    hidden = out.last_hidden_state  # (b, L, D)
    return hidden, (rows * ids.shape[1] + cols).to(device)


def micro_batches(n: int, size: int) -> list[range]:
    return [range(a, min(a + size, n)) for a in range(0, n, size)]


@torch.no_grad()
def sampling_pass(model, ref_model, roll: Rollouts, tcfg: Train, cfg: Config, pad_id: int,
                  device) -> dict[str, Tensor]:
    """Log-prob, entropy and Rényi-2 of every response token under the sampling policy (and the
    reference's log-prob when β > 0), flat (N,), computed before any update of the step."""
    ts = cfg.token_stats
    parts: dict[str, list[Tensor]] = {"logprob": [], "entropy": [], "renyi2": [], "ref": []}
    for mb in micro_batches(len(roll.response_ids), tcfg.micro_batch_size):
        p = [roll.prompt_ids[i] for i in mb]
        r = [roll.response_ids[i] for i in mb]
        ids = torch.tensor([t for x in r for t in x], device=device)
        pairs = [(model, "")] + ([(ref_model, "ref")] if ref_model is not None else [])
        for m, key in pairs:
            hidden, flat = trunk_hidden(m, p, r, pad_id, device)
            head = m.get_output_embeddings()
            stats = chunked_token_statistics(
                hidden.flatten(0, 1)[flat], head.weight, ids, tcfg.temperature,
                head_bias=head.bias, chunk_positions=ts.chunk_positions,
                chunk_vocab=ts.chunk_vocab, jsd=False)
            if key == "ref":
                parts["ref"].append(stats["logprob"].float().cpu())
            else:
                for k in ("logprob", "entropy", "renyi2"):
                    parts[k].append(stats[k].float().cpu())
    empty = torch.zeros(0)
    return {k: torch.cat(v) if v else empty for k, v in parts.items()}


@dataclass
class Update:
    """What one optimizer step reports (sums over the whole mini-batch, all ranks)."""

    loss: float
    grad_norm: float
    n_valid: int
    n_selected: int
    n_clipped: int
    kl_sum: float
    entropy_selected_sum: float
    renyi2_selected_sum: float
    mask: Tensor  # (B_global, T) the selection, for tests


def update_minibatch(engine, mb: Rollouts, method: Method, cfg: Config, dist: Dist,
                     generator: torch.Generator, pad_id: int) -> Update:
    """One optimizer step on a mini-batch (this rank's part in `mb`) with the selective head."""
    tcfg, loss_cfg, ts = cfg.train, cfg.train.loss, cfg.token_stats
    model, device, temp = engine.module, dist.device, tcfg.temperature
    head = model.get_output_embeddings()
    lengths = mb.lengths
    ids = torch.tensor([t for r in mb.response_ids for t in r], dtype=torch.long)  # (N,)
    micro = micro_batches(len(lengths), tcfg.micro_batch_size)

    # 1. score every valid position without gradient, with the current parameters
    reuse = len(micro) == 1  # one micro-batch: its forward with gradient serves the scoring too
    kept: tuple[Tensor, Tensor] | None = None
    if reuse:
        kept = trunk_hidden(model, mb.prompt_ids, mb.response_ids, pad_id, device)
        hv = kept[0].flatten(0, 1)[kept[1]].detach()
    else:
        with torch.no_grad():
            hv = torch.cat([
                (lambda h, f: h.flatten(0, 1)[f])(*trunk_hidden(
                    model, [mb.prompt_ids[i] for i in m], [mb.response_ids[i] for i in m], pad_id,
                    device))
                for m in micro
            ])  # (N, D)
    stats = score_scope(hv, head.weight, head.bias, ids.to(device), temp,
                        deviation=deviation_for(method),
                        all_reduce=dist.sum if dist.world > 1 else None,
                        chunk_positions=ts.chunk_positions, chunk_vocab=ts.chunk_vocab)
    del hv

    # 2. select over the whole mini-batch: every rank gathers the scope and makes the same mask
    per_rank = dist.gather(torch.tensor(lengths, dtype=torch.long))
    lengths_all = torch.cat(per_rank)
    offset = int(sum(int(x.sum()) for x in per_rank[: dist.rank]))
    flat = {k: dist.cat(stats[k].float().cpu()) for k in ("entropy", "renyi2", "logprob")}
    if "jsd" in stats:
        flat["jsd"] = dist.cat(stats["jsd"].float().cpu())
    valid = valid_grid(lengths_all)
    inp = SelectionInput(
        valid=valid,
        entropy=grid(flat["entropy"], lengths_all),
        logprob=grid(flat["logprob"], lengths_all),
        jsd=grid(flat["jsd"], lengths_all) if "jsd" in flat else None,
        token_ids=grid(dist.cat(ids), lengths_all),
        advantages=dist.cat(mb.advantages.float()),
        id_scores=tuple(x.cpu() for x in stats["id_scores"]) if "id_scores" in stats else None,
        generator=generator,
    )
    mask = select_tokens(method.selector, inp, **method.selector_params())  # (B_all, T)
    weights = loss_weights(mask, valid, loss_cfg.denominator)[valid]  # (N_all,)
    sel_all = mask[valid]  # (N_all,)
    n_local = len(ids)
    sel = sel_all[offset : offset + n_local]
    w = weights[offset : offset + n_local]
    adv_tok = mb.advantages.float().repeat_interleave(torch.tensor(lengths))  # (N,)

    # 3. the loss at the selected positions only; gradients accumulate over micro-batches
    starts = torch.tensor([0] + lengths).cumsum(0).tolist()
    total = torch.zeros((), dtype=torch.float64)
    clipped_n, kl_sum = 0, 0.0
    for j, m in enumerate(micro):
        engine.set_gradient_accumulation_boundary(j == len(micro) - 1)
        if reuse:
            hidden, flat_pos = kept
        else:
            hidden, flat_pos = trunk_hidden(model, [mb.prompt_ids[i] for i in m],
                                            [mb.response_ids[i] for i in m], pad_id, device)
        a, b = starts[m.start], starts[m.stop]
        pick = sel[a:b].nonzero().squeeze(1)  # (n_sel,) within the micro-batch
        h = hidden.flatten(0, 1)[flat_pos[pick.to(device)]]  # (n_sel, D): only these get a head
        logp = head_logprobs(head, h, ids[a:b][pick].to(device), temp)
        token_loss, clipped = clipped_surrogate(
            logp, mb.old_logprob[a:b][pick].to(device), adv_tok[a:b][pick].to(device),
            loss_cfg.eps_low, loss_cfg.eps_high, loss_cfg.dual_clip)
        if loss_cfg.kl_beta > 0:
            kl = k3_kl(logp, mb.ref_logprob[a:b][pick].to(device))
            token_loss = token_loss + loss_cfg.kl_beta * kl
            kl_sum += float(kl.detach().sum())
        part = (w[a:b][pick].to(device, logp.dtype) * token_loss).sum()
        # DeepSpeed averages gradients over ranks; the loss is a sum over them
        engine.backward(part * dist.world)
        total += float(part.detach())
        clipped_n += int(clipped.sum())
        del hidden, h, logp, token_loss
    kept = None
    grad_norm = None
    if tcfg.zero_stage == 0:  # ZeRO-0 keeps reduced full gradients on every rank
        grads = [p.grad.detach().float().norm() for p in model.parameters() if p.grad is not None]
        grad_norm = float(torch.stack(grads).norm()) if grads else 0.0
    engine.step()
    if grad_norm is None:
        grad_norm = float(engine.get_global_grad_norm() or 0.0)
    sums = dist.sum(torch.tensor([float(total), clipped_n, kl_sum], dtype=torch.float64))
    h_sel = flat["entropy"][sel_all].double().sum()
    h2_sel = flat["renyi2"][sel_all].double().sum()
    return Update(loss=float(sums[0]), grad_norm=grad_norm, n_valid=int(valid.sum()),
                  n_selected=int(mask.sum()), n_clipped=int(sums[1]), kl_sum=float(sums[2]),
                  entropy_selected_sum=float(h_sel), renyi2_selected_sum=float(h2_sel), mask=mask)


def split_minibatches(roll: Rollouts, groups_per_minibatch: int, group_size: int) -> list[Rollouts]:
    """This rank's part of each mini-batch: consecutive groups, with their flat token slices."""
    out = []
    starts = torch.tensor([0] + roll.lengths).cumsum(0).tolist()
    per = groups_per_minibatch * group_size
    for a in range(0, len(roll.response_ids), per):
        b = min(a + per, len(roll.response_ids))
        ta, tb = starts[a], starts[b]
        out.append(Rollouts(
            roll.prompt_ids[a:b], roll.response_ids[a:b], roll.groups[a:b], roll.advantages[a:b],
            roll.old_logprob[ta:tb] if roll.old_logprob is not None else None,
            roll.ref_logprob[ta:tb] if roll.ref_logprob is not None else None,
        ))
    return out


# ---------------------------------------------------------------------------------------------
# Resume state
# ---------------------------------------------------------------------------------------------
def fingerprint(cfg: Config, args) -> str:
    """What a resume folder must have been made by: the config parts read, the job, the inputs."""
    inputs = {}
    for name in ("model", "prompts"):
        st = Path(getattr(args, name)).stat()
        inputs[name] = [st.st_size, st.st_mtime_ns]
    blob = json.dumps({"config": cfg.section_hash(*config_keys(args.size, args.method)),
                       "job": [args.size, args.method, args.seed], "inputs": inputs},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def read_state(resume_dir: Path, expected: str, world: int) -> dict | None:
    """The last complete checkpoint of this job in resume_dir, or None; refuses a foreign one."""
    path = resume_dir / STATE_FILE
    if not path.exists():
        if resume_dir.exists() and any(resume_dir.iterdir()):
            cli.log.warning("%s: no %s (killed before its first checkpoint); starting over",
                            resume_dir, STATE_FILE)
        return None
    try:
        state = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ArtifactError(f"{path}: not valid JSON ({err}); delete {resume_dir} to start over") from None
    if state.get("fingerprint") != expected:
        raise ArtifactError(
            f"{resume_dir}: resume state of a different config or inputs (fingerprint "
            f"{state.get('fingerprint')!r}, this job {expected!r}); delete the folder to start over"
        )
    if state.get("world_size") != world:
        raise ArtifactError(
            f"{resume_dir}: saved by {state.get('world_size')} process(es), this job has {world};"
            " resume with the same number or delete the folder"
        )
    return state


def save_state(engine, resume_dir: Path, state: dict, dist: Dist) -> None:
    """A DeepSpeed checkpoint, then (rank 0) the state file pointing at it, then old ones removed."""
    tag = f"step{state['step']:06d}"
    engine.save_checkpoint(str(resume_dir), tag=tag, save_latest=False)
    dist.barrier()
    if dist.rank == 0:
        write_json(resume_dir / STATE_FILE, {**state, "tag": tag})
        for old in resume_dir.glob("step*"):
            if old.is_dir() and old.name != tag:
                shutil.rmtree(old, ignore_errors=True)
    dist.barrier()


# ---------------------------------------------------------------------------------------------
# The stage
# ---------------------------------------------------------------------------------------------
def check_args(args, cfg: Config) -> Method:
    if args.size not in cfg.models:
        raise ConfigError(f"--size {args.size!r}: not a key of 'models' ({sorted(cfg.models)})")
    if args.method not in cfg.methods:
        raise ConfigError(f"--method {args.method!r}: not a key of 'methods' ({sorted(cfg.methods)})")
    for name in ("model", "prompts"):
        if not Path(getattr(args, name)).exists():
            raise ArtifactError(f"{getattr(args, name)}: --{name} file not found")
    return cfg.methods[args.method]


def check_layout(cfg: Config, method: Method, method_name: str, world: int) -> None:
    t = cfg.train
    if t.zero_stage == 3:
        # ZeRO-3 gathers parameters in the hooks of the root module's forward; the selective head
        # calls the trunk and the head separately (and they share the tied embedding), which
        # ZeRO-3 does not reduce correctly: checked, the update differs from ZeRO 0-2's
        raise ConfigError("train.zero_stage: 3 is not supported by the trainer; use 0, 1 or 2")
    if t.mini_batch_prompts % world:
        raise ConfigError(f"train.mini_batch_prompts: {t.mini_batch_prompts} does not split over "
                          f"{world} processes")
    if method.selector == "ict" and method.variant == "pooled" and world > 1:
        raise ConfigError(f"methods.{method_name}.variant: 'pooled' needs one process, not {world}")


def main(args, cfg: Config) -> None:
    method = check_args(args, cfg)
    tcfg = cfg.train
    out_dir = Path(args.out_dir)
    resume_dir = Path(args.resume_dir) if args.resume_dir else out_dir.parent / f".{out_dir.name}.resume"
    launch = resolve_launch(cfg, args.size)
    check_layout(cfg, method, args.method, launch.world)
    expected = fingerprint(cfg, args)
    state = read_state(resume_dir, expected, launch.world)  # before anything is written

    from .core.modeling import load_model_and_tokenizer
    from .core.samplers import HfPolicySampler, VllmPolicySampler

    dtype = torch.bfloat16 if tcfg.dtype == "bfloat16" else torch.float32
    model, tokenizer = load_model_and_tokenizer(args.model, dtype=dtype, device=str(launch.device))
    ref_model = None
    if tcfg.loss.kl_beta > 0:
        ref_model, _ = load_model_and_tokenizer(args.model, dtype=dtype, device=str(launch.device))
        ref_model.requires_grad_(False)
    problems = read_parquet(args.prompts, PROBLEM_SCHEMA)
    if tcfg.prompt_pool is not None:
        problems = problems.head(tcfg.prompt_pool)
    if problems.height == 0:
        raise ArtifactError(f"{args.prompts}: the training prompt file is empty")
    longest = max(len(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in problems["prompt"])
    limit = model.config.max_position_embeddings
    if longest + tcfg.max_response_tokens > limit:
        raise ConfigError(f"train.max_response_tokens: {tcfg.max_response_tokens} + the longest "
                          f"prompt ({longest} tokens) exceed the model's {limit} positions")
    pad_id = tokenizer.pad_token_id
    run_seed = seed_of(cfg.seed, args.seed)
    torch.manual_seed(run_seed)

    dist = init_distributed(launch)
    engine = build_engine(model, tcfg, dist.world)
    engine.eval()  # no dropout: old and new log-probs of the same parameters agree
    start, consumed, rows = 0, 0, []
    if state is not None:
        path, _ = engine.load_checkpoint(str(resume_dir), tag=state["tag"], load_optimizer_states=True,
                                         load_lr_scheduler_states=False)
        if path is None:
            raise ArtifactError(f"{resume_dir / state['tag']}: DeepSpeed checkpoint missing or unreadable")
        start, consumed, rows = state["step"], state["consumed"], state["metrics"]
        cli.log.info("resuming %s/%s seed %d at step %d from %s", args.size, args.method,
                     args.seed, start, resume_dir)
    if tcfg.backend == "vllm":
        sampler = VllmPolicySampler(
            args.model, engine.module, tokenizer, world_size=dist.world, seed=run_seed + dist.rank,
            gpu_memory_utilization=tcfg.vllm_gpu_memory_utilization,
            max_model_len=longest + tcfg.max_response_tokens,
            dtype="bfloat16" if tcfg.dtype == "bfloat16" else "float32")
    else:
        sampler = HfPolicySampler(engine.module, tokenizer, tcfg.generation_batch_size)

    began = time.perf_counter()
    bar = cli_progress(start, tcfg.steps, f"train {args.size}/{args.method}", dist.rank)
    for step in range(start, tcfg.steps):
        t0 = time.perf_counter()
        for group in engine.optimizer.param_groups:
            group["lr"] = lr_at(step, tcfg)
        sampled = Sampled()
        roll, consumed = collect(step, consumed, cfg, run_seed, sampler, problems, dist, sampled)
        old = sampling_pass(engine.module, ref_model, roll, tcfg, cfg, pad_id, dist.device)
        roll.old_logprob = old["logprob"]
        roll.ref_logprob = old["ref"] if ref_model is not None else None
        updates = []
        share = tcfg.mini_batch_prompts // dist.world
        for epoch in range(tcfg.ppo_epochs):
            for k, mb in enumerate(split_minibatches(roll, share, tcfg.group_size)):
                gen = torch.Generator().manual_seed(seed_of(run_seed, step, epoch, k))
                updates.append(update_minibatch(engine, mb, method, cfg, dist, gen, pad_id))
        sampler.sync()
        row = step_metrics(step, sampled, old, updates, dist, time.perf_counter() - t0,
                           kl_on=ref_model is not None)
        rows.append(row)
        bar.update(1)
        bar.set_postfix(reward=f"{row['reward_mean']:.3f}", H=f"{row['entropy_mean']:.3f}")
        done = step + 1
        if done % tcfg.checkpoint_every == 0 and done < tcfg.steps:
            save_state(engine, resume_dir, {"fingerprint": expected, "world_size": dist.world,
                                            "step": done, "consumed": consumed, "metrics": rows},
                       dist)
    bar.close()
    seconds = time.perf_counter() - began
    finish(engine, tokenizer, cfg, args, rows, out_dir, resume_dir, dist, seconds, start)
    torch.distributed.destroy_process_group()


def cli_progress(start: int, total: int, desc: str, rank: int):
    from .core.progress import progress

    return progress(total=total, initial=start, desc=desc, unit="step", disable=rank != 0)


def step_metrics(step: int, sampled: Sampled, old: dict, updates: list[Update], dist: Dist,
                 seconds: float, kl_on: bool) -> dict:
    """One row of metrics.parquet, the same on every rank."""
    s = dist.sum(torch.tensor([
        sampled.responses, sampled.correct, sampled.reward, sampled.tokens,
        float(old["entropy"].double().sum()), float(old["renyi2"].double().sum()),
        float(old["entropy"].numel()),
    ], dtype=torch.float64)).tolist()
    n_sel = sum(u.n_selected for u in updates)
    n_valid = sum(u.n_valid for u in updates)
    kl = sum(u.kl_sum for u in updates)

    def ratio(a: float, b: float) -> float | None:
        return a / b if b else None

    return {
        "step": step,
        "reward_mean": s[2] / s[0],
        "accuracy": s[1] / s[0],
        "entropy_mean": ratio(s[4], s[6]) or 0.0,
        "renyi2_mean": ratio(s[5], s[6]) or 0.0,
        "entropy_selected_mean": ratio(sum(u.entropy_selected_sum for u in updates), n_sel),
        "renyi2_selected_mean": ratio(sum(u.renyi2_selected_sum for u in updates), n_sel),
        "selected_fraction": n_sel / n_valid if n_valid else 0.0,
        "clip_fraction": ratio(sum(u.n_clipped for u in updates), n_sel),
        "kl": ratio(kl, n_sel) if kl_on else None,
        "grad_norm": sum(u.grad_norm for u in updates) / len(updates) if updates else 0.0,
        "loss": sum(u.loss for u in updates) / len(updates) if updates else 0.0,
        "response_length_mean": s[3] / s[0],
        "tokens_per_second": s[3] / seconds,
        "time_s": seconds,
    }


def finish(engine, tokenizer, cfg: Config, args, rows: list[dict], out_dir: Path, resume_dir: Path,
           dist: Dist, seconds: float, start: int) -> None:
    """Write final/, metrics.parquet, summary.json and (last) model.json; drop the resume state."""
    model = engine.module
    prov = provenance("train", STAGE_VERSION, cfg.section_hash(*config_keys(args.size, args.method)),
                      cfg.seed, size=args.size, method=args.method, run_seed=args.seed,
                      world_size=dist.world)
    last = rows[-1]
    summary = {
        "size": args.size, "method": args.method, "seed": args.seed,
        "steps": cfg.train.steps, "resumed_at_step": start, "world_size": dist.world,
        "torch_threads": torch.get_num_threads(), "train_seconds": round(seconds, 1),
        "final_reward_mean": last["reward_mean"], "final_accuracy": last["accuracy"],
    }
    if dist.rank == 0:
        with atomic_dir(out_dir / "final") as tmp:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            write_json(tmp / RESOLVED_CONFIG, {"config": cfg.model_dump(mode="json"),
                                               "method": args.method, "provenance": prov,
                                               "summary": summary})
        write_parquet(rows, out_dir / "metrics.parquet", METRICS_SCHEMA, prov)
        write_json(out_dir / "summary.json", summary)
        write_json(out_dir / "model.json", {"kind": "scratch", "path": "final"})
        shutil.rmtree(resume_dir, ignore_errors=True)
        cli.log.info("%s/%s seed %d: %d steps in %.0f s, last reward %.3f -> %s", args.size,
                     args.method, args.seed, cfg.train.steps, seconds, last["reward_mean"], out_dir)
    dist.barrier()


def build_parser():
    p = cli.parser(__doc__.splitlines()[0])
    p.add_argument("--size", required=True, help="a key of 'models'")
    p.add_argument("--method", required=True, help="a key of 'methods'")
    p.add_argument("--seed", required=True, type=int, help="the run's seed (experiment.seeds)")
    p.add_argument("--model", required=True, help="base.json of that size")
    p.add_argument("--prompts", required=True, help="prepared training prompts (Parquet)")
    p.add_argument("--out-dir", required=True, help="folder for model.json, final/, metrics.parquet")
    p.add_argument("--resume-dir", default=None,
                   help="checkpoints to resume from (default: .<out-dir name>.resume beside it)")
    # the deepspeed launcher passes --local_rank; the rank is read from the environment
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return p


if __name__ == "__main__":
    cli.run(main, build_parser())
