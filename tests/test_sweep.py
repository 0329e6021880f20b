"""Every trial of a sweep is its own run: its own directory, W&B and MLflow runs, finished before the next starts."""

from __future__ import annotations

import re

import pytest

from tests.helpers.processes import run

SHORT = [f"trainer.limit_{s}_batches=2" for s in ("train", "val", "test")]  # hparams_search=optuna implies -m


@pytest.mark.slow
def test_optuna_trials_are_separate_wandb_and_mlflow_runs(tmp_path):
    sweep = ["hparams_search=optuna", "hydra.sweeper.n_trials=2", "logger=many", "run_id=sweep"]
    run("train", *sweep, "trainer=cpu", "trainer.max_epochs=1", *SHORT, "extras.print_config=false", log_dir=tmp_path)
    trials = [tmp_path / "train" / "multiruns" / "sweep" / str(n) for n in (0, 1)]
    logs = [(t / "wandb" / "debug.log").read_text() for t in trials]
    for n, log in enumerate(logs):
        assert f"finishing run mlproject/train-sweep-{n}" in log  # its own id, finished by train()
    finished = re.search(r"^(\S+ \S+) .*finishing run", logs[0], flags=re.M).group(1)
    started = re.match(r"(\S+ \S+)", logs[1]).group(1)
    assert finished < started  # trial 0's run ended before trial 1's began

    from mlflow.tracking import MlflowClient

    runs = []
    for n, trial in enumerate(trials):
        client = MlflowClient(f"sqlite:///{trial}/mlflow/mlflow.db")
        (found,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
        assert found.info.run_name == f"train-sweep-{n}" and found.info.status == "FINISHED"
        runs.append(found.info)
    assert runs[0].end_time <= runs[1].start_time
