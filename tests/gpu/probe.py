"""Test-only callbacks of the GPU suite, named by `+callbacks.<key>._target_=tests.gpu.probe.<Class>`."""

from __future__ import annotations

import json

import torch
from lightning.pytorch.callbacks import Callback
from torch.nn.modules.batchnorm import _BatchNorm


class BatchNormTypes(Callback):
    """The class names of the model's BatchNorm layers once training starts (after Lightning's
    sync_batchnorm conversion), written by rank 0 as JSON."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_start(self, trainer, pl_module) -> None:
        if trainer.is_global_zero:
            names = sorted({type(m).__name__ for m in pl_module.modules() if isinstance(m, _BatchNorm)})
            with open(self.path, "w") as f:
                json.dump(names, f)


class DeviceLosses(Callback):
    """Every step's training loss, kept on the device until training ends (reading each at once would be a
    host sync per step), then saved by rank 0 as one tensor. `read`: read each at once instead, `.item()`, a
    host sync in every step."""

    def __init__(self, path: str, read: bool = False) -> None:
        self.path, self.read, self.losses = path, read, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"].detach()
        self.losses.append(loss.item() if self.read else loss)

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.is_global_zero:
            torch.save(torch.tensor([float(x) for x in self.losses]), self.path)
