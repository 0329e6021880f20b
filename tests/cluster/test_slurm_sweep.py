"""An Optuna sweep on the local SLURM (conftest.py): each trial its own job, hydra.sweeper.n_jobs at a time."""

from __future__ import annotations

import csv
import re
import subprocess
from collections import defaultdict
from datetime import datetime

import pytest

from mlproject.core.constants import PROJECT_ROOT
from tests.helpers.processes import PYTHON, clean_env, read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

TINY = ["trainer=cpu", "trainer.max_epochs=1", *[f"++trainer.limit_{s}_batches=2" for s in ("train", "val", "test")]]
CPU_JOB = ["cluster.gpus_per_node=0", "cluster.tasks_per_node=1", "cluster.cpus_per_task=1", "cluster.time_min=10"]


def test_four_trials_run_as_slurm_jobs_two_at_a_time(slurm, tmp_path):
    cmd = [PYTHON, "-m", "mlproject.train", f"paths.log_dir={tmp_path}", "hparams_search=digits"]
    cmd += ["cluster=slurm", "hydra/launcher=slurm", "hydra.sweeper.n_trials=4", "hydra.sweeper.n_jobs=2"]
    cmd += ["run_id=slurm", "logger=csv", "extras.print_config=false", *TINY, *CPU_JOB]
    cmd += ["hydra.sweeper.pruner.n_startup_trials=10"]  # no pruning: every trial completes
    proc = subprocess.run(
        cmd, cwd=PROJECT_ROOT, env=clean_env(**slurm.env_extra), capture_output=True, text=True, timeout=540
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    sweep = tmp_path / "train" / "multiruns" / "slurm"

    rows = list(csv.DictReader((sweep / "summary.csv").open()))
    assert [(r["trial"], r["state"]) for r in rows] == [(str(n), "COMPLETE") for n in range(4)]
    for r in rows:  # the value the study holds is the trial's own last val/acc, logged in its own run directory
        (logged,) = (sweep / r["trial"]).rglob("metrics.csv")
        val_acc = [row["val/acc"] for row in csv.DictReader(logged.open()) if row.get("val/acc")]
        assert float(r["value"]) == pytest.approx(float(val_acc[-1]))
        assert read_metrics(sweep / r["trial"])["test/acc"] >= 0  # and it ran its test

    # submitit submits each batch of n_jobs trials as one job array: each array task is its own SLURM job
    arrays = defaultdict(list)
    for p in (sweep / ".submitit").iterdir():
        if m := re.fullmatch(r"(\d+)_(\d+)", p.name):
            arrays[int(m[1])].append(p.name)
    batches = [sorted(arrays[a]) for a in sorted(arrays)]
    assert [len(b) for b in batches] == [2, 2], batches
    first, second = [[(slurm.field(j, "StartTime"), slurm.field(j, "EndTime")) for j in b] for b in batches]
    assert max(s for s, _ in first) <= min(e for _, e in first)  # the two of a batch ran at the same time
    # the next two were submitted once the first two had finished training (their jobs end a little later)
    trained = max((sweep / n / "metrics.json").stat().st_mtime for n in ("0", "1"))
    submitted = {slurm.field(j, "SubmitTime") for j in batches[1]}
    assert min(submitted) >= datetime.fromtimestamp(trained).strftime("%Y-%m-%dT%H:%M:%S"), (submitted, trained)
