"""SLURM end to end on a real (one-host, three-node) cluster: submit, multi-node, sweep, the time-limit
warning (SIGUSR1) and real preemption (SIGTERM from a higher-priority job; conftest.py's partitions).

The jobs of all tests are started together by one fixture (the cluster has room for all of them), so the
module costs about the time of its slowest job rather than the sum; each test then checks its own job.
All runs use one config, so one local 2-process run is the reference for every job's numbers.
"""

from __future__ import annotations

import re
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from mlproject.cluster.slurm import RENDEZVOUS
from mlproject.core.constants import PROJECT_ROOT
from tests.cluster.conftest import CPUS, HIGH, LOW
from tests.helpers.processes import PYTHON, clean_env, read_metrics, run, run_dirs

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # all jobs start in the first test's setup

# One training step per epoch and no dropout: a job preempted after any step resumes at an epoch boundary,
# so the resumed run is the uninterrupted one step for step (mid-epoch data position is the ckpt issue's).
# monitor=null keeps every epoch's checkpoint, so last.ckpt holds the final weights (Lightning 2.6 rewrites
# last.ckpt only when it saves a top-k checkpoint, i.e. when val/acc improves).
BASE = [
    "extras.print_config=false",
    "trainer=cpu",
    "strategy=ddp",
    "model.net.dropout=0",
    "trainer.max_epochs=12",
    "trainer.limit_train_batches=1",
    "trainer.limit_val_batches=1",
    "trainer.limit_test_batches=1",
    "callbacks.model_checkpoint.monitor=null",
]
CPU_NODE = ["cluster.gpus_per_node=0", "cluster.cpus_per_task=1", "cluster.time_min=10"]


def submit(slurm, log_dir: Path, *overrides: str) -> str:
    cmd = [PYTHON, "-m", "mlproject.submit", f"paths.log_dir={log_dir}", *BASE, *CPU_NODE, *overrides]
    proc = subprocess.run(cmd, cwd=PROJECT_ROOT, env=clean_env(**slurm.env_extra), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split()[3]  # "submitted SLURM job <id>"


def catches(pid: str, signum: int) -> bool:
    """Whether the process has a handler for `signum`: SIGUSR1's is the Requeue callback's, SIGTERM's the
    one Lightning registers for it; both are set when training starts."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = int(status.split("SigCgt:")[1].split()[0], 16)
    return bool(caught & (1 << (signum - 1)))


def wait_until_training(slurm, job: str) -> None:
    """Until both tasks handle SIGUSR1 and SIGTERM (the "nodes" run on this host, so their PIDs are visible)."""
    deadline = time.monotonic() + 200
    while True:
        state = slurm.state(job)
        assert time.monotonic() < deadline and state in ("PENDING", "RUNNING"), state
        if state == "RUNNING":
            node = slurm.field(job, "BatchHost")  # listpids asks one slurmd: the one running the tasks
            rows = [r.split() for r in slurm.cmd("scontrol", "listpids", job, node, check=False).splitlines()[1:]]
            tasks = [row[0] for row in rows if row[2] == "0"]  # step 0: the srun tasks
            if sum(catches(pid, signal.SIGUSR1) and catches(pid, signal.SIGTERM) for pid in tasks) == 2:
                return
        time.sleep(0.1)


def wait_requeued_and_done(slurm, job: str) -> str:
    """Until SLURM has requeued the job (Restarts=1) it shows its first run's end state (FAILED) while that
    run's step winds down (seconds on a loaded machine): waiting on that state would stop too early. The
    requeued job starts at once instead of after its ~120 s BeginTime."""
    deadline = time.monotonic() + 120
    while slurm.field(job, "Restarts") == "0" and time.monotonic() < deadline:
        time.sleep(0.2)
    return slurm.wait(job, requeue_now=True)


def warn_of_time_limit(slurm, job: str) -> str:
    """Signal the job as SLURM does `cluster.signal_seconds` before its time limit."""
    wait_until_training(slurm, job)
    slurm.cmd("scancel", "--signal=USR1", job)
    return wait_requeued_and_done(slurm, job)


def preempt(slurm, job: str) -> tuple[str, str]:
    """Submit a job that needs all of the training job's node to the higher-priority partition: SLURM
    preempts the training job (SIGTERM, then the grace time). Returns both jobs' end states."""
    wait_until_training(slurm, job)
    wrap = ["--wrap", "sleep 1"]
    high = slurm.cmd(
        "sbatch", "--parsable", f"--partition={HIGH}", f"--cpus-per-task={CPUS}", "--output=/dev/null", *wrap
    )
    return wait_requeued_and_done(slurm, job), slurm.wait(high)


# Training held after its first step until the signal arrives (a window of a few seconds was missed under load),
# every step checked for signals: the signal is honoured at the next step
HELD = ["+callbacks.hold._target_=tests.helpers.callbacks.UntilSignalled", "cluster.signal_check_every_n_steps=1"]


def final_state(run_dir: Path) -> dict[str, torch.Tensor]:
    ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert ckpt["global_step"] == 12, ckpt["global_step"]  # max_epochs x one step: the end of training
    return ckpt["state_dict"]


@pytest.fixture(scope="module")
def jobs(slurm, tmp_path_factory):
    names = ("local", "one_node", "two_nodes", "time_limit", "preempted", "sweep")
    logs = {k: tmp_path_factory.mktemp(k) for k in names}
    sweep = [
        "--multirun",
        f"paths.log_dir={logs['sweep']}",
        "cluster=slurm",
        "hydra/launcher=slurm",
        *BASE,
        *CPU_NODE,
        "cluster.tasks_per_node=1",  # DDP in a job is tested above; one process per trial saves CPU
        "model.optimizer.lr=0.01,0.02",
    ]
    with ThreadPoolExecutor(4) as pool:
        local = pool.submit(run, "train", *BASE, "trainer.devices=2", log_dir=logs["local"])
        sweeping = pool.submit(
            subprocess.run,
            [PYTHON, "-m", "mlproject.train", *sweep],
            cwd=PROJECT_ROOT,
            env=clean_env(**slurm.env_extra),
            capture_output=True,
            text=True,
            timeout=300,
        )
        ids = {
            "one_node": submit(slurm, logs["one_node"], "cluster.tasks_per_node=2"),
            "two_nodes": submit(slurm, logs["two_nodes"], "cluster.nodes=2", "cluster.tasks_per_node=1"),
            "time_limit": submit(slurm, logs["time_limit"], "cluster.tasks_per_node=2", *HELD),
            # alone on its node (conftest.py): the higher-priority job preempts this one only
            "preempted": submit(
                slurm, logs["preempted"], "cluster.tasks_per_node=2", f"cluster.partition={LOW}", *HELD
            ),
        }
        warned = pool.submit(warn_of_time_limit, slurm, ids["time_limit"])
        preempted = pool.submit(preempt, slurm, ids["preempted"])
        states = {k: slurm.wait(j) for k, j in ids.items() if k not in ("time_limit", "preempted")}
        states["time_limit"] = warned.result()
        states["preempted"], states["preemptor"] = preempted.result()
        local.result()
        sweep_proc = sweeping.result()
    (reference,) = run_dirs(logs["local"])
    return {"logs": logs, "ids": ids, "states": states, "reference": reference, "sweep": sweep_proc}


def slurm_log(jobs, key: str) -> str:
    return (jobs["logs"][key] / "train" / "slurm" / f"{jobs['ids'][key]}.out").read_text()


def test_one_node_two_tasks_matches_local_ddp(jobs):
    assert jobs["states"]["one_node"] == "COMPLETED", slurm_log(jobs, "one_node")[-3000:]
    (run_dir,) = run_dirs(jobs["logs"]["one_node"])  # one directory for both tasks, named by the job id
    assert run_dir.name == jobs["ids"]["one_node"]
    assert "2 data-parallel rank(s)" in slurm_log(jobs, "one_node")
    ours, reference = read_metrics(run_dir), read_metrics(jobs["reference"])
    assert ours.keys() == reference.keys()
    for key, value in reference.items():
        assert ours[key] == pytest.approx(value, rel=1e-6, abs=1e-7), key


def test_two_nodes_one_task_each(jobs):
    log = slurm_log(jobs, "two_nodes")
    assert jobs["states"]["two_nodes"] == "COMPLETED", log[-3000:]
    assert "GLOBAL_RANK: 1, MEMBER: 2/2" in log and "2 data-parallel rank(s)" in log  # world size 2, one rank per node
    (run_dir,) = run_dirs(jobs["logs"]["two_nodes"])
    assert read_metrics(run_dir)["test/loss"] == pytest.approx(read_metrics(jobs["reference"])["test/loss"], rel=1e-6)


def test_sweep_one_job_per_trial(jobs):
    assert jobs["sweep"].returncode == 0, jobs["sweep"].stdout[-3000:] + jobs["sweep"].stderr[-3000:]
    (sweep,) = (jobs["logs"]["sweep"] / "train" / "multiruns").iterdir()
    trials = sorted(p for p in sweep.iterdir() if p.name.isdigit())
    assert [t.name for t in trials] == ["0", "1"]
    # submitit submits a job array; each array task (<array id>_<n>) is its own SLURM job, one per trial
    array_tasks = sorted(p.name for p in (sweep / ".submitit").iterdir() if re.fullmatch(r"\d+_\d+", p.name))
    assert [t.split("_")[1] for t in array_tasks] == ["0", "1"], array_tasks
    # The launcher's sbatch header comes from the cluster config, and asks for our signal, not submitit's.
    (script,) = {p.read_text() for p in (sweep / ".submitit").rglob("*_submission.sh")}
    expected = ["--nodes=1", "--ntasks-per-node=1", "--cpus-per-task=1", "--time=10", "--signal=USR1@120", "--requeue"]
    for line in expected:
        assert f"#SBATCH {line}\n" in script, line
    lrs = set()
    for trial in trials:
        assert read_metrics(trial)["test/samples"] == 64  # limit_test_batches=1 of 64
        lrs.add((trial / ".hydra" / "overrides.yaml").read_text().split("model.optimizer.lr=")[1].split()[0])
    assert lrs == {"0.01", "0.02"}


def assert_resumed_in_its_run_directory(jobs, slurm, key: str, signal_name: str) -> None:
    job = jobs["ids"][key]
    log = slurm_log(jobs, key)
    assert jobs["states"][key] == "COMPLETED", log[-3000:]
    assert slurm.field(job, "Restarts") == "1"
    assert re.search(rf"signal {signal_name}: saved \S+/last.ckpt at step \d+", log), log[-3000:]
    assert f"requeued SLURM job {job}" in log and "Restoring states from the checkpoint path" in log
    (run_dir,) = run_dirs(jobs["logs"][key])
    assert run_dir.name == job
    # Same steps on the same data from the same state: equal up to float summation order (gloo's
    # all-reduce of two ranks is deterministic, so in practice this holds bitwise).
    ours, reference = final_state(run_dir), final_state(jobs["reference"])
    assert ours.keys() == reference.keys()
    for key in reference:
        torch.testing.assert_close(ours[key], reference[key], rtol=1e-6, atol=1e-7, msg=key)


def test_launcher_rendezvous_is_submits():
    text = (PROJECT_ROOT / "configs" / "hydra" / "launcher" / "slurm.yaml").read_text()
    assert all(line in text for line in RENDEZVOUS)


def test_time_limit_warning_requeues_and_resumes_in_its_run_directory(jobs, slurm):
    assert_resumed_in_its_run_directory(jobs, slurm, "time_limit", "SIGUSR1")


def test_preempted_job_saves_requeues_and_ends_as_an_uninterrupted_run(jobs, slurm):
    assert jobs["states"]["preemptor"] == "COMPLETED"
    assert_resumed_in_its_run_directory(jobs, slurm, "preempted", "SIGTERM")
