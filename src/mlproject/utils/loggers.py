"""Logger factories where Lightning's constructors need a decision made first."""

from __future__ import annotations

import csv
import netrc
import os

from lightning.pytorch.loggers import CSVLogger as _CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.loggers.logger import rank_zero_experiment

from mlproject.utils.rank_logging import get_logger

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


def finish_loggers(loggers) -> None:
    """End the loggers' runs now, not at interpreter exit: the next trial of a sweep runs in this process
    and would otherwise log into this trial's W&B run."""
    from lightning.pytorch.loggers import WandbLogger

    for logger in loggers:
        if isinstance(logger, WandbLogger) and logger._experiment is not None:
            logger._experiment.finish()


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
