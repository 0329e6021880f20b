"""Progress output: a rich bar on a terminal, plain lines in batch jobs (where a bar only fills logs).

Both read the step metrics they show (`train/loss` by default) from `trainer.callback_metrics` when they
draw: the value of the last step that logged them. Logging a step metric with `prog_bar=True` instead makes Lightning
turn it into a Python float on every step: a host-device sync per step on a GPU.
"""

from __future__ import annotations

import sys
import time

from lightning.pytorch.callbacks import ProgressBar, RichProgressBar


def auto_progress_bar(refresh_rate: int = 10, every_n_steps: int = 0, show: tuple[str, ...] = ("train/loss",)):
    if sys.stdout.isatty():
        return RichBar(refresh_rate, show)
    return PlainProgressBar(every_n_steps, show)


def shown_metrics(bar: ProgressBar, trainer, pl_module, show) -> dict:
    metrics = ProgressBar.get_metrics(bar, trainer, pl_module)
    metrics.pop("v_num", None)
    logged = trainer.callback_metrics
    return {**{k: float(logged[k]) for k in show if k in logged}, **metrics}


class RichBar(RichProgressBar):
    """Lightning's rich bar, drawn every `refresh_rate` batches; Lightning's re-reads the metrics and redraws
    on every batch whatever the rate says."""

    def __init__(self, refresh_rate: int, show=("train/loss",), **kwargs):
        super().__init__(refresh_rate=refresh_rate, leave=True, **kwargs)
        self.show = tuple(show)

    def get_metrics(self, trainer, pl_module) -> dict:
        return shown_metrics(self, trainer, pl_module, self.show)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if (batch_idx + 1) % self.refresh_rate == 0 or trainer.is_last_batch:
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)


class PlainProgressBar(ProgressBar):
    """One line per epoch with the progress-bar metrics, plus one every N steps if asked."""

    def __init__(self, every_n_steps: int = 0, show=("train/loss",)):
        super().__init__()
        self.every_n_steps, self.show, self._enabled, self._start = every_n_steps, tuple(show), True, time.monotonic()

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    def _print(self, trainer, pl_module, head: str) -> None:
        metrics = shown_metrics(self, trainer, pl_module, self.show)
        body = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items())
        print(f"{head} step {trainer.global_step} [{time.monotonic() - self._start:.1f}s] {body}", flush=True)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        n = self.every_n_steps
        if self._enabled and n and trainer.global_step % n == 0 and trainer.is_last_batch is False:
            self._print(trainer, pl_module, f"epoch {trainer.current_epoch}")

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if self._enabled:
            self._print(trainer, pl_module, f"epoch {trainer.current_epoch}/{trainer.max_epochs - 1}")
