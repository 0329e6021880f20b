"""A test-only callback: the global training loss of every step and the full final parameters."""

from __future__ import annotations

import torch
from lightning.pytorch import Callback
from torch.distributed.tensor import DTensor


class Recorder(Callback):
    def __init__(self, path: str):
        self.path, self.losses = path, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        # the mean over ranks is the global batch's loss: micro-batches hold equal token counts
        self.losses.append(float(trainer.strategy.reduce(outputs["loss"].detach(), reduce_op="mean")))

    def on_train_end(self, trainer, pl_module) -> None:
        params = {
            name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu().clone()
            for name, p in pl_module.net.named_parameters()
        }
        if trainer.global_rank == 0:
            torch.save({"losses": self.losses, "params": params}, self.path)
