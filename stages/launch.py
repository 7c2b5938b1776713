"""Start a stage on the GPUs (or CPU processes) its job was given, on one node or several.

    python -m stages.launch --gpus 8 -- python -m stages.train --config CFG ...
    python -m stages.launch --gpus 0 --procs-per-node 2 -- python -m stages.train ...
    python -m stages.launch --gpus 16 --nodes 2 -- python -m stages.train ...          # in SLURM
    python -m stages.launch --gpus 16 --nodes 2 --node-rank R --rdzv-endpoint HOST:PORT \\
        -- python -m stages.train ...                                # by hand, once on each node

`--gpus` is the job's total (models.<size>.gpus.train), `--nodes` its nodes (train_nodes); each
node runs `--procs-per-node` workers: one per GPU (the default, gpus / nodes), or on CPU the
config's train_processes / train_nodes gloo processes. Every worker gets RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT from torchrun (DeepSpeed's init_distributed reads them; no
--local_rank argument to parse). torchrun rather than the DeepSpeed launcher: one interface for
every trainer, and no ssh between nodes.

One node: the wrapper first checks that the node sees at least the GPUs asked for — a missing
`--gpus` on the sbatch line or a partition without GPUs otherwise shows up much later, as a hang in
the process group or an out-of-memory error — and then replaces itself with `torchrun
--standalone`, which picks a free rendezvous port, so two jobs on one node do not collide. With one
worker (or --processes one: vLLM with tensor parallelism starts its own workers) the command runs
as it is, after the same check.

Several nodes, inside a SLURM job (SLURM_JOB_ID set; the job was submitted with --nodes N and one
task per node, workflow/rules/common.smk): the wrapper runs in the batch script, on the job's
first node. It reads the job's nodes and CPUs per task with `scontrol show job` (the executor
plugin drops the other SLURM_* variables before the rule's command runs), asks the OS for a port
that is free on this node, where the rendezvous will be (so jobs that share a node never pick the
same port, as a fixed or job-id-derived one could; only a process binding that very port in the
seconds before the rendezvous starts could take it), and replaces itself with

    srun --nodes=N --ntasks=N --ntasks-per-node=1 --cpus-per-task=C --mem=0 --kill-on-bad-exit=1 \
        bash -c 'exec python -m stages.launch --gpus G --nodes N --procs-per-node P \
                 --node-rank "$SLURM_NODEID" --rdzv-endpoint <first node's NodeAddr>:<port> \
                 --rdzv-id slurm-<job id> -- <command>'

which runs this wrapper once on each node (so every node checks its own GPUs), each of them then
starting one torchrun agent:

    torchrun --nnodes=N --nproc-per-node=P --rdzv-backend=c10d --rdzv-endpoint=HOST:PORT \
        --rdzv-id=ID --rdzv-conf=is_host=<1 on node 0, else 0> --no-python <command>

The agent of node 0, which must run on HOST, serves the c10d store, and the agents agree on the
ranks there (c10d orders them by host name; torchrun's own --node-rank is for its static
rendezvous only, so the node rank goes in as is_host). `--cpus-per-task` and `--mem=0` give each
node's step all the CPUs and memory the job has on that node (a bare srun step would get one CPU
per task). Outside SLURM the same agents start when each node runs the same command with its own
--node-rank, and the same --rdzv-endpoint (node 0's address and a port free there) and --rdzv-id.

Every agent of a multi-node job gets GLOO_SOCKET_IFNAME (unless the site set it): the value of
NCCL_SOCKET_IFNAME when that is set, else the interface this node reaches the rendezvous host
through. gloo otherwise binds to the address the host name resolves to, which on many clusters is
a loopback or management address the other nodes cannot reach, and gloo groups cross the nodes:
DeepSpeed's on CPUs, and vLLM's own (its external launcher builds a gloo group over every rank of
the job) on GPUs.

Bad input (nodes that do not divide the GPUs, a missing rendezvous, too few GPUs on a node) stops
the launcher before anything starts, with exit status 2 and one line on stderr.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import shlex
import socket
import subprocess
import sys
from dataclasses import dataclass

log = logging.getLogger("stages.launch")

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


class GpuShortage(RuntimeError):
    """A node of the job sees fewer GPUs than its rule requested."""


class LaunchError(ValueError):
    """The launch cannot be set up as asked (bad flags, a missing rendezvous, an odd SLURM job)."""


def visible_gpus() -> int:
    """GPUs this process can use (torch honours CUDA_VISIBLE_DEVICES, which SLURM sets)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_gpus(requested: int, visible: int, env: dict[str, str] | None = None, nodes: int = 1) -> None:
    """Raise GpuShortage, with what the job was given, when this node's `visible` GPUs are fewer
    than `requested`, the GPUs each of the job's `nodes` nodes must have."""
    if requested < 0:
        raise ValueError(f"--gpus must be >= 0, got {requested}")
    if visible >= requested:
        return
    env = os.environ if env is None else env
    seen = ", ".join(
        f"{k}={env[k]!r}"
        for k in ("CUDA_VISIBLE_DEVICES", "SLURM_JOB_ID", "SLURM_JOB_GPUS", "SLURM_GPUS_ON_NODE")
        if k in env
    )
    if nodes == 1:
        head = f"this job requested {requested} GPU(s) but sees {visible}"
        resource = "the rule's `gpu` resource reached sbatch as --gpus"
    else:
        node = env.get("SLURMD_NODENAME") or socket.gethostname()
        head = f"node {node} of this {nodes}-node job needs {requested} GPU(s) but sees {visible}"
        resource = f"the rule's `gres` resource reached sbatch as --gres=gpu:{requested}"
    raise GpuShortage(
        head + (f" ({seen})" if seen else "")
        + f". Check that {resource} (the SLURM profile and models.<size>.gpus) and that the"
        " partition ($ICT_GPU_PARTITION) has GPU nodes; to run on fewer GPUs, lower"
        " models.<size>.gpus in the config."
    )


def procs_per_node(gpus: int, nodes: int, procs: int | None) -> int:
    """Workers on each node: one per GPU (gpus / nodes), or `procs` CPU processes on CPU."""
    if nodes < 1:
        raise LaunchError(f"--nodes must be >= 1, got {nodes}")
    if gpus < 0:
        raise LaunchError(f"--gpus must be >= 0, got {gpus}")
    if gpus % nodes:
        raise LaunchError(f"--gpus {gpus} do not split evenly over --nodes {nodes}"
                          " (models.<size>.gpus.train and train_nodes)")
    if procs is not None and procs < 1:
        raise LaunchError(f"--procs-per-node must be >= 1, got {procs}")
    per_node = gpus // nodes
    if gpus and procs is not None and procs != per_node:
        raise LaunchError(f"--procs-per-node {procs}: a GPU job runs one worker per GPU, "
                          f"{per_node} on each node ({gpus} GPUs over {nodes} node(s))")
    return per_node if gpus else (procs or 1)


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """HOST:PORT (IPv6 as [ADDR]:PORT) -> (host, port)."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise LaunchError(f"--rdzv-endpoint {endpoint!r}: expected HOST:PORT")
    return host.strip("[]"), int(port)


def check_processes(processes: str, nodes: int) -> None:
    if processes == "one" and nodes > 1:
        raise LaunchError("--processes one starts its own workers on one node; it cannot span "
                          f"--nodes {nodes}")


def join_endpoint(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def worker_command(gpus: int, command: list[str], processes: str = "per-gpu", *, nodes: int = 1,
                   procs: int | None = None, node_rank: int | None = None,
                   rdzv_endpoint: str | None = None, rdzv_id: str = "ict-rlvr") -> list[str]:
    """What this node runs: `command` itself (one worker), torchrun --standalone (one node), or a
    torchrun agent joining the c10d rendezvous at `rdzv_endpoint` (node `node_rank` of `nodes`)."""
    if not command:
        raise LaunchError("no command to launch")
    per_node = procs_per_node(gpus, nodes, procs)
    if nodes == 1:
        if node_rank is not None or rdzv_endpoint is not None:
            raise LaunchError("--node-rank and --rdzv-endpoint are for jobs of --nodes > 1")
        if processes == "one" or per_node == 1:
            return list(command)
        return [*TORCHRUN, "--standalone", "--nnodes=1", f"--nproc-per-node={per_node}",
                "--no-python", *command]
    check_processes(processes, nodes)
    if node_rank is None or rdzv_endpoint is None:
        raise LaunchError(f"a {nodes}-node launch outside SLURM needs --node-rank (0..{nodes - 1}, "
                          "this node's) and --rdzv-endpoint HOST:PORT (the same on every node)")
    if not 0 <= node_rank < nodes:
        raise LaunchError(f"--node-rank {node_rank}: not in 0..{nodes - 1} (--nodes {nodes})")
    parse_endpoint(rdzv_endpoint)
    # c10d ignores torchrun's --node-rank (ranks follow the agents' host names); the node rank says
    # which agent serves the rendezvous store: node 0, on HOST, rather than whichever agent's host
    # name happens to match HOST
    return [*TORCHRUN, f"--nnodes={nodes}", f"--nproc-per-node={per_node}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint={rdzv_endpoint}", f"--rdzv-id={rdzv_id}",
            f"--rdzv-conf=is_host={int(node_rank == 0)}", "--no-python", *command]


def interface_address(name: str) -> str | None:
    """The IPv4 address of network interface `name` (Linux's SIOCGIFADDR), or None."""
    import fcntl
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def route_interface(host: str) -> str | None:
    """The network interface this host reaches `host` through (IPv4), or None when it cannot
    tell (an IPv6 or unresolvable host, no such interface)."""
    try:
        address = socket.gethostbyname(host)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((address, 9))  # UDP: nothing is sent, the kernel only picks the route
            local = s.getsockname()[0]
    except OSError:
        return None
    return next((name for _, name in socket.if_nameindex() if interface_address(name) == local), None)


def gloo_interface(env: dict[str, str], rdzv_host: str) -> str | None:
    """The GLOO_SOCKET_IFNAME a multi-node agent runs with: the site's own, else
    NCCL_SOCKET_IFNAME's, else the interface that reaches the rendezvous host (None: leave it)."""
    return (env.get("GLOO_SOCKET_IFNAME") or env.get("NCCL_SOCKET_IFNAME")
            or route_interface(rdzv_host))


# ----- SLURM ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class SlurmJob:
    """What the launcher needs to know of the SLURM job it runs in."""

    job_id: str
    nodes: list[str]  # node names, in the job's order
    cpus_per_task: int | None  # None: not set on the job (srun's default, one per task)
    rdzv_host: str  # address (NodeAddr) of the job's first node, node 0, where the rendezvous is


def _scontrol(*args: str) -> str:
    try:
        proc = subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise LaunchError(f"`scontrol {' '.join(args)}` failed: {err}") from None
    if proc.returncode:
        raise LaunchError(f"`scontrol {' '.join(args)}` failed: {proc.stderr.strip()}")
    return proc.stdout


def _field(text: str, key: str) -> str | None:
    m = re.search(rf"(?:^|\s){re.escape(key)}=(\S+)", text)
    return m[1] if m else None


def slurm_job(env: dict[str, str]) -> SlurmJob:
    """The SLURM job of SLURM_JOB_ID: its nodes, its CPUs per task and its first node's address."""
    job_id = env["SLURM_JOB_ID"]
    info = _scontrol("show", "job", "-o", job_id)
    nodelist = _field(info, "NodeList")
    if not nodelist or nodelist == "(null)":
        raise LaunchError(f"SLURM job {job_id} has no nodes yet (scontrol show job: {info.strip()[:200]})")
    nodes = _scontrol("show", "hostnames", nodelist).split()
    cpus = _field(info, "CPUs/Task")
    # SLURM_NODEID 0 is the first node of the list, where the batch script (and this) runs
    addr = _field(_scontrol("show", "node", "-o", nodes[0]), "NodeAddr") or nodes[0]
    return SlurmJob(job_id, nodes, int(cpus) if cpus and cpus.isdigit() else None, addr)


def free_port() -> int:
    """A TCP port that nothing on this host listens on now, on any interface (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def srun_command(job: SlurmJob, gpus: int, nodes: int, procs: int | None, command: list[str],
                 endpoint: str) -> list[str]:
    """srun starting this launcher once on each of the job's nodes, each with its node rank; the
    agents meet at `endpoint` (HOST:PORT)."""
    if len(job.nodes) != nodes:
        raise LaunchError(f"--nodes {nodes}, but SLURM job {job.job_id} has {len(job.nodes)} node(s)"
                          f" ({','.join(job.nodes)}): check that the rule's `nodes` resource reached"
                          " sbatch as --nodes (models.<size>.train_nodes)")
    per_node = procs_per_node(gpus, nodes, procs)
    parse_endpoint(endpoint)
    # the per-node launcher: the same flags, and the node rank SLURM gives each task
    inner = shlex.join([sys.executable, "-m", "stages.launch", "--gpus", str(gpus),
                        "--nodes", str(nodes), "--procs-per-node", str(per_node)])
    inner += ' --node-rank "$SLURM_NODEID" ' + shlex.join(
        ["--rdzv-endpoint", endpoint, "--rdzv-id", f"slurm-{job.job_id}", "--", *command])
    cpus = [f"--cpus-per-task={job.cpus_per_task}"] if job.cpus_per_task else []
    return ["srun", f"--nodes={nodes}", f"--ntasks={nodes}", "--ntasks-per-node=1", *cpus,
            "--mem=0", "--kill-on-bad-exit=1", "bash", "-c", f"exec {inner}"]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gpus", type=int, required=True,
                   help="GPUs of the whole job (models.<size>.gpus.train); each node needs gpus/nodes")
    p.add_argument("--nodes", type=int, default=1, help="nodes of the job (models.<size>.train_nodes)")
    p.add_argument("--procs-per-node", type=int, default=None,
                   help="workers on each node: default one per GPU; on CPU the config's "
                        "train_processes / train_nodes")
    p.add_argument("--node-rank", type=int, default=None,
                   help="outside SLURM, with --nodes > 1: this node's rank, 0..nodes-1")
    p.add_argument("--rdzv-endpoint", default=None,
                   help="with --nodes > 1: HOST:PORT of the c10d rendezvous, the same on every node "
                        "(in SLURM, by default: the job's first node and a port free there)")
    p.add_argument("--rdzv-id", default="ict-rlvr", help="rendezvous id, the same on every node")
    p.add_argument(
        "--processes", choices=["per-gpu", "one"], default="per-gpu",
        help="per-gpu: torchrun starts one worker per GPU; one: the command starts its own workers",
    )
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run")
    args = p.parse_args(argv)
    logging.basicConfig(
        level=os.environ.get("ICT_RLVR_LOGLEVEL", "INFO"),
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("give the command to run after --")
    try:
        per_node = procs_per_node(args.gpus, args.nodes, args.procs_per_node)
        check_processes(args.processes, args.nodes)
        if args.nodes > 1 and args.node_rank is None and "SLURM_JOB_ID" in os.environ:
            job = slurm_job(dict(os.environ))
            endpoint = args.rdzv_endpoint or join_endpoint(job.rdzv_host, free_port())
            final = srun_command(job, args.gpus, args.nodes, per_node, command, endpoint)
            where = f"{args.nodes} nodes of SLURM job {os.environ['SLURM_JOB_ID']}"
        else:
            final = worker_command(args.gpus, command, args.processes, nodes=args.nodes,
                                   procs=args.procs_per_node, node_rank=args.node_rank,
                                   rdzv_endpoint=args.rdzv_endpoint, rdzv_id=args.rdzv_id)
            gpus_here = args.gpus // args.nodes
            check_gpus(gpus_here, visible_gpus() if gpus_here else 0, nodes=args.nodes)
            if args.nodes > 1:  # gloo groups span the nodes: bind them where the others reach us
                interface = gloo_interface(dict(os.environ), parse_endpoint(args.rdzv_endpoint)[0])
                if interface:
                    os.environ["GLOO_SOCKET_IFNAME"] = interface
                    log.info("GLOO_SOCKET_IFNAME=%s", interface)
            where = (f"node {args.node_rank} of {args.nodes}" if args.nodes > 1 else "this node") + (
                f", {gpus_here} GPU(s)" if args.gpus else f", {per_node} CPU process(es)")
    except (GpuShortage, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    log.info("launching on %s: %s", where, shlex.join(final))
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvp(final[0], final)


if __name__ == "__main__":
    main()
