"""The 8x8 handwritten digits that ship with scikit-learn: 1,797 images, 10 classes, no download."""

from __future__ import annotations

import torch
from torch.utils.data import Subset, TensorDataset

from mlproject.core.errors import ConfigError
from mlproject.data.labels import check_labels
from mlproject.training.datamodule import DataModule


class DigitsDataModule(DataModule):
    def __init__(
        self,
        batch_size: int = 64,
        val_size: int = 200,
        test_size: int = 360,
        split_seed: int = 0,
        num_workers: int = 0,
        pin_memory: bool = False,
        folds: int | None = None,
        fold: int = 0,
    ):
        super().__init__(batch_size, num_workers, pin_memory, folds, fold)
        self.save_hyperparameters()

    def splits(self):
        from sklearn.datasets import load_digits

        images, labels = load_digits(return_X_y=True)
        x = torch.tensor(images, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0  # pixels are 0..16
        y = torch.tensor(labels, dtype=torch.long)
        check_labels(self, int(y.max()), "the digits' labels")
        data, hp = TensorDataset(x, y), self.hparams
        if hp.val_size + hp.test_size >= len(data):
            raise ConfigError(
                f"data.val_size + data.test_size = {hp.val_size + hp.test_size} leaves no training data "
                f"out of {len(data)} samples; make them smaller"
            )
        order = torch.randperm(len(data), generator=torch.Generator().manual_seed(hp.split_seed)).tolist()
        n_test, n_held = hp.test_size, hp.test_size + hp.val_size
        return Subset(data, order[n_held:]), Subset(data, order[n_test:n_held]), Subset(data, order[:n_test])
