"""A checkpoint or early-stopping monitor must be equal on every rank, or ranks decide differently (one saves,
one does not) and the job hangs in the next collective."""

from __future__ import annotations

import math

import torch
from lightning.pytorch.callbacks import Callback

from mlproject.core.errors import ConfigError


class MonitorsAgree(Callback):
    """At the first validation's end (before any checkpoint decides), one all_gather of the monitored values:
    a value logged from a torchmetrics object, or with `sync_dist=True`, is the same on every rank; a rank's own
    value (a step loss) is not, and stops the run on every rank with one line. Needs nothing from the module."""

    def __init__(self, callbacks: list):
        self.monitors = sorted({m for c in callbacks if (m := getattr(c, "monitor", None))})
        self.checked = False

    def on_validation_end(self, trainer, pl_module) -> None:
        if self.checked or trainer.sanity_checking or trainer.world_size == 1 or not self.monitors:
            return
        self.checked = True
        logged = trainer.callback_metrics
        local = torch.tensor([float(logged.get(m, math.nan)) for m in self.monitors], dtype=torch.float64)
        ranks = trainer.strategy.all_gather(local.to(pl_module.device)).reshape(-1, len(self.monitors)).cpu()
        for monitor, values in zip(self.monitors, ranks.T, strict=True):
            if not (values.isnan().all() or (values == values[0]).all()):
                raise ConfigError(
                    f"a callback monitors '{monitor}', which differs across ranks ({values.tolist()}): monitor a "
                    "metric logged from a torchmetrics object or with self.log(..., sync_dist=True), e.g. val/acc"
                )
