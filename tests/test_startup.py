"""Start-up costs what it must (issue 40): optional libraries are imported where used, and the checks that cost a
compose or a model build run once, on rank 0, where its refusal ends the job."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mlproject.preflight import checked_by_rank_0
from tests.helpers.processes import clean_env

ROOT = Path(__file__).resolve().parents[1]

OPTIONAL = ("deepspeed", "optuna", "mlflow", "wandb", "submitit")


def imported_by(module: str, *args: str, cwd) -> list[str]:
    """The optional libraries in sys.modules when `python -m module args` ends (atexit: also after sys.exit), in a
    cold interpreter: the suite's warm one (processes.PYTHON) has them imported already."""
    code = (
        "import atexit, json, runpy, sys; "
        f"atexit.register(lambda: print('IMPORTED', json.dumps([m for m in {OPTIONAL} if m in sys.modules]))); "
        f"sys.argv = ['{module}', *sys.argv[1:]]; runpy.run_module('{module}', run_name='__main__')"
    )
    proc = subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, env=clean_env(), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("IMPORTED")]
    return json.loads(line.removeprefix("IMPORTED "))


# feature: slurm, kubernetes
def test_submit_imports_no_optional_library():
    # a dry run writes nothing
    args = (
        "--dry-run",
        "trainer=gpu",
        # feature: planner
        "cluster.gpu_memory_gb=80",  # submit plans the configured layout, which fits; ZeRO's estimators stay unread
        # /feature: planner
    )
    # feature: slurm
    assert imported_by("mlproject.submit", *args, "cluster=slurm", cwd=ROOT) == []
    # /feature: slurm
    # feature: kubernetes
    assert imported_by("mlproject.submit", *args, "cluster=kubernetes", cwd=ROOT) == []
    # /feature: kubernetes


# /feature: slurm, kubernetes
def test_a_short_run_imports_no_optional_library(tmp_path):
    args = ("trainer=cpu", "++trainer.fast_dev_run=true", "test=false", f"paths.log_dir={tmp_path}")
    assert imported_by("mlproject.train", *args, cwd=ROOT) == []


@pytest.mark.parametrize(
    "env, skips",
    [
        ({}, False),  # one process: it checks
        ({"_MLPROJECT_CHECKED_BY_RANK_0": "1"}, True),  # a local rank launch_local_ranks started
        ({"TORCHELASTIC_RUN_ID": "j", "RANK": "0", "GROUP_RANK": "0"}, False),
        ({"TORCHELASTIC_RUN_ID": "j", "RANK": "3", "GROUP_RANK": "0"}, True),  # rank 0's agent stops it
        ({"TORCHELASTIC_RUN_ID": "j", "RANK": "8", "GROUP_RANK": "1"}, False),  # another node's agent would not
        # feature: slurm
        ({"SLURM_PROCID": "5", "SLURM_KILL_BAD_EXIT": "1"}, True),
        ({"SLURM_PROCID": "5"}, False),  # srun without --kill-on-bad-exit: it would wait for a rank 0 that refused
        ({"SLURM_PROCID": "0", "SLURM_KILL_BAD_EXIT": "1"}, False),
        # /feature: slurm
    ],
)
def test_rank_0_checks_for_the_ranks_its_refusal_ends(monkeypatch, env, skips):
    for var in ("_MLPROJECT_CHECKED_BY_RANK_0", "TORCHELASTIC_RUN_ID", "RANK", "GROUP_RANK"):
        monkeypatch.delenv(var, raising=False)
    # feature: slurm
    for var in ("SLURM_PROCID", "SLURM_KILL_BAD_EXIT"):  # SLURM_KILL_BAD_EXIT: in the parametrized env of a case only
        monkeypatch.delenv(var, raising=False)
    # /feature: slurm
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    assert checked_by_rank_0() is skips
