"""The LightningModule for next-token prediction with the GPT of models/components/gpt.py.

Like the Classifier it takes plain dicts. The config's `parallel` plan, which says how the model-parallel
strategies (fsdp, hsdp, ...) split the network, goes to the strategy, not here (distributed/parallel.py);
`compile` compiles the network (never this module), per block where it is sharded. With mixture-of-experts
MLPs (model=gpt_moe), `aux_loss_weights` weighs the routers' auxiliary losses (summed over layers) into the
training loss, and each expert's share of the routed tokens is logged per layer
(train/moe/load/layer<i>/expert<e>, over the global batch).
"""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from torch import nn
from torchmetrics import MeanMetric, SumMetric
from torchmetrics.classification import MulticlassAccuracy

from mlproject.core.constants import IGNORE_INDEX
from mlproject.distributed.parallel import parallelize
from mlproject.training.optim import configure


def next_token_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE_INDEX)


def eval_metrics(vocab_size: int) -> nn.ModuleDict:
    """Next-token acc, the mean loss over tokens and the number of sequences counted; no input checks (a
    host-device sync per step on a GPU), float64 sums (the mean does not depend on how samples were split)."""
    return nn.ModuleDict(
        {
            "acc": MulticlassAccuracy(num_classes=vocab_size, average="micro", validate_args=False),
            "loss": MeanMetric(nan_strategy="disable").set_dtype(torch.float64),
            "samples": SumMetric(nan_strategy="disable"),
        }
    )


class GPTModule(L.LightningModule):
    def __init__(
        self,
        net: dict,
        optimizer: dict,
        scheduler: dict,
        compile: bool = False,
        aux_loss_weights: dict | None = None,
    ):
        super().__init__()
        self.save_hyperparameters()
        self.net = instantiate(net)
        # feature: pipeline
        self.pipeline = None  # distributed/pipeline.py's Pipeline, set by parallelize under pipeline parallelism
        # /feature: pipeline
        self.val_metrics, self.test_metrics = eval_metrics(net["vocab_size"]), eval_metrics(net["vocab_size"])

    @property
    def flops_per_token(self) -> int:
        """Training FLOPs per token: optional, callbacks/throughput.py reports perf/mfu where a module has it."""
        return self.net.flops_per_token()

    def configure_model(self):
        parallelize(self, self.net, compile=self.hparams.compile, loss_fn=next_token_loss)  # by model.parallel

    def forward(self, x):
        # feature: pipeline
        if self.pipeline is not None:  # the logits on the last stage
            return self.pipeline(x)
        # /feature: pipeline
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        # feature: pipeline
        if self.pipeline is not None:
            loss = self.pipeline.step(x, y)  # forward and backward of every micro-batch; see backward()
            self.log("train/loss", loss)
            return loss
        # /feature: pipeline
        loss = next_token_loss(self(x), y)
        self.log("train/loss", loss)  # this rank's value: no collective, and no sync (see callbacks/progress.py)
        return loss + self._router_losses()

    # feature: pipeline
    # A pipeline schedule runs the backward of each micro-batch itself, interleaved with the forwards of others,
    # inside training_step (which starts from zeroed gradients); the loss returned is for logging only. So under
    # a pipeline Lightning's backward is skipped, and so is its zero_grad, which runs between training_step and
    # backward. Automatic optimization stays otherwise as it is (clipping, optimizer and LR steps, callbacks):
    # pipeline parallelism changes nothing else about a run.
    def backward(self, loss, *args, **kwargs):
        if self.pipeline is None:
            super().backward(loss, *args, **kwargs)

    def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
        if self.pipeline is None:
            super().optimizer_zero_grad(epoch, batch_idx, optimizer)

    # /feature: pipeline
    def _router_losses(self):
        moe = self.net.moe_layers
        if not moe:
            return 0.0
        total = 0.0
        for name, weight in (self.hparams.aux_loss_weights or {}).items():
            value = sum(layer.stats[name] for layer in moe)
            self.log(f"train/moe/{name}", value)
            total = total + weight * value
        loads = {
            f"train/moe/load/layer{i}/expert{e}": share
            for i, layer in enumerate(moe)
            for e, share in enumerate(layer.stats["load"])
        }
        self.log_dict(loads)  # the same on every rank: counted over the global batch
        return total

    def _evaluate(self, batch, stage: str, metrics: nn.ModuleDict) -> None:
        x, y = batch
        logits = self(x)
        # feature: pipeline
        if self.pipeline is not None and not self.pipeline.last:  # no sequence counted, so all ranks sync the same
            logits, y = torch.zeros(0, y.size(1), self.hparams.net["vocab_size"], device=y.device), y[:0]
        # /feature: pipeline
        logits, flat = logits.flatten(0, 1).float(), y.flatten()
        if len(flat):  # torchmetrics' accuracy cannot reshape an empty batch (the pipeline's other stages)
            metrics["acc"].update(logits, flat)
        metrics["loss"].update(F.cross_entropy(logits, flat, reduction="none"))
        metrics["samples"].update(len(y))
        for name, metric in metrics.items():
            self.log(f"{stage}/{name}", metric, on_step=False, on_epoch=True, prog_bar=name == "loss")

    def validation_step(self, batch, batch_idx):
        self._evaluate(batch, "val", self.val_metrics)

    def test_step(self, batch, batch_idx):
        self._evaluate(batch, "test", self.test_metrics)

    def configure_optimizers(self):
        return configure(self, self.hparams.optimizer, self.hparams.scheduler)
