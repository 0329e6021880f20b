"""Hostile config values in the sbatch script and the TrainJob manifest: each stays one literal value where it goes,
the structure around it is unchanged, and nothing in it runs. A line break, which no quoting keeps inside an
#SBATCH line or a YAML comment, is refused in one line naming the key."""

from __future__ import annotations

import copy
import re
import subprocess
import sys

import pytest
import yaml
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, OmegaConf

from mlproject import submit
from mlproject.cluster import kubernetes
from mlproject.cluster.slurm import sbatch_script
from mlproject.core.constants import CONFIG_DIR
from mlproject.core.errors import ConfigError
from mlproject.core.topology import Topology
from tests.cluster.test_kubernetes import kubelet_expand

HOSTILE = {
    "subshell": "$(touch canary)",
    "backticks": "`touch canary`",
    "semicolon": "; touch canary",
    "quotes": 'it\'s "quoted" \\ # not a comment',
    "option": "x --qos=evil",
    "k8s-var": "$(PET_MASTER_ADDR) $$ $",
}
# in the script's body and the manifest's data a line break is one more character of the value
IN_BODY = {**HOSTILE, "newline": "x\n#SBATCH --partition=evil\ntouch canary"}
SBATCH_KEYS = ("task_name", "cluster.partition", "cluster.account", "cluster.qos", "cluster.constraint")
BREAK = "{}={!r} holds a line break or control character, which cannot be written into {}; remove it"


@pytest.fixture(scope="module")
def composed() -> dict[str, DictConfig]:
    """The train config under each cluster, composed once (a second or two each): tests change copies."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfgs = {c: compose("train", [f"cluster={c}", "trainer=gpu"]) for c in ("slurm", "kubernetes")}
    GlobalHydra.instance().clear()
    return cfgs


def sbatch_arguments(script: str) -> list[str]:
    """The options sbatch reads from a script, as src/sbatch/opt.c does (_opt_batch_script, _get_argument): the
    #SBATCH lines before the first command; in each, blanks split arguments, quotes group, a backslash escapes the
    next character (in quotes too), an unquoted '#' ends the line."""
    args = []
    for line in script.split("\n"):
        if not line.startswith("#SBATCH"):
            if line.strip()[:1] not in ("", "#"):
                break  # the first command: no directive after it counts
            continue
        rest, i = line.removeprefix("#SBATCH"), 0
        while True:
            while i < len(rest) and rest[i].isspace():
                i += 1
            arg, quote = "", ""
            while i < len(rest) and (quote or not rest[i].isspace()):
                ch, i = rest[i], i + 1
                if ch == "\\":
                    arg, i = arg + rest[i : i + 1], i + 1
                elif quote and ch == quote:
                    quote = ""
                elif not quote and ch in "\"'":
                    quote = ch
                elif not quote and ch == "#":
                    i = len(rest)
                    break
                else:
                    arg += ch
            assert not quote, f"sbatch: unmatched {quote} in {line!r}"
            if not arg:
                break
            args.append(arg)
    return args


def slurm_job(composed, value: str, overrides: list[str]) -> str:
    cfg = copy.deepcopy(composed["slurm"])
    for key in SBATCH_KEYS:
        OmegaConf.update(cfg, key, value)
    cfg.cluster.extra_sbatch = [value]
    topology = Topology.of(cfg).validate()
    return sbatch_script(cfg, topology, overrides, workdir=f"/work/{value}", output=f"/logs/{value}/%j.out")


@pytest.mark.parametrize("value", HOSTILE.values(), ids=HOSTILE.keys())
def test_sbatch_directives_keep_their_structure(composed, tmp_path, value):
    """Every #SBATCH value is one argument, read back literally; the options are those of a plain value."""
    plain = sbatch_arguments(slurm_job(composed, "plain", []))
    script = slurm_job(composed, value, [])
    assert sbatch_arguments(script) == [arg.replace("plain", value) for arg in plain]


@pytest.mark.parametrize("value", IN_BODY.values(), ids=IN_BODY.keys())
def test_sbatch_body_passes_overrides_literally(composed, tmp_path, value):
    """bash parses the script, and runs it (scontrol and srun stand-ins) with each override one literal argument
    of srun; no directive is added and nothing else runs."""
    overrides = [value, f"task_name={value}", f"+note='{value}'"]
    script = slurm_job(composed, "plain", overrides)
    assert sbatch_arguments(script) == sbatch_arguments(slurm_job(composed, "plain", []))
    (tmp_path / "job.sh").write_text(script)
    assert subprocess.run(["bash", "-n", "job.sh"], cwd=tmp_path).returncode == 0
    stand_ins = 'scontrol() { :; }; srun() { printf "%s\\0" "$@"; }; . ./job.sh'
    proc = subprocess.run(["bash", "-c", stand_ins], cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    python = sys.executable
    train = ["--kill-on-bad-exit=1", "--cpus-per-task=8", python, "-m", "mlproject.train", *overrides, "ckpt_path=auto"]
    assert proc.stdout.split("\0")[:-1] == train
    assert not (tmp_path / "canary").exists()


@pytest.mark.parametrize("key", [*SBATCH_KEYS, "cluster.extra_sbatch", "the current directory"])
def test_line_break_in_a_directive_is_refused_naming_the_key(composed, key):
    cfg = copy.deepcopy(composed["slurm"])
    value, workdir = "gpu\n#SBATCH --qos=evil", "/work"
    if key == "the current directory":
        workdir = value
    elif key == "cluster.extra_sbatch":
        cfg.cluster.extra_sbatch, key = ["--exclusive", value], "cluster.extra_sbatch[1]"
    else:
        OmegaConf.update(cfg, key, value)
    with pytest.raises(ConfigError) as refused:
        sbatch_script(cfg, Topology.of(cfg).validate(), [], workdir=workdir, output="/logs/%j.out")
    assert str(refused.value) == BREAK.format(key, value, "an #SBATCH line")


def test_submit_refuses_a_line_break_in_one_line(capsys, no_sbatch):
    assert submit.main(["--dry-run", "--no-plan", "trainer=gpu", "cluster.partition='gpu\n#SBATCH --qos=evil'"]) == 2
    captured = capsys.readouterr()
    assert not captured.out
    message = BREAK.format("cluster.partition", "gpu\n#SBATCH --qos=evil", "an #SBATCH line")
    assert captured.err == f"error: {message}.\n"


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
    assert submit.main(["--dry-run", "--no-plan", "cluster=kubernetes", "trainer=gpu", override]) == 2
    captured = capsys.readouterr()
    assert not captured.out and captured.err == f"error: {message}.\n"


@pytest.mark.parametrize(
    ("cluster", "key", "value"), [("slurm", "task_name", "../../x"), ("kubernetes", "run_id", "a/b")]
)
def test_folder_names_are_checked_before_submission(capsys, no_sbatch, cluster, key, value):
    """They name folders of the paths the job writes (core/rundir.py's rule, which the job applies too)."""
    assert submit.main(["--dry-run", "--no-plan", f"cluster={cluster}", "trainer=gpu", f"{key}={value}"]) == 2
    captured = capsys.readouterr()
    assert not captured.out and captured.err == (
        f"error: {key}={value!r} must be one folder name (letters, digits and _ . + = , @ -, no '/', '..' or "
        f"newline): it names a directory under paths.log_dir and goes into job scripts; e.g. {key}=my_run.\n"
    )
