"""The short path for data: subclass `DataModule`, return the train, val and test datasets from `splits()`.

`batch_size` is global (per optimizer step, over all devices and accumulation steps), where a plain
LightningDataModule's DataLoaders set it per device. The loaders it returns are plain DataLoaders; the
template gives them its samplers like any datamodule's (training/loaders.py).
"""

from __future__ import annotations

import lightning as L
import numpy as np
from lightning.pytorch.trainer.states import TrainerFn
from torch.utils.data import ConcatDataset, DataLoader, Dataset, Subset

from mlproject.core.errors import ConfigError
from mlproject.core.topology import per_device_batch_size
from mlproject.training.loaders import data_parallel


class DataModule(L.LightningDataModule):
    """Base datamodule. `batch_size` is global: each device gets batch_size / (world x accumulation)."""

    def __init__(
        self, batch_size: int, num_workers: int = 0, pin_memory: bool = False, folds: int | None = None, fold: int = 0
    ):
        super().__init__()
        self.batch_size, self.num_workers, self.pin_memory = batch_size, num_workers, pin_memory
        if folds is not None and not (folds >= 2 and 0 <= fold < folds):
            raise ConfigError(f"data.folds={folds} data.fold={fold}: use folds >= 2 and 0 <= fold < folds")
        self.folds, self.fold = folds, fold  # k-fold cross-validation over train + val (see `setup`)
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None
        self.test_set: Dataset | None = None

    def splits(self) -> tuple[Dataset, Dataset, Dataset]:
        """The train, val and test datasets of `(x, y)` pairs: what a subclass provides."""
        raise NotImplementedError

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is None:  # Lightning calls setup once per stage: build the splits once
            self.train_set, self.val_set, self.test_set = self.splits()
            if self.folds:
                self.train_set, self.val_set = self.split_fold(self.train_set, self.val_set)

    def split_fold(self, train: Dataset, val: Dataset) -> tuple[Dataset, Dataset]:
        """The train and val sets of fold `self.fold`: train + val pooled and cut (`fold_split`). A subclass
        whose train and val differ in more than their samples (augmentation) or whose samples are ordered
        (text) overrides it."""
        return fold_split(train, val, self.folds, self.fold)

    @property
    def per_device_batch_size(self) -> int:
        """Exact while fitting; rounded up for evaluation alone (its batches may differ by one per rank)."""
        trainer, accumulate = self.trainer, self.trainer.accumulate_grad_batches if self.trainer else 1
        fitting = trainer is None or trainer.state.fn == TrainerFn.FITTING
        return per_device_batch_size(self.batch_size, data_parallel(trainer)[0], accumulate, exact=fitting)

    def _loader(self, dataset: Dataset, train: bool = False) -> DataLoader:
        return DataLoader(
            dataset,
            batch_size=self.per_device_batch_size,
            shuffle=train,
            drop_last=train,  # every rank's micro-batch the same size
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            persistent_workers=self.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, train=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.test_set)

    def predict_dataloader(self) -> DataLoader:
        return self.test_dataloader()


def fold_indices(n: int, folds: int, fold: int, shuffle: bool = True) -> tuple[list[int], list[int]]:
    """(train, val) indices of fold `fold` of `n` samples: shuffled once (a fixed seed: the same on every rank,
    run and fold), or in order for samples whose neighbours are related, then cut into `folds` near-equal
    parts; part `fold` validates, the others train."""
    order = np.random.default_rng(0).permutation(n) if shuffle else np.arange(n)
    parts = np.array_split(order, folds)
    return np.concatenate([p for i, p in enumerate(parts) if i != fold]).tolist(), parts[fold].tolist()


def fold_split(train: Dataset, val: Dataset, folds: int, fold: int, shuffle: bool = True) -> tuple[Dataset, Dataset]:
    """Fold `fold` of k-fold cross-validation over train + val (`fold_indices`), as two subsets of the pool."""
    pool = ConcatDataset([train, val])
    keep, held = fold_indices(len(pool), folds, fold, shuffle)
    return Subset(pool, keep), Subset(pool, held)
