"""The masked RLVR trainer: selective head, process-count invariance, resume, bad input.

Tiny models (hidden 32, 1 layer) on CPU. The two slow tests start real processes: 1 vs 2
DeepSpeed ranks on one global mini-batch, and four training runs of the CLI (uninterrupted;
killed after its first checkpoint; resumed through operational edits; resumed from the same state
with other physical micro-batches).
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
import types

import polars as pl
import pytest
import torch
import yaml

from stages import train
from stages.config import ConfigError, validate
from stages.core.common.io import ArtifactError
from stages.core.data.problems import Problem, render_prompt
from stages.core.models import engine as engine_glue
from stages.core.models.modeling import build_scratch_model, build_tokenizer
from stages.core.statistics.scorer import (
    Chunks,
    Scope,
    head_logprob,
    micro_batches,
    response_rows,
    score_scope,
    trunk_hidden,
)
from stages.core.statistics.scoring import pack
from stages.core.statistics.stats import chunked_token_statistics, group_step_jsd
from stages.core.training import rollouts
from stages.core.training.actor import actor_step, micro_loss
from stages.core.training.live import LOGGERS
from stages.core.training.losses import aggregate_loss, clipped_surrogate, loss_weights
from stages.core.training.selectors import SelectionInput, grid, select_tokens, valid_grid
from tests.conftest import ROOT, run_stage, save_scratch_model, write_problems, write_yaml
from tests.helpers import start_ranks, wait_ranks, worker_argv

ARCH = types.SimpleNamespace(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1,
                             max_position_embeddings=128)
VOCAB, PAD = 259, 256  # the byte-level tokenizer: 256 bytes + 3 specials; eos = pad = 256


def random_batch(seed=0, prompts=2, g=4, vocab=256):
    """prompt ids, response ids (ragged), advantages (B,) and log-prob noise (N,)."""
    gen = torch.Generator().manual_seed(seed)
    p_ids, r_ids = [], []
    for _ in range(prompts):
        p = torch.randint(0, vocab, (int(torch.randint(3, 7, (1,), generator=gen)),), generator=gen)
        for _ in range(g):
            p_ids.append(p.tolist())
            n = int(torch.randint(2, 11, (1,), generator=gen))
            r_ids.append(torch.randint(0, vocab, (n,), generator=gen).tolist())
    adv = torch.randn(prompts * g, generator=gen)
    noise = 0.3 * torch.randn(sum(map(len, r_ids)), generator=gen)
    return p_ids, r_ids, adv, noise


# ---------------------------------------------------------------------------------------------
# The selective head
# ---------------------------------------------------------------------------------------------
def head_case(perturb_masked: bool = False):
    """Hidden states (leaf, float64) of a tiny model on a ragged batch, the head, ids, mask."""
    model = build_scratch_model(ARCH, VOCAB, PAD, seed=0).double()
    p_ids, r_ids, adv, noise = random_batch()
    ids, attention, rows, cols = pack(p_ids, r_ids, PAD)
    with torch.no_grad():
        hidden = model.get_decoder()(input_ids=ids, attention_mask=attention).last_hidden_state
    tokens = torch.tensor([t for r in r_ids for t in r])  # (N,)
    lengths = [len(r) for r in r_ids]
    valid = valid_grid(lengths)
    stats = chunked_token_statistics(hidden[rows, cols], model.lm_head.weight, tokens)
    mask = select_tokens("entropy_top", SelectionInput(valid=valid, entropy=grid(stats["entropy"], lengths)),
                         rho=0.3)
    sel = mask[valid]  # (N,)
    if perturb_masked:  # change everything about the masked positions: inputs and targets
        hidden = hidden.clone()
        hidden[rows[~sel], cols[~sel]] += torch.randn(int((~sel).sum()), hidden.shape[-1],
                                                      dtype=hidden.dtype)
        tokens = torch.where(sel, tokens, (tokens + 7) % 256)
    hidden = hidden.detach().requires_grad_()
    old = stats["logprob"] + noise.double()
    adv_tok = adv.double().repeat_interleave(torch.tensor(lengths))
    return model, hidden, rows, cols, tokens, lengths, valid, mask, sel, old, adv_tok


def full_head_loss(model, hidden, rows, cols, tokens, lengths, valid, mask, old, adv_tok, denom):
    """What TRL and verl do: the head at every valid position, then the mask on the loss."""
    logits = model.lm_head(hidden[rows, cols])  # (N, V)
    logp = logits.log_softmax(-1).gather(1, tokens[:, None]).squeeze(1)
    loss, _ = clipped_surrogate(logp, old, adv_tok, 0.2, 0.28)
    return aggregate_loss(grid(loss, lengths), mask, valid, denom)


def selective_head_loss(model, hidden, rows, cols, tokens, lengths, valid, mask, sel, old, adv_tok,
                        denom):
    pick = sel.nonzero().squeeze(1)
    # small chunks: the forward and the recomputing backward cross several blocks of logits
    logp = head_logprob(model.lm_head, hidden[rows[pick], cols[pick]], tokens[pick], 1.0,
                        Chunks(positions=5, vocab=37))
    loss, clipped = clipped_surrogate(logp, old[pick], adv_tok[pick], 0.2, 0.28)
    w = loss_weights(mask, valid, denom, dtype=torch.float64)[valid][pick]
    return (w * loss).sum(), clipped


@pytest.mark.parametrize("denom", ["selected", "all", "sequence"])
def test_selective_head_equals_full_head_in_loss_and_gradients(denom):
    model, hidden, rows, cols, tokens, lengths, valid, mask, sel, old, adv = head_case()
    assert 0 < int(mask.sum()) < int(valid.sum())
    full = full_head_loss(model, hidden, rows, cols, tokens, lengths, valid, mask, old, adv, denom)
    full.backward()
    g_full_h, g_full_w = hidden.grad.clone(), model.lm_head.weight.grad.clone()
    hidden.grad = None
    model.zero_grad()
    part, clipped = selective_head_loss(model, hidden, rows, cols, tokens, lengths, valid, mask,
                                        sel, old, adv, denom)
    part.backward()
    assert float(part.detach()) == pytest.approx(float(full.detach()), rel=1e-12, abs=1e-15)
    assert torch.allclose(hidden.grad, g_full_h, rtol=1e-10, atol=1e-14)
    assert torch.allclose(model.lm_head.weight.grad, g_full_w, rtol=1e-10, atol=1e-14)
    # masked response positions, prompts and padding: exactly zero, in both paths
    chosen = torch.zeros(hidden.shape[:2], dtype=torch.bool)
    chosen[rows[sel], cols[sel]] = True
    assert (hidden.grad[~chosen] == 0).all() and (g_full_h[~chosen] == 0).all()
    pick = sel.nonzero().squeeze(1)
    live = pick[~clipped]  # selected and not clipped: these do carry gradient
    assert live.numel() > 0 and (hidden.grad[rows[live], cols[live]].abs().sum(-1) > 0).all()


def test_masked_positions_cannot_change_the_head_gradient():
    grads = []
    for perturb in (False, True):
        model, hidden, rows, cols, tokens, lengths, valid, mask, sel, old, adv = head_case(perturb)
        selective_head_loss(model, hidden, rows, cols, tokens, lengths, valid, mask, sel, old,
                            adv, "selected")[0].backward()
        grads.append((model.lm_head.weight.grad.clone(), hidden.grad.clone()))
    assert torch.equal(grads[0][0], grads[1][0])  # bit for bit
    assert torch.equal(grads[0][1], grads[1][1])


def test_empty_selection_gives_a_zero_head_gradient():
    model = build_scratch_model(ARCH, VOCAB, PAD, seed=0)
    logp = head_logprob(model.lm_head, torch.zeros(0, 32, requires_grad=True),
                        torch.zeros(0, dtype=torch.long), 1.0)
    logp.sum().backward()
    assert logp.shape == (0,) and (model.lm_head.weight.grad == 0).all()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_chunked_head_gradient_equals_the_full_softmax_gradient(dtype):
    """The recomputing backward against autograd through a materialised log-softmax of the same
    (float32-upcast) logits; float64 to 1e-12, bf16 inputs to bf16 rounding of the result."""
    g = torch.Generator().manual_seed(3)
    hidden = (torch.randn(23, 16, generator=g) * 2).to(dtype).requires_grad_()
    head = torch.nn.Linear(16, 53, bias=True).to(dtype)
    ids = torch.randint(0, 53, (23,), generator=g)
    up = torch.float64 if dtype == torch.float64 else torch.float32
    h2 = hidden.detach().to(up).requires_grad_()
    w2 = head.weight.detach().to(up).requires_grad_()
    b2 = head.bias.detach().to(up).requires_grad_()
    weights = torch.randn(23, generator=g, dtype=up)
    logp = head_logprob(head, hidden, ids, 0.8, Chunks(positions=4, vocab=9))
    (logp.to(up) * weights).sum().backward()
    z = (h2 @ w2.T + b2) / 0.8
    ref = z.gather(1, ids[:, None]).squeeze(1) - torch.logsumexp(z, -1)
    (ref * weights).sum().backward()
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    assert logp.dtype == up
    assert torch.allclose(logp.detach(), ref.detach(), rtol=tol, atol=tol)
    for got, want in ((hidden.grad, h2.grad), (head.weight.grad, w2.grad), (head.bias.grad, b2.grad)):
        assert got.dtype == dtype
        assert torch.allclose(got.to(up), want, rtol=tol, atol=tol)


def test_score_scope_matches_the_token_statistics_and_ict_u():
    model = build_scratch_model(ARCH, VOCAB, PAD, seed=1).double()
    p_ids, r_ids, _, _ = random_batch(seed=4, prompts=3, g=3)
    groups = [k // 3 for k in range(len(r_ids))]
    ids, attention, rows, cols = pack(p_ids, r_ids, PAD)
    with torch.no_grad():
        hidden = model.get_decoder()(input_ids=ids, attention_mask=attention).last_hidden_state
    h = hidden[rows, cols]
    tokens = torch.tensor([t for r in r_ids for t in r])
    w = model.lm_head.weight.detach()
    ref = chunked_token_statistics(h, w, tokens, 0.7, jsd=True)
    keys = torch.tensor([grp * 100 + t for grp, r in zip(groups, r_ids, strict=True) for t in range(len(r))])
    u = group_step_jsd(h, w, keys, 0.7)
    got = score_scope(model, Scope(p_ids, r_ids, groups), PAD, 0.7, {"jsd", "group_jsd"},
                      device="cpu", max_sequences=4, max_tokens=30, chunks=Chunks(7, 50))
    for key in ("entropy", "renyi2", "logprob", "jsd"):
        assert torch.allclose(got[key], ref[key], rtol=1e-10, atol=1e-13), key
    assert torch.allclose(got["group_jsd"], u, rtol=1e-10, atol=1e-13)


def test_micro_batches_respect_the_sequence_and_token_budgets():
    assert micro_batches([5, 5, 5, 5, 5], 2) == [range(0, 2), range(2, 4), range(4, 5)]
    # sequences x longest within 12 tokens: [5, 5] = 10, then 5 * 3 = 15 > 12
    assert micro_batches([5, 5, 5, 2, 9, 1], 8, 12) == [range(0, 2), range(2, 4), range(4, 5), range(5, 6)]
    assert micro_batches([20, 3], 8, 12) == [range(0, 1), range(1, 2)]  # too long: alone
    for lengths, n, budget in (([3, 7, 2, 8, 8, 1, 4], 3, 16), ([1] * 9, 4, 3)):
        parts = micro_batches(lengths, n, budget)
        assert [i for r in parts for i in r] == list(range(len(lengths)))
        for r in parts:
            assert len(r) <= n
            assert len(r) == 1 or len(r) * max(lengths[i] for i in r) <= budget


def test_micro_loss_sums_to_the_minibatch_loss_for_any_split():
    """The per-micro-batch terms (× world for DeepSpeed's average) add up to the aggregate loss."""
    from stages.config import Loss

    g = torch.Generator().manual_seed(0)
    lengths = [3, 5, 2, 4]
    valid = valid_grid(lengths)
    mask = valid & (torch.rand(valid.shape, generator=g) < 0.6)
    n = int(valid.sum())
    logp = torch.randn(n, generator=g, dtype=torch.float64)
    old = logp + 0.3 * torch.randn(n, generator=g, dtype=torch.float64)
    ref = logp + 0.2 * torch.randn(n, generator=g, dtype=torch.float64)
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    loss = Loss(denominator="sequence", kl_beta=0.01)
    expect = aggregate_loss(grid(clipped_surrogate(logp, old, adv, 0.2, 0.28)[0]
                                 + 0.01 * (torch.exp(ref - logp) - (ref - logp) - 1), lengths),
                            mask, valid, "sequence")
    w = loss_weights(mask, valid, "sequence", dtype=torch.float64)[valid]
    sel = mask[valid]
    for world in (1, 2):
        total, terms = 0.0, 0.0
        for part in (slice(0, 4), slice(4, 11), slice(11, n)):
            pick = sel[part].nonzero().squeeze(1) + part.start
            term, value, _, _, _ = micro_loss(logp[pick], old[pick], adv[pick], w[pick], loss, world, ref[pick])
            total += value
            terms += float(term)
        assert total == pytest.approx(float(expect), rel=1e-12)
        assert terms == pytest.approx(world * float(expect), rel=1e-12)


def test_rank_slots_keep_each_minibatch_whole_for_any_number_of_processes():
    one = rollouts.rank_slots(8, 4, 1, 0)
    two = [rollouts.rank_slots(8, 4, 2, r) for r in (0, 1)]
    assert one == list(range(8))
    assert two == [[0, 1, 4, 5], [2, 3, 6, 7]]  # mini-batch 0 = prompts 0-3 either way
    assert sorted(rollouts.prompt_stream(5, 0, 12, seed=3)) == sorted(
        list(range(5)) * 2 + rollouts.prompt_stream(5, 10, 2, seed=3))


# ---------------------------------------------------------------------------------------------
# One process vs two
# ---------------------------------------------------------------------------------------------
CASES = [
    ({"selector": "ict", "rho": 0.3, "variant": "token_id"}, "selected", 0),
    ({"selector": "ict", "rho": 0.3}, "sequence", 2),  # ICT's rule: u against the group's step mean
    ({"selector": "entropy_top", "rho": 0.5}, "sequence", 0),
    ({"selector": "all"}, "all", 2),
]


def _update_worker(out: str) -> None:
    """One optimizer step per case on the same global mini-batch (2 groups of 4 sequences), split
    over the ranks of this process group; rank 0 saves loss, mask and the updated parameters."""
    torch.set_num_threads(1)
    base = yaml.safe_load((ROOT / "config" / "test.yaml").read_text())
    dist = None
    results = []
    for method, denom, zero in CASES:
        raw = copy.deepcopy(base)
        raw["train"].update(micro_batch_size=3, mini_batch_prompts=2, prompts_per_step=2,
                            group_size=4, zero_stage=zero, lr=1e-2, grad_clip=1e9)
        raw["train"]["loss"] = {"denominator": denom}
        raw["methods"]["case"] = method
        cfg = validate(raw, "case")
        if dist is None:
            dist = engine_glue.init_distributed(engine_glue.resolve_launch(cfg, "tiny-s"))
        model = build_scratch_model(ARCH, VOCAB, PAD, seed=0)
        initial = {k: v.clone() for k, v in model.state_dict().items()}
        engine = engine_glue.build_engine(model, cfg.train, dist.world)
        engine.train()
        p_ids, r_ids, adv, noise = random_batch()
        share = len(r_ids) // dist.world
        mine = slice(dist.rank * share, (dist.rank + 1) * share)
        groups = [i // 4 for i in range(len(r_ids))][mine]
        roll = rollouts.Rollouts(p_ids[mine], r_ids[mine], groups, adv[mine])
        case = cfg.methods["case"]
        roll.stats = train.rescore(engine.module, roll, train.scorer_needs(case, False), cfg, PAD, dist)
        starts = torch.tensor([0] + [len(r) for r in r_ids]).cumsum(0)
        # old log-probs off the current policy's, so that ratios differ from 1 and some clip
        roll.stats["logprob"] = roll.stats["logprob"] + noise[starts[mine.start] : starts[mine.stop]]
        gen = torch.Generator().manual_seed(5)
        u = actor_step(engine, roll, case, cfg, dist, gen, PAD, stats=roll.stats, on_policy=False)
        after = {k: v.detach().clone() for k, v in engine.module.lm.state_dict().items()}
        results.append({"loss": u.loss, "grad_norm": u.grad_norm, "mask": u.mask,
                        "clipped": u.n_clipped, "params": after, "initial": initial})
    if dist.rank == 0:
        torch.save(results, out)


@pytest.mark.slow
def test_two_processes_give_the_loss_and_update_of_one(tmp_path):
    wait_ranks([p for world, out in ((1, tmp_path / "one.pt"), (2, tmp_path / "two.pt"))
                for p in start_ranks(world, worker_argv("tests.test_train", "_update_worker", out))])
    one, two = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")
    for (method, denom, zero), a, b in zip(CASES, one, two, strict=True):
        what = f"{method['selector']} / {denom} / ZeRO {zero}"
        assert torch.equal(a["mask"], b["mask"]), what
        assert 0 < int(a["mask"].sum()), what
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6, abs=1e-9), what
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5), what
        assert a["grad_norm"] > 0, what
        for name, value in a["params"].items():
            assert not torch.equal(value, a["initial"][name]) or "norm" in name, (what, name)
            if name.endswith("k_proj.bias"):
                # its gradient is 0 in exact arithmetic (a key bias shifts all of a query's
                # attention logits equally): AdamW turns the rounding noise into steps of ±lr
                continue
            # one AdamW step of lr 1e-2 divides by |g|: summation-order rounding of a small g
            # (micro-batches of 3 over 4 or 8 sequences) shows up near 1e-6
            assert torch.allclose(value, b["params"][name], rtol=1e-5, atol=2e-6), (what, name)


# ---------------------------------------------------------------------------------------------
# The stage: determinism, resume after a kill, bad input
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """A tiny base model taught the answer format (it then guesses digits: rewards vary), its
    prompts (copy a digit) and a config of 6 steps with a checkpoint every 2."""
    from stages.core.training.sft import encode_pairs, train_sft

    d = tmp_path_factory.mktemp("train")
    tok = build_tokenizer()
    model = build_scratch_model(ARCH, len(tok), tok.eos_token_id, seed=0)
    problems = []
    for digit in range(10):
        for op in ("+0", "*1"):
            p = Problem(f"p{digit}{op}", "test", f"{digit}{op}=?", str(digit), "math",
                        solution=f"#### {digit}")
            problems.append(Problem(**{**p.row(), "prompt": render_prompt("Q: {question} A:", p)}))
    examples = encode_pairs(tok, [p.prompt for p in problems], [" " + p.solution for p in problems])
    train_sft(model, tok, examples,
              types.SimpleNamespace(steps=60, batch_size=20, lr=1e-2, warmup_steps=5, weight_decay=0.0),
              seed=0)
    save_scratch_model(d, model, tok)
    write_problems(d / "prompts.parquet", problems)
    raw = yaml.safe_load((ROOT / "config" / "test.yaml").read_text())
    raw["train"].update(steps=6, prompts_per_step=4, group_size=4, mini_batch_prompts=2,
                        micro_batch_size=4, lr=3e-3, warmup_steps=1, max_response_tokens=12,
                        generation_batch_size=16, checkpoint_every=2)
    write_yaml(d / "cfg.yaml", raw)
    return d, raw


def cli_args(d, out: str, method: str = "ict", config: str = "cfg.yaml", model: str = "base.json"):
    return ["--config", str(d / config), "--size", "tiny-s", "--method", method, "--seed", "0",
            "--model", str(d / model), "--prompts", str(d / "prompts.parquet"),
            "--out-dir", str(d / out), "--resume-dir", str(d / f"{out}-resume"), "--threads", "1"]


def files_of(folder):
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


OPERATIONAL_EDITS = {
    "train": {"checkpoint_every": 3, "vllm_gpu_memory_utilization": 0.5, "max_sampling_rounds": 3,
              "gradient_checkpointing": True, "generation_batch_size": 5,
              "checkpoint_every_minutes": 60.0, "save_before_limit_minutes": 5.0,
              "engine_kwargs": {"enforce_eager": True, "kv_cache_memory_bytes": 1 << 26}},
    "models": {"label": "Tiny", "gpu_memory_gb": 80.0},
    "methods": {"label": "ICT (ours)"},
    "resources": {"runtime": 99},
}
"""Operational keys (stages.keys) edited between a kill and the resume that must give the
uninterrupted run's metrics bit for bit (the sampler's own log-probs move by float rounding
with generation_batch_size: the rollout_* mismatch columns are compared to 1e-6)."""
PHYSICAL_EDITS = {"train": {"micro_batch_size": 2, "micro_batch_tokens": 40},
                  "models": {"train_processes": 2}}
"""The physical forwards and the world size (the state saved by one process, resumed by two): the
same selection and loss weights, gradients summed in another order."""
MISMATCH_COLUMNS = ("rollout_logprob_diff_mean", "rollout_logprob_diff_max", "rollout_kl")


def edited(raw: dict, name: str, d, edits: dict) -> str:
    """The config `raw` with `edits` ({section: changes}) applied, written as d/name.yaml."""
    raw = copy.deepcopy(raw)
    for section, changes in edits.items():
        target = {"models": raw["models"]["tiny-s"], "methods": raw["methods"]["ict"],
                  "resources": raw.setdefault("resources", {}).setdefault("train", {})}.get(
                      section, raw.get(section))
        target.update(changes)
    write_yaml(d / f"{name}.yaml", raw)
    return f"{name}.yaml"


def live_rows(path) -> list[dict]:
    """The rows of a metrics.jsonl (a last line still being written is not one)."""
    if not path.exists():
        return []
    lines = path.read_text().split("\n")
    return [json.loads(line) for line in lines[:-1]]


def kill_after_first_checkpoint(d, out: str, config: str = "cfg.yaml") -> tuple[int, list[dict]]:
    """Start the stage, SIGKILL it once its first resume state exists and metrics.jsonl holds a
    row after the state's step (a row the resumed job must drop); (the state's step, the live
    rows at the kill)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    killed = subprocess.Popen([sys.executable, "-m", "stages.train", *cli_args(d, out, config=config)],
                              cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    state, live = d / f"{out}-resume" / "state.json", d / out / "metrics.jsonl"

    def ahead() -> bool:  # metrics.jsonl has a row of a step after the resume state's
        return state.exists() and len(live_rows(live)) > json.loads(state.read_text())["step"]

    deadline = time.monotonic() + 300
    while not ahead() and killed.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    assert state.exists() and not (d / out / "model.json").exists(), "not killed mid-run"
    return json.loads(state.read_text())["step"], live_rows(live)


def tensorboard_scalars(folder) -> dict[str, dict[int, float]]:
    """Every scalar TensorBoard shows of the event files in `folder`: {tag: {step: value}}."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    events.Reload()
    out = {}
    for tag in events.Tags()["scalars"]:
        steps = [e.step for e in events.Scalars(tag)]
        assert len(steps) == len(set(steps)), (tag, steps)  # purged: each step once
        out[tag] = {e.step: e.value for e in events.Scalars(tag)}
    return out


def wandb_records(path) -> list:
    """The records of a W&B run file (run-<id>.wandb): a 7-byte header (':W&B', magic, version),
    then LevelDB's log format: 32 KiB blocks of chunks (crc32, length, type: 1 whole, 2 first,
    3 middle, 4 last), each record a wandb_internal_pb2.Record."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    pos, block, chunks, part = 7, 1 << 15, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 1:
            chunks.append(chunk)
        elif kind == 2:
            part = chunk
        elif kind == 3:
            part += chunk
        elif kind == 4:
            chunks.append(part + chunk)
    records = []
    for chunk in chunks:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(chunk)
        records.append(record)
    return records


def wandb_attempts(folder) -> tuple[set[str], list[dict[int, dict]]]:
    """The offline W&B runs under folder/wandb, oldest first: (their run ids, each run's history
    {step: {key: value}})."""
    ids, history = set(), []
    for run in sorted((folder / "wandb").glob("offline-run-*")):
        (path,) = run.glob("run-*.wandb")
        records = wandb_records(path)
        ids |= {r.run.run_id for r in records if r.WhichOneof("record_type") == "run"}
        history.append({r.history.step.num: {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                                             for i in r.history.item}
                        for r in records if r.WhichOneof("record_type") == "history"})
    return ids, history


INSTALLED_LOGGERS = [name for name in LOGGERS if importlib.util.find_spec(name) is not None]
"""train.loggers whose optional extra is installed (CI installs both: the dev extra)."""


def check_loggers(out, metrics: pl.DataFrame, saved: int) -> None:
    """What each installed logger wrote, read back: TensorBoard's events (the killed attempt's
    steps after the resume state purged) hold every step's metrics; W&B's offline run files are
    two attempts of one run id, the second from the resume state's step."""
    if "tensorboard" in INSTALLED_LOGGERS:
        scalars = tensorboard_scalars(out / "tensorboard")
        for column in ("reward_mean", "entropy_mean", "selected_fraction", "time_s",
                       "time_training_s", "length_limit_fraction"):
            assert scalars[f"train/{column}"] == pytest.approx(dict(enumerate(metrics[column])),
                                                               rel=1e-6), column
    if "wandb" not in INSTALLED_LOGGERS:
        return
    ids, history = wandb_attempts(out)
    assert len(history) == 2, history
    assert len(ids) == 1, ids  # the resumed attempt continued the same run
    # W&B's service buffers its file: of an attempt killed by SIGKILL only what it flushed is
    # there (often nothing); every step from the resume state's on is in the resumed attempt's
    assert sorted(history[1]) == list(range(saved, 6)), sorted(history[1])
    assert set(history[0]) <= set(range(len(metrics)))
    for step, row in [*history[0].items(), *history[1].items()]:
        assert row["train/reward_mean"] == pytest.approx(metrics["reward_mean"][step], rel=1e-12)
        assert row["train/entropy_mean"] == pytest.approx(metrics["entropy_mean"][step], rel=1e-12)


@pytest.fixture(scope="module")
def whole(job):
    """The job's training uninterrupted, in d/a: its metrics."""
    d, _ = job
    proc = run_stage("train", *cli_args(d, "a"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return pl.read_parquet(d / "a" / "metrics.parquet")


@pytest.mark.slow
def test_killed_run_resumes_through_operational_edits_to_the_same_metrics_and_weights(job, whole):
    import shutil

    d, raw = job
    metrics = whole
    assert metrics["step"].to_list() == list(range(6))
    assert set(metrics.columns) == set(train.METRICS_SCHEMA.names)
    assert (metrics["grad_norm"] > 0).any(), "no learning signal: the test would prove nothing"
    # ICT: a dense warm-up of one step (methods.ict.warmup_steps), then ceil(10%) of each response
    assert metrics["selected_fraction"][0] == 1.0
    assert ((metrics["selected_fraction"][1:] > 0) & (metrics["selected_fraction"][1:] < 0.5)).all()
    assert json.loads((d / "a" / "model.json").read_text()) == {"kind": "scratch", "path": "final"}
    assert (d / "a" / "final" / "model.safetensors").exists()
    assert not (d / "a-resume").exists()  # dropped once the outputs exist

    # the killed attempt logs to TensorBoard and W&B (offline); the resumed one continues both
    with_loggers = copy.deepcopy(raw)
    with_loggers["train"]["loggers"] = INSTALLED_LOGGERS
    saved, live = kill_after_first_checkpoint(d, "b", config=edited(with_loggers, "b", d, {}))
    assert 2 <= saved < 6 and len(live) > saved  # a row made after the state, to be dropped
    assert [row["step"] for row in live] == list(range(len(live)))
    shutil.copytree(d / "b-resume", d / "m-resume")  # the same state, for the physical edits

    # a result key edited: refused, naming the key, on a copy of this real resume folder; nothing
    # touched
    foreign = d / "b-resume-copy"
    shutil.copytree(d / "b-resume", foreign)
    before = files_of(foreign)
    other = copy.deepcopy(raw)
    other["train"]["lr"] = 1e-3
    args = argparse.Namespace(**dict(zip(
        ("size", "method", "seed", "model", "prompts", "out_dir"),
        ("tiny-s", "ict", 0, str(d / "base.json"), [str(d / "prompts.parquet")], str(d / "c")),
        strict=True)), resume_dir=str(foreign))
    with pytest.raises(ArtifactError, match=f"{foreign}: resume state of a different config or "
                       r"inputs \(train.lr: 0.003 in the resume state, 0.001 now\)"):
        train.main(args, validate(other, "other.yaml"))
    assert files_of(foreign) == before and not (d / "c").exists()

    keep = [c for c in metrics.columns if c not in (*train.TIME_COLUMNS, *MISMATCH_COLUMNS)]
    resumed = run_stage("train", *cli_args(d, "b", config=edited(with_loggers, "ops", d,
                                                                   OPERATIONAL_EDITS)))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"at step {saved}" in resumed.stderr
    # one log line per step of this attempt, with the reward, entropy, selected share and time
    lines = re.findall(r"step (\d+)/6: reward ([\d.]+), entropy ([\d.]+), selected ([\d.]+), "
                       r"([\d.]+) s", resumed.stderr)
    assert [int(m[0]) for m in lines] == list(range(saved + 1, 7)), resumed.stderr[-3000:]
    other = pl.read_parquet(d / "b" / "metrics.parquet")
    # metrics.jsonl: the resumed job dropped the killed attempt's rows after the state's step
    # (their times differ), and it equals metrics.parquet, time columns too
    assert pl.DataFrame(live_rows(d / "b" / "metrics.jsonl"), schema=other.schema).equals(other)
    assert live[saved]["time_s"] != other["time_s"][saved]
    check_loggers(d / "b", other, saved)
    assert other.select(keep).equals(metrics.select(keep))
    for column in MISMATCH_COLUMNS:
        assert other[column].to_list() == pytest.approx(metrics[column].to_list(), abs=1e-6)
    assert (d / "a" / "final" / "model.safetensors").read_bytes() == \
        (d / "b" / "final" / "model.safetensors").read_bytes()

    # the physical micro-batches and two processes: the same samples, the metrics within float
    # rounding
    physical = edited(raw, "physical", d, PHYSICAL_EDITS)
    resumed = subprocess.run(
        [sys.executable, "-m", "stages.launch", "--gpus", "0", "--procs-per-node", "2", "--",
         sys.executable, "-m", "stages.train", *cli_args(d, "m", config=physical)],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
        timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"at step {saved}" in resumed.stderr
    assert "saved by 1 process(es), resumed by 2 (ZeRO-0: one state for all)" in resumed.stderr
    other = pl.read_parquet(d / "m" / "metrics.parquet")
    assert other["micro_batches"][saved:].to_list() != metrics["micro_batches"][saved:].to_list()
    for column in keep:
        if column != "micro_batches":
            got, want = other[column].to_list(), metrics[column].to_list()
            assert [v is None for v in got] == [v is None for v in want], column
            assert [v for v in got if v is not None] == pytest.approx(
                [v for v in want if v is not None], rel=1e-3, abs=1e-4), column


@pytest.mark.slow
def test_sigurg_saves_and_exits_and_the_minutes_cadence_saves_between_step_checkpoints(job, whole):
    """SLURM's signal before the time limit, sent by hand: the job saves at the next step boundary
    and exits with status 75; the resumed attempt, with no step checkpoint due
    (checkpoint_every 100) but checkpoint_every_minutes tiny, saves at its step boundaries (seen
    by a SIGKILL after one); the third attempt ends with the uninterrupted run's metrics."""
    from stages.core.training.resume import EXIT_RESUBMIT, SAVE_SIGNAL

    d, raw = job
    config = edited(raw, "sig", d, {"train": {"checkpoint_every": 100}})
    state, live = d / "s-resume" / "state.json", d / "s" / "metrics.jsonl"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "stages.train", *cli_args(d, "s", config=config)]
    first = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not live_rows(live) and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    first.send_signal(SAVE_SIGNAL)  # its handler is in place: a step has ended
    _, err = first.communicate(timeout=300)
    assert first.returncode == EXIT_RESUBMIT, err[-3000:]
    saved = json.loads(state.read_text())["step"]
    assert 1 <= saved < 6 and len(live_rows(live)) == saved
    assert f"SIGURG (time limit near): resume state saved after step {saved} of 6" in err

    timed = edited(raw, "timed", d, {"train": {"checkpoint_every": 100,
                                               "checkpoint_every_minutes": 1e-6}})
    cmd = [sys.executable, "-m", "stages.train", *cli_args(d, "s", config=timed)]
    second = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    while (json.loads(state.read_text())["step"] == saved and second.poll() is None
           and time.monotonic() < deadline):
        time.sleep(0.02)
    second.send_signal(signal.SIGKILL)
    second.wait()
    again = json.loads(state.read_text())["step"]
    assert saved < again < 6, (saved, again)  # a state no step checkpoint would have written

    third = run_stage("train", *cli_args(d, "s", config=config))
    assert third.returncode == 0, third.stderr[-3000:]
    assert f"at step {again}" in third.stderr
    keep = [c for c in whole.columns if c not in train.TIME_COLUMNS]
    assert pl.read_parquet(d / "s" / "metrics.parquet").select(keep).equals(whole.select(keep))


@pytest.mark.slow
def test_stop_after_steps_resubmits_each_attempt_and_ends_with_the_whole_runs_metrics(job, whole):
    """A pilot's forced resume: with train.stop_after_steps 4 of 6 steps, the first attempt saves
    after step 4 and exits 75, the second resumes there and finishes with the uninterrupted run's
    metrics."""
    from stages.core.training.resume import EXIT_RESUBMIT

    d, raw = job
    config = edited(raw, "stop", d, {"train": {"stop_after_steps": 4}})
    first = run_stage("train", *cli_args(d, "f", config=config))
    assert first.returncode == EXIT_RESUBMIT, first.stderr[-3000:]
    assert ("train.stop_after_steps (4 steps an attempt): resume state saved after step 4 of 6"
            in first.stderr)
    assert json.loads((d / "f-resume" / "state.json").read_text())["step"] == 4
    second = run_stage("train", *cli_args(d, "f", config=config))
    assert second.returncode == 0, second.stderr[-3000:]
    assert "at step 4" in second.stderr
    keep = [c for c in whole.columns if c not in train.TIME_COLUMNS]
    assert pl.read_parquet(d / "f" / "metrics.parquet").select(keep).equals(whole.select(keep))


SIGNAL_IN_GENERATION = """
import os, sys
from stages import cli, train
from stages.core.training.resume import SAVE_SIGNAL

collect = train.collect

def signalled(step, *args, **kwargs):
    out = collect(step, *args, **kwargs)
    if step == int(os.environ["SIGNAL_STEP"]):
        os.kill(os.getpid(), SAVE_SIGNAL)  # while the step's samples are drawn
    return out

train.collect = signalled
sys.argv = ["stages.train", *sys.argv[1:]]
cli.run(train.main, train.build_parser())
"""


@pytest.mark.slow
def test_a_signal_during_generation_saves_before_the_update_when_the_lead_is_short(job, whole):
    """SIGURG while step 4's samples are drawn, with a lead (60 µs) too short for the update, the
    sync and a save: the job saves the state after step 3 at once (before step 4's update) and
    exits 75; the resumed attempt draws step 4's samples again and ends with the uninterrupted
    run's metrics. With a long lead (10 min) the step finishes first and saves after step 4."""
    from stages.core.training.resume import EXIT_RESUBMIT

    d, raw = job
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SIGNAL_STEP": "3"}
    # the short lead (60 microseconds) is gone by the check before the update, whatever the update
    # takes; the long one covers any update of this model
    for name, lead, saved in [("short", 1e-6, 3), ("long", 10.0, 4)]:
        config = edited(raw, name, d, {"train": {"checkpoint_every": 100,
                                                  "save_before_limit_minutes": lead},
                                        "resources": {"runtime": 120}})
        cmd = [sys.executable, "-c", SIGNAL_IN_GENERATION, *cli_args(d, name, config=config)]
        first = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert first.returncode == EXIT_RESUBMIT, first.stderr[-3000:]
        assert json.loads((d / f"{name}-resume" / "state.json").read_text())["step"] == saved
        if saved == 3:
            assert ("SIGURG (time limit near) during the generation of step 4: resume state at "
                    "step 3 of 6, before its update" in first.stderr)
        else:
            assert "SIGURG (time limit near): resume state saved after step 4 of 6" in first.stderr
    resumed = run_stage("train", *cli_args(d, "short", config="short.yaml"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "at step 3" in resumed.stderr
    keep = [c for c in whole.columns if c not in train.TIME_COLUMNS]
    assert pl.read_parquet(d / "short" / "metrics.parquet").select(keep).equals(whole.select(keep))


def test_unknown_method_is_a_clear_cli_error(job):
    d, _ = job
    proc = run_stage("train", *cli_args(d, "x", method="ppo"))
    assert proc.returncode == 2
    assert "--method 'ppo': not a key of 'methods'" in proc.stderr
    assert not (d / "x").exists() and not (d / "x-resume").exists()


def test_base_checkpoint_that_does_not_load_names_the_file(job, monkeypatch):
    d, raw = job
    broken = d / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    (d / "broken.json").write_text(json.dumps({"kind": "scratch", "path": "broken"}))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    args = argparse.Namespace(size="tiny-s", method="grpo", seed=0, model=str(d / "broken.json"),
                              prompts=[str(d / "prompts.parquet")], out_dir=str(d / "y"),
                              resume_dir=str(d / "y-resume"))
    with pytest.raises(ArtifactError, match="broken.json: cannot load the model at .*broken"):
        train.main(args, validate(raw, "cfg.yaml"))
    assert not (d / "y").exists() and not (d / "y-resume").exists()


def test_config_errors_name_the_key(job):
    _, raw = job
    for edit, key in [
        (lambda r: r["methods"]["ict"].update(rho=0.0), "methods.ict.rho"),
        (lambda r: r["methods"]["ict"].update(rho=1.5), "methods.ict.rho"),
        (lambda r: r["methods"]["ict"].update(variant="pooled"), "methods.ict.variant"),
        (lambda r: r["methods"]["ict"].update(warmup_steps=6), "methods.ict.warmup_steps"),
        (lambda r: r["methods"]["ict"].update(bogus=1), "methods.ict.bogus"),
        (lambda r: r["methods"]["grpo"].update(selector="top_p"), "methods.grpo.selector"),
        (lambda r: r["train"].update(top_p=0.95), "train.top_p"),
        (lambda r: r["train"].update(dtype="bfloat16", zero_stage=0), "train: zero_stage"),
        (lambda r: r["train"].update(mini_batch_prompts=3), "train"),
        (lambda r: r["train"].update(loss={"denominator": "tokens"}), "train.loss.denominator"),
    ]:
        bad = copy.deepcopy(raw)
        edit(bad)
        with pytest.raises(ConfigError, match=f"bad.yaml: {key}"):
            validate(bad, "bad.yaml")


@pytest.mark.slow  # a stage or Snakemake in a subprocess: the full tier
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_first_on_policy_ratio_is_one_and_kl_zero(job, dtype):
    """Step 0 of a run with a KL term: the policy is the sampling policy and the reference, so
    no token is clipped and the k3 KL is exactly 0 — in bf16 too, where the old and new log-probs
    came from one scorer (the head in float32 reductions) and the reference from the same rows."""
    d, raw = job
    cfg = copy.deepcopy(raw)
    # one mini-batch per step: step 0's only update is the on-policy one
    cfg["train"].update(steps=2, dtype=dtype, gradient_checkpointing=True, micro_batch_size=3,
                        mini_batch_prompts=cfg["train"]["prompts_per_step"],
                        zero_stage=1 if dtype == "bfloat16" else 0,
                        loss={"kl_beta": 0.05, "denominator": "sequence"})
    write_yaml(d / f"kl-{dtype}.yaml", cfg)
    proc = run_stage("train", *cli_args(d, f"kl-{dtype}", method="grpo", config=f"kl-{dtype}.yaml"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = pl.read_parquet(d / f"kl-{dtype}" / "metrics.parquet")
    first = metrics.row(0, named=True)
    assert first["selected_fraction"] == 1.0 and first["grad_norm"] > 0
    assert first["clip_fraction"] == 0.0
    assert first["kl"] == 0.0
    assert metrics["kl"][1] > 0  # the policy moved: the KL term is live


def _trunk_and_head_grads(model, p_ids, r_ids, pick):
    model.zero_grad()
    hidden, flat = trunk_hidden(model, p_ids, r_ids, PAD, "cpu")
    tokens = torch.tensor([t for r in r_ids for t in r])[pick]
    logp = head_logprob(model.lm_head, response_rows(hidden, flat, pick), tokens, 1.0, Chunks(7, 64))
    (logp * torch.linspace(-1, 1, logp.numel())).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_gradient_checkpointing_gives_the_same_gradients():
    p_ids, r_ids, _, _ = random_batch(seed=2)
    pick = torch.arange(0, sum(map(len, r_ids)), 3)
    model = build_scratch_model(ARCH, VOCAB, PAD, seed=0).train()
    plain = _trunk_and_head_grads(model, p_ids, r_ids, pick)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert model.is_gradient_checkpointing and model.training
    checkpointed = _trunk_and_head_grads(model, p_ids, r_ids, pick)
    assert plain.keys() == checkpointed.keys() and len(plain) > 5
    for name, grad in plain.items():
        assert torch.allclose(grad, checkpointed[name], rtol=1e-6, atol=1e-9), name


def test_bf16_log_probs_of_the_scorer_agree_where_a_bf16_head_does_not():
    """A bf16 model with a Qwen-sized logit scale: the scorer's log-probs of all positions
    (sampling pass) and of a subset (the loss's rows) agree to float32 rounding; logits taken
    from the head in bf16 (the old loss path) are off by orders of magnitude more."""
    arch = types.SimpleNamespace(**{**vars(ARCH), "hidden_size": 64, "intermediate_size": 128})
    model = build_scratch_model(arch, 4096, PAD, seed=0)
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)  # logits of a trained model's size (std ~ several nats)
    model = model.to(torch.bfloat16)
    p_ids, r_ids, _, _ = random_batch(seed=5, vocab=4096)
    groups = [k // 4 for k in range(len(r_ids))]
    every = score_scope(model, Scope(p_ids, r_ids, groups), PAD, 1.0, device="cpu",
                        max_sequences=8, chunks=Chunks(64, 1024))["logprob"]
    pick = torch.arange(1, every.numel(), 2)
    with torch.no_grad():
        hidden, flat = trunk_hidden(model, p_ids, r_ids, PAD, "cpu")
        rows = response_rows(hidden, flat, pick)
        tokens = torch.tensor([t for r in r_ids for t in r])[pick]
        ours = head_logprob(model.lm_head, rows, tokens, 1.0, Chunks(16, 512))
        bf16_head = model.lm_head(rows).float().log_softmax(-1).gather(1, tokens[:, None]).squeeze(1)
    ours_err = float((ours - every[pick]).abs().max())
    bf16_err = float((bf16_head - every[pick]).abs().max())
    assert ours.dtype == torch.float32
    assert ours_err < 1e-4, ours_err
    assert bf16_err > 100 * ours_err and bf16_err > 1e-2, (bf16_err, ours_err)


class _ScriptedSampler:
    """Responses chosen per prompt text: 'right' answers 7 (correct), others 3; lengths vary so
    that the overlong penalty makes every reward of a group different."""

    def __init__(self):
        self.calls = []

    def sample(self, prompts, *, n, temperature, top_p, max_new_tokens, prompt_seeds, desc=""):
        from stages.core.models.generation import Sample

        self.calls.append(list(max_new_tokens))
        self.seeds = list(prompt_seeds)
        out = []
        for i, p in enumerate(prompts):
            for j in range(n):
                answer = "7" if p.startswith("right") or (p.startswith("mixed") and j % 2) else "3"
                length = min(max_new_tokens[i], 4 + j)
                out.append(Sample(i, j, [1], [5] * length, f"#### {answer}", "stop"))
        return out


def test_dynamic_sampling_filters_groups_on_correctness_not_reward(test_raw):
    raw = copy.deepcopy(test_raw)
    raw["train"].update(prompts_per_step=3, mini_batch_prompts=3, group_size=4,
                        dynamic_sampling=True, dynamic_sampling_pool="rank", max_sampling_rounds=1,
                        max_response_tokens=6, overlong_buffer=3)
    cfg = validate(raw, "t.yaml")
    pool = rollouts.PromptPool(["right", "wrong", "mixed"], ["7", "7", "7"], ["math"] * 3, [6, 5, 6])
    dist = engine_glue.Dist(0, 1, torch.device("cpu"))
    sampled = rollouts.Sampled()
    sampler = _ScriptedSampler()
    roll, consumed = rollouts.collect(0, 0, cfg, 0, sampler, pool, dist, sampled)
    order = rollouts.prompt_stream(3, 0, 3, 0)
    assert sampler.calls == [[pool.limits[i] for i in order]]  # each prompt's own limit
    assert consumed == 3 and sampled.responses == 12
    # the all-correct and all-wrong groups are dropped although their rewards differ (penalty)
    assert len(roll.response_ids) == 4 and set(roll.groups) == {0}
    assert len(set(roll.advantages.tolist())) > 1


def test_config_keys_are_what_the_trainer_reads(test_raw):
    """A dataset's response limit reruns training; the token-statistics stage's own keys do not."""
    from stages.keys import train_config_hash

    def digest(raw):
        return train_config_hash(validate(raw, "t.yaml"), "tiny-s", "ict")

    base = digest(test_raw)
    raw = copy.deepcopy(test_raw)
    raw["token_stats"]["dtype"] = "float64"
    raw["token_stats"]["high_entropy_quantile"] = 0.8
    assert digest(raw) == base
    raw["datasets"]["rl"]["max_response_tokens"] = 7
    assert digest(raw) != base
    before = digest(raw)
    raw["datasets"]["rl"]["grader"] = "math_dapo"  # the training reward
    assert digest(raw) != before
    # the rule hashes the same parts
    from stages.keys import config_hash_of

    assert 'job_hash("train")' in (ROOT / "workflow" / "rules" / "train.smk").read_text()
    w = {"size": "tiny-s", "method": "ict", "seed": "0"}
    assert config_hash_of(validate(raw, "t.yaml"), "train", w) == digest(raw)


def sampler_closes_first() -> None:
    """One rank's check (a process of its own: the test process may hold a group already)."""
    class Sampler:
        def __init__(self, takes_the_group: bool) -> None:
            self.takes_the_group, self.saw_group = takes_the_group, None

        def close(self) -> None:
            self.saw_group = torch.distributed.is_initialized()
            if self.takes_the_group:
                torch.distributed.destroy_process_group()

    for takes in (True, False):
        torch.distributed.init_process_group("gloo")  # env://: the rank's variables
        sampler = Sampler(takes)
        train.shutdown(sampler)
        assert sampler.saw_group is True and not torch.distributed.is_initialized()


def test_a_training_process_closes_its_sampler_before_the_process_group():
    """Finished or stopped for a time limit, a training process shuts its sampler down while the
    default group still exists (a vLLM engine's teardown destroys its groups and then the default
    one, which it shares with DeepSpeed), and destroys the group only where the sampler left it."""
    from tests.helpers import run_ranks, worker_argv

    run_ranks(1, worker_argv("tests.test_train", "sampler_closes_first"), timeout=120)
