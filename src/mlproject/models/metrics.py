"""Evaluation metrics as torchmetrics objects: reduced over all ranks by torchmetrics, never averaged
per rank. Padded slots are skipped by their sampler index (the caller passes `valid = idx != PAD`), never
by their target, so N processes report what one would whatever the targets are.

No update syncs the host with the device: the scores skip their input checks (`validate_args`, which
call torch.unique; targets come from our own datamodules), and the loss keeps NaNs (see WeightedMean).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics import MeanMetric, Metric, SumMetric
from torchmetrics.classification import MulticlassAccuracy, MulticlassAUROC, MulticlassF1Score

from mlproject.core.constants import IGNORE_INDEX


class WeightedMean(MeanMetric):
    """The weighted mean of a tensor, NaN included: a diverged model reports a NaN loss, not the mean of the
    finite values. torchmetrics' default nan_strategy drops NaNs after checking for them (a host-device sync
    per update); its "disable" skips the check but, in torchmetrics 1.9, also replaces the weights by ones."""

    def __init__(self):
        super().__init__(nan_strategy="disable")
        self.set_dtype(torch.float64)  # float64 sums: the mean does not depend on how samples were split

    def update(self, value: torch.Tensor, weight: torch.Tensor) -> None:
        self.mean_value += (value * weight).sum().to(self.dtype)
        self.weight += weight.sum().to(self.dtype)


def counter() -> SumMetric:
    return SumMetric(nan_strategy="disable")  # counts are never NaN: no check, no sync


class ClassificationMetrics(nn.Module):
    """acc, macro f1, auroc, the sample-weighted mean loss and the number of samples counted."""

    def __init__(self, num_classes: int):
        super().__init__()
        kw = {"num_classes": num_classes, "ignore_index": IGNORE_INDEX, "validate_args": False}
        self.scores = nn.ModuleDict(
            {
                "acc": MulticlassAccuracy(average="micro", **kw),
                "f1": MulticlassF1Score(average="macro", **kw),
                "auroc": MulticlassAUROC(**kw),
            }
        )
        self.loss, self.samples = WeightedMean(), counter()

    def update(self, logits: torch.Tensor, target: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Accumulate one batch (`valid`: False on padded slots); returns its mean loss over real samples."""
        target = target.masked_fill(~valid, IGNORE_INDEX)  # where torchmetrics' scores skip a slot
        losses = F.cross_entropy(logits.float(), target, ignore_index=IGNORE_INDEX, reduction="none")
        valid = valid.float()
        self.loss.update(losses.double(), valid.double())
        self.samples.update(valid.sum())
        for metric in self.scores.values():
            metric.update(logits, target)
        return (losses * valid).sum() / valid.sum().clamp(min=1)

    def items(self) -> dict[str, Metric]:
        return {**self.scores, "loss": self.loss, "samples": self.samples}


class LanguageModelMetrics(nn.Module):
    """Next-token acc and the token-weighted mean loss over real tokens, and the number of sequences counted."""

    def __init__(self, vocab_size: int):
        super().__init__()
        kw = {"ignore_index": IGNORE_INDEX, "validate_args": False}
        self.acc = MulticlassAccuracy(num_classes=vocab_size, average="micro", **kw)
        self.loss, self.samples = WeightedMean(), counter()

    def update(self, logits: torch.Tensor, target: torch.Tensor, valid: torch.Tensor) -> None:
        """logits (batch, time, vocab), target (batch, time), valid (batch,): False on padded sequences."""
        target = target.masked_fill(~valid[:, None], IGNORE_INDEX)
        logits, flat = logits.flatten(0, 1).float(), target.flatten()
        losses = F.cross_entropy(logits, flat, ignore_index=IGNORE_INDEX, reduction="none")
        self.loss.update(losses.double(), (flat != IGNORE_INDEX).double())
        self.samples.update(valid.sum())
        self.acc.update(logits, flat)

    def items(self) -> dict[str, Metric]:
        return {"acc": self.acc, "loss": self.loss, "samples": self.samples}
