"""configs/logger/csv.yaml: Lightning's CSVLogger, appending to the run's metrics.csv."""

from __future__ import annotations

import csv

from lightning.pytorch.loggers import CSVLogger as _CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.loggers.logger import rank_zero_experiment


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
