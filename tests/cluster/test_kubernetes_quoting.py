"""Hostile config values in the TrainJob manifest: each stays one literal value where it goes, the structure around
it is unchanged, and nothing in it runs. A line break, which no quoting keeps inside a YAML comment, is refused in one
line naming the key."""

from __future__ import annotations

import copy
import re

import pytest
import yaml
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig

from mlproject import submit
from mlproject.cluster import kubernetes
from mlproject.core.constants import CONFIG_DIR
from mlproject.core.errors import ConfigError
from mlproject.core.topology import Topology
from tests.cluster import NO_PLAN
from tests.cluster.test_kubernetes import kubelet_expand

HOSTILE = {
    "subshell": "$(touch canary)",
    "backticks": "`touch canary`",
    "semicolon": "; touch canary",
    "quotes": 'it\'s "quoted" \\ # not a comment',
    "option": "x --qos=evil",
    "k8s-var": "$(PET_MASTER_ADDR) $$ $",
}
# in the manifest's data a line break is one more character of the value
IN_BODY = {**HOSTILE, "newline": "x\n- evil: true\ntouch canary"}
BREAK = "{}={!r} holds a line break or control character, which cannot be written into {}; remove it"


@pytest.fixture(scope="module")
def composed() -> dict[str, DictConfig]:
    """The train config under cluster=kubernetes, composed once (a second or two): tests change copies."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfgs = {"kubernetes": compose("train", ["cluster=kubernetes", "trainer=gpu"])}
    GlobalHydra.instance().clear()
    return cfgs


def trainjob(composed, value: str, overrides: list[str], task_name: str = "plain") -> tuple[str, list]:
    """The manifest's first line and its documents, with the pods' command as the kubelet runs it."""
    cfg = copy.deepcopy(composed["kubernetes"])
    cfg.task_name = task_name
    cfg.cluster.image, cfg.cluster.queue, cfg.cluster.volume_claim = value, value, value
    text = kubernetes.manifest(cfg, Topology.of(cfg).validate(), overrides, "digits-k8s")
    head, docs = text.split("\n", 1)[0], list(yaml.safe_load_all(text))
    trainer = docs[1]["spec"]["trainer"]
    env = {"PET_MASTER_ADDR": "10.0.0.1", "PET_MASTER_PORT": "29400", "MLPROJECT_RUN_ID": "digits-k8s"}
    trainer["command"] = [kubelet_expand(arg, env) for arg in trainer["command"]]
    return head, docs


def swap(obj, value: str):
    """`obj` with "plain" in each string replaced by value."""
    if isinstance(obj, dict):
        return {k: swap(v, value) for k, v in obj.items()}
    if isinstance(obj, list):
        return [swap(v, value) for v in obj]
    return obj.replace("plain", value) if isinstance(obj, str) else obj


@pytest.mark.parametrize("value", IN_BODY.values(), ids=IN_BODY.keys())
def test_trainjob_values_are_data(composed, value):
    """Parsed back, the manifest is the plain one with the value in its places, literally: in the image, the
    queue's label, the volume claim and the pods' command line after the kubelet's $(VAR) expansion."""
    overrides = [value, f"+note='{value}'"]
    head, docs = trainjob(composed, value, overrides)
    _, plain = trainjob(composed, "plain", ["plain", "+note='plain'"])
    assert docs == swap(plain, value)
    assert head.endswith("; run directory /mnt/shared/logs/plain/runs/digits-k8s")


@pytest.mark.parametrize("value", HOSTILE.values(), ids=HOSTILE.keys())
def test_trainjob_comment_holds_the_task_name_literally(composed, value):
    head, _ = trainjob(composed, "plain", [], task_name=value)
    assert head.endswith(f"; run directory /mnt/shared/logs/{value}/runs/digits-k8s")


def test_line_break_in_the_manifest_comment_is_refused_naming_the_key(composed):
    with pytest.raises(ConfigError) as refused:
        trainjob(composed, "plain", [], task_name="x\n- y")
    assert str(refused.value) == BREAK.format("task_name", "x\n- y", "the manifest's first line, a YAML comment")


@pytest.mark.parametrize(
    ("task_name", "derived"),
    [
        ("train", "train"),
        ("My Task_1", "my-task-1"),
        ("$(touch canary)", "touch-canary"),
        ("123", "run-123"),
        ("--", "run"),
        ("x" * 60, "x" * 24),
    ],
)
def test_derived_job_name_is_a_kubernetes_name(composed, task_name, derived):
    cfg = copy.deepcopy(composed["kubernetes"])
    cfg.task_name = task_name
    name = kubernetes.job_name(cfg)
    assert re.fullmatch(rf"{derived}-\d{{8}}-\d{{6}}", name) and len(name) <= kubernetes.MAX_NAME


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "cluster.job_name='digits\n'",
            "cluster.job_name='digits\\n' is not a Kubernetes name: lowercase letters, digits and '-', starting with "
            "a letter, at most 40 characters; set cluster.job_name",
        ),
        (
            "cluster.namespace=Team_A",
            "cluster.namespace='Team_A' is not a Kubernetes namespace: lowercase letters, digits and '-', starting "
            "and ending with a letter or digit, at most 63 characters",
        ),
        (
            "cluster.mount_path='/mnt/my share'",
            "cluster.mount_path='/mnt/my share' must be an absolute path of letters, digits and _ . - "
            "(e.g. /mnt/shared)",
        ),
        (
            "paths.log_dir=/mnt/shared/../etc",
            "paths.log_dir=/mnt/shared/../etc is not on the pods' shared volume; drop it (the pods write to "
            "/mnt/shared/logs) or put it under cluster.mount_path",
        ),
    ],
    ids=["job-name", "namespace", "mount-path", "log-dir-up"],
)
def test_kubernetes_names_and_paths_are_refused_in_one_line(capsys, no_sbatch, override, message):
    assert submit.main(["--dry-run", *NO_PLAN, "cluster=kubernetes", "trainer=gpu", override]) == 2
    captured = capsys.readouterr()
    assert not captured.out and captured.err == f"error: {message}.\n"


def test_folder_names_are_checked_before_submission(capsys, no_sbatch):
    """They name folders of the paths the job writes (core/rundir.py's rule, which the job applies too)."""
    key, value = "run_id", "a/b"
    assert submit.main(["--dry-run", *NO_PLAN, "cluster=kubernetes", "trainer=gpu", f"{key}={value}"]) == 2
    captured = capsys.readouterr()
    assert not captured.out and captured.err == (
        f"error: {key}={value!r} must be one folder name (letters, digits and _ . + = , @ -, no '/', '..' or "
        f"newline): it names a directory under paths.log_dir and goes into job scripts; e.g. {key}=my_run.\n"
    )
