"""The multi-GPU launcher: the GPU check fails fast and clearly; torchrun really starts N workers."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from stages.launch import GpuShortage, check_gpus, worker_command
from tests.conftest import ROOT


@pytest.mark.parametrize("requested, visible", [(0, 0), (1, 1), (2, 2), (1, 8), (0, 4)])
def test_enough_gpus_pass(requested, visible):
    check_gpus(requested, visible, env={})


def test_too_few_gpus_name_what_the_job_was_given():
    env = {"CUDA_VISIBLE_DEVICES": "0", "SLURM_JOB_ID": "42", "PATH": "/bin"}
    with pytest.raises(GpuShortage) as info:
        check_gpus(8, 1, env=env)
    msg = str(info.value)
    assert msg.startswith("this job requested 8 GPU(s) but sees 1 (")
    assert "CUDA_VISIBLE_DEVICES='0'" in msg and "SLURM_JOB_ID='42'" in msg
    assert "PATH" not in msg and "models.<size>.gpus" in msg


def test_negative_request_is_refused():
    with pytest.raises(ValueError, match="--gpus must be >= 0"):
        check_gpus(-1, 0, env={})


def test_one_gpu_or_one_process_runs_the_command_itself():
    cmd = ["python", "-m", "stages.train", "--config", "c.yaml"]
    assert worker_command(0, cmd) == cmd
    assert worker_command(1, cmd) == cmd
    assert worker_command(2, cmd, processes="one") == cmd


def test_several_gpus_start_one_worker_per_gpu_through_torchrun():
    cmd = ["python", "-m", "stages.train", "--config", "c.yaml"]
    assert worker_command(8, cmd) == [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
        "--nproc-per-node=8", "--no-python", *cmd,
    ]


def launch(*args: str, tmp_path) -> subprocess.CompletedProcess:
    # no GPU is visible, whatever the machine has
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run(
        [sys.executable, "-m", "stages.launch", *args],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120,
    )


def test_cli_fails_fast_before_running_the_command(tmp_path):
    marker = tmp_path / "ran"
    proc = launch("--gpus", "2", "--", sys.executable, "-c", f"open({str(marker)!r}, 'w')",
                  tmp_path=tmp_path)
    assert proc.returncode == 2
    assert "error: this job requested 2 GPU(s) but sees 0 (CUDA_VISIBLE_DEVICES='')" in proc.stderr
    assert not marker.exists()


def test_cli_without_gpus_runs_the_command_and_passes_its_exit_code(tmp_path):
    proc = launch("--gpus", "0", "--", sys.executable, "-c", "print('ran'); raise SystemExit(3)",
                  tmp_path=tmp_path)
    assert proc.returncode == 3 and proc.stdout.strip() == "ran"


def test_cli_needs_a_command(tmp_path):
    proc = launch("--gpus", "1", tmp_path=tmp_path)
    assert proc.returncode == 2 and "give the command to run after --" in proc.stderr


@pytest.mark.slow
def test_torchrun_command_starts_one_rank_per_worker(tmp_path):
    # the exact command the launcher would exec for 2 GPUs, run on CPU: no GPU is touched
    script = "import os; print(os.environ['RANK'], os.environ['LOCAL_RANK'], os.environ['WORLD_SIZE'])"
    cmd = worker_command(2, [sys.executable, "-c", script])
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    ranks = sorted(line.split() for line in proc.stdout.splitlines() if line.strip())
    assert ranks == [["0", "0", "2"], ["1", "1", "2"]]
