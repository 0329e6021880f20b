"""Logger factories where Lightning's constructors need a decision made first."""

from __future__ import annotations

import csv
import netrc
import os
from collections.abc import Mapping

from lightning.pytorch.loggers import CSVLogger as _CSVLogger
from lightning.pytorch.loggers import MLFlowLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.loggers.logger import DummyLogger, rank_zero_experiment
from lightning.pytorch.utilities import rank_zero_only

from mlproject.utils.rank_logging import get_logger, rank

log = get_logger(__name__)


def _wandb_credentials() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (FileNotFoundError, netrc.NetrcParseError):
        return False


def sweep_trial() -> int | None:
    """The trial number inside a Hydra sweep (multirun), else None."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized() or HydraConfig.get().mode.name != "MULTIRUN":
        return None
    return HydraConfig.get().job.num


def wandb_logger(offline: bool | None = None, id: str | None = None, name: str | None = None, **kwargs):
    """A WandbLogger that goes offline (and says so) when there are no credentials.

    The run id comes from the config (task name + run id), so a resumed run continues the same W&B run;
    in a sweep each trial gets its own (`-<trial>` appended), as it gets its own run directory.
    """
    from lightning.pytorch.loggers import WandbLogger

    trial = sweep_trial()
    if trial is not None:
        id, name = f"{id}-{trial}", f"{name}-{trial}"

    if offline is None:
        offline = os.environ.get("WANDB_MODE") in ("offline", "dryrun") or not _wandb_credentials()
        if offline:
            log.info(
                "wandb: no credentials found (WANDB_API_KEY or ~/.netrc), logging offline; "
                "upload later with `wandb sync <run dir>/wandb/offline-run-*`"
            )
    return WandbLogger(offline=offline, resume="allow", id=id, name=name, **kwargs)


def mlflow_logger(
    tracking_uri: str,
    experiment_name: str,
    run_name: str,
    tags: list[str] | tuple[str, ...] = (),
    **kwargs,
):
    """An MLFlowLogger that continues its MLflow run when the training run resumes.

    MLflow makes its own run ids, so the run is found again by its name (task name + run id, `-<trial>` in a
    sweep, as for W&B). The tags are labels, as in W&B. Only rank 0 opens the store: MLflow's client opens
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


def flatten(params: Mapping, prefix: str = "") -> dict:
    """{"a": {"b": 1}} -> {"a/b": 1}, the names Lightning's MLFlowLogger logs nested parameters under."""
    flat = {}
    for key, value in params.items():
        if isinstance(value, Mapping):
            flat |= flatten(value, f"{prefix}{key}/")
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def finish_loggers(loggers) -> None:
    """End the loggers' runs now, not at interpreter exit: the next trial of a sweep runs in this process
    and would otherwise log into this trial's W&B run. Lightning finalized them after fit and test already;
    again here, since the run's outcome (report.log_outcome) came after."""
    from lightning.pytorch.loggers import WandbLogger

    for logger in loggers:
        logger.finalize("success")
        if isinstance(logger, WandbLogger):
            import wandb

            if wandb.run is not None:  # the run the logger started (its `experiment` property would start one)
                wandb.finish()


class CSVLogger(_CSVLogger):
    """Lightning's CSVLogger, except that it appends to a metrics.csv already in the run directory.

    A resumed run keeps its rows (Lightning deletes the file). With strategy=ddp_spawn, fit and test run
    in fresh processes that get the logger as it was before fit: they learn the columns fit wrote from the
    file's header instead of rewriting it with only their own ("dict contains fields not in fieldnames").
    """

    @property
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _AppendingWriter(log_dir=self.log_dir)
        return self._experiment


class _AppendingWriter(ExperimentWriter):
    def _read_header(self) -> None:
        if self._fs.isfile(self.metrics_file_path):
            with self._fs.open(self.metrics_file_path, "r", newline="") as f:
                self.metrics_keys = next(csv.reader(f), [])

    def _check_log_dir_exists(self) -> None:
        self._read_header()  # keep the file, and its columns for the rows to come

    def _record_new_keys(self) -> set[str]:
        if not self.metrics_keys:  # a writer made before another process wrote the file (ddp_spawn)
            self._read_header()
        return super()._record_new_keys()


class SilentLogger(DummyLogger):
    """Lightning's DummyLogger answers every attribute, dunders too, so OmegaConf takes it for an attrs class
    when Hydra merges it into the trainer's arguments; here dunders are missing, as on any object."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return super().__getattr__(name)
