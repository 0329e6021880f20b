"""The LightningModule for classification: training step, exact evaluation, optimizer and schedule.

It takes plain dicts (the model config), so its saved hyperparameters load with
`torch.load(weights_only=True)`; the network itself is any nn.Module named by `net._target_`.
"""

from __future__ import annotations

import lightning as L
import torch.nn.functional as F
from hydra.utils import instantiate
from torchmetrics.classification import MulticlassAccuracy

from mlproject.core.constants import PAD
from mlproject.distributed.parallel import parallelize
from mlproject.models.metrics import ClassificationMetrics
from mlproject.models.optim import configure


class Classifier(L.LightningModule):
    def __init__(self, net: dict, num_classes: int, optimizer: dict, scheduler: dict, compile: bool = False):
        super().__init__()
        self.save_hyperparameters()
        self.net = instantiate(net)
        # the share of samples right, as val/acc; no input checks per training step: they call torch.unique, a
        # host-device sync on a GPU
        self.train_acc = MulticlassAccuracy(num_classes=num_classes, average="micro", validate_args=False)
        self.val_metrics = ClassificationMetrics(num_classes)
        self.test_metrics = ClassificationMetrics(num_classes)

    @property
    def synced_metrics(self) -> set[str]:
        """Metrics reduced by torchmetrics, equal on every rank: the only ones safe to monitor."""
        return {"train/acc"} | {f"{stage}/{name}" for stage in ("val", "test") for name in self.val_metrics.items()}

    def configure_model(self):
        # no plan: under fsdp/hsdp the network is one FSDP unit; elsewhere only the compile (the network, never
        # this module; checkpoint keys stay)
        parallelize(self, self.net, compile=self.hparams.compile)

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y, _ = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        self.train_acc.update(logits, y)  # computed (and synced) once per epoch, not per step
        self.log("train/loss", loss)  # this rank's value: no collective, and no sync (see callbacks/progress.py)
        return loss

    def on_train_epoch_end(self):
        # once per epoch, not per step: every self.log call moves Lightning's copy of the value to the device
        self.log("train/acc", self.train_acc)

    def _evaluate(self, batch, stage: str, metrics: ClassificationMetrics) -> None:
        x, y, idx = batch
        metrics.update(self(x), y, idx != PAD)
        for name, metric in metrics.items().items():
            self.log(f"{stage}/{name}", metric, on_step=False, on_epoch=True, prog_bar=name in ("acc", "loss"))

    def validation_step(self, batch, batch_idx):
        self._evaluate(batch, "val", self.val_metrics)

    def test_step(self, batch, batch_idx):
        self._evaluate(batch, "test", self.test_metrics)

    def predict_step(self, batch, batch_idx):
        x, y, idx = batch
        return {"idx": idx, "target": y, "pred": self(x).argmax(-1)}

    def configure_optimizers(self):
        return configure(self, self.hparams.optimizer, self.hparams.scheduler)
