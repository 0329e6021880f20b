"""Test-only callback: the global training loss of every step and the final weights, saved by rank 0;
optionally also the final checkpoint (every rank: `last.ckpt` in the run directory)."""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback


class RecordSteps(Callback):
    def __init__(self, checkpoint: bool = False) -> None:
        self.losses: list[float] = []
        self.checkpoint = checkpoint

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        # The mean over ranks of each rank's mean loss = the loss of the whole global batch.
        self.losses.append(float(trainer.strategy.reduce(outputs["loss"].detach(), reduce_op="mean")))

    def on_train_end(self, trainer, pl_module) -> None:
        if self.checkpoint:
            trainer.save_checkpoint(Path(trainer.default_root_dir) / "last.ckpt")
        params = list(pl_module.parameters())
        gather = nullcontext()
        if any(hasattr(p, "ds_id") for p in params):  # ZeRO-3 holds a shard per rank: gather the full tensors
            import deepspeed

            gather = deepspeed.zero.GatheredParameters(params)
        with gather:
            state = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
        if trainer.is_global_zero:
            torch.save({"losses": self.losses, "state": state}, Path(trainer.default_root_dir) / "steps.pt")
