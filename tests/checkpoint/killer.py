"""A test-only callback that SIGKILLs its own process: a real, uncatchable kill, no cleanup."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import lightning as L


class KillAt(L.Callback):
    """Kill this process when optimizer step `step` is about to run (on `rank` only, or on every rank),
    after writing the wall time to `stamp` (if given), so a test can time what happens after the kill."""

    def __init__(self, step: int, rank: int | None = None, stamp: str | None = None):
        self.step, self.rank, self.stamp = step, rank, stamp

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step and self.rank in (None, trainer.global_rank):
            if self.stamp:
                Path(self.stamp).write_text(str(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
