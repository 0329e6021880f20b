"""Stall watchdog: when no batch finishes for `timeout` seconds, every rank writes all its threads' stacks.

A hung collective shows as silence: each rank waits in a different place and nothing is printed. The
dumps say where each rank is. faulthandler does the waiting in a C thread, so re-arming it every batch
costs microseconds and it still fires when Python itself is blocked inside a collective.
"""

from __future__ import annotations

import faulthandler
from pathlib import Path

from lightning.pytorch.callbacks import Callback

from mlproject.utils.rank_logging import get_logger

log = get_logger(__name__)


class StallWatchdog(Callback):
    def __init__(self, timeout: float = 300):
        self.timeout = timeout
        self._file = None

    def _arm(self, *_) -> None:
        if self._file is not None:
            faulthandler.dump_traceback_later(self.timeout, repeat=True, file=self._file)

    def _disarm(self, *_) -> None:
        if self._file is not None:
            faulthandler.cancel_dump_traceback_later()
            self._file.close()
            self._file = None

    def on_fit_start(self, trainer, pl_module) -> None:
        path = Path(trainer.default_root_dir) / "stalls" / f"rank{trainer.global_rank}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a")
        log.info(f"stall watchdog: no batch for {self.timeout:g}s writes every rank's stacks to {path.parent}/")
        self._arm()

    on_train_batch_end = on_validation_batch_end = on_train_epoch_start = on_validation_start = _arm
    on_fit_end = on_exception = _disarm
