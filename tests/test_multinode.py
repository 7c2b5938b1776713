"""Two torchrun agents as two nodes give the training of two processes on one node, under ZeRO-3,
and that training equals ZeRO-2's.

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
import torch
from safetensors.torch import load_file

from stages.launch import free_port
from stages.train import TIME_COLUMNS
from tests.conftest import ROOT, write_yaml
from tests.test_train import cli_args, job  # noqa: F401  (job: the fixture of a tiny trained base)

pytestmark = pytest.mark.slow  # two torchrun agents as two nodes: scripts/test.sh --all


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
    """ZeRO-3 over two nodes equals ZeRO-3 over two processes on one node bit for bit, and ZeRO-2 on
    one node within 1e-5 (float32: ZeRO-3 gathers and reduce-scatters in another order)."""
    d, raw = job
    for name, nodes, zero in (("one-node.yaml", 1, 3), ("two-nodes.yaml", 2, 3), ("zero2.yaml", 1, 2)):
        cfg = copy.deepcopy(raw)
        cfg["train"].update(steps=2, checkpoint_every=10, zero_stage=zero)  # ICT: a dense step, then a selective one
        cfg["models"]["tiny-s"].update(train_processes=2, train_nodes=nodes)
        write_yaml(d / name, cfg)
    endpoint = f"127.0.0.1:{free_port()}"
    procs = [launcher(d, out, f"{out}.yaml", "--nodes", "1", "--procs-per-node", "2")
             for out in ("one-node", "zero2")] + [
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
    # each node's gloo binds the interface that reaches the rendezvous host (here loopback)
    assert joined.count("GLOO_SOCKET_IFNAME=lo") == 2
    one, two, zero2 = (pl.read_parquet(d / out / "metrics.parquet") for out in ("one-node", "two-nodes", "zero2"))
    assert one["step"].to_list() == [0, 1]
    assert (one["grad_norm"] > 0).all(), "no learning signal: the test would prove nothing"
    keep = [c for c in one.columns if c not in TIME_COLUMNS]
    assert two.select(keep).equals(one.select(keep))
    weights = [load_file(d / out / "final" / "model.safetensors") for out in ("one-node", "two-nodes", "zero2")]
    assert (d / "one-node" / "final" / "model.safetensors").read_bytes() == (
        d / "two-nodes" / "final" / "model.safetensors").read_bytes()
    for column in keep:
        for a, b in zip(zero2[column].to_list(), two[column].to_list(), strict=True):
            assert (a is None) == (b is None), column
            assert a is None or b == pytest.approx(a, rel=1e-5, abs=1e-5), column
    assert set(weights[1]) == set(weights[2])
    for key, value in weights[2].items():
        assert torch.allclose(weights[1][key], value, rtol=0, atol=1e-5), key
