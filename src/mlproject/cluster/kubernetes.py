"""The Kubeflow Trainer (v2) manifest of a training job, written from the composed config, and the checks before
submission.

Two documents: a TrainingRuntime (the torch-distributed ClusterTrainingRuntime's shape, plus what a TrainJob cannot
set in Trainer v2.3: the JobSet's failure policy, the pods' grace period, the shared volume) and the TrainJob that
uses it. The controller's torch plugin sets PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK, PET_MASTER_ADDR and
PET_MASTER_PORT in the `node` container; torchrun reads the PET_* variables as its flags, and here rendezvous with
c10d at the master's address, which `--max-restarts` needs (distributed/launch.py). The run id is the TrainJob's
name, read by the downward API from the label JobSet puts on every pod, so all pods and every restart of the job
share one run directory on the volume, and `ckpt_path=auto` resumes it.
"""

from __future__ import annotations

import os
import re
from datetime import datetime

import yaml
from omegaconf import DictConfig

from mlproject.cluster.jobs import Job, check_allocation, given_run_id, single_line
from mlproject.core.errors import ConfigError
from mlproject.core.ranges import check_ranges
from mlproject.core.topology import Topology

API = "trainer.kubeflow.org/v1alpha1"
NODE = "node"  # the runtime's replicated job and container: where the torch plugin injects the PET_* variables
ANCESTOR = {"trainer.kubeflow.org/trainjob-ancestor-step": "trainer"}  # marks that job as the trainer's
JOBSET_NAME = "jobset.sigs.k8s.io/jobset-name"  # a label of every pod: the JobSet's name, which is the TrainJob's
MARGIN_SECONDS = 30  # beyond cluster.save_seconds: torchrun forwards SIGTERM, the processes exit
NAME = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")  # the TrainJob CRD's rule (RFC 1035 label)
MAX_NAME = 40  # pod hostnames <name>-node-<i>-0 and the names Kubernetes derives from them stay within 63
NAMESPACE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")  # a DNS-1123 label
MOUNT = re.compile(r"(/[\w.-]+)+")  # an absolute path that is also a Hydra override's plain value
WHOLE = {  # key: least value
    "nodes": 1,
    "gpus_per_node": 0,
    "procs_per_node": 1,
    "cpus_per_node": 1,
    "mem_gb": 1,
    "save_seconds": 1,
    "max_restarts": 0,
    "worker_restarts": 0,
}


def check_job_size(cfg: DictConfig) -> None:
    """With cluster=kubernetes, the Trainer must ask for exactly what the pods are given."""
    check_allocation(cfg, "kubernetes", "procs_per_node", WHOLE, "torchrun starts")


def check_in_job(cfg: DictConfig) -> None:
    """Inside a pod (preflight): the processes are torchrun's, else the other nodes' ranks never come."""
    if (cfg.get("cluster") or {}).get("scheduler") == "kubernetes" and "TORCHELASTIC_RUN_ID" not in os.environ:
        raise ConfigError(
            "cluster=kubernetes runs under torchrun in the pods of a TrainJob; submit it with "
            "`python -m mlproject.submit cluster=kubernetes ...` (or drop cluster=kubernetes to run here)"
        )
    check_job_size(cfg)


def job_name(cfg: DictConfig) -> str:
    """cluster.job_name, checked; else one derived from task_name, <task>-<date>-<time> (one new run per
    submission), where <task> is task_name in lowercase, each run of other characters than letters and digits a
    '-', shortened to fit."""
    if not cfg.cluster.job_name:
        stamp = f"{datetime.now():%Y%m%d-%H%M%S}"
        task = re.sub(r"[^a-z0-9]+", "-", str(cfg.task_name).lower()).strip("-")
        task = task if task[:1].isalpha() else f"run-{task}"  # a name starts with a letter
        return f"{task[: MAX_NAME - len(stamp) - 1].rstrip('-')}-{stamp}"
    name = str(cfg.cluster.job_name)
    if not NAME.fullmatch(name) or len(name) > MAX_NAME:
        raise ConfigError(
            f"cluster.job_name={name!r} is not a Kubernetes name: lowercase letters, digits and '-', starting "
            f"with a letter, at most {MAX_NAME} characters; set cluster.job_name"
        )
    return name


def log_dir(cfg: DictConfig, overrides: list[str]) -> str:
    """Where the pods write: <mount_path>/logs, or the paths.log_dir given, which must be on the volume."""
    c = cfg.cluster
    given = next((o.split("=", 1)[1] for o in overrides if o.startswith("paths.log_dir=")), None)
    mount = c.mount_path.rstrip("/")
    if not MOUNT.fullmatch(mount) or ".." in mount.split("/"):
        raise ConfigError(
            f"cluster.mount_path={c.mount_path!r} must be an absolute path of letters, digits and _ . - "
            "(e.g. /mnt/shared)"
        )
    if given is not None and (not given.startswith(mount + "/") or ".." in given.split("/")):
        raise ConfigError(
            f"paths.log_dir={given} is not on the pods' shared volume; drop it (the pods write to {mount}/logs) "
            "or put it under cluster.mount_path"
        )
    if c.nodes > 1 and not c.volume_claim:
        raise ConfigError(
            f"cluster.nodes={c.nodes} needs one run directory that every pod sees; set cluster.volume_claim to a "
            "ReadWriteMany PersistentVolumeClaim (docs/kubernetes.md)"
        )
    return given or f"{mount}/logs"


def run_dir(cfg: DictConfig, overrides: list[str], name: str) -> str:
    """Where the pods' run writes, <log_dir>/<task_name>/runs/<run_id>: the run id is the TrainJob's name unless
    run_id is set (in the config or an override), which every pod then composes alike."""
    return f"{log_dir(cfg, overrides)}/{cfg.task_name}/runs/{given_run_id(cfg) or name}"


def check_namespace(cfg: DictConfig) -> str:
    ns = str(cfg.cluster.namespace)
    if not NAMESPACE.fullmatch(ns):
        raise ConfigError(
            f"cluster.namespace={ns!r} is not a Kubernetes namespace: lowercase letters, digits and '-', starting "
            "and ending with a letter or digit, at most 63 characters"
        )
    return ns


def check_before_submit(cfg: DictConfig, overrides: list[str]) -> Topology:
    """What preflight would refuse in the pods, minus what only the nodes can tell (their GPUs); the job's name
    and where it writes."""
    check_ranges(cfg)
    check_job_size(cfg)
    check_namespace(cfg)
    job_name(cfg)
    log_dir(cfg, overrides)
    return Topology.of(cfg).validate()


def container_arg(arg: str) -> str:
    """`arg` as a container's command argument that reaches the process as written: Kubernetes expands $(VAR) in
    command and args, and reads $$ as a literal $."""
    return arg.replace("$", "$$")


def job(cfg: DictConfig, topology: Topology, overrides: list[str]) -> Job:
    """The manifest, for `kubectl apply -f -`."""
    name, ns = job_name(cfg), check_namespace(cfg)

    def submitted(stdout: str) -> str:
        return (
            f"applied TrainJob {name} in namespace {ns} with `kubectl apply -f -`:\n{stdout.rstrip()}\n"
            f"  watch: kubectl get trainjob {name} -n {ns} -w\n"
            f"  logs:  kubectl logs -n {ns} -f -l {JOBSET_NAME}={name}\n"
            f"  run directory: {run_dir(cfg, overrides, name)} (on the shared volume)"
        )

    return Job(manifest(cfg, topology, overrides, name), "manifest", ["kubectl", "apply", "-f", "-"], submitted)


def manifest(cfg: DictConfig, topology: Topology, overrides: list[str], name: str) -> str:
    """The TrainingRuntime and the TrainJob, as one YAML stream for `kubectl apply -f -`: values are data for the
    YAML dumper, and reach the pods' command line as written ($ escaped); only the first line, a comment, is text."""
    c, meta = cfg.cluster, {"name": name, "namespace": check_namespace(cfg)}
    grace = c.save_seconds + MARGIN_SECONDS
    logs = log_dir(cfg, overrides)
    train_overrides = [*(o for o in overrides if not o.startswith("paths.log_dir=")), f"paths.log_dir={logs}"]
    if not any(o.startswith("ckpt_path=") for o in overrides):
        train_overrides.append("ckpt_path=auto")
    command = [
        "python",
        "-m",
        "torch.distributed.run",  # torchrun; PET_NNODES and PET_NPROC_PER_NODE are its --nnodes, --nproc-per-node
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=$(PET_MASTER_ADDR):$(PET_MASTER_PORT)",  # Kubernetes expands $(VAR) from the env
        "--rdzv-id=$(MLPROJECT_RUN_ID)",
        f"--max-restarts={c.worker_restarts}",
        f"--shutdown-timeout={c.save_seconds}",  # after SIGTERM, before torchrun kills its processes
        "-m",
        "mlproject.train",
        *map(container_arg, train_overrides),
    ]
    env = [
        {"name": "MLPROJECT_RUN_ID", "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{JOBSET_NAME}']"}}},
        {"name": "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "value": "1"},  # a fresh store per torchrun restart
        {"name": "PYTHONUNBUFFERED", "value": "1"},  # `kubectl logs` as it happens
    ]
    resources = {"cpu": str(c.cpus_per_node), "memory": f"{c.mem_gb}Gi"}
    if c.gpus_per_node:
        resources["nvidia.com/gpu"] = str(c.gpus_per_node)
    shared = {"persistentVolumeClaim": {"claimName": c.volume_claim}} if c.volume_claim else {"emptyDir": {}}
    pod = {
        "restartPolicy": "Never",  # a failed pod fails its job, and the failure policy restarts all of them
        "terminationGracePeriodSeconds": grace,
        "containers": [
            {
                "name": NODE,
                "image": c.image,
                "volumeMounts": [
                    {"name": "shared", "mountPath": c.mount_path},
                    {"name": "dshm", "mountPath": "/dev/shm"},
                ],
            }
        ],
        "volumes": [
            {"name": "shared", **shared},
            {"name": "dshm", "emptyDir": {"medium": "Memory"}},  # dataloader workers' shared memory (64 MiB by default)
        ],
    }
    runtime = {
        "apiVersion": API,
        "kind": "TrainingRuntime",
        "metadata": {**meta, "labels": {"trainer.kubeflow.org/framework": "torch"}},
        "spec": {
            "mlPolicy": {"numNodes": c.nodes, "torch": {}},
            "template": {
                "spec": {
                    "failurePolicy": {"maxRestarts": c.max_restarts},
                    "replicatedJobs": [
                        {
                            "name": NODE,
                            "template": {
                                "metadata": {"labels": ANCESTOR},
                                "spec": {"backoffLimit": 0, "template": {"spec": pod}},
                            },
                        }
                    ],
                }
            },
        },
    }
    job = {
        "apiVersion": API,
        "kind": "TrainJob",
        "metadata": {**meta, **({"labels": {"kueue.x-k8s.io/queue-name": c.queue}} if c.queue else {})},
        "spec": {
            "runtimeRef": {"name": name, "kind": "TrainingRuntime", "apiGroup": "trainer.kubeflow.org"},
            "trainer": {
                "image": c.image,
                "command": command,
                "env": env,
                "numNodes": c.nodes,
                "numProcPerNode": c.procs_per_node,
                "resourcesPerNode": {"requests": resources, "limits": dict(resources)},  # two dicts: no YAML anchor
            },
        },
    }
    for key, value in (("paths.log_dir", logs), ("task_name", cfg.task_name), ("run_id", given_run_id(cfg) or "")):
        single_line(key, value, "the manifest's first line, a YAML comment")
    t = cfg.trainer
    head = (
        f"# trainer.num_nodes={t.num_nodes} trainer.devices={t.devices}: {topology.world_size} processes; "
        f"run directory {run_dir(cfg, overrides, name)}\n"
    )
    return head + yaml.safe_dump_all([runtime, job], sort_keys=False, width=120)
