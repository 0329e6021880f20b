"""A real SLURM cluster for the tests: munged, slurmctld and three slurmd daemons on this host.

Nodes n1 and n2 form the default partition `debug`. Node n3 belongs only to two partitions for preemption
tests: a job on `high` preempts (requeues, after a grace time) a job on `low`, and nothing else runs there.

Everything lives in a temporary directory (config, state, logs, the munge socket); every daemon is
started here and stopped here by PID. Where SLURM is missing, the fixture installs it with apt-get
if allowed (root, apt-get present, and CI=true or MLPROJECT_SLURM_INSTALL=1), else the tests skip; under
CI=true they fail instead.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers.processes import free_port

PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge"]
BINARIES = ["slurmctld", "slurmd", "sbatch", "munged"]
CPUS = 8  # per node, as SLURM counts them (config_overrides): room for every test job at once
NODES = ("n1", "n2", "n3")
LOW, HIGH = "low", "high"  # n3's partitions: a job on HIGH preempts one on LOW
GRACE_SECONDS = 90  # between SIGTERM and SIGKILL of a preempted job: time to reach a step and save


def in_ci() -> bool:
    """CI=true (or 1), as CI services set it: the one rule for installing SLURM and for failing without it."""
    return os.environ.get("CI", "").lower() in ("1", "true")


def install_reason() -> str | None:
    """None when SLURM is (now) installed, else why not."""
    if all(shutil.which(b) for b in BINARIES):
        return None
    allowed = os.environ.get("MLPROJECT_SLURM_INSTALL", "1" if in_ci() else "0") == "1"
    if not (allowed and os.geteuid() == 0 and shutil.which("apt-get")):
        return (
            "SLURM is not installed: apt-get install -y --no-install-recommends "
            + " ".join(PACKAGES)
            + " (as root, or set MLPROJECT_SLURM_INSTALL=1 to let the tests install it)"
        )
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    cmd = "apt-get update -q && apt-get install -y -q --no-install-recommends " + " ".join(PACKAGES)
    proc = subprocess.run(cmd, shell=True, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0 or not all(shutil.which(b) for b in BINARIES):
        return f"installing SLURM failed: {proc.stderr.strip()[-300:]}"
    return None


@dataclass
class Slurm:
    root: Path
    env: dict[str, str]  # the environment for the clients (sbatch, scontrol)

    @property
    def env_extra(self) -> dict[str, str]:
        """What a test adds to a child's environment so that it talks to this cluster."""
        return {"SLURM_CONF": self.env["SLURM_CONF"]}

    def cmd(self, *args: str, check: bool = True) -> str:
        proc = subprocess.run(args, env=self.env, capture_output=True, text=True, timeout=60)
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(args)} exited {proc.returncode}: {proc.stderr}")
        return proc.stdout.strip()

    def state(self, job: str) -> str:
        """PENDING, RUNNING, COMPLETED, FAILED, ... (no accounting database: from scontrol)."""
        return self.field(job, "JobState")

    def field(self, job: str, name: str) -> str:
        return self.cmd("scontrol", "show", "job", job, "-o").split(f"{name}=")[1].split()[0]

    def wait(self, job: str, timeout: float = 240, requeue_now: bool = False) -> str:
        """Wait until the job ends. A requeued job waits ~120 s (its BeginTime) unless requeue_now."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.state(job)
            if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
                return state
            if requeue_now and state == "PENDING" and self.field(job, "Reason") == "BeginTime":
                self.cmd("scontrol", "update", f"JobId={job}", "StartTime=now")
            time.sleep(0.5)
        raise AssertionError(f"job {job} still {self.state(job)} after {timeout} s")


def write_conf(root: Path) -> Path:
    nodes = "\n".join(
        f"NodeName=n{i} NodeHostname=localhost NodeAddr=127.0.0.1 Port={free_port()} CPUs={CPUS} State=UNKNOWN"
        for i in range(1, len(NODES) + 1)
    )
    conf = root / "slurm.conf"
    conf.write_text(
        f"""ClusterName=mlproject-test
SlurmctldHost=localhost
SlurmctldPort={free_port()}
SlurmUser=root
SlurmdUser=root
SlurmdParameters=config_overrides
AuthInfo=socket={root}/munge/munge.sock
StateSaveLocation={root}/ctld
SlurmdSpoolDir={root}/spool.%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
MpiDefault=none
ReturnToService=2
MailProg=/bin/true
KillWait=5
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
{nodes}
PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP
PartitionName={LOW} Nodes=n3 PriorityTier=1 GraceTime={GRACE_SECONDS} MaxTime=INFINITE State=UP
PartitionName={HIGH} Nodes=n3 PriorityTier=2 PreemptMode=OFF MaxTime=INFINITE State=UP
"""
    )
    return conf


def unavailable(reason: str) -> None:
    """Skip here, but fail under CI=true: CI must not pass without a test of requeue and multi-node."""
    if in_ci():
        pytest.fail(f"CI=true but SLURM is unavailable: {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def slurm() -> Slurm:
    reason = install_reason() or (None if os.geteuid() == 0 else "starting slurmd and munged needs root")
    if reason:
        unavailable(reason)
    # Not under pytest's tmp dir: that one is private to root, and munged runs as the munge user.
    root = Path(tempfile.mkdtemp(prefix="mlproject-slurm-"))
    root.chmod(0o755)
    conf = write_conf(root)
    env = {**os.environ, "SLURM_CONF": str(conf)}
    procs: list[subprocess.Popen] = []

    def start(*cmd: str, **kw) -> None:  # each daemon logs to its own file in root (see slurm.conf)
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, **kw))

    try:
        munge_dir = root / "munge"
        munge_dir.mkdir(mode=0o755)
        shutil.chown(munge_dir, "munge", "munge")
        start(
            "munged",
            "--foreground",
            f"--socket={munge_dir}/munge.sock",
            f"--pid-file={munge_dir}/munged.pid",
            f"--log-file={munge_dir}/munged.log",
            f"--seed-file={munge_dir}/munged.seed",
            user="munge",
            group="munge",
        )
        while not (munge_dir / "munge.sock").exists() and procs[0].poll() is None:
            time.sleep(0.1)
        start("slurmctld", "-D", "-i", "-f", str(conf))
        for node in NODES:
            start("slurmd", "-D", "-N", node, "-f", str(conf))
        cluster = Slurm(root, env)
        deadline = time.monotonic() + 60
        while set(cluster.cmd("sinfo", "-h", "-o", "%t", check=False).split() or ["none"]) != {"idle"}:
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                logs_text = "\n".join(f.read_text()[-1500:] for f in root.glob("*.log*") if f.is_file())
                unavailable(f"SLURM did not start here: {cluster.cmd('sinfo', check=False)}\n{logs_text}")
            time.sleep(0.5)
        yield cluster
    finally:
        # End the jobs first: a job step whose slurmd is gone lingers (slurmstepd, srun) after the test.
        cluster = Slurm(root, env)
        if len(procs) == 2 + len(NODES) and all(p.poll() is None for p in procs):
            for partition in ("debug", LOW, HIGH):
                cluster.cmd("scancel", f"--partition={partition}", check=False)
            deadline = time.monotonic() + 30
            while cluster.cmd("squeue", "-h", check=False) and time.monotonic() < deadline:
                time.sleep(0.5)
        for p in reversed(procs):
            p.terminate()
        for p in reversed(procs):
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(root, ignore_errors=True)
