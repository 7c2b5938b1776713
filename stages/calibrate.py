"""Calibrate the cost plan from a pilot's finished run, and check it against a full run.

    python -m stages.calibrate --configfile config/paper.yaml --pilot config/pilots/paper.yaml
    python -m stages.calibrate --configfile config/config.yaml --pilot config/pilots/default.yaml --check

The pilot's run (the configuration with the pilot laid on it, results/<its run>) is read back: each
training's metrics.parquet (tokens generated, responses, generation batches, each phase's seconds)
and its log's timing line (every attempt's wall time: start-up is an attempt's wall time less its
steps'), each evaluation's samples and timing (tokens and generation seconds), the token
statistics' timing, the base model's rollouts (prompt and response lengths). They give, per model
size, the `cost` values the plan would need to predict the pilot itself: mean lengths, generation
batches, tokens/s per GPU (or CPU process) of each rule's engine, the share of the peak the
forwards reach (train_mfu, at the plan's own FLOP count), the step overhead and each rule's
start-up. Those are written as a config file (default results/<pilot run>/calibration.yaml) to
add with a second --configfile, and the full run's plan is printed with them.

What transfers and what does not: rates are taken as measured, so a pilot with the full run's
lengths and batches (ICT's) predicts its rates; one that cuts them (the 80/20 study's) predicts
a full step from rates measured on shorter sequences and smaller batches. Response lengths are
calibrated only where the pilot's limit is the full run's, else the configuration's assumption
stays (and the output says so). Sizes the pilot did not run keep the configuration's values.

--check reads the full run too (results/<the configuration's run>, finished) and prints, for every
job the plan estimates, the predicted and the measured wall time (the stages' own: each job's
process, start to end, every attempt), by rule and in total, and the counted work of both
(tokens generated, responses, attempts), which must agree exactly where the plan counts from the
run's own lengths (docs/performance.md#the-cost-plan-against-measured-runs).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

import polars as pl
import yaml

from .config import Config, ConfigError, load_configs, source_of
from .core.common import numerics, timing
from .core.common.io import ArtifactError
from .core.plans import cost as cc
from .core.plans.dimensions import model_arch
from .cost import cost_plan, on_cpu, runtime_limit, train_counts, train_limit, units
from .cost_report import render
from .paths import RunPaths

MIN_STEPS = 3
"""Fewest measured steps per training that a calibration accepts (the first steps of a run are
not typical: caches warm, lengths move), and at least one evaluation and one attempt record."""


class CalibrationError(ConfigError):
    """A run that cannot be calibrated from: what is missing and why."""


# ---------------------------------------------------------------------------------------------
# What a finished run measured
# ---------------------------------------------------------------------------------------------
@dataclass
class Training:
    size: str
    method: str
    seed: int
    steps: int
    tokens: float
    responses: float
    generation_batches: float
    generation_s: float
    forward_s: float
    others: list[float]
    """each step's seconds beside generation, scoring and training"""
    attempts: list[dict]

    @property
    def wall_s(self) -> float:
        return sum(a["wall_s"] for a in self.attempts)

    @property
    def startup_s(self) -> float:
        """Every attempt's time outside its steps: start-up, loading, the final writes."""
        return sum(a["wall_s"] - a["steps_s"] for a in self.attempts)


@dataclass
class Job:
    """An evaluation or the token statistics: its record from the log."""

    rule: str
    size: str
    method: str
    wall_s: float
    work_s: float
    tokens: float
    samples: float = 0.0


@dataclass
class Measured:
    trainings: list[Training] = field(default_factory=list)
    jobs: list[Job] = field(default_factory=list)
    prompt_tokens: dict[str, float] = field(default_factory=dict)
    rollout_response_tokens: dict[str, float] = field(default_factory=dict)


def _timing(path: str, what: str) -> dict:
    record = timing.read(path)
    if record is None:
        raise CalibrationError(f"{path}: no timing line ({what} did not finish, or ran before "
                               "the stages logged their timing): rerun it")
    return record


def measure(cfg: Config, *, methods=None, seeds=None) -> Measured:
    """Everything the run of `cfg` measured, from results/<run>: it must have finished."""
    paths = RunPaths(f"results/{cfg.run}")
    exp = cfg.experiment
    out = Measured()
    for size in exp.sizes:
        rollouts = Path(paths.rollouts(size))
        if not rollouts.exists():
            raise CalibrationError(f"{rollouts}: missing: the run has not made its base-model "
                                   "rollouts (run it to the end first)")
        frame = pl.read_parquet(rollouts, columns=["prompt_token_ids", "response_token_ids"])
        out.prompt_tokens[size] = float(frame["prompt_token_ids"].list.len().mean())
        out.rollout_response_tokens[size] = float(frame["response_token_ids"].list.len().mean())
        roll = _timing(paths.log("rollout", size), "the base model's rollouts")
        if "generation_s" not in roll:
            raise CalibrationError(f"{paths.log('rollout', size)}: its timing line has no "
                                   "generation time (made before the stage recorded it): rerun it")
        out.jobs.append(Job("rollout", size, "base", roll["wall_s"], roll["generation_s"],
                            roll["tokens"], roll["samples"]))
        stats = _timing(paths.log("token_stats", size), "the token statistics")
        out.jobs.append(Job("token_stats", size, "base", stats["wall_s"], stats["statistics_s"],
                            stats["tokens"]))
        for method in methods or exp.methods:
            for seed in seeds or exp.seeds:
                out.trainings.append(_training(cfg, paths, size, method, seed))
        for method in ["base", *(methods or exp.methods)]:
            for seed in seeds or exp.seeds:
                rec = _timing(paths.log("evaluate", size, method, seed), f"evaluation {size}/{method}")
                out.jobs.append(Job("evaluate", size, method, rec["wall_s"], rec["generation_s"],
                                    rec["tokens"], rec["samples"]))
    return out


def _training(cfg: Config, paths: RunPaths, size: str, method: str, seed: int) -> Training:
    where = Path(paths.train_dir(size, method, seed)) / "metrics.parquet"
    if not where.exists():
        raise CalibrationError(f"{where}: missing: training {size}/{method}/seed={seed} has not "
                               "finished")
    m = pl.read_parquet(where)
    if len(m) < MIN_STEPS:
        raise CalibrationError(f"{where}: {len(m)} steps, fewer than the {MIN_STEPS} a calibration "
                               "needs (the first steps are not typical); run the pilot longer "
                               "(train.steps)")
    tokens = m["tokens_per_second"] * m["time_s"]  # the step's generated tokens, as counted
    forward = m["time_scoring_s"] + m["time_training_s"]
    record = _timing(paths.log("train", size, method, seed), f"training {size}/{method}")
    attempts = record.get("attempts") or []
    if not attempts or attempts[-1]["last_step"] != len(m) or attempts[0]["first_step"] != 0:
        raise CalibrationError(f"{paths.log('train', size, method, seed)}: its attempts do not "
                               f"cover the {len(m)} steps from the first (resumed from a state "
                               "made before the stages recorded attempts?): rerun the training")
    return Training(size, method, seed, len(m), float(tokens.sum()),
                    float((tokens / m["response_length_mean"]).sum()),
                    float(m["generation_batches"].mean()), float(m["time_generation_s"].sum()),
                    float(forward.sum()), (m["time_s"] - m["time_generation_s"] - forward).to_list(),
                    attempts)


# ---------------------------------------------------------------------------------------------
# The calibration
# ---------------------------------------------------------------------------------------------
def calibrate(full: Config, pilot: Config, measured: Measured) -> tuple[dict, list[str]]:
    """The `cost` section (a mapping, for YAML) the pilot's measurements imply for the full run,
    and notes on what was not calibrated and why."""
    notes: list[str] = []
    sizes: dict[str, dict] = {}
    for size in pilot.experiment.sizes:
        if size not in full.models:
            continue
        arch = model_arch(pilot, size)
        rates = pilot.cost.of(size, "train")
        trainings = [t for t in measured.trainings if t.size == size]
        prompt = measured.prompt_tokens[size]
        own: dict = {"prompt_tokens": prompt}
        tokens = sum(t.tokens for t in trainings)
        responses = sum(t.responses for t in trainings)
        response = tokens / responses
        cap = max(train_limit(pilot, size, t.method) for t in trainings)
        _length(own, "response_tokens", response, cap, f"{size}: training responses", notes,
                {train_limit(full, size, m) for m in full.experiment.methods})
        if pilot.train.dynamic_sampling:
            own["generation_batches"] = round(sum(t.generation_batches for t in trainings)
                                              / len(trainings), 3)
        # a step's overhead is the typical step's (the median): what the first step of an attempt
        # spends above it (the graders' first calls, warming caches) is the attempt's start-up
        others = [x for t in trainings for x in t.others]
        overhead = statistics.median(others)
        own["step_overhead_s"] = round(overhead, 4)
        first_steps = sum(others) - overhead * len(others)
        gpus = units(pilot, size, "train")
        gen_rate = tokens / (sum(t.generation_s for t in trainings) * gpus)
        # the plan's FLOPs of each training at the measured lengths, against its forwards' seconds
        at = rates.model_copy(update={"prompt_tokens": prompt})
        flops = sum(train_counts(pilot, size, t.method, arch, at, response).forward_flops()
                    for t in trainings)
        mfu = flops / (sum(t.forward_s for t in trainings) * gpus * rates.gpu_tflops * 1e12)
        attempts = [a for t in trainings for a in t.attempts]
        startup = (sum(t.startup_s for t in trainings) + first_steps) / len(attempts)
        rules = {"train": {"generation_tokens_per_s": _sig(gen_rate), "train_mfu": _sig(min(1.0, mfu)),
                           "startup_minutes": _sig(startup / 60)}}
        evals = [j for j in measured.jobs if j.rule == "evaluate" and j.size == size]
        section = pilot.evaluate
        engine = pilot.models[size].tensor_parallel_size if section.backend == "vllm" else 1
        e_tokens = sum(j.tokens for j in evals)
        rules["evaluate"] = {
            "generation_tokens_per_s": _sig(e_tokens / (sum(j.work_s for j in evals) * engine)),
            "startup_minutes": _sig(sum(j.wall_s - j.work_s for j in evals) / len(evals) / 60)}
        _length(own, "eval_response_tokens", e_tokens / sum(j.samples for j in evals),
                section.max_new_tokens, f"{size}: evaluation responses", notes,
                {full.evaluate.max_new_tokens})
        rules["evaluate_checkpoint"] = dict(rules["evaluate"])
        stats = next(j for j in measured.jobs if j.rule == "token_stats" and j.size == size)
        r = pilot.rollout
        stat_rates = pilot.cost.of(size, "token_stats")
        rollout_resp = measured.rollout_response_tokens[size]
        stat_flops = r.prompts * r.n * (prompt + rollout_resp) * cc.forward_flops(
            arch, cc.mean_context(prompt, rollout_resp))
        rules["token_stats"] = {
            "train_mfu": _sig(min(1.0, stat_flops / (stats.work_s * stat_rates.gpu_tflops * 1e12))),
            "startup_minutes": _sig((stats.wall_s - stats.work_s) / 60)}
        lengths: dict = {}
        _length(lengths, "response_tokens", rollout_resp, r.max_new_tokens,
                f"{size}: the base model's rollouts", notes, {full.rollout.max_new_tokens})
        rules["token_stats"] |= lengths
        roll = next(j for j in measured.jobs if j.rule == "rollout" and j.size == size)
        engine = pilot.models[size].tensor_parallel_size if r.backend == "vllm" else 1
        rules["rollout"] = {"generation_tokens_per_s": _sig(roll.tokens / (roll.work_s * engine)),
                            "startup_minutes": _sig((roll.wall_s - roll.work_s) / 60), **lengths}
        rules["overlap"] = dict(rules["token_stats"])
        own["rules"] = rules
        sizes[size] = own
    missing = [s for s in full.experiment.sizes if s not in sizes]
    if missing:
        notes.append(f"{', '.join(missing)}: not in the pilot: the configuration's assumptions stay")
    cost: dict = {"sizes": sizes}
    if any(on_cpu(pilot, s) for s in sizes):
        cost["cpu_jobs"] = True
    return cost, notes


def _length(into: dict, key: str, measured: float, cap: int, what: str, notes: list[str],
            full_caps: set[int]) -> None:
    """The mean before the limit (the plan's length model, stages.core.plans.cost.capped_mean)
    that gives the `measured` mean under the pilot's `cap`; where the full run's limit differs,
    the plan cuts that mean at its own limit (the model's extrapolation, noted)."""
    mean = cc.uncapped_mean(measured, cap)
    if mean is None:
        notes.append(f"{what}: not calibrated: their mean ({measured:.0f} tokens) is too close "
                     f"to the pilot's limit of {cap} for the length model to tell the tail")
        return
    into[key] = mean
    if full_caps != {cap}:
        notes.append(f"{what}: measured {measured:.1f} tokens under the pilot's limit of {cap}, "
                     f"a mean of {mean:.1f} before it by the length model; the full run's limit "
                     f"({', '.join(map(str, sorted(full_caps)))}) cuts that mean its own way")


def _sig(x: float) -> float:
    """Four significant figures: a rate, not a measurement's noise."""
    return float(f"{x:.4g}")


def _processor_name() -> str:
    cpu = numerics.processor()
    return " ".join(filter(None, [cpu.get("model"), *cpu.get("extensions", [])])) or "unknown processor"


def write_calibration(cost: dict, notes: list[str], path: Path, pilot_source: str) -> None:
    head = [f"# The cost plan's calibration from the pilot run of {pilot_source}",
            f"# (python -m stages.calibrate, {datetime.date.today().isoformat()}, on "
            f"{platform.node() or 'this machine'}: {_processor_name()}).",
            "# Add it after the configuration: --configfile CONFIG " + str(path),
            *[f"# note: {n}" for n in notes]]
    text = "\n".join(head) + "\n" + yaml.safe_dump({"cost": cost}, sort_keys=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


# ---------------------------------------------------------------------------------------------
# The check against a finished full run
# ---------------------------------------------------------------------------------------------
RULE_ORDER = ("rollout", "token_stats", "train", "evaluate")


def check(full: Config, measured: Measured) -> tuple[list[dict], list[str]]:
    """Predicted against measured, by rule (RULE_ORDER) and in total, with the counted work of
    both; problems: counts that differ."""
    plan = cost_plan(full, limit=runtime_limit(full, query=False)[0])
    rows, problems = [], []
    predicted = {rule: 0.0 for rule in RULE_ORDER}
    jobs = {rule: 0 for rule in RULE_ORDER}
    for r in plan.rows:
        if r.rule in predicted:
            predicted[r.rule] += r.jobs * r.wall_min * 60
            jobs[r.rule] += r.jobs
    others = [rule for rule in RULE_ORDER if rule != "train"]
    wall = {"train": sum(t.wall_s for t in measured.trainings),
            **{rule: sum(j.wall_s for j in measured.jobs if j.rule == rule) for rule in others}}
    counted = {"train": len(measured.trainings),
               **{rule: sum(1 for j in measured.jobs if j.rule == rule) for rule in others}}
    for rule in RULE_ORDER:
        if counted[rule] != jobs[rule]:
            problems.append(f"{rule}: the plan counts {jobs[rule]} jobs, the run has {counted[rule]}")
        rows.append({"rule": rule, "jobs": jobs[rule], "predicted_s": predicted[rule],
                     "measured_s": wall[rule]})
    rows.append({"rule": "total", "jobs": sum(jobs.values()),
                 "predicted_s": sum(predicted.values()), "measured_s": sum(wall.values())})
    # the counted work: generated tokens and responses of every training at the run's own mean
    # lengths, and its attempts
    for size in full.experiment.sizes:
        ts = [t for t in measured.trainings if t.size == size]
        if not ts:
            continue
        rates = full.cost.of(size, "train")
        arch = model_arch(full, size)
        mean = sum(t.tokens for t in ts) / sum(t.responses for t in ts)
        # each training at the run's own mean length and generation batches (dynamic sampling)
        counts = {id(t): train_counts(full, size, t.method, arch, rates.model_copy(
            update={"generation_batches": t.generation_batches}), mean) for t in ts}
        for t in ts:
            c = counts[id(t)]
            if round(c.responses * c.steps) != round(t.responses):
                problems.append(f"train {size}/{t.method}/seed={t.seed}: the plan counts "
                                f"{c.responses * c.steps:.0f} responses, the run sampled {t.responses:.0f}")
        counted_tokens = sum(counts[id(t)].generated * t.steps for t in ts)
        if abs(counted_tokens - sum(t.tokens for t in ts)) > 0.5:
            problems.append(f"train {size}: the plan counts {counted_tokens:.0f} generated tokens "
                            f"at the run's mean length, the run generated {sum(t.tokens for t in ts):.0f}")
        planned_attempts = {r.methods[i]: r.attempts for r in cost_plan(full).rows
                            if r.rule == "train" and r.size == size for i in range(len(r.methods))}
        for t in ts:
            if planned_attempts.get(t.method) != len(t.attempts):
                problems.append(f"train {size}/{t.method}/seed={t.seed}: the plan counts "
                                f"{planned_attempts.get(t.method)} attempts, the run made {len(t.attempts)}")
    return rows, problems


def check_table(rows: list[dict]) -> str:
    lines = ["| rule | jobs | predicted | measured | predicted / measured |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['rule']} | {r['jobs']} | {r['predicted_s']:,.0f} s | "
                     f"{r['measured_s']:,.0f} s | {r['predicted_s'] / r['measured_s']:.3f} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configfile", required=True, nargs="+", metavar="FILE",
                   help="the full run's configuration (several files: laid on each other)")
    p.add_argument("--pilot", required=True, metavar="FILE",
                   help="the pilot laid on it (config/pilots/...), whose run has finished")
    p.add_argument("--out", default=None, metavar="FILE",
                   help="where the calibration goes (default results/<pilot run>/calibration.yaml)")
    p.add_argument("--check", action="store_true",
                   help="also read the full run (finished) and print predicted against measured")
    args = p.parse_args(argv)
    try:
        full = load_configs(args.configfile)
        pilot = load_configs([*args.configfile, args.pilot])
        measured = measure(pilot)
        cost, notes = calibrate(full, pilot, measured)
        out = Path(args.out or f"results/{pilot.run}/calibration.yaml")
        write_calibration(cost, notes, out, source_of([*args.configfile, args.pilot]))
        calibrated = load_configs([*args.configfile, str(out)])
    except (ConfigError, ArtifactError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"calibration: {out.resolve()}")
    for n in notes:
        print(f"note: {n}")
    plan = cost_plan(calibrated, source_of([*args.configfile, str(out)]),
                     *runtime_limit(calibrated))
    print(render(plan, calibrated), end="")
    if args.check:
        try:
            rows, problems = check(calibrated, measure(calibrated))
        except (ConfigError, ArtifactError) as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        print(f"\n## the plan against the run of {source_of(args.configfile)} (results/{full.run})")
        print(check_table(rows))
        print(json.dumps(rows))
        if problems:
            print("counted work differs:\n  " + "\n  ".join(problems), file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
