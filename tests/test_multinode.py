"""Two torchrun agents as two nodes give the training of two processes on one node.

Both runs go through `python -m stages.launch` as the train rule calls it, on CPU (gloo): the
two-node run as two launchers on localhost, each with its own --node-rank and the same c10d
--rdzv-endpoint (what each node runs outside SLURM, and what srun runs on each node inside it),
the one-node run as one launcher starting two workers (torchrun --standalone). Sampling seeds
depend on the rank, so both runs have the same world size, 2. The same two-node launch through a
real two-node SLURM cluster: tests/test_slurm.py.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import polars as pl
import pytest

from stages.core.engine import free_port
from stages.train import TIME_COLUMNS
from tests.conftest import ROOT, write_yaml
from tests.test_train import cli_args, job  # noqa: F401  (job: the fixture of a tiny trained base)


def launcher(d, out: str, config: str, *layout: str) -> tuple[subprocess.Popen, object]:
    """`stages.launch --gpus 0 <layout> -- stages.train ...` started; (process, its log path)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}  # never srun here
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "stages.launch", "--gpus", "0", *layout, "--",
           sys.executable, "-m", "stages.train", *cli_args(d, out, config=config)]
    log = d / f"{out}-{len(list(d.glob(f'{out}-*.log')))}.log"
    with open(log, "w") as fh:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT), log


@pytest.mark.slow
def test_two_torchrun_agents_as_two_nodes_equal_two_processes_on_one_node(job):  # noqa: F811
    d, raw = job
    for name, nodes in (("one-node.yaml", 1), ("two-nodes.yaml", 2)):
        cfg = copy.deepcopy(raw)
        cfg["train"].update(steps=2, checkpoint_every=10)  # ICT: a dense step, then a selective one
        cfg["models"]["tiny-s"].update(train_processes=2, train_nodes=nodes)
        write_yaml(d / name, cfg)
    endpoint = f"127.0.0.1:{free_port()}"
    procs = [launcher(d, "one-node", "one-node.yaml", "--nodes", "1", "--procs-per-node", "2")] + [
        launcher(d, "two-nodes", "two-nodes.yaml", "--nodes", "2", "--procs-per-node", "1",
                 "--node-rank", str(rank), "--rdzv-endpoint", endpoint)
        for rank in (0, 1)
    ]
    for p, _ in procs:
        p.wait(timeout=600)
    logs = [log.read_text(errors="replace") for _, log in procs]
    for p, _ in procs:
        assert p.returncode == 0, "\n".join(text[-3000:] for text in logs)
    joined = "\n".join(logs)
    assert "--rdzv-backend=c10d --rdzv-endpoint=" + endpoint in joined
    assert "--rdzv-conf=is_host=1" in joined and "--rdzv-conf=is_host=0" in joined
    one, two = (pl.read_parquet(d / out / "metrics.parquet") for out in ("one-node", "two-nodes"))
    assert one["step"].to_list() == [0, 1]
    assert (one["grad_norm"] > 0).all(), "no learning signal: the test would prove nothing"
    keep = [c for c in one.columns if c not in TIME_COLUMNS]
    assert two.select(keep).equals(one.select(keep))
    weights = [(d / out / "final" / "model.safetensors").read_bytes() for out in ("one-node", "two-nodes")]
    assert weights[0] == weights[1]
