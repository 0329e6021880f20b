"""Two Kubernetes "pods" simulated faithfully on this machine: two torchrun agents with the environment Kubeflow
Trainer's controller gives the pods of a TrainJob, running the rendered manifest's command on the digits CNN of the
distributed proofs; then SIGTERM to both and their restart.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback

from mlproject.core.constants import EXIT_SIGTERM, PROJECT_ROOT
from tests.checkpoint.helpers import assert_bitwise
from tests.cluster.test_kubernetes import kubelet_expand, render
from tests.distributed.conftest import EXACT, STEPS, assert_same_training, train_steps
from tests.helpers.processes import clean_env, free_port, kill_group, run_dirs, together

# Two CPU "pods" of one process each, the digits model of the distributed proofs (tests/distributed/conftest.py)
POD_LAYOUT = [
    "cluster.nodes=2",
    "cluster.gpus_per_node=0",
    "cluster.procs_per_node=1",
    "cluster.volume_claim=shared-logs",
    "cluster.save_seconds=60",
    "cluster.signal_check_every_n_steps=1",  # SIGTERM is acted on at the step it arrives
    "trainer=cpu",
    "strategy=ddp",
]
OUTPUT = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT}
STOP_AT = 5  # optimizer step at which each pod's worker has its agent sent SIGTERM (as the kubelet sends it)


def pod_commands(job: dict, log_dir: Path, *extra: str) -> tuple[list[list[str]], list[dict]]:
    """The `node` container of pods 0 and 1: the manifest's command, the env the controller sets (torch plugin,
    v2.3.0) and the downward API's run id, with $(VAR) expanded as the kubelet does. The image's `python` is
    this interpreter; the user's overrides follow the manifest's, as on a command line."""
    name, trainer, port = job["metadata"]["name"], job["spec"]["trainer"], str(free_port())
    envs = []
    for rank in range(trainer["numNodes"]):
        env = {e["name"]: e.get("value") for e in trainer["env"]}
        env |= {"MLPROJECT_RUN_ID": name}  # metadata.labels['jobset.sigs.k8s.io/jobset-name']: the JobSet's name
        env |= {"PET_NNODES": str(trainer["numNodes"]), "PET_NPROC_PER_NODE": str(trainer["numProcPerNode"])}
        env |= {"PET_NODE_RANK": str(rank), "PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": port}
        envs.append(clean_env(**env))
    commands = [
        [
            sys.executable,
            *(kubelet_expand(a, env) for a in trainer["command"][1:]),
            *EXACT,
            f"paths.log_dir={log_dir}",
            *extra,
        ]
        for env in envs
    ]
    return commands, envs


def run_pods(job: dict, log_dir: Path, *extra: str, timeout: int = 400) -> list[subprocess.CompletedProcess]:
    commands, envs = pod_commands(job, log_dir, *extra)
    procs = [  # a process group each, as a pod is: the agent and its workers
        subprocess.Popen(cmd, cwd=PROJECT_ROOT, env=env, text=True, start_new_session=True, **OUTPUT)
        for cmd, env in zip(commands, envs, strict=True)
    ]
    try:
        outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:  # nothing is left after a timeout or a failure
            kill_group(p.pid)
    return [subprocess.CompletedProcess(p.args, p.returncode, out) for p, out in zip(procs, outputs, strict=True)]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_pods_train_as_one_process_and_resume_bitwise_after_sigterm(tmp_path, capsys, no_sbatch):
    _, job = render(capsys, *POD_LAYOUT)
    assert "--max-restarts=0" in job["spec"]["trainer"]["command"]
    stop = [
        "+callbacks.stop._target_=tests.cluster.test_kubernetes_digits.SignalAgent",
        f"+callbacks.stop.step={STOP_AT}",
        f"+callbacks.stop.dir={tmp_path}",
    ]
    single, straight, stopped = together(
        lambda: train_steps(tmp_path / "single"),
        lambda: run_pods(job, tmp_path / "straight"),
        lambda: run_pods(job, tmp_path / "stopped", *stop),
    )
    # One run directory, named by the TrainJob, and the training of one process on the same global batch.
    assert all(p.returncode == 0 for p in straight), straight[0].stdout[-3000:] + straight[1].stdout[-3000:]
    (run_dir,) = run_dirs(tmp_path / "straight")
    assert run_dir.name == "digits-k8s"
    reference = torch.load(run_dir / "steps.pt")
    assert_same_training(reference, single, rtol=1e-5, atol=1e-5)

    # SIGTERM to both agents: every rank saved at the same step and exited 143 (torchrun itself exits 1).
    records = [json.loads((tmp_path / f"stopped{rank}.json").read_text()) for rank in range(2)]
    assert records == [{"step": STOP_AT, "code": EXIT_SIGTERM}] * 2, records
    assert [p.returncode for p in stopped] == [1, 1]  # torchrun's own exit on a signal (docs/kubernetes.md)
    ckpt = tmp_path / "stopped" / "train" / "runs" / "digits-k8s" / "checkpoints" / "last.ckpt"
    assert torch.load(ckpt, map_location="cpu", weights_only=False)["global_step"] == STOP_AT

    # The restarted pods (same command and environment) resume from last.ckpt and end bitwise as the straight run.
    resumed = run_pods(job, tmp_path / "stopped")
    assert all(p.returncode == 0 for p in resumed), resumed[0].stdout[-3000:] + resumed[1].stdout[-3000:]
    assert "Restored all states from the checkpoint" in resumed[0].stdout + resumed[1].stdout
    after = torch.load(ckpt.parent.parent / "steps.pt")
    assert len(after["losses"]) == STEPS - STOP_AT
    assert after["losses"] == reference["losses"][STOP_AT:]
    assert_bitwise(after["state"], reference["state"])


class SignalAgent(Callback):
    """At the end of optimizer step `step`, send SIGTERM to this rank's torchrun agent (the pod's main process, where
    the kubelet sends it) and give it time to forward it; on the way out, write the step and this rank's exit code
    (<dir>/stopped<rank>.json)."""

    def __init__(self, dir: str, step: int):
        self.dir, self.step = Path(dir), step

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getppid(), signal.SIGTERM)
            time.sleep(3)  # the agent forwards it to this process, so Signals acts at this very step

    def on_exception(self, trainer, pl_module, exception) -> None:
        record = {"step": trainer.global_step, "code": getattr(exception, "code", None)}
        (self.dir / f"stopped{trainer.global_rank}.json").write_text(json.dumps(record))
