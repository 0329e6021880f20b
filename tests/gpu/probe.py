"""Test-only callback: the class names of the model's BatchNorm layers once training starts (after
Lightning's sync_batchnorm conversion), written by rank 0 as JSON."""

from __future__ import annotations

import json

from lightning.pytorch.callbacks import Callback
from torch.nn.modules.batchnorm import _BatchNorm


class BatchNormTypes(Callback):
    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_start(self, trainer, pl_module) -> None:
        if trainer.is_global_zero:
            names = sorted({type(m).__name__ for m in pl_module.modules() if isinstance(m, _BatchNorm)})
            with open(self.path, "w") as f:
                json.dump(names, f)
