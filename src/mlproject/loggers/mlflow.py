"""configs/logger/mlflow.yaml: MLflow, its run continued when the training run resumes."""

from __future__ import annotations

import os
from collections.abc import Mapping

from lightning.pytorch.loggers import MLFlowLogger
from lightning.pytorch.loggers.logger import DummyLogger
from lightning.pytorch.utilities import rank_zero_only

from mlproject.loggers import sweep_trial
from mlproject.utils.rank_logging import rank


def mlflow_logger(
    tracking_uri: str,
    experiment_name: str,
    run_name: str,
    tags: list[str] | tuple[str, ...] = (),
    **kwargs,
):
    """An MLFlowLogger that continues its MLflow run when the training run resumes.

    MLflow makes its own run ids, so the run is found again by its name (task name + run id, `-<trial>` in a
    sweep). The tags are labels (`<tag>=true`). Only rank 0 opens the store: MLflow's client opens
    it when made (a new SQLite store is created then, which ranks racing each other would break); the other
    ranks get a logger that logs nothing, as Lightning's loggers do there.
    """
    from mlflow.tracking import MlflowClient

    if rank() != 0:
        return SilentLogger()
    trial = sweep_trial()
    if trial is not None:
        run_name = f"{run_name}-{trial}"
    if tracking_uri.startswith("sqlite:///"):
        os.makedirs(os.path.dirname(tracking_uri.removeprefix("sqlite:///")), exist_ok=True)
    client = MlflowClient(tracking_uri)
    experiment = client.get_experiment_by_name(experiment_name)
    runs = experiment and client.search_runs(
        [experiment.experiment_id], filter_string=f"attributes.run_name = '{run_name}'", max_results=1
    )
    return ResumingMLFlowLogger(
        tracking_uri=tracking_uri,
        experiment_name=experiment_name,
        run_name=run_name,
        run_id=runs[0].info.run_id if runs else None,  # None: a new run
        tags={tag: "true" for tag in tags},
        **kwargs,
    )


class ResumingMLFlowLogger(MLFlowLogger):
    """Lightning's MLFlowLogger, keeping the parameters a resumed run logged first."""

    @rank_zero_only
    def log_hyperparams(self, params) -> None:
        # MLflow refuses to change a logged parameter: a resumed run keeps its first values (the resumed
        # config, ckpt_path=auto and all, is in the run directory).
        params = flatten(params if isinstance(params, Mapping) else vars(params))  # a dict or a Namespace
        logged = self.experiment.get_run(self.run_id).data.params
        super().log_hyperparams({k: v for k, v in params.items() if k not in logged})

    def log_outcome(self, best: dict) -> None:
        for key, value in best.items():  # tags, not parameters: a resumed run's best moves
            self.experiment.set_tag(self.run_id, key, value)


def flatten(params: Mapping, prefix: str = "") -> dict:
    """{"a": {"b": 1}} -> {"a/b": 1}, the names Lightning's MLFlowLogger logs nested parameters under."""
    flat = {}
    for key, value in params.items():
        if isinstance(value, Mapping):
            flat |= flatten(value, f"{prefix}{key}/")
        else:
            flat[f"{prefix}{key}"] = value
    return flat


class SilentLogger(DummyLogger):
    """Lightning's DummyLogger answers every attribute, dunders too, so OmegaConf takes it for an attrs class
    when Hydra merges it into the trainer's arguments; here dunders are missing, as on any object."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return super().__getattr__(name)
