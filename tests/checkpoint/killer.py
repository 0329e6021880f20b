"""A test-only callback that SIGKILLs its own process: a real, uncatchable kill, no cleanup."""

from __future__ import annotations

import os
import signal

import lightning as L


class KillAt(L.Callback):
    """Kill this process when training is about to run optimizer step `step` (on `rank` only, or every rank)."""

    def __init__(self, step: int, rank: int | None = None):
        self.step, self.rank = step, rank

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step and self.rank in (None, trainer.global_rank):
            os.kill(os.getpid(), signal.SIGKILL)
