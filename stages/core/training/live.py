"""Live metrics of a training job: every step's row on disk as it is made, and the loggers.

- `metrics.jsonl` in the output folder: one JSON object per step, appended and flushed to disk by
  the job's rank 0 as the step ends, so it can be read while the job runs (`tail -f`, or
  polars.read_ndjson). A resumed job rewrites it with the resume state's rows first: the rows of
  the steps after the checkpoint, which the job is about to redo, are dropped. A job that starts
  over (no resume state) starts the file, and the loggers' folders, afresh. `metrics.parquet`
  is still written at the end, with the same rows.
- `train.loggers`: `tensorboard` (torch's SummaryWriter, event files in `<out>/tensorboard`;
  a resumed job writes with purge_step at its first step, so TensorBoard hides the events of the
  steps it redoes) and `wandb` (Weights & Biases in its offline mode unless WANDB_MODE says
  otherwise, files in `<out>/wandb`; project $WANDB_PROJECT or ict-rlvr). Each logger's run id
  is kept in the resume state, so a resubmitted job continues the same run (verl#2783): W&B
  gets `id` and `resume="allow"`; an offline resumed run is a second `offline-run-*-<id>`
  folder of the same id, which `wandb sync` sends to the same run. W&B's service process buffers
  what it writes: an attempt killed outright (SIGKILL, out of memory, a step still running at
  the time limit) may lose its last rows there, or all of them offline, while metrics.jsonl and
  TensorBoard (flushed every step) keep every row; an attempt that stops on SLURM's signal
  closes its runs. Each logger is an optional extra (`pip install -e '.[tensorboard,wandb]'`),
  imported only when configured.

Every value logged is a step's metric under `train/<column>` at that step; None values (a
metric not computed that step) are left out.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

LIVE_FILE = "metrics.jsonl"
LOGGER_DIRS = {"tensorboard": "tensorboard", "wandb": "wandb"}
LOGGERS = tuple(LOGGER_DIRS)


class LiveMetrics:
    """The live outputs of one training job's rank 0 (on other ranks every call is a no-op).

    rows: the resume state's rows (its step is len(rows)), empty for a fresh start; ids: the
    loggers' run ids from the resume state; name: the run's display name; config: the resolved
    config, recorded with the W&B run."""

    def __init__(self, out_dir: Path, loggers: list[str], *, rows: list[dict], ids: dict | None,
                 name: str, config: dict, active: bool) -> None:
        self.active = active
        self.ids = dict(ids or {})
        self.writers: dict = {}
        if not active:
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        self.path = out_dir / LIVE_FILE
        start = len(rows)
        if start == 0:  # a fresh start: nothing of an earlier attempt belongs to this run
            self.ids = {}
            for folder in LOGGER_DIRS.values():
                shutil.rmtree(out_dir / folder, ignore_errors=True)
        tmp = self.path.with_name(f".{LIVE_FILE}.{os.getpid()}.tmp")
        tmp.write_text("".join(json.dumps(row) + "\n" for row in rows))
        os.replace(tmp, self.path)
        self.file = open(self.path, "a")  # noqa: SIM115 - held for the job's life
        for logger in loggers:
            self.writers[logger] = _START[logger](self, out_dir / LOGGER_DIRS[logger], start,
                                                  name, config)

    def log(self, row: dict) -> None:
        """One step's row: appended to metrics.jsonl (flushed to disk) and sent to each logger."""
        if not self.active:
            return
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        os.fsync(self.file.fileno())
        values = {f"train/{k}": float(v) for k, v in row.items()
                  if k != "step" and isinstance(v, int | float) and not isinstance(v, bool)}
        step = row["step"]
        if "tensorboard" in self.writers:
            writer = self.writers["tensorboard"]
            for key, value in values.items():
                writer.add_scalar(key, value, step)
            writer.flush()
        if "wandb" in self.writers:
            self.writers["wandb"].log(values, step=step)

    def close(self) -> None:
        if not self.active:
            return
        self.file.close()
        if "tensorboard" in self.writers:
            self.writers["tensorboard"].close()
        if "wandb" in self.writers:
            self.writers["wandb"].finish()


def _tensorboard(live: LiveMetrics, folder: Path, start: int, name: str, config: dict):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as err:
        raise ImportError(f"train.loggers: tensorboard needs the package ({err}); install the "
                          "extra: pip install -e '.[tensorboard]'") from None
    live.ids["tensorboard"] = str(folder)
    # purge_step: TensorBoard hides the events this folder holds from that step on
    return SummaryWriter(log_dir=str(folder), purge_step=start if start else None)


def _wandb(live: LiveMetrics, folder: Path, start: int, name: str, config: dict):
    try:
        import wandb
    except ImportError as err:
        raise ImportError(f"train.loggers: wandb needs the package ({err}); install the extra: "
                          "pip install -e '.[wandb]'") from None
    run_id = live.ids.get("wandb") or uuid.uuid4().hex[:12]  # W&B's ids: [a-z0-9], unique
    live.ids["wandb"] = run_id
    folder.mkdir(parents=True, exist_ok=True)
    # wandb makes its run folders in <dir>/wandb: <out>/wandb/offline-run-<time>-<id>
    return wandb.init(project=os.environ.get("WANDB_PROJECT", "ict-rlvr"), name=name, id=run_id,
                      resume="allow", mode=os.environ.get("WANDB_MODE", "offline"),
                      dir=str(folder.parent), config=config)


_START = {"tensorboard": _tensorboard, "wandb": _wandb}
