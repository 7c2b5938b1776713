"""The launcher: the GPU check fails fast and clearly; the torchrun (and srun) command lines of one
node, of several nodes in SLURM and by hand; torchrun really starts N workers.

Two torchrun agents as two nodes running the trainer: tests/test_multinode.py; through a real
two-node SLURM cluster: tests/test_slurm.py."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

import pytest

from stages.launch import (
    TORCHRUN,
    GpuShortage,
    LaunchError,
    SlurmJob,
    check_gpus,
    gloo_interface,
    route_interface,
    srun_command,
    worker_command,
)
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


CMD = ["python", "-m", "stages.train", "--config", "c.yaml"]


def test_several_gpus_start_one_worker_per_gpu_through_torchrun():
    assert worker_command(8, CMD) == [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
        "--nproc-per-node=8", "--no-python", *CMD,
    ]


def test_cpu_processes_on_one_node_are_torchrun_workers_too():
    assert worker_command(0, CMD, procs=2) == [
        *TORCHRUN, "--standalone", "--nnodes=1", "--nproc-per-node=2", "--no-python", *CMD]
    assert worker_command(0, CMD, procs=1) == CMD


@pytest.mark.parametrize("rank", [0, 1])
def test_each_node_outside_slurm_starts_one_c10d_agent_with_its_rank(rank):
    # 16 GPUs over 2 nodes: 8 workers here; node 0 serves the rendezvous store
    assert worker_command(16, CMD, nodes=2, node_rank=rank, rdzv_endpoint="10.1.2.3:29400",
                          rdzv_id="run7") == [
        *TORCHRUN, "--nnodes=2", "--nproc-per-node=8", "--rdzv-backend=c10d",
        "--rdzv-endpoint=10.1.2.3:29400", "--rdzv-id=run7", f"--rdzv-conf=is_host={int(rank == 0)}",
        "--no-python", *CMD,
    ]
    # CPU: the config's processes per node
    got = worker_command(0, CMD, nodes=2, procs=3, node_rank=rank, rdzv_endpoint="h:1")
    assert got[len(TORCHRUN):len(TORCHRUN) + 2] == ["--nnodes=2", "--nproc-per-node=3"]


def test_in_slurm_srun_runs_the_launcher_once_per_node_with_the_node_rank():
    job = SlurmJob("77", ["n1", "n2"], cpus_per_task=16, rdzv_host="10.0.0.5")
    cmd = srun_command(job, 16, 2, None, [*CMD, "--out", "a b"], "10.0.0.5:41000")
    assert cmd[:-1] == ["srun", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1",
                        "--cpus-per-task=16", "--mem=0", "--kill-on-bad-exit=1", "bash", "-c"]
    # what bash runs on the node SLURM numbers 1
    script = cmd[-1]
    assert script.startswith("exec ") and '"$SLURM_NODEID"' in script
    on_node_1 = shlex.split(script.replace('"$SLURM_NODEID"', "1"))
    assert on_node_1 == [
        "exec", sys.executable, "-m", "stages.launch", "--gpus", "16", "--nodes", "2",
        "--procs-per-node", "8", "--node-rank", "1", "--rdzv-endpoint", "10.0.0.5:41000",
        "--rdzv-id", "slurm-77", "--", *CMD, "--out", "a b",
    ]
    # a job without CPUs per task: srun's own default
    bare = srun_command(SlurmJob("78", ["a", "b", "c"], None, "a"), 0, 3, 2, CMD, "a:5")
    assert bare[:4] == ["srun", "--nodes=3", "--ntasks=3", "--ntasks-per-node=1"]
    assert not any(a.startswith("--cpus-per-task") for a in bare)
    assert "--procs-per-node 2" in bare[-1]


@pytest.mark.parametrize(
    "call, expect",
    [
        (lambda: worker_command(3, CMD, nodes=2, node_rank=0, rdzv_endpoint="h:1"),
         "--gpus 3 do not split evenly over --nodes 2"),
        (lambda: worker_command(0, CMD, nodes=2, procs=1),
         "a 2-node launch outside SLURM needs --node-rank (0..1, this node's) and --rdzv-endpoint"),
        (lambda: worker_command(0, CMD, nodes=2, procs=1, node_rank=0),
         "needs --node-rank (0..1, this node's) and --rdzv-endpoint HOST:PORT"),
        (lambda: worker_command(8, CMD, nodes=2, node_rank=2, rdzv_endpoint="h:1"),
         "--node-rank 2: not in 0..1"),
        (lambda: worker_command(8, CMD, nodes=2, node_rank=0, rdzv_endpoint="h"),
         "--rdzv-endpoint 'h': expected HOST:PORT"),
        (lambda: worker_command(8, CMD, nodes=2, procs=2, node_rank=0, rdzv_endpoint="h:1"),
         "--procs-per-node 2: a GPU job runs one worker per GPU, 4 on each node"),
        (lambda: worker_command(8, CMD, "one", nodes=2, node_rank=0, rdzv_endpoint="h:1"),
         "--processes one starts its own workers on one node"),
        (lambda: worker_command(2, CMD, node_rank=0), "--node-rank and --rdzv-endpoint are for jobs"),
        (lambda: worker_command(2, []), "no command to launch"),
        (lambda: srun_command(SlurmJob("9", ["n1"], 1, "n1"), 0, 2, 1, CMD, "n1:5"),
         "--nodes 2, but SLURM job 9 has 1 node(s) (n1): check that the rule's `nodes` resource"),
    ],
)
def test_bad_layouts_are_refused_before_anything_starts(call, expect):
    with pytest.raises(LaunchError) as info:
        call()
    assert expect in str(info.value)


def test_too_few_gpus_on_a_node_of_a_multi_node_job_names_the_node_and_gres():
    env = {"CUDA_VISIBLE_DEVICES": "0", "SLURMD_NODENAME": "n2"}
    with pytest.raises(GpuShortage) as info:
        check_gpus(4, 1, env=env, nodes=2)
    msg = str(info.value)
    assert msg.startswith("node n2 of this 2-node job needs 4 GPU(s) but sees 1 (CUDA_VISIBLE_DEVICES='0')")
    assert "--gres=gpu:4" in msg


def launch(*args: str, tmp_path) -> subprocess.CompletedProcess:
    # no GPU is visible, whatever the machine has; not in a SLURM job, even if the tests are
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    env.update(PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
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


@pytest.mark.parametrize(
    "args, expect",
    [
        (["--gpus", "3", "--nodes", "2"], "error: --gpus 3 do not split evenly over --nodes 2"),
        (["--gpus", "0", "--nodes", "2", "--procs-per-node", "1"],
         "error: a 2-node launch outside SLURM needs --node-rank"),
        (["--gpus", "4", "--nodes", "2"], "error: a 2-node launch outside SLURM needs --node-rank"),
        (["--gpus", "4", "--nodes", "2", "--node-rank", "1", "--rdzv-endpoint", "127.0.0.1:1"],
         "error: node "),  # the GPU check comes first: this node sees none of its 2
    ],
)
def test_cli_refuses_a_bad_multi_node_launch_in_one_line(tmp_path, args, expect):
    marker = tmp_path / "ran"
    proc = launch(*args, "--", sys.executable, "-c", f"open({str(marker)!r}, 'w')", tmp_path=tmp_path)
    assert proc.returncode == 2 and proc.stderr.startswith(expect), proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not marker.exists()


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


def test_multi_node_agents_bind_gloo_where_the_other_nodes_reach_them():
    """GLOO_SOCKET_IFNAME of a multi-node agent: the site's own, else NCCL's, else the interface
    that reaches the rendezvous host (vLLM's external launcher and DeepSpeed on CPUs build gloo
    groups across the nodes; gloo otherwise binds where the host name resolves, often loopback)."""
    assert gloo_interface({"GLOO_SOCKET_IFNAME": "eth9", "NCCL_SOCKET_IFNAME": "ib0"}, "h") == "eth9"
    assert gloo_interface({"NCCL_SOCKET_IFNAME": "ib0"}, "h") == "ib0"
    assert gloo_interface({}, "127.0.0.1") == route_interface("127.0.0.1") == "lo"
    assert route_interface("no-such-host.invalid") is None

