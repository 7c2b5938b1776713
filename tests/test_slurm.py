"""The SLURM profile against a real two-node SLURM cluster on localhost.

The cluster fixture installs SLURM and munge from Debian packages when they are missing (root and
apt-get needed; otherwise the tests are skipped and say why, or fail where ICT_RLVR_REQUIRE_SLURM=1
as in CI), writes /etc/slurm/slurm.conf and gres.conf (jobs' inner `srun` and `scontrol` read only
that path: the executor plugin drops SLURM_* variables, SLURM_CONF too), starts its own munged (own
key and socket), slurmctld and two slurmd (`slurmd -N n1`, `-N n2`: two nodes of one host, each on
its own port, as Debian's SLURM is built with MULTIPLE_SLURMD), and stops exactly those pids
afterwards, also when a test fails; config files that were there before are put back. Each node
has two fake GPUs (SLURM schedules them, CUDA sees none); there are three partitions of both
nodes: the default one, and the two the tests name through the environment. The whole test config
runs through the cluster once (its single-node jobs land on either node); then one training job
spans both nodes (mpi, srun, one torchrun agent per node) and is compared with the same world
size run locally; and one training is ended by three time limits in a row (SLURM's own, lowered
by the test while each attempt runs; the rule's --signal=URG@60 makes the trainer save and exit,
the profile's retries resubmit it) and finishes with the uninterrupted run's metrics. Facts
behind the settings: ../shared/notes/slurm.md.
"""

from __future__ import annotations

import fcntl
import json
import os
import pwd
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import polars as pl
import pytest
import yaml
from polars.testing import assert_frame_equal

from stages.config import ConfigError, Gpus, load_config, validate
from stages.core.common.io import read_provenance
from stages.launch import free_port
from stages.train import TIME_COLUMNS
from tests.conftest import ROOT, workflow_env, write_yaml
from tests.helpers import copy_checkout, move_run, snapshot

pytestmark = pytest.mark.slow  # a real two-node SLURM cluster and workflow runs through it (minutes): scripts/test.sh --all

PACKAGES = ["slurm-wlm", "munge"]
BINARIES = ["munged", "munge", "unmunge", "slurmctld", "slurmd", "sbatch", "squeue", "sinfo", "scancel"]
SLURM_CONF = Path("/etc/slurm/slurm.conf")
GRES_CONF = SLURM_CONF.with_name("gres.conf")
FAKE_GPUS = 2  # GPUs SLURM schedules on each node; none exist, so a job that asks for them sees 0
GPU_TYPE = "fake"  # the nodes' GPUs have a type (gres.conf Type=), as a site's do
NODE_FEATURE = "ib"  # and the nodes a feature (slurm.conf Feature=)
NODES = ("n1", "n2")  # two slurmd on this host
LOCK = Path(tempfile.gettempdir()) / "ict-rlvr-slurm-test.lock"
PARTITION = "ict"  # where the test sends CPU jobs; not the default partition
GPU_PARTITION = "ict-gpu"
RUN_TIMEOUT_S = 600  # either Snakemake run; the module takes 5-6 minutes on 2 busy cores
CONF_HEADER = "# written by tests/test_slurm.py"
# CI sets this (.ci/run): there, a cluster that cannot be set up is a failure, not a skip.
REQUIRED = os.environ.get("ICT_RLVR_REQUIRE_SLURM") == "1"


def unavailable(reason: str):
    """Skip (or, where SLURM is required, fail) with the reason the cluster cannot run."""
    if REQUIRED:
        pytest.fail(f"ICT_RLVR_REQUIRE_SLURM=1 but {reason}")
    pytest.skip(reason)


# ----- the cluster ------------------------------------------------------------------------------
def missing_binaries() -> list[str]:
    return [b for b in BINARIES if shutil.which(b) is None]


def ensure_packages() -> None:
    """Install SLURM and munge with apt-get when missing; skip with the reason when impossible."""
    if not missing_binaries():
        return
    if shutil.which("apt-get") is None:
        unavailable(f"SLURM/munge not installed ({', '.join(missing_binaries())} missing) and no apt-get")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", *PACKAGES]):
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        if proc.returncode:
            unavailable(f"`{' '.join(cmd)}` failed, SLURM cannot be installed: {proc.stderr[-800:]}")
    if missing := missing_binaries():
        unavailable(f"apt-get installed {PACKAGES} but {missing} are still missing")


def running(name: str) -> list[str]:
    proc = subprocess.run(["pgrep", "-x", name], capture_output=True, text=True)
    return proc.stdout.split()


def node_memory_mb() -> int:
    out = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, check=True).stdout
    # more than slurmd measures marks the node INVALID; leave room for the OS
    return int(int(re.search(r"RealMemory=(\d+)", out)[1]) * 0.85)


class LocalSlurm:
    """munged + slurmctld + slurmd on this machine, in a temporary directory."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="ict-slurm-"))
        self.dir.chmod(0o755)  # munged runs as the munge user and must reach its directory
        self.host = socket.gethostname().split(".")[0]
        self.procs: dict[str, subprocess.Popen] = {}
        self.saved: dict[Path, bytes | None] = {}  # config files replaced here -> what was there

    def log_tails(self, lines: int = 30) -> str:
        out = []
        for name in ("munged", "slurmctld", *(f"slurmd-{n}" for n in NODES)):
            path = self.dir / f"{name}.log"
            if path.exists():
                tail = path.read_text(errors="replace").splitlines()[-lines:]
                out.append(f"--- {path} ---\n" + "\n".join(tail))
        return "\n".join(out)

    def start(self) -> None:
        munge_user = pwd.getpwnam("munge")
        mdir = self.dir / "munge"
        mdir.mkdir(mode=0o755)
        key = mdir / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        for path in (mdir, key):
            os.chown(path, munge_user.pw_uid, munge_user.pw_gid)
        self.munge_socket = mdir / "munge.socket"
        # munged refuses to run as root with a munge-owned key: start it as the munge user
        self.spawn("munged", [
            "munged", "--foreground", f"--socket={self.munge_socket}", f"--key-file={key}",
            f"--pid-file={mdir / 'munged.pid'}", f"--seed-file={mdir / 'munged.seed'}",
            f"--log-file={self.dir / 'munged.log'}",
        ], user=munge_user.pw_uid, group=munge_user.pw_gid)
        self.wait_for(lambda: self.munge_socket.exists(), "munged socket")
        check = subprocess.run(
            f"munge -n -S {self.munge_socket} | unmunge -S {self.munge_socket}",
            shell=True, capture_output=True, text=True,
        )
        assert check.returncode == 0, f"munge does not work: {check.stderr}\n{self.log_tails()}"

        self.write_conf()
        self.spawn("slurmctld", ["slurmctld", "-D", "-i"])
        self.wait_for(lambda: self.sinfo() is not None, "slurmctld")
        for node in NODES:
            self.spawn(f"slurmd-{node}", ["slurmd", "-D", "-N", node])
        self.wait_for(lambda: self.node_states() == dict.fromkeys(NODES, "idle"), "both nodes idle")

    def write_conf(self) -> None:
        d = self.dir
        (d / "ctld").mkdir()
        for node in NODES:
            (d / f"spool-{node}").mkdir()
        memory, cpus = node_memory_mb(), os.cpu_count()
        # both nodes are this host (NodeHostname), each slurmd on its own port; %n is the node name
        nodes = "\n".join(
            f"NodeName={node} NodeHostname={self.host} NodeAddr=127.0.0.1 Port={free_port()} "
            f"CPUs={cpus} RealMemory={memory} Gres=gpu:{GPU_TYPE}:{FAKE_GPUS} "
            f"Feature={NODE_FEATURE} State=UNKNOWN" for node in NODES)
        conf = f"""\
{CONF_HEADER} for a throw-away two-node cluster on one host; removed afterwards
ClusterName=ictrlvr
SlurmctldHost={self.host}(127.0.0.1)
SlurmctldPort={free_port()}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket}
SlurmUser=root
SlurmdUser=root
StateSaveLocation={d / 'ctld'}
SlurmdSpoolDir={d / 'spool-%n'}
SlurmctldPidFile={d / 'slurmctld.pid'}
SlurmdPidFile={d / 'slurmd-%n.pid'}
SlurmctldLogFile={d / 'slurmctld.log'}
SlurmdLogFile={d / 'slurmd-%n.log'}
ProctrackType=proctrack/linuxproc
# no CPU binding: the two nodes share this host's CPUs
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=1000
ReturnToService=2
# squeue status checks need finished jobs to stay visible (the plugin polls up to 180 s apart);
# the tests read finished jobs with scontrol up to the end of the module
MinJobAge=3600
MpiDefault=none
SwitchType=switch/none
GresTypes=gpu
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
{nodes}
PartitionName=other Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP
PartitionName={PARTITION} Nodes={','.join(NODES)} MaxTime=INFINITE State=UP
PartitionName={GPU_PARTITION} Nodes={','.join(NODES)} MaxTime=INFINITE State=UP
"""
        # Fake GPUs: SLURM only counts GPUs it has device files for; copies of /dev/null will do.
        # Jobs that ask for them get CUDA_VISIBLE_DEVICES, and CUDA still finds no GPU.
        gres = CONF_HEADER + "\n"
        for node in NODES:
            (d / node).mkdir()
            for i in range(FAKE_GPUS):
                os.mknod(d / node / f"gpu{i}", stat.S_IFCHR | 0o666, os.makedev(1, 3))
            gres += (f"NodeName={node} Name=gpu Type={GPU_TYPE} "
                     f"File={d / node}/gpu[0-{FAKE_GPUS - 1}]\n")
        SLURM_CONF.parent.mkdir(parents=True, exist_ok=True)
        for path, text in ((SLURM_CONF, conf), (GRES_CONF, gres)):
            before = path.read_bytes() if path.exists() else None
            # a file left by a killed run of this test is not worth putting back
            self.saved[path] = None if before and before.startswith(CONF_HEADER.encode()) else before
            path.write_text(text)

    def spawn(self, name: str, cmd: list[str], **kwargs) -> None:
        log = open(self.dir / f"{name}.out", "w")
        self.procs[name] = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, **kwargs
        )

    def sinfo(self) -> str | None:
        proc = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True)
        return proc.stdout.strip() if proc.returncode == 0 else None

    def node_states(self) -> dict[str, str]:
        proc = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True, text=True)
        return dict(line.split() for line in set(proc.stdout.splitlines())) if proc.returncode == 0 else {}

    def wait_for(self, ready, what: str, timeout: float = 60) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    out = (self.dir / f"{name}.out").read_text(errors="replace")[-2000:]
                    raise AssertionError(f"{name} exited ({proc.returncode}): {out}\n{self.log_tails()}")
            if ready():
                return
            time.sleep(0.2)
        raise AssertionError(f"timed out waiting for {what}\n{self.log_tails()}")

    def stop(self) -> None:
        """Cancel this cluster's jobs, stop the daemons started here (by pid), restore the config."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            jobs = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout.split()
            if jobs:
                subprocess.run(["scancel", *jobs], capture_output=True)
        for name in (*(f"slurmd-{n}" for n in NODES), "slurmctld", "munged"):
            proc = self.procs.get(name)
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=15)
        for path, before in self.saved.items():
            if before is None:
                path.unlink(missing_ok=True)
            else:
                path.write_bytes(before)
        shutil.rmtree(self.dir, ignore_errors=True)


def take_lock(timeout: float = 900):
    """One cluster at a time on this machine (ports, /etc/slurm/slurm.conf): wait for another test."""
    fh = open(LOCK, "w")
    end = time.monotonic() + timeout
    while True:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fh
        except BlockingIOError:
            if time.monotonic() > end:
                fh.close()
                pytest.fail(f"another SLURM test held {LOCK} for {timeout:.0f} s")
            time.sleep(1)


@pytest.fixture(scope="module")
def slurm_cluster():
    if os.geteuid() != 0:
        unavailable("needs root: starts munged, slurmctld and slurmd (and may apt-get install them)")
    ensure_packages()
    lock = take_lock()
    try:
        if others := [(n, p) for n in ("slurmctld", "slurmd") for p in running(n)]:
            unavailable(f"SLURM daemons not started by this test are running {others}; not touching them")
        cluster = LocalSlurm()
        try:
            cluster.start()
            yield cluster
        finally:
            cluster.stop()
    finally:
        lock.close()


# ----- the runs ---------------------------------------------------------------------------------
# After each status check that finds no finished job the plugin waits 10 s longer (up to 180 s):
# right for hour-long jobs, but here it would add ~30 s to each of a chain of ~20 s jobs. The SLURM
# run of this test checks every 2 s instead; submission and status queries are the plugin's own.
FAST_POLLING = """
import snakemake_executor_plugin_slurm as plugin
from snakemake.cli import main
plugin.Executor.next_seconds_between_status_checks = property(lambda self: 2, lambda self, value: None)
main()
"""


def snakemake_cmd(cwd: Path, *args: str, timeout: int = RUN_TIMEOUT_S, fast_polling=False) -> list[str]:
    python = [sys.executable, "-c", FAST_POLLING] if fast_polling else [sys.executable, "-m", "snakemake"]
    return ["timeout", "-k", "10", str(timeout), *python,
            "-s", str(ROOT / "Snakefile"), "--directory", str(cwd), *args]


def job_counts(out: str) -> dict[str, int]:
    """The first 'Job stats' table of a Snakemake log as {rule: count}, without the target rule."""
    table = out.split("Job stats:")[1].split("total")[0]
    return {m[1]: int(m[2]) for m in re.finditer(r"^(\w+)\s+(\d+)$", table, re.M) if m[1] != "all"}


def slurm_jobs(workdir: Path) -> list[tuple[str, str, str]]:
    """(rule, wildcards, SLURM job id) of every job the plugin submitted, from its kept logs."""
    logs = sorted((workdir / ".snakemake" / "slurm_logs").glob("rule_*/**/*.log"))
    jobs = []
    for log in logs:
        parts = log.relative_to(workdir / ".snakemake" / "slurm_logs").parts
        jobs.append((parts[0].removeprefix("rule_"), "/".join(parts[1:-1]), log.stem))
    return jobs


def job_logs(workdir: Path, chars: int = 3000) -> str:
    logs = (workdir / ".snakemake" / "slurm_logs").glob("rule_*/**/*.log")
    return "\n".join(f"--- {p} ---\n{p.read_text(errors='replace')[-chars:]}" for p in logs)


def is_timing(name: str) -> bool:
    """Wall-clock timings, the only values two runs may differ in (stages.train.TIME_COLUMNS)."""
    return name in TIME_COLUMNS or name.endswith("_seconds")


def without_timings(obj, also: tuple[str, ...] = ()):
    """A JSON value without its wall-clock timings (and without the keys `also`)."""
    if isinstance(obj, dict):
        return {k: without_timings(v, also) for k, v in obj.items() if not is_timing(k) and k not in also}
    if isinstance(obj, list):
        return [without_timings(v, also) for v in obj]
    return obj


def compare_results(local: Path, slurm: Path, differ: tuple[str, ...] = ()) -> list[str]:
    """Asserts that every deterministic artifact is the same in both runs; returns their paths.

    Same seed, same threads (the rule's cpus), same code: on CPU every value is bit-identical,
    but for wall-clock timings, and for the keys `differ` of JSON files and provenance (config
    keys in which the two runs' configs differ, and so their config hashes). Figures (PNG) are
    left out."""
    def files(*suffixes):
        found = sorted(p.relative_to(local) for p in local.rglob("*") if p.suffix in suffixes)
        assert found == sorted(p.relative_to(slurm) for p in slurm.rglob("*") if p.suffix in suffixes)
        return found

    parquet, summaries, exact = files(".parquet"), files(".json"), files(
        ".safetensors", ".csv", ".md", ".tex", ".html", ".yaml")
    for rel in parquet:
        a, b = (pl.read_parquet(root / rel) for root in (local, slurm))
        timings = [c for c in a.columns if is_timing(c)]
        assert_frame_equal(a.drop(timings), b.drop(timings), check_exact=True)
        a, b = (without_timings(read_provenance(root / rel), differ) for root in (local, slurm))
        assert a == b, rel
    for rel in summaries:
        a, b = (json.loads((root / rel).read_text()) for root in (local, slurm))
        assert without_timings(a, differ) == without_timings(b, differ), rel
    for rel in exact:
        assert (local / rel).read_bytes() == (slurm / rel).read_bytes(), rel
    return [str(p) for p in parquet + summaries + exact]


def scontrol_jobs() -> dict[str, dict[str, str]]:
    """Every job slurmctld still remembers (MinJobAge) as {job id: {field: value}}."""
    out = subprocess.run(["scontrol", "-o", "show", "job"], capture_output=True, text=True).stdout
    jobs = {}
    for line in out.splitlines():
        fields = dict(kv.split("=", 1) for kv in line.split() if "=" in kv)
        if "JobId" in fields:  # not "No jobs in the system"
            jobs[fields["JobId"]] = fields
    return jobs


def stop_runs(runs: dict[str, dict]) -> None:
    """Terminate the runs ({name: {"proc": Popen, ...}}) still going, and wait for them."""
    for run in runs.values():
        if run["proc"].poll() is None:
            run["proc"].terminate()
            run["proc"].wait(timeout=30)


@pytest.fixture(scope="module")
def runs(slurm_cluster, tmp_path_factory, request):
    """The test config run through `--profile slurm`, and the session's local run beside it; the
    training jobs of `training_runs` start once the local run has made their inputs."""
    cfg = str(ROOT / "config" / "test.yaml")
    # the site's partition travels through the environment (common.smk); it is not the default one
    env = workflow_env(SBATCH_PARTITION=PARTITION, ICT_GPU_PARTITION=GPU_PARTITION)
    slurm_wd = tmp_path_factory.mktemp("slurm-run")
    log = slurm_wd.parent / f"{slurm_wd.name}.log"
    started = time.monotonic()
    # --profile with a path: `--profile slurm` means ./slurm/ of the current directory.
    # No retries here: a failure should show at once, not after a resubmission.
    with open(log, "w") as out:
        slurm = subprocess.Popen(
            snakemake_cmd(slurm_wd, "--profile", str(ROOT / "slurm"), "--configfile", cfg,
                          "--retries", "0", "--slurm-keep-successful-logs", fast_polling=True),
            cwd=slurm_wd, env=env, stdout=out, stderr=subprocess.STDOUT, text=True,
        )
        # The local reference run (the session's, started here if no test has needed it yet)
        # computes while the SLURM run mostly waits on the scheduler.
        local_wd, local = request.getfixturevalue("local_test_run")
        # and so, from then on, do the training jobs of the tests at the end
        training = (start_training_runs(local_wd, cfg, env, tmp_path_factory.mktemp("training"))
                    if local.returncode == 0 else {})
        slurm.wait(timeout=RUN_TIMEOUT_S + 30)
    try:
        slurm_out = log.read_text()
        print(f"\nSLURM run and local run done after {time.monotonic() - started:.0f} s")
        assert slurm.returncode == 0, (
            f"SLURM run failed ({slurm.returncode}):\n{slurm_out[-5000:]}\n"
            f"{job_logs(slurm_wd)}\n{slurm_cluster.log_tails()}"
        )
        local_out = local.stdout + local.stderr
        assert local.returncode == 0, local_out[-4000:]
        jobs = slurm_jobs(slurm_wd)
        print("SLURM jobs:\n" + "\n".join(
            f"  {jobid:>4} {rule} {wc}" for rule, wc, jobid in sorted(jobs, key=lambda j: int(j[2]))))
        yield {"cfg": cfg, "env": env, "slurm_wd": slurm_wd, "local_wd": local_wd, "jobs": jobs,
               "expected": job_counts(local_out), "scontrol": scontrol_jobs(), "training": training}
    finally:
        stop_runs(training.get("runs", {}))  # stopped here if no test waited for them


@pytest.mark.slow
def test_every_job_went_through_slurm_once_in_the_sites_partition(runs):
    jobs, expected = runs["jobs"], runs["expected"]
    assert {"prepare_data", "base_model", "rollout", "token_stats"} <= set(expected)
    assert Counter(rule for rule, _, _ in jobs) == expected, (jobs, expected)
    assert len({jobid for _, _, jobid in jobs}) == len(jobs)
    for _, _, jobid in jobs:
        job = runs["scontrol"][jobid]
        assert (job["JobState"], job["Partition"], job["NumTasks"]) == ("COMPLETED", PARTITION, "1"), job


@pytest.mark.slow
def test_slurm_results_equal_the_local_run(runs):
    compared = compare_results(runs["local_wd"] / "results" / "test", runs["slurm_wd"] / "results" / "test")
    for stage in ("data", "models", "rollouts", "token_stats", "train", "eval", "tables"):
        assert any(p.startswith(f"{stage}/") for p in compared), (stage, compared)


@pytest.mark.slow
def test_second_run_has_nothing_to_do(runs):
    again = subprocess.run(
        snakemake_cmd(runs["slurm_wd"], "--profile", str(ROOT / "slurm"), "--configfile", runs["cfg"],
                      timeout=120),
        cwd=runs["slurm_wd"], env=runs["env"], capture_output=True, text=True,
    )
    assert again.returncode == 0 and "Nothing to be done" in again.stdout + again.stderr, (
        again.stderr[-3000:])


@pytest.mark.slow
def test_a_moved_copy_of_the_checkout_and_run_has_nothing_to_do(runs, tmp_path):
    """The checkout and the finished SLURM run copied elsewhere, dry-run from there through the
    profile, with the stages' interpreter named by another path: no job is listed (no parameter
    holds the interpreter or an absolute path), and nothing under results/ is written."""
    moved = copy_checkout(tmp_path / "moved")
    move_run(runs["slurm_wd"], moved, copy=True)
    before = snapshot(moved / "results")
    link = tmp_path / "python"
    link.symlink_to(sys.executable)
    dry = subprocess.run(
        ["timeout", "-k", "10", "120", sys.executable, "-m", "snakemake", "-n", "--profile", "slurm",
         "--configfile", "config/test.yaml"],
        cwd=moved, env={**runs["env"], "PYTHONPATH": str(moved), "ICT_RLVR_STAGE_PYTHON": str(link)},
        capture_output=True, text=True)
    assert dry.returncode == 0 and "Nothing to be done" in dry.stdout + dry.stderr, dry.stderr[-3000:]
    assert snapshot(moved / "results") == before


# ----- training jobs: several GPUs, several nodes -----------------------------------------------
TRAINING_TIMEOUT_S = 400


def start_training_runs(local_wd: Path, cfg_path: str, env: dict[str, str], base: Path) -> dict:
    """tiny-s's training (the first method and seed) four more times, all started at once (they
    mostly wait on the scheduler), each in a fresh folder with the local run's data and base model
    (copied with their mtimes: with mtime triggers only, nothing before training reruns):

    two_nodes: 2 CPU processes, one on each node, through `--profile slurm`;
    local: the same 2 processes on one node, locally (`--cores 2`), to compare with two_nodes;
    gpus: FAKE_GPUS GPUs on one node, which SLURM grants and CUDA cannot use: must fail;
    gpus_two_nodes: FAKE_GPUS GPUs on each of the two nodes: must fail on each node.
    """
    raw = yaml.safe_load(Path(cfg_path).read_text())
    method, seed = raw["experiment"]["methods"][0], raw["experiment"]["seeds"][0]
    target = f"results/test/train/size=tiny-s/method={method}/seed={seed}/model.json"
    layouts = {
        "two_nodes": {"train_processes": 2, "train_nodes": 2},
        "local": {"train_processes": 2, "train_nodes": 1},
        "gpus": {"gpus": {"train": FAKE_GPUS}},
        "gpus_two_nodes": {"gpus": {"train": 2 * FAKE_GPUS}, "train_nodes": 2},
    }
    # the GPU runs name a GPU type and a node feature, as a site would ($ICT_GPU_MODEL,
    # $ICT_GPU_CONSTRAINT): slurmctld must grant both from the nodes' typed gres and features
    typed = {**env, "ICT_GPU_MODEL": GPU_TYPE, "ICT_GPU_CONSTRAINT": NODE_FEATURE}
    runs = {}
    for name, layout in layouts.items():
        cfg = json.loads(json.dumps(raw))
        cfg["models"]["tiny-s"].update(layout)
        # the test base model answers nothing right; DAPO's length penalty on responses longer than
        # 8 tokens gives the groups rewards that differ, and so gradients to compare
        cfg["train"]["overlong_buffer"] = cfg["train"]["max_response_tokens"] - 8
        wd = base / name
        for part in ("data", "models"):
            shutil.copytree(local_wd / "results" / "test" / part, wd / "results" / "test" / part)
        how = (["--cores", "2"] if name == "local" else
               ["--profile", str(ROOT / "slurm"), "--retries", "0", "--slurm-keep-successful-logs", "--verbose"])
        log = base / f"{name}.log"
        with open(log, "w") as fh:
            # the target first: --configfile and --rerun-triggers take several values
            proc = subprocess.Popen(
                snakemake_cmd(wd, target, *how, "--configfile", str(write_yaml(base / f"{name}.yaml", cfg)),
                              "--rerun-triggers", "mtime", timeout=TRAINING_TIMEOUT_S,
                              fast_polling=name != "local"),
                cwd=wd, env=typed if name.startswith("gpus") else env, stdout=fh,
                stderr=subprocess.STDOUT, text=True)
        runs[name] = {"wd": wd, "log": log, "proc": proc}
    return {"target": target, "runs": runs, "started": time.monotonic()}


# ----- three walltime kills in a row -------------------------------------------------------------
KILLS = 3
# steps of the killed training: room for three attempts of a few steps each (the test stops an
# attempt within about one step of its first row; an Intel Xeon trains several steps a second)
KILL_STEPS = 24
SIGNAL_LEAD_S = 60  # train.save_before_limit_minutes: 1
KILLS_TIMEOUT_S = 900
SIGURG_PENDING = 1 << (signal.SIGURG - 1)  # its bit in /proc/<pid>/status's ShdPnd mask


def kills_config(raw: dict) -> dict:
    """The test config's first training as the three-kill run trains it: KILL_STEPS steps, a
    checkpoint every 3 (save_every: they must survive the failed attempts), no resume state but
    the ones the signal asks for, SIGURG a minute before the time limit, a 10-minute walltime
    that the test lowers while each of the first attempts runs."""
    cfg = json.loads(json.dumps(raw))
    cfg["train"].update(steps=KILL_STEPS, checkpoint_every=100, save_every=3,
                        save_before_limit_minutes=SIGNAL_LEAD_S / 60,
                        # rewards that differ within groups (the length penalty), so gradients
                        overlong_buffer=cfg["train"]["max_response_tokens"] - 8)
    cfg["resources"]["train"]["runtime"] = 10
    return cfg


def start_walltime_kills(local_wd: Path, raw: dict, env: dict[str, str], base: Path) -> dict:
    """The three-kill run through `--profile slurm --retries 3` (with its controller thread) and
    the same training uninterrupted, locally, to compare it with."""
    import threading

    cfg = kills_config(raw)
    method, seed = raw["experiment"]["methods"][0], raw["experiment"]["seeds"][0]
    target = f"results/test/train/size=tiny-s/method={method}/seed={seed}/model.json"
    runs = {}
    for name, how in (("kills", ["--profile", str(ROOT / "slurm"), "--retries", str(KILLS),
                                 "--slurm-keep-successful-logs", "--verbose"]),
                      ("uninterrupted", ["--cores", "1"])):
        wd = base / name
        for part in ("data", "models"):
            shutil.copytree(local_wd / "results" / "test" / part, wd / "results" / "test" / part)
        log = base / f"{name}.log"
        with open(log, "w") as fh:
            proc = subprocess.Popen(
                snakemake_cmd(wd, target, *how, "--configfile",
                              str(write_yaml(base / f"{name}.yaml", cfg)), "--rerun-triggers",
                              "mtime", timeout=KILLS_TIMEOUT_S, fast_polling=name == "kills"),
                cwd=wd, env=env, stdout=fh, stderr=subprocess.STDOUT, text=True)
        runs[name] = {"wd": wd, "log": log, "proc": proc}
    kills: list[dict] = []
    controller = threading.Thread(target=kill_attempts, daemon=True,
                                  args=(runs["kills"]["wd"], runs["kills"]["proc"], target, kills))
    controller.start()
    return {"runs": runs, "target": target, "controller": controller, "kills": kills}


def running_job(wd: Path) -> tuple[str, dict] | None:
    """(job id, scontrol fields) of the RUNNING job whose working directory is `wd`, or None."""
    for jobid, job in scontrol_jobs().items():
        if job.get("JobState") == "RUNNING" and Path(job.get("WorkDir", "")).resolve() == wd.resolve():
            return jobid, job
    return None


def trainer_pid(wd: Path) -> int | None:
    """The pid of the `python -m stages.train` process running in `wd` (one CPU process:
    stages.launch runs it without torchrun; its paths are relative to the working folder)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            cwd = (entry / "cwd").resolve()
        except OSError:
            continue
        if argv[1:3] == [b"-m", b"stages.train"] and cwd == wd.resolve():
            return int(entry.name)
    return None


def signal_arrived(pid: int) -> bool:
    """SIGURG is pending at the stopped process `pid`, or the process runs again (slurmstepd
    continues a stopped task when it signals it) or is gone."""
    try:
        status = dict(line.split(":", 1) for line in
                      Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    except OSError:
        return True
    return bool(int(status["ShdPnd"], 16) & SIGURG_PENDING) or not status["State"].strip().startswith("T")


def seconds(value: str) -> int:
    """SLURM's [days-]hours:minutes:seconds as seconds."""
    days, _, clock = value.rpartition("-")
    h, m, s = (int(x) for x in clock.split(":"))
    return int(days or 0) * 86400 + h * 3600 + m * 60 + s


def kill_attempts(wd: Path, proc: subprocess.Popen, target: str, kills: list[dict]) -> None:
    """Ends each of the first KILLS attempts of `wd`'s training at a real SLURM time limit.

    Once the attempt has written a row of its own to metrics.jsonl (its trainer runs, its SIGURG
    handler is installed), its trainer is stopped (SIGSTOP: it would only burn CPU while SLURM
    gets round to the signal), and the job's TimeLimit is lowered with `scontrol update` so that
    slurmctld's next periodic check (every 30 s) finds it within SIGNAL_LEAD_S of the limit and
    sends the rule's --signal=URG@60 (TimeLimit is whole minutes: end - now is brought into
    (lead + 5, lead + 30] s, waiting when it would be more). Once the signal has reached the
    stopped trainer (slurmstepd continues a stopped task it signals; else the test does), it
    saves at its step boundary and exits; the profile's retries resubmit the job. Records each kill: job id, limit, the state's step."""
    live = wd / Path(target).parent / "metrics.jsonl"
    state = wd / "results" / "test" / "resume" / Path(target).parent.relative_to(
        "results/test/train") / "state.json"
    done = 0
    while len(kills) < KILLS and proc.poll() is None:
        # the new row first and the stop at once (a file read and a scan of /proc); SLURM's view
        # of the job after: a fast machine trains several steps in one scontrol call
        rows = len(live.read_text().splitlines()) if live.exists() else 0
        pid = trainer_pid(wd) if rows > done else None
        if pid is None:
            time.sleep(0.05)
            continue
        try:
            os.kill(pid, signal.SIGSTOP)
        except ProcessLookupError:  # it ended between the scan and the signal
            continue
        found = running_job(wd)
        if found is None:  # not (or no longer) a running job: let it go on, and look again
            os.kill(pid, signal.SIGCONT)
            time.sleep(0.5)
            continue
        jobid, job = found
        elapsed = seconds(job["RunTime"])
        minutes = -(-(elapsed + SIGNAL_LEAD_S + 6) // 60)
        wait = (60 * minutes - elapsed) - (SIGNAL_LEAD_S + 30)
        if wait > 0:
            time.sleep(wait)
        subprocess.run(["scontrol", "update", f"JobId={jobid}", f"TimeLimit={minutes}"], check=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not signal_arrived(pid):
            time.sleep(0.2)
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:  # it already went on, saved and exited
            pass
        # this job, not any job of wd: the retry's job may already run (and, finishing the last
        # steps, remove the resume folder) before a poll sees the folder without a running job
        while (now := running_job(wd)) is not None and now[0] == jobid and proc.poll() is None:
            time.sleep(0.2)
        step = saved_step(wd, jobid, state)
        kills.append({"jobid": jobid, "time_limit_minutes": minutes, "step": step,
                      "signalled": time.monotonic() < deadline})
        done = step


def train_job_log(wd: Path, jobid: str) -> Path | None:
    """The SLURM log the plugin kept of training job `jobid` run from `wd` (None before it has one)."""
    return next((wd / ".snakemake" / "slurm_logs").glob(f"rule_train/**/{jobid}.log"), None)


def saved_step(wd: Path, jobid: str, state: Path) -> int:
    """The step attempt `jobid` saved its resume state after: from its own SLURM log, which
    stays (the retry may already have finished and removed the resume folder), else from the
    state, else 0 (nothing saved: the test fails on it)."""
    log = train_job_log(wd, jobid)
    if log and (found := re.search(r"resume state saved after step (\d+) of", log.read_text())):
        return int(found.group(1))
    return json.loads(state.read_text())["step"] if state.exists() else 0


@pytest.fixture(scope="module")
def walltime_kills(slurm_cluster, tmp_path_factory):
    """The finished three-kill run and its uninterrupted twin, from the training's inputs made
    locally first (prepare_data and base_model alone: `--omit-from train`), so that this test
    needs no other test's runs and can run alone (`-k walltime_kills`)."""
    cfg = ROOT / "config" / "test.yaml"
    raw = yaml.safe_load(cfg.read_text())
    env = workflow_env(SBATCH_PARTITION=PARTITION, ICT_GPU_PARTITION=GPU_PARTITION)
    base = tmp_path_factory.mktemp("walltime-kills")
    inputs = base / "inputs"
    inputs.mkdir()
    method, seed = raw["experiment"]["methods"][0], raw["experiment"]["seeds"][0]
    target = f"results/test/train/size=tiny-s/method={method}/seed={seed}/model.json"
    made = subprocess.run(snakemake_cmd(inputs, target, "--cores", "2", "--configfile", str(cfg),
                                        "--omit-from", "train"),
                          cwd=inputs, env=env, capture_output=True, text=True)
    assert made.returncode == 0, (made.stdout + made.stderr)[-4000:]
    started = time.monotonic()
    kills = start_walltime_kills(inputs, raw, env, base)
    try:
        for run in kills["runs"].values():
            run["proc"].wait(timeout=KILLS_TIMEOUT_S + 30)
            run["out"] = run["log"].read_text()
        kills["controller"].join(timeout=30)
        print(f"\nthree-kill training done after {time.monotonic() - started:.0f} s: "
              f"{kills['kills']}")
        yield kills
    finally:
        stop_runs(kills["runs"])


@pytest.mark.slow
def test_three_walltime_kills_in_a_row_end_with_the_uninterrupted_runs_metrics(walltime_kills):
    runs, target = walltime_kills["runs"], walltime_kills["target"]
    for name, run in runs.items():
        assert run["proc"].returncode == 0, f"{name}:\n{run['out'][-5000:]}"
    wd = runs["kills"]["wd"]
    kills = walltime_kills["kills"]
    assert len(kills) == KILLS and all(k["signalled"] for k in kills), kills
    steps = [k["step"] for k in kills]
    assert 0 < steps[0] < steps[1] < steps[2] < KILL_STEPS, steps  # each attempt saved progress
    jobs = slurm_jobs(wd)
    assert [rule for rule, _, _ in jobs] == ["train"] * (KILLS + 1), jobs
    known = scontrol_jobs()
    ids = sorted((jobid for _, _, jobid in jobs), key=int)
    assert ids[:KILLS] == [k["jobid"] for k in kills]
    for k in kills:  # a real time limit: the trainer saved on SLURM's signal and exited before it
        job = known[k["jobid"]]
        assert job["JobState"] == "FAILED" and seconds(job["TimeLimit"]) == 60 * k["time_limit_minutes"], job
        assert seconds(job["RunTime"]) < seconds(job["TimeLimit"]), job
        log = train_job_log(wd, k["jobid"]).read_text()
        assert f"SIGURG (time limit near): resume state saved after step {k['step']} of {KILL_STEPS}" in log, log[-3000:]
    assert known[ids[-1]]["JobState"] == "COMPLETED", known[ids[-1]]
    # the rule asked SLURM for the signal: its sbatch lines
    assert len(re.findall(r"sbatch call: sbatch .*--signal=URG@60", runs["kills"]["out"])) == KILLS + 1
    for previous, k in zip([0, *steps], [*kills, None], strict=True):  # each attempt resumed
        jobid = k["jobid"] if k else ids[-1]
        log = train_job_log(wd, jobid).read_text()
        assert (f"at step {previous} from" in log) == bool(previous), log[-3000:]
    # the uninterrupted run's metrics (timings aside), final weights and save_every checkpoints
    job = Path(target).parent
    compared = compare_results(runs["uninterrupted"]["wd"] / job, wd / job,
                               differ=("resumed_at_step",))
    assert {"metrics.parquet", "final/model.safetensors",
            *(f"checkpoints/step={s}/model/model.safetensors" for s in range(3, KILL_STEPS, 3))
            } <= set(compared), compared
    metrics = pl.read_parquet(wd / job / "metrics.parquet")
    assert metrics["step"].to_list() == list(range(KILL_STEPS)) and (metrics["grad_norm"] > 0).any()
    assert json.loads((wd / job / "summary.json").read_text())["resumed_at_step"] == steps[-1]
    assert not (wd / "results" / "test" / "resume").joinpath(*job.parts[3:]).exists()


@pytest.fixture(scope="module")
def training_runs(runs):
    """The finished runs of start_training_runs: {name: {wd, out, returncode, and for the SLURM
    ones jobid, scontrol, job_log, sbatch (the plugin's sbatch line)}, "target": the target}."""
    training = runs["training"]
    for run in training["runs"].values():
        run["proc"].wait(timeout=TRAINING_TIMEOUT_S + 30)
    print(f"\ntraining jobs (two nodes, local, GPUs on one and on two nodes) done "
          f"{time.monotonic() - training['started']:.0f} s after they started")
    known = scontrol_jobs()
    out = {"target": training["target"]}
    for name, run in training["runs"].items():
        run = out[name] = {**run, "out": run["log"].read_text(), "returncode": run["proc"].returncode}
        if name == "local":
            continue
        jobs = slurm_jobs(run["wd"])
        assert [rule for rule, _, _ in jobs] == ["train"], (name, jobs, run["out"][-3000:])
        run["jobid"] = jobid = jobs[0][2]
        run["scontrol"] = known[jobid]
        run["job_log"] = train_job_log(run["wd"], jobid).read_text()
        sbatch = re.search(r"sbatch call: (sbatch .*?) --wrap=", run["out"])
        assert sbatch, run["out"][-3000:]
        run["sbatch"] = sbatch[1]
        print(f"{name}: {sbatch[1]}")
    return out


def succeeded(run: dict) -> None:
    assert run["returncode"] == 0, f"failed ({run['returncode']}):\n{run['out'][-5000:]}\n{run.get('job_log', '')[-3000:]}"


@pytest.mark.slow
def test_multi_gpu_training_is_one_task_that_stops_when_it_sees_too_few_gpus(training_runs):
    # The node has 2 GPUs for SLURM but none for CUDA: the job is granted them, the launcher
    # inside finds 0 usable and must stop before starting any worker.
    run = training_runs["gpus"]
    assert run["returncode"] != 0, run["out"][-3000:]
    job = run["scontrol"]
    assert (job["JobState"], job["Partition"], job["NumTasks"]) == ("FAILED", GPU_PARTITION, "1"), job
    # the site's GPU type and node feature, once each on the plugin's sbatch line, granted
    assert f" --gpus={GPU_TYPE}:{FAKE_GPUS}" in run["sbatch"] and "--gres" not in run["sbatch"], run["sbatch"]
    assert f" -C {NODE_FEATURE}" in run["sbatch"], run["sbatch"]
    assert job["TresPerJob"] == f"gres:gpu:{GPU_TYPE}:{FAKE_GPUS}", job
    assert job["Features"] == NODE_FEATURE, job
    assert f"error: this job requested {FAKE_GPUS} GPU(s) but sees 0 (CUDA_VISIBLE_DEVICES='0,1'" in run["job_log"]
    assert "stages.launch INFO launching" not in run["job_log"]  # it stopped before starting any worker


@pytest.mark.slow
def test_two_node_training_is_one_job_over_both_nodes_with_an_agent_on_each(training_runs):
    run = training_runs["two_nodes"]
    succeeded(run)
    job, log = run["scontrol"], run["job_log"]
    assert (job["JobState"], job["Partition"], job["NumNodes"], job["NumTasks"], job["NodeList"]) == (
        "COMPLETED", PARTITION, "2", "2", "n[1-2]"), job
    # the plugin's sbatch line: the nodes and one task on each, no GPU flags for a CPU job
    assert " --nodes=2 --ntasks=2 --cpus-per-task=1 " in run["sbatch"] and "--g" not in run["sbatch"]
    # stages.launch in the batch script: srun over both nodes; then one torchrun agent on each
    assert re.search(rf"launching on 2 nodes of SLURM job {run['jobid']}: srun --nodes=2 --ntasks=2 "
                     r"--ntasks-per-node=1 --cpus-per-task=1 --mem=0", log), log[-3000:]
    for rank in (0, 1):
        assert re.search(rf"launching on node {rank} of 2, 1 CPU process\(es\): \S+ -m "
                         rf"torch.distributed.run --nnodes=2 --nproc-per-node=1 --rdzv-backend=c10d "
                         rf"--rdzv-endpoint=127.0.0.1:\d+ --rdzv-id=slurm-{run['jobid']} "
                         rf"--rdzv-conf=is_host={int(rank == 0)}", log), log[-3000:]


@pytest.mark.slow
def test_two_node_training_equals_two_processes_on_one_node_locally(training_runs):
    for name in ("two_nodes", "local"):
        succeeded(training_runs[name])
    # the configs differ in train_nodes only, and so do the config hashes of the training
    train = Path("results/test/train")
    slurm, local = (training_runs[name]["wd"] for name in ("two_nodes", "local"))
    compared = compare_results(local / train, slurm / train, differ=("train_nodes", "config_hash"))
    job = Path(training_runs["target"]).parent
    assert {str(job.relative_to(train) / f) for f in (
        "metrics.parquet", "summary.json", "final/model.safetensors")} <= set(compared), compared
    assert json.loads((slurm / job / "summary.json").read_text())["world_size"] == 2
    metrics = pl.read_parquet(slurm / job / "metrics.parquet")
    assert (metrics["grad_norm"] > 0).any(), "no learning signal: the comparison would prove nothing"


@pytest.mark.slow
def test_two_node_gpu_job_asks_each_node_for_its_gpus_and_each_node_checks_them(training_runs):
    # FAKE_GPUS per node as gres, one task per node; every node's launcher finds 0 usable GPUs
    run = training_runs["gpus_two_nodes"]
    assert run["returncode"] != 0, run["out"][-3000:]
    assert " --nodes=2 --ntasks=2 --cpus-per-task=1 " in run["sbatch"], run["sbatch"]
    assert run["sbatch"].endswith(f" --gres=gpu:{GPU_TYPE}:{FAKE_GPUS}"), run["sbatch"]
    assert "--gpus" not in run["sbatch"] and "--ntasks-per-gpu" not in run["sbatch"], run["sbatch"]
    assert f" -C {NODE_FEATURE}" in run["sbatch"], run["sbatch"]
    job, log = run["scontrol"], run["job_log"]
    assert (job["JobState"], job["Partition"], job["NumNodes"]) == ("FAILED", GPU_PARTITION, "2"), job
    assert job["TresPerNode"] == f"gres:gpu:{GPU_TYPE}:{FAKE_GPUS}", job
    assert job["Features"] == NODE_FEATURE, job
    # the step on each node sees the node's GPUs; srun stops the other node once one fails, so at
    # least one says so
    assert re.search(rf"error: node n[12] of this 2-node job needs {FAKE_GPUS} GPU\(s\) but sees 0 "
                     rf"\(CUDA_VISIBLE_DEVICES='0,1'", log), log[-3000:]
    assert "launching on node" not in log  # no node started torchrun


# ----- the profile's requests, without a cluster -----------------------------------------------
def dry_run_jobs(out: str) -> list[dict[str, str]]:
    """Each job block of `snakemake -n` output as {'rule', 'size', resource: value}."""
    jobs = []
    for block in re.split(r"\n(?=rule \w+:)", out):
        if not (m := re.match(r"rule (\w+):", block)):
            continue
        job = {"rule": m[1]}
        if w := re.search(r"wildcards: .*?\bsize=([^,\s]+)", block):
            job["size"] = w[1]
        if w := re.search(r"wildcards: .*?\bmethod=([^,\s]+)", block):
            job["method"] = w[1]
        if r := re.search(r"resources: (.*)", block):
            job.update(kv.split("=", 1) for kv in r[1].split(", "))
        jobs.append(job)
    return jobs


def test_paper_dry_run_requests_each_sizes_gpus_and_the_sites_partition(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "SBATCH_PARTITION": "cpu-part", "ICT_GPU_PARTITION": "gpu-part", "SBATCH_QOS": "high"}
    env.pop("SBATCH_ACCOUNT", None)
    # from the repository root, as the README says: `--profile slurm` is ./slurm/
    proc = subprocess.run(
        snakemake_cmd(tmp_path, "-n", "--profile", "slurm", "--configfile",
                      str(ROOT / "config" / "paper.yaml"), timeout=300),
        cwd=ROOT, env=env, capture_output=True, text=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    cfg = load_config(ROOT / "config" / "paper.yaml")
    jobs = [j for j in dry_run_jobs(out) if j["rule"] != "all"]
    assert jobs
    seen = set()
    # a GPU job's walltime is the plan's (cost.walltime_margin), another job's its rule's
    from stages.cost import planned_requests

    planned = planned_requests(cfg, None)
    # rules that ask for another rule's resources: the overlap of a trained model runs as a
    # token-statistics job, a checkpoint's evaluation as an evaluation (overlap.smk, curves.smk)
    borrowed = {"overlap": "token_stats", "evaluate_checkpoint": "evaluate"}
    for job in jobs:
        rule, size = borrowed.get(job["rule"], job["rule"]), job.get("size")
        gpus = getattr(cfg.models[size].gpus, rule) if rule in Gpus.model_fields else 0
        want = cfg.resources.of(rule, size)
        runtime = planned.get((job["rule"], size, job.get("method"))) or want.runtime
        assert int(job["gpu"]) == gpus, job
        assert (int(job["cpus_per_task"]), int(job["mem_mb"]), int(job["runtime"])) == (
            want.cpus, want.mem_mb, runtime), job
        assert not gpus or runtime < want.runtime  # the plan's, below the 24 h of the rule
        assert job["slurm_partition"] == ("gpu-part" if gpus else "cpu-part"), job
        assert job["qos"] == "high" and job["nodes"] == "1" and "tasks" not in job, job
        seen.add((rule, size, gpus))
    # rollouts: one GPU per job but for 7B's tensor parallelism; training: the paper's 4 GPUs
    for size, tp in [("qwen2.5-0.5b", 1), ("qwen2.5-1.5b", 1), ("qwen2.5-7b", 2)]:
        assert ("rollout", size, tp) in seen and ("token_stats", size, 1) in seen
    train = {size: gpus for rule, size, gpus in seen if rule == "train"}
    assert train == {"qwen2.5-0.5b": 4, "qwen2.5-1.5b": 4, "qwen2.5-7b": 4}  # METHODS §8
    assert {rule for rule, _, _ in seen} >= {"prepare_data", "base_model", "evaluate", "tables"}


def sbatch_line(job: dict[str, str]) -> str:
    """The sbatch flags snakemake-executor-plugin-slurm builds from one dry-run job's resources
    (its own get_submit_command and set_gres_string, on a stand-in for Snakemake's job object)."""
    import types

    from snakemake_executor_plugin_slurm.submit_string import get_submit_command
    from snakemake_executor_plugin_slurm.utils import set_gres_string

    class Resources(dict):
        __getattr__ = dict.__getitem__

    res = Resources({k: int(v) if v.isdigit() else v for k, v in job.items() if k not in ("rule", "size")})
    stand_in = types.SimpleNamespace(resources=res, threads=res["cpus_per_task"])
    params = {"run_uuid": "u", "slurm_logfile": "x.log", "comment_str": "c", "account": "",
              "partition": f"-p {res['slurm_partition']}", "workdir": ""}
    return get_submit_command(stand_in, params) + set_gres_string(stand_in)


def test_multi_node_training_asks_for_nodes_one_task_each_and_gres_per_node(tmp_path, test_raw):
    # (the two-node CPU job's sbatch line: the cluster tests above, from the plugin's own log)
    test_raw["models"]["tiny-s"].update(train_nodes=2, gpus={"train": 4})
    cfg = write_yaml(tmp_path / "two-nodes.yaml", test_raw)
    env = workflow_env(SBATCH_PARTITION="cpu-part", ICT_GPU_PARTITION="gpu-part")
    proc = subprocess.run(
        snakemake_cmd(tmp_path, "-n", "--profile", "slurm", "--configfile", str(cfg), timeout=300),
        cwd=ROOT, env=env, capture_output=True, text=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs = dry_run_jobs(proc.stdout + proc.stderr)
    train = [j for j in jobs if j["rule"] == "train"]
    others = [j for j in jobs if j["rule"] not in ("train", "all")]
    assert train and others and all(j["nodes"] == "1" and "mpi" not in j for j in others), others
    for job in train:
        assert (job["nodes"], job["mpi"], job["tasks"]) == ("2", "srun", "2"), job
        assert "gpu" not in job, job  # --gpus is a job total SLURM may split unevenly
        line = sbatch_line(job)
        assert " --nodes=2 --ntasks=2 --cpus-per-task=1" in line, line
        assert "--gpus" not in line and "--ntasks-per-gpu" not in line, line
        assert job["gres"] == "gpu:2" and line.endswith(" --gres=gpu:2"), line
        assert " -p gpu-part " in line, line
    print("\n" + sbatch_line(train[0]))


# ----- the config's resources section -------------------------------------------------------------
def test_size_override_changes_only_its_fields(test_raw):
    test_raw["resources"]["train"] = {"cpus": 4, "mem_mb": 8000, "runtime": 60,
                                      "sizes": {"tiny-s": {"runtime": 90}}}
    cfg = validate(test_raw, "t.yaml")
    got = cfg.resources.of("train", "tiny-s")
    assert (got.cpus, got.mem_mb, got.runtime) == (4, 8000, 90)
    assert cfg.resources.of("train", "another-size").runtime == 60
    assert cfg.resources.of("tables").cpus == 1


@pytest.mark.parametrize(
    "edit, expect",
    [
        (lambda r: r["train"].update(gpus=2), "resources.train.gpus: unknown key"),
        (lambda r: r.update(trian={}), "resources.trian: unknown key"),
        (lambda r: r["train"].update(sizes={"70b": {"runtime": 5}}),
         "resources.train.sizes.70b: unknown model size '70b'"),
        (lambda r: r["tables"].update(sizes={"tiny-s": {"runtime": 5}}), "resources.tables.sizes: unknown key"),
        (lambda r: r["rollout"].update(mem_mb=0), "resources.rollout.mem_mb:"),
    ],
)
def test_resource_mistakes_name_the_key(test_raw, edit, expect):
    edit(test_raw["resources"])
    with pytest.raises(ConfigError) as info:
        validate(test_raw, "t.yaml")
    assert f"t.yaml: {expect}" in str(info.value)


@pytest.mark.parametrize(
    "edit, expect",
    [
        (lambda r: r["train"].update(save_before_limit_minutes=10),
         "train.save_before_limit_minutes: 10 minutes before the time limit is not within the "
         "tiny-s/grpo training job's walltime (resources.train.runtime: 10 minutes)"),
        (lambda r: r["resources"]["train"].update(sizes={"tiny-s": {"runtime": 1}}),
         "train.save_before_limit_minutes: 1 minutes before the time limit is not within the "
         "tiny-s/grpo training job's walltime (resources.train.sizes.tiny-s.runtime: 1 minutes)"),
        (lambda r: r["methods"]["ict"].update(train={"save_before_limit_minutes": 30}),
         "methods.ict.train.save_before_limit_minutes: 30 minutes before the time limit is not "
         "within the tiny-s/ict training job's walltime (resources.train.runtime: 10 minutes)"),
        (lambda r: r["resources"].update(max_runtime=1),
         "train.save_before_limit_minutes: 1 minutes before the time limit is not within the "
         "tiny-s/grpo training job's walltime (resources.max_runtime: 1 minutes)"),
    ],
)
def test_the_save_signal_comes_within_the_training_jobs_walltime(test_raw, edit, expect):
    # a lead of the whole walltime would have SLURM signal each attempt at its start
    validate(test_raw, "t.yaml")  # the test config's 1 minute of 10
    edit(test_raw)
    with pytest.raises(ConfigError) as info:
        validate(test_raw, "t.yaml")
    assert f"t.yaml: {expect}" in str(info.value)
    test_raw["train"]["save_before_limit_minutes"] = None  # no signal asked: nothing to check
    test_raw["methods"]["ict"].pop("train", None)
    validate(test_raw, "t.yaml")


# ----- an offline site: the fetch where Snakemake runs, the jobs without the hub ------------------
@pytest.mark.slow
def test_after_the_fetch_the_slurm_jobs_read_the_snapshots_without_the_hub(slurm_cluster, tmp_path,
                                                                          test_raw):
    """A hub variant of the test config (tests/test_offline.py) fetched on this host, where
    Snakemake runs; then the hub is stopped and HF_ENDPOINT points at a closed port, and the jobs
    that read the hub's model and data (prepare_data, base_model, rollout) run through SLURM on the
    two nodes and finish from the snapshot store."""
    from tests.hubserver import Hub
    from tests.test_offline import DATA, MODEL, data_folder, fetch, hub_config, model_folder

    h = Hub().start()
    h.repo("model", MODEL).push(Hub.folder_files(model_folder(tmp_path / "model-src")))
    h.repo("dataset", DATA).push(Hub.folder_files(data_folder(tmp_path / "data-src")))
    cfg = hub_config(test_raw, tmp_path)
    try:
        fetched = fetch(h, tmp_path, cfg)
    finally:
        h.stop()
    assert fetched.returncode == 0, fetched.stderr
    targets = ["results/hub/rollouts/size=tiny-s/rollouts.parquet",
               "results/hub/data/dataset=arith-easy/problems.parquet"]
    env = workflow_env(SBATCH_PARTITION=PARTITION, HF_ENDPOINT="http://127.0.0.1:9")
    run = subprocess.run(
        snakemake_cmd(tmp_path, *targets, "--profile", str(ROOT / "slurm"), "--configfile", str(cfg),
                      "--retries", "0", "--slurm-keep-successful-logs", fast_polling=True),
        cwd=tmp_path, env=env, capture_output=True, text=True)
    assert run.returncode == 0, f"{run.stderr[-4000:]}\n{job_logs(tmp_path)}"
    jobs = Counter(rule for rule, _, _ in slurm_jobs(tmp_path))
    assert jobs == {"prepare_data": 2, "base_model": 1, "rollout": 1}, jobs
    prov = read_provenance(str(tmp_path / targets[0]))
    assert prov["hub"][f"model:{MODEL}"]["commit"] == h.repo("model", MODEL).branches["main"]
