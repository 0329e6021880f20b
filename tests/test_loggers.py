"""Every logger gets the same things: the resolved config, the tags, the final test metrics and the best
checkpoint's path. Each is read back with its own reader (e.g. TensorBoard's event files)."""

from __future__ import annotations

import ast
import csv
import functools
import operator
from pathlib import Path

import pytest

from tests.helpers.processes import read_metrics, run

RUN = ["extras.print_config=false", "trainer=cpu", "debug=limit", "trainer.max_epochs=1", "tags=[dev,every]"]
# Keys of the resolved config each logger must hold: top-level, nested, and an interpolation (the run directory)
CONFIG = ("seed", "model.optimizer.lr", "data.batch_size", "paths.output_dir")


def config(hparams: dict, flat: bool) -> dict:
    """CONFIG's values from a logger's hyperparameters, nested (e.g. CSV) or flattened with "/" (TensorBoard)."""
    if flat:
        return {k: hparams[k.replace(".", "/")] for k in CONFIG}
    return {k: functools.reduce(operator.getitem, k.split("."), hparams) for k in CONFIG}


def number_or_text(text: str) -> float | str:
    try:
        return float(text)
    except ValueError:
        return text


def read_csv(run_dir: Path) -> dict:
    from lightning.pytorch.core.saving import load_hparams_from_yaml

    hparams = load_hparams_from_yaml(run_dir / "csv" / "hparams.yaml")
    with open(run_dir / "csv" / "metrics.csv", newline="") as f:
        test_acc = [float(row["test/acc"]) for row in csv.DictReader(f) if row["test/acc"]]
    return {"config": config(hparams, flat=False), "tags": hparams["tags"], "test/acc": test_acc[-1], **best(hparams)}


def read_tensorboard(run_dir: Path) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    (content,) = [c for tag, c in events.PluginTagToContent("hparams").items() if "session_start_info" in tag]
    hparams = HParamsPluginData.FromString(content).session_start_info.hparams  # name -> protobuf Value
    values = {name: getattr(value, value.WhichOneof("kind")) for name, value in hparams.items()}
    return {
        "config": config(values, flat=True),
        "tags": ast.literal_eval(hparams["tags"].string_value),
        "test/acc": events.Scalars("test/acc")[-1].value,
        "best_checkpoint": hparams["best_checkpoint"].string_value,
    }


# feature: wandb
def read_wandb(run_dir: Path) -> dict:
    import json

    from tests.helpers.wandb_records import records

    (path,) = run_dir.glob("wandb/offline-run-*/*.wandb")
    hparams, summary, tags, history = {}, {}, None, {}
    for record in records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            tags = list(record.run.tags)
        elif kind in ("config", "summary"):
            target = hparams if kind == "config" else summary
            target.update({key(u): json.loads(u.value_json) for u in getattr(record, kind).update})
        elif kind == "history":
            history.update({key(i): json.loads(i.value_json) for i in record.history.item})
    return {"config": config(hparams, flat=False), "tags": tags, "test/acc": history["test/acc"], **best(summary)}


def key(item) -> str:
    return item.key or "/".join(item.nested_key)  # W&B sends "test/acc" in either form


# /feature: wandb
# feature: mlflow
def read_mlflow(run_dir: Path) -> dict:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{run_dir}/mlflow/mlflow.db")
    (found,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    data = found.data
    assert found.info.status == "FINISHED"
    return {
        "config": config({k: number_or_text(v) for k, v in data.params.items()}, flat=True),  # strings
        "tags": sorted(k for k, v in data.tags.items() if v == "true"),
        "test/acc": client.get_metric_history(found.info.run_id, "test/acc")[-1].value,
        **best(data.tags),
    }


# /feature: mlflow
def best(where: dict) -> dict:
    return {"best_checkpoint": where.get("best_checkpoint")}


READERS = {"csv": read_csv, "tensorboard": read_tensorboard}
# feature: wandb
READERS["wandb"] = read_wandb
# /feature: wandb
# feature: mlflow
READERS["mlflow"] = read_mlflow
# /feature: mlflow


@pytest.mark.slow
def test_every_logger_gets_config_tags_test_metrics_and_best_checkpoint(tmp_path):
    overrides = ["model.optimizer.lr=0.002", "data.batch_size=32"]  # not the defaults: these reach the loggers
    run("train", *RUN, *overrides, "logger=many", "run_id=every", log_dir=tmp_path)
    run_dir = tmp_path / "debug" / "runs" / "every"
    (best_ckpt,) = (run_dir / "checkpoints").glob("epoch_*.ckpt")
    expected = {
        "config": {"seed": 42, "model.optimizer.lr": 0.002, "data.batch_size": 32, "paths.output_dir": str(run_dir)},
        "tags": ["dev", "every"],
        "test/acc": pytest.approx(read_metrics(run_dir)["test/acc"], abs=1e-6),
        "best_checkpoint": str(best_ckpt),
    }
    assert {name: read(run_dir) for name, read in READERS.items()} == dict.fromkeys(READERS, expected)


# feature: mlflow
@pytest.mark.slow
def test_mlflow_run_continues_when_training_resumes(tmp_path):
    """One MLflow run for the training run, found again by its name after a resume (MLflow makes its own ids)."""
    run("train", *RUN, "logger=mlflow", "run_id=again", log_dir=tmp_path)
    run("train", *RUN, "logger=mlflow", "run_id=again", "ckpt_path=auto", "trainer.max_epochs=2", log_dir=tmp_path)
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path}/debug/runs/again/mlflow/mlflow.db")
    (found,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert found.info.run_name == "debug-again"
    epochs = [m.value for m in client.get_metric_history(found.info.run_id, "epoch")]
    assert {0, 1} <= set(epochs)  # both runs' epochs, in the one MLflow run


@pytest.mark.slow
def test_mlflow_logs_from_rank_zero_only(tmp_path):
    """DDP on 2 processes: one MLflow run, each metric once per step (rank 1 gets a logger that logs nothing,
    and that Hydra can merge into the trainer's arguments: it failed there once)."""
    ddp = ["strategy=ddp", "trainer.devices=2", "trainer.log_every_n_steps=1"]
    run("train", *RUN, *ddp, "logger=mlflow", "run_id=ddp", log_dir=tmp_path)
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path}/debug/runs/ddp/mlflow/mlflow.db")
    (found,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    steps = [m.step for m in client.get_metric_history(found.info.run_id, "train/loss")]
    assert sorted(steps) == sorted(set(steps)) and len(steps) == 5  # debug=limit: 5 steps
    assert len(client.get_metric_history(found.info.run_id, "test/acc")) == 1
    # /feature: mlflow
