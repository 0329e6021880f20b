"""The make targets pass every override through exactly as given, in both forms and mixed."""

from __future__ import annotations

import shlex
import subprocess

import pytest

from mlproject.core.constants import PROJECT_ROOT

# make command line (as a shell would read it) -> the overrides the Python command must receive
THREE = ["trainer.max_epochs=1", "seed=3", "data.batch_size=32"]
CASES = {
    'train ARGS="trainer.max_epochs=1 seed=3 data.batch_size=32"': THREE,
    "train trainer.max_epochs=1 seed=3 data.batch_size=32": THREE,
    "train tags='[a, b]' \"model.name=it's\"": ["tags=[a, b]", "model.name=it's"],
    "train +trainer.x=a=b,c ARGS='~logger \"paths.log_dir=my logs\"'": [
        "+trainer.x=a=b,c", "~logger", "paths.log_dir=my logs",
    ],
    'submit-dryrun ARGS="cluster=slurm cluster.nodes=4 cluster.gpus_per_node=8"': [
        "--dry-run", "cluster=slurm", "cluster.nodes=4", "cluster.gpus_per_node=8",
    ],
    "eval CKPT=a.ckpt data.batch_size=7": ["ckpt_path=a.ckpt", "data.batch_size=7"],
    "export CKPT=a.ckpt OUT=m.pt": ["ckpt_path=a.ckpt", "out=m.pt"],
}  # fmt: skip


def python_args(make_line: str) -> list[str]:
    """The arguments after `-m mlproject.<module>` of the command `make -n` would run."""
    out = subprocess.run(
        ["make", "-n", *shlex.split(make_line)], cwd=PROJECT_ROOT, capture_output=True, text=True, check=True
    ).stdout
    (line,) = [ln for ln in out.splitlines() if " -m mlproject." in ln]
    return shlex.split(line)[3:]


@pytest.mark.parametrize("make_line", CASES)
def test_make_passes_overrides_through(make_line):
    assert python_args(make_line) == CASES[make_line]
