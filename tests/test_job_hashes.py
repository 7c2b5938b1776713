"""Every job hash of every shipped config, against the values of tests/fixtures/job_hashes.json.

A job reruns when its hash changes (stages.keys.job_hash_of), so a change of code that moves one
by accident would rerun finished work on every site that upgrades. A change that must move them
(a stage's version bumped, a result key's meaning changed) rewrites the file on purpose:

    python -m tests.test_job_hashes --write

and the diff of the file shows which jobs will rerun.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from stages.config import load_config
from stages.keys import checkpoint_steps, curve_benchmarks, job_hash_of

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "job_hashes.json"
CONFIGS = sorted(p.name for p in (ROOT / "config").glob("*.yaml"))


def all_job_hashes(path: Path) -> dict[str, str]:
    """{'rule size=... method=...': job hash} for every job of the config's grid (a training's
    seeds share one hash, so the seed is left out)."""
    cfg = load_config(path)
    exp = cfg.experiment
    jobs: list[tuple[str, dict[str, str]]] = []
    datasets = {exp.sft_dataset, *exp.train_datasets, *exp.benchmarks} - {None}
    jobs += [("prepare_data", {"dataset": d}) for d in sorted(datasets)]
    for size in exp.sizes:
        jobs += [("base_model", {"size": size}), ("rollout", {"size": size}),
                 ("token_stats", {"size": size})]
        jobs += [("evaluate", {"size": size, "method": m}) for m in ["base", *exp.methods]]
        for method in exp.methods:
            jobs += [("train", {"size": size, "method": method}),
                     ("overlap", {"size": size, "method": method})]
            if checkpoint_steps(cfg.train_for(method, size)) and curve_benchmarks(cfg):
                jobs.append(("evaluate_checkpoint", {"size": size, "method": method}))
    jobs.append(("tables", {}))
    return {" ".join([rule, *(f"{k}={v}" for k, v in w.items())]): job_hash_of(cfg, rule, w)
            for rule, w in jobs}


@pytest.mark.parametrize("name", CONFIGS)
def test_every_job_hash_is_the_recorded_one(name, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    recorded = json.loads(FIXTURE.read_text())
    assert name in recorded, f"{name}: no recorded hashes; python -m tests.test_job_hashes --write"
    now = all_job_hashes(ROOT / "config" / name)
    moved = {job: (recorded[name].get(job), h) for job, h in now.items() if recorded[name].get(job) != h}
    assert not moved, (f"{name}: these jobs' hashes moved, so they rerun on every finished run "
                       f"(recorded, now): {moved}. If that is meant, rewrite {FIXTURE.name} with "
                       "python -m tests.test_job_hashes --write")


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit(__doc__)
    FIXTURE.write_text(json.dumps({name: all_job_hashes(ROOT / "config" / name) for name in CONFIGS},
                                  indent=1, sort_keys=True) + "\n")
    print(f"wrote {FIXTURE}")
