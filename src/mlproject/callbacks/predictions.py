"""Write every test sample's prediction exactly once, in dataset order, whatever the world size."""

from __future__ import annotations

import csv
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import BasePredictionWriter


class PredictionWriter(BasePredictionWriter):
    """Gathers `predict_step` outputs (dicts of per-sample tensors, e.g. `target`, `pred`) from all ranks into
    one CSV, `id` being the sample's index in the split.

    Each data-parallel rank predicts its own contiguous block of the split, the blocks in rank order
    (training/loaders.EvalBatches), so the split's order is the ranks' rows one after the other. Ranks hold
    blocks that differ by one row: each pads its rows to the longest for one all_gather, and says how many are
    real; ranks of one tensor-parallel group predict the same block, which is written once.
    """

    def __init__(self, path: str | Path):
        super().__init__(write_interval="epoch")
        self.path = Path(path)

    def write_on_epoch_end(self, trainer, pl_module, predictions, batch_indices):
        local = {k: torch.cat([p[k] for p in predictions]) for k in predictions[0]}
        some = next(iter(local.values()))
        rank = (trainer.distributed_sampler_kwargs or {"rank": 0})["rank"]  # the data-parallel rank
        counts = pl_module.all_gather(some.new_tensor([len(some), rank])).reshape(-1, 2).tolist()
        longest = max(n for n, _ in counts)
        padded = {k: F.pad(v, (0, longest - len(v))) for k, v in local.items()}
        gathered = {k: pl_module.all_gather(v).reshape(-1, longest).cpu() for k, v in padded.items()}
        if trainer.is_global_zero:
            blocks = {}  # data-parallel rank -> (the first world rank that holds its block, its length)
            for world_rank, (n, rank) in enumerate(counts):
                blocks.setdefault(rank, (world_rank, n))
            order = [blocks[rank] for rank in sorted(blocks)]
            columns = {k: torch.cat([v[r, :n] for r, n in order]).tolist() for k, v in gathered.items()}
            rows = zip(range(len(columns["pred"])), columns["target"], columns["pred"], strict=True)
            tmp = self.path.with_suffix(".tmp")
            with tmp.open("w", newline="") as f:
                writer = csv.writer(f)
                writer.writerow(["id", "label", "pred"])
                writer.writerows(rows)
            os.replace(tmp, self.path)
