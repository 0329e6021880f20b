"""The LightningModule for classification: a plain one (Lightning's API only), as a user's own would be.

It takes plain dicts (the model config), so its saved hyperparameters load with
`torch.load(weights_only=True)`; the network itself is any nn.Module named by `net._target_`. Its metrics
are torchmetrics objects logged with `on_epoch=True`: torchmetrics syncs them across ranks, and the
template's evaluation samplers count every sample once, so they are exact on any world size.
"""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from torch import nn
from torchmetrics import MeanMetric, SumMetric
from torchmetrics.classification import MulticlassAccuracy, MulticlassAUROC, MulticlassF1Score

from mlproject.distributed.parallel import parallelize
from mlproject.training.optim import configure


def eval_metrics(num_classes: int) -> nn.ModuleDict:
    """acc, macro f1, auroc, the mean loss and the number of samples counted. No input checks
    (validate_args, nan checks): they call torch.unique or isnan().any(), a host-device sync per step on a GPU;
    a diverged model reports a NaN loss. float64 sums: the mean does not depend on how samples were split."""
    kw = {"num_classes": num_classes, "validate_args": False}
    return nn.ModuleDict(
        {
            "acc": MulticlassAccuracy(average="micro", **kw),
            "f1": MulticlassF1Score(average="macro", **kw),
            "auroc": MulticlassAUROC(**kw),
            "loss": MeanMetric(nan_strategy="disable").set_dtype(torch.float64),
            "samples": SumMetric(nan_strategy="disable"),
        }
    )


class Classifier(L.LightningModule):
    def __init__(self, net: dict, num_classes: int, optimizer: dict, scheduler: dict, compile: bool = False):
        super().__init__()
        self.save_hyperparameters()
        self.net = instantiate(net)
        # the share of samples right, as val/acc
        self.train_acc = MulticlassAccuracy(num_classes=num_classes, average="micro", validate_args=False)
        self.val_metrics, self.test_metrics = eval_metrics(num_classes), eval_metrics(num_classes)

    def configure_model(self):
        # no plan: under fsdp/hsdp the network is one FSDP unit; elsewhere only the compile (the network, never
        # this module; checkpoint keys stay)
        parallelize(self, self.net, compile=self.hparams.compile)

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        self.train_acc.update(logits, y)  # computed (and synced) once per epoch, not per step
        self.log("train/loss", loss)  # this rank's value: no collective, and no sync (see callbacks/progress.py)
        return loss

    def on_train_epoch_end(self):
        self.log("train/acc", self.train_acc)

    def _evaluate(self, batch, stage: str, metrics: nn.ModuleDict) -> None:
        x, y = batch
        logits = self(x)
        for name in ("acc", "f1", "auroc"):
            metrics[name].update(logits, y)
        metrics["loss"].update(F.cross_entropy(logits.float(), y, reduction="none"))
        metrics["samples"].update(len(y))
        for name, metric in metrics.items():
            self.log(f"{stage}/{name}", metric, on_step=False, on_epoch=True, prog_bar=name in ("acc", "loss"))

    def validation_step(self, batch, batch_idx):
        self._evaluate(batch, "val", self.val_metrics)

    def test_step(self, batch, batch_idx):
        self._evaluate(batch, "test", self.test_metrics)

    def predict_step(self, batch, batch_idx):
        x, y = batch
        return {"target": y, "pred": self(x).argmax(-1)}

    def configure_optimizers(self):
        return configure(self, self.hparams.optimizer, self.hparams.scheduler)
