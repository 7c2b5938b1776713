"""A resume state moved to another world size (stages.core.training.resume): DeepSpeed 0.19.8's universal
checkpoints, on CPU processes (gloo) and the tiny model of tests/test_train.py.

Three jobs of real DeepSpeed, one after the other: two processes save a resume state of every
ZeRO stage after one update (the trainer's save_state) and continue one more update; one process
resumes each of them (ZeRO 1-3 through the universal conversion the trainer makes, ZeRO-0 from its
single state file) and saves its own after one update of its own; two processes resume those.
The restored float32 weights, Adam moments and step equal the saved ones bit for bit, both ways;
the converted state resumed on its own world size takes the very update the original run took;
across world sizes the next update agrees to the float rounding of a reduction in another order
(bit-for-bit equality is not to be had there).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import yaml

from stages.config import ConfigError, validate
from tests.conftest import ROOT
from tests.helpers import run_ranks, worker_argv

STAGES = (0, 1, 2, 3)


def _config(stage: int):
    raw = yaml.safe_load((ROOT / "config" / "test.yaml").read_text())
    raw["train"].update(micro_batch_size=3, mini_batch_prompts=2, prompts_per_step=2, group_size=4,
                        zero_stage=stage, lr=1e-2, grad_clip=1e9)
    return validate(raw, f"zero{stage}")


def full_states(engine) -> dict:
    """Every parameter's float32 weight and Adam moments, whole (gathered from the partitions:
    collective under ZeRO 1-3), and the optimizer's step."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    base = getattr(engine.optimizer, "optimizer", engine.optimizer)
    out = {"step": sorted({float(s["step"]) for s in base.state.values()})}
    for name, param in engine.module.named_parameters():
        if safe_get_full_fp32_param(param) is None:  # ZeRO-0: the client AdamW's own state
            state = base.state[param]
            out[name] = (param.detach().float().clone(), state["exp_avg"].clone(),
                         state["exp_avg_sq"].clone())
        else:
            out[name] = (safe_get_full_fp32_param(param).clone(),
                         safe_get_full_optimizer_state(param, "exp_avg").clone(),
                         safe_get_full_optimizer_state(param, "exp_avg_sq").clone())
    return out


def _universal_worker(phase: str, folder: str) -> None:
    """phase save2: save every stage's state after one update on two processes, and continue
    one; load1: resume each on one process, save its own; load2: resume those on two."""
    from stages import train
    from stages.core.models import engine as engine_glue
    from stages.core.models.modeling import build_scratch_model
    from stages.core.training import rollouts
    from stages.core.training.actor import actor_step
    from tests.test_train import ARCH, PAD, VOCAB, random_batch

    torch.set_num_threads(1)
    root = Path(folder)
    cfgs = {stage: _config(stage) for stage in STAGES}
    launch = engine_glue.resolve_launch(cfgs[0], "tiny-s")
    dist = engine_glue.init_distributed(launch)
    p_ids, r_ids, adv, noise = random_batch()
    share = len(r_ids) // dist.world
    mine = slice(dist.rank * share, (dist.rank + 1) * share)
    method = cfgs[0].methods["grpo"]

    def update(engine, cfg, seed: int) -> None:
        """One optimizer step on the global mini-batch (this rank's slice of it)."""
        roll = rollouts.Rollouts(p_ids[mine], r_ids[mine], [i // 4 for i in range(len(r_ids))][mine],
                                 adv[mine] * seed)
        roll.stats = train.rescore(engine.module, roll, train.scorer_needs(method, False), cfg,
                                   PAD, dist)
        starts = torch.tensor([0] + [len(r) for r in r_ids]).cumsum(0)
        roll.stats["logprob"] = roll.stats["logprob"] + noise[starts[mine.start]:starts[mine.stop]]
        actor_step(engine, roll, method, cfg, dist, torch.Generator().manual_seed(seed), PAD,
                   stats=roll.stats, on_policy=False)

    def engine_of(cfg, universal: bool = False):
        engine = engine_glue.build_engine(build_scratch_model(ARCH, VOCAB, PAD, seed=0), cfg.train,
                                          dist.world, load_universal=universal)
        engine.train()
        return engine

    def resume(cfg, resume_dir: Path, saved_world: int | None = None):
        """The trainer's resume: its state, its tag (converted when the world size differs;
        saved_world: pretend the state was saved on that many processes), a new engine."""
        state = train.read_state(resume_dir, "x")
        if saved_world is not None:
            state = {**state, "world_size": saved_world}
        tag, universal = train.resume_tag(state, resume_dir, cfg.train, launch)
        engine = engine_of(cfg, universal)
        path, _ = engine.load_checkpoint(str(resume_dir), tag=tag, load_optimizer_states=True,
                                         load_lr_scheduler_states=False)
        assert path is not None, resume_dir
        return engine, universal

    def save_and_continue(cfg, stage: int) -> tuple[dict, dict]:
        """A fresh engine after one update, its state saved (z<stage>-w<world>) and taken, and
        taken again after the next update."""
        engine = engine_of(cfg)
        update(engine, cfg, 1)
        train.save_state(engine, root / f"z{stage}-w{dist.world}",
                         {"fingerprint": "x", "world_size": dist.world, "step": 1}, dist)
        saved = full_states(engine)
        update(engine, cfg, 2)
        return saved, full_states(engine)

    report: dict = {}
    for stage, cfg in cfgs.items():
        got = report[stage] = {}
        if phase == "save2":
            got["saved"], got["next"] = save_and_continue(cfg, stage)
            if stage:  # the converted state on its own world size: the very same next update
                again, universal = resume(cfg, root / f"z{stage}-w2", saved_world=0)
                assert universal
                got["restored_same"] = full_states(again)
                update(again, cfg, 2)
                got["next_same"] = full_states(again)
        else:
            source = root / f"z{stage}-w{1 if phase == 'load2' else 2}"
            engine, universal = resume(cfg, source)
            got["universal"] = universal
            got["restored"] = full_states(engine)
            if phase == "load1":  # this world size's own state after one update of its own
                got["saved"], got["own_next"] = save_and_continue(cfg, stage)
            update(engine, cfg, 2)
            got["next"] = full_states(engine)
    if dist.rank == 0:
        torch.save(report, root / f"{phase}.pt")
    dist.barrier()
    torch.distributed.destroy_process_group()


def run_phase(phase: str, world: int, folder: Path) -> dict:
    run_ranks(world, worker_argv("tests.test_universal", "_universal_worker", phase, folder),
              timeout=900)
    return torch.load(folder / f"{phase}.pt", weights_only=False)


def assert_states_equal(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    assert a["step"] == b["step"] and len(a["step"]) == 1, (what, a["step"], b["step"])
    for name in a:
        if name != "step":
            for kind, x, y in zip(("fp32", "exp_avg", "exp_avg_sq"), a[name], b[name], strict=True):
                assert torch.equal(x, y), (what, name, kind)


def max_difference(a: dict, b: dict) -> float:
    return max(float((x - y).abs().max()) for name in a if name != "step"
               for x, y in zip(a[name][:1], b[name][:1], strict=True))


@pytest.mark.slow
def test_universal_checkpoints_move_a_resume_state_between_world_sizes(tmp_path):
    save2 = run_phase("save2", 2, tmp_path)
    load1 = run_phase("load1", 1, tmp_path)
    load2 = run_phase("load2", 2, tmp_path)
    for stage in STAGES:
        what = f"ZeRO-{stage}"
        assert load1[stage]["universal"] == (stage > 0) == load2[stage]["universal"], what
        moved = save2[stage]["saved"]
        assert moved["step"] == [1.0], what
        # 2 -> 1 and 1 -> 2 processes: the state restored bit for bit
        assert_states_equal(load1[stage]["restored"], save2[stage]["saved"], f"{what} 2->1")
        assert_states_equal(load2[stage]["restored"], load1[stage]["saved"], f"{what} 1->2")
        if stage:
            # converted, and resumed on the world size it was saved on: the same next update
            assert_states_equal(save2[stage]["restored_same"], save2[stage]["saved"], what)
            assert_states_equal(save2[stage]["next_same"], save2[stage]["next"], what)
        # the next update on another world size: float rounding of another reduction order;
        # one AdamW step of lr 1e-2 divides by |g|, so a small g's rounding shows near 1e-6
        for got, want, how in ((load1[stage]["next"], save2[stage]["next"], "2->1"),
                               (load2[stage]["next"], load1[stage]["own_next"], "1->2")):
            diff = max_difference(got, want)
            assert diff < 1e-5, (what, how, diff)
            print(f"{what} {how}: next update within {diff:.1e} of the original run's")


def test_a_sequence_parallel_zero_state_is_refused_on_another_world_size(test_raw, tmp_path):
    from stages.core.training.resume import check_universal

    raw = copy.deepcopy(test_raw)
    raw["train"].update(zero_stage=2, sequence_parallel=2)
    raw["models"]["tiny-s"]["train_processes"] = 2
    cfg = validate(raw, "sp.yaml")
    with pytest.raises(ConfigError, match=r"train.sequence_parallel: .* was saved by 4 "
                       r"process\(es\) and this job has 2; .* fails with sequence parallelism"):
        check_universal(cfg.train, 4, 2, tmp_path)
    check_universal(cfg.train.model_copy(update={"sequence_parallel": 1}), 4, 2, tmp_path)
