"""The stall watchdog writes the stack of a rank that stops finishing batches, and stays quiet otherwise."""

from __future__ import annotations

import time

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from mlproject.callbacks.watchdog import StallWatchdog


class Stalls(L.LightningModule):
    def __init__(self, stall_at: int, seconds: float):
        super().__init__()
        self.layer, self.stall_at, self.seconds = torch.nn.Linear(2, 1), stall_at, seconds

    def training_step(self, batch, batch_idx):
        if batch_idx == self.stall_at:
            time.sleep(self.seconds)  # stands in for a collective that never returns
        return self.layer(batch[0]).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(tmp_path, stall_at: int) -> str:
    trainer = L.Trainer(
        default_root_dir=tmp_path,
        accelerator="cpu",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        callbacks=[StallWatchdog(timeout=0.3)],
    )
    trainer.fit(Stalls(stall_at, seconds=1.0), DataLoader(TensorDataset(torch.randn(8, 2)), batch_size=2))
    return (tmp_path / "stalls" / "rank0.txt").read_text()


def test_a_stalled_step_dumps_the_stack(tmp_path):
    stacks = fit(tmp_path, stall_at=2)
    assert "training_step" in stacks and "Thread" in stacks


def test_no_dump_while_batches_keep_finishing(tmp_path):
    assert fit(tmp_path, stall_at=-1) == ""
