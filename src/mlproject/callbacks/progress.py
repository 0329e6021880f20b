"""Progress output: a rich bar on a terminal, plain lines in batch jobs (where a bar only fills logs)."""

from __future__ import annotations

import sys
import time

from lightning.pytorch.callbacks import ProgressBar, RichProgressBar


def auto_progress_bar(refresh_rate: int = 10, every_n_steps: int = 0) -> ProgressBar:
    if sys.stdout.isatty():
        return RichProgressBar(refresh_rate=refresh_rate, leave=True)
    return PlainProgressBar(every_n_steps)


class PlainProgressBar(ProgressBar):
    """One line per epoch with the progress-bar metrics, plus one every N steps if asked."""

    def __init__(self, every_n_steps: int = 0):
        super().__init__()
        self.every_n_steps, self._enabled, self._start = every_n_steps, True, time.monotonic()

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    def _print(self, trainer, pl_module, head: str) -> None:
        metrics = self.get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)
        body = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items())
        print(f"{head} step {trainer.global_step} [{time.monotonic() - self._start:.1f}s] {body}", flush=True)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        n = self.every_n_steps
        if self._enabled and n and trainer.global_step % n == 0 and trainer.is_last_batch is False:
            self._print(trainer, pl_module, f"epoch {trainer.current_epoch}")

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if self._enabled:
            self._print(trainer, pl_module, f"epoch {trainer.current_epoch}/{trainer.max_epochs - 1}")
