"""Hostile config values in the sbatch script: each stays one literal value where it goes, the structure around it
is unchanged, and nothing in it runs. A line break, which no quoting keeps inside an #SBATCH line, is refused in one
line naming the key."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, OmegaConf

from mlproject import submit
from mlproject.cluster.slurm import sbatch_script
from mlproject.core.constants import CONFIG_DIR
from mlproject.core.errors import ConfigError
from mlproject.core.topology import Topology
from tests.cluster import NO_PLAN

HOSTILE = {
    "subshell": "$(touch canary)",
    "backticks": "`touch canary`",
    "semicolon": "; touch canary",
    "quotes": 'it\'s "quoted" \\ # not a comment',
    "option": "x --qos=evil",
    "dollars": "$HOME $$ $",
}
# in the script's body a line break is one more character of the value
IN_BODY = {**HOSTILE, "newline": "x\n#SBATCH --partition=evil\ntouch canary"}
SBATCH_KEYS = ("task_name", "cluster.partition", "cluster.account", "cluster.qos", "cluster.constraint")
BREAK = "{}={!r} holds a line break or control character, which cannot be written into {}; remove it"


@pytest.fixture(scope="module")
def composed() -> dict[str, DictConfig]:
    """The train config under cluster=slurm, composed once (a second or two): tests change copies."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfgs = {"slurm": compose("train", ["cluster=slurm", "trainer=gpu"])}
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
    assert submit.main(["--dry-run", *NO_PLAN, "trainer=gpu", "cluster.partition='gpu\n#SBATCH --qos=evil'"]) == 2
    captured = capsys.readouterr()
    assert not captured.out
    message = BREAK.format("cluster.partition", "gpu\n#SBATCH --qos=evil", "an #SBATCH line")
    assert captured.err == f"error: {message}.\n"


def test_folder_names_are_checked_before_submission(capsys, no_sbatch):
    """They name folders of the paths the job writes (core/rundir.py's rule, which the job applies too)."""
    key, value = "task_name", "../../x"
    assert submit.main(["--dry-run", *NO_PLAN, "cluster=slurm", "trainer=gpu", f"{key}={value}"]) == 2
    captured = capsys.readouterr()
    assert not captured.out and captured.err == (
        f"error: {key}={value!r} must be one folder name (letters, digits and _ . + = , @ -, no '/', '..' or "
        f"newline): it names a directory under paths.log_dir and goes into job scripts; e.g. {key}=my_run.\n"
    )
