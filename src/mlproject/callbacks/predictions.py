"""Write every test sample's prediction exactly once, in dataset order, whatever the world size."""

from __future__ import annotations

import csv
import os
from pathlib import Path

import torch
from lightning.pytorch.callbacks import BasePredictionWriter


class PredictionWriter(BasePredictionWriter):
    """Gathers `predict_step` outputs (dicts with `idx`, `target`, `pred`) from all ranks into one CSV.

    Every rank holds the same number of rows (evaluation is padded to equal length), so one all_gather
    of fixed-size tensors suffices; padded rows carry idx -1 and are dropped before writing.
    """

    def __init__(self, path: str | Path):
        super().__init__(write_interval="epoch")
        self.path = Path(path)

    def write_on_epoch_end(self, trainer, pl_module, predictions, batch_indices):
        local = {k: torch.cat([p[k] for p in predictions]) for k in predictions[0]}
        gathered = {k: pl_module.all_gather(v).reshape(-1).cpu() for k, v in local.items()}
        if trainer.is_global_zero:
            keep = gathered["idx"] >= 0
            order = gathered["idx"][keep].argsort()
            rows = zip(*(gathered[k][keep][order].tolist() for k in ("idx", "target", "pred")), strict=True)
            tmp = self.path.with_suffix(".tmp")
            with tmp.open("w", newline="") as f:
                writer = csv.writer(f)
                writer.writerow(["id", "label", "pred"])
                writer.writerows(rows)
            os.replace(tmp, self.path)
