"""A checkpoint or early-stopping monitor must be logged by the module, and equal on every rank, or ranks decide
differently (one saves, one does not) and the job hangs in the next collective."""

from __future__ import annotations

import math

import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from mlproject.core.errors import ConfigError
from mlproject.utils.rank_logging import get_logger

log = get_logger(__name__)

FALLBACK = "val/loss"  # what a Lightning module logs when it logs anything at validation


class MonitorsAgree(Callback):
    """At the first validation's end (before any checkpoint decides; Lightning runs checkpoint callbacks last):

    - a checkpoint monitor the module does not log (the default val/acc of a module that logs val/loss only) falls
      back to val/loss, min, with a one-line notice: what a Lightning user means by "the best checkpoint" when the
      config's default names a classifier's metric; without val/loss either, one line says what to monitor;
    - one all_gather of the monitored values: a value logged from a torchmetrics object, or with `sync_dist=True`,
      is the same on every rank; a rank's own value (a step loss) is not, and stops the run on every rank with one
      line. Needs nothing from the module."""

    def __init__(self, callbacks: list):
        self.callbacks = callbacks
        self.checked = False

    def on_validation_end(self, trainer, pl_module) -> None:
        if self.checked or trainer.sanity_checking:
            return
        self.checked = True
        logged = trainer.callback_metrics
        for c in self.callbacks:
            if isinstance(c, ModelCheckpoint) and c.monitor and c.monitor not in logged:
                follow_fallback(c, logged, type(pl_module).__name__)
        monitors = sorted({m for c in self.callbacks if (m := getattr(c, "monitor", None))})
        if trainer.world_size == 1 or not monitors:
            return
        local = torch.tensor([float(logged.get(m, math.nan)) for m in monitors], dtype=torch.float64)
        ranks = trainer.strategy.all_gather(local.to(pl_module.device)).reshape(-1, len(monitors)).cpu()
        for monitor, values in zip(monitors, ranks.T, strict=True):
            if not (values.isnan().all() or (values == values[0]).all()):
                raise ConfigError(
                    f"a callback monitors '{monitor}', which differs across ranks ({values.tolist()}): monitor a "
                    "metric logged from a torchmetrics object or with self.log(..., sync_dist=True), e.g. val/acc"
                )


def follow_fallback(checkpoint: ModelCheckpoint, logged: dict, module: str) -> None:
    """Rank by val/loss (min) instead of a monitor the module does not log. A resumed run keeps the scores it
    ranked by val/loss before (the checkpoint's state holds them, not the monitor's name)."""
    if FALLBACK not in logged:
        keys = ", ".join(k for k in logged if k.startswith("val")) or "no val/ metric"
        raise ConfigError(
            f"callbacks.model_checkpoint.monitor={checkpoint.monitor} is not logged by {module} (it logs {keys}); "
            "set callbacks.model_checkpoint.monitor=<a logged metric> and callbacks.model_checkpoint.mode=min|max"
        )
    log.info(f"{module} logs no {checkpoint.monitor}: the best checkpoint is the one with the lowest {FALLBACK}")
    checkpoint.monitor, checkpoint.mode = FALLBACK, "min"
    if not checkpoint.best_k_models:
        checkpoint.kth_value = torch.tensor(torch.inf)  # what ModelCheckpoint starts a min monitor from
