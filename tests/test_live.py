"""The live metrics of a training job (stages.core.training.live), without a training: rows logged, the
job stopped after a resume state and resumed from it. metrics.jsonl keeps the state's rows and
then the resumed ones; each logger's output is read back (tests/test_train.py's readers), and
a logger's test skips only where its optional extra is not installed (CI installs both)."""

from __future__ import annotations

import json

import pytest

from stages.core.training.live import LIVE_FILE, LiveMetrics
from tests.test_train import tensorboard_scalars, wandb_attempts


def rows(steps) -> list[dict]:
    return [{"step": s, "reward_mean": 0.1 * s, "entropy_mean": 1.0 + s, "note": None}
            for s in steps]


def two_attempts(out, loggers: list[str]) -> None:
    """Steps 0-3 logged by a first attempt whose resume state is at step 2; the second resumes
    there and logs steps 2-4 with other values (the killed attempt's 2 and 3 are redone)."""
    first = LiveMetrics(out, loggers, rows=[], ids=None, name="run", config={"a": 1}, active=True)
    for row in rows(range(4)):
        first.log(row)
    ids = dict(first.ids)
    first.close()
    second = LiveMetrics(out, loggers, rows=rows(range(2)), ids=ids, name="run", config={"a": 1},
                         active=True)
    assert second.ids == ids  # each logger's run id, from the resume state
    for row in rows(range(2, 5)):
        second.log({**row, "reward_mean": row["reward_mean"] + 10})
    second.close()


def expected() -> dict[int, float]:
    return {s: 0.1 * s + (10 if s >= 2 else 0) for s in range(5)}


def test_metrics_jsonl_drops_the_rows_after_the_resume_state(tmp_path):
    two_attempts(tmp_path, [])
    got = [json.loads(line) for line in (tmp_path / LIVE_FILE).read_text().splitlines()]
    assert [r["step"] for r in got] == list(range(5))
    assert {r["step"]: r["reward_mean"] for r in got} == pytest.approx(expected())
    # a fresh start (no resume state) starts the file afresh
    LiveMetrics(tmp_path, [], rows=[], ids=None, name="run", config={}, active=True).close()
    assert (tmp_path / LIVE_FILE).read_text() == ""
    # on other ranks nothing is written
    LiveMetrics(tmp_path / "rank1", [], rows=[], ids=None, name="run", config={}, active=False)
    assert not (tmp_path / "rank1").exists()


def test_tensorboard_shows_each_step_once_with_the_resumed_values(tmp_path):
    pytest.importorskip("tensorboard")
    two_attempts(tmp_path, ["tensorboard"])
    scalars = tensorboard_scalars(tmp_path / "tensorboard")
    assert scalars["train/reward_mean"] == pytest.approx(expected())
    assert "train/note" not in scalars and "train/step" not in scalars


def test_wandb_offline_runs_are_two_attempts_of_one_run(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_MODE", raising=False)  # offline by default
    # W&B in this process starts its service and names it in os.environ (WANDB_SERVICE): a
    # training started later by this pytest process would inherit it and fail to attach, so the
    # service ends with this test
    monkeypatch.setenv("WANDB_SERVICE", "")
    monkeypatch.delenv("WANDB_SERVICE")
    try:
        two_attempts(tmp_path, ["wandb"])
    finally:
        wandb.teardown()
    ids, history = wandb_attempts(tmp_path)
    assert len(history) == 2, history
    assert len(ids) == 1, ids
    assert sorted(history[0]) == [0, 1, 2, 3] and sorted(history[1]) == [2, 3, 4]
    for step, row in history[1].items():
        assert row["train/reward_mean"] == pytest.approx(expected()[step])
