"""SyncBatchNorm that also runs on CPU, so that `trainer.sync_batchnorm=true` is tested for real in CI.

torch.nn.SyncBatchNorm refuses CPU tensors. On CPU this subclass computes the batch mean and variance
over all ranks with autograd-aware all-reduces over gloo (torch.distributed.nn), which gives the same
outputs, gradients and running statistics as one process seeing the whole batch; on GPU it is torch's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from lightning.pytorch.plugins.layer_sync import TorchSyncBatchNorm
from torch import nn

from mlproject.utils.logging import get_logger

log = get_logger(__name__)


class AllReduceSum(torch.autograd.Function):
    """Sum over ranks, differentiable: each rank's input gradient is the sum of every rank's output gradient.
    (torch.distributed.nn.functional.all_reduce does this too but is deprecated.)"""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class SyncBatchNorm(nn.SyncBatchNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu":
            return super().forward(x)
        group = self.process_group or (dist.group.WORLD if dist.is_available() and dist.is_initialized() else None)
        if not (self.training and group is not None and dist.get_world_size(group) > 1):
            return nn.modules.batchnorm._BatchNorm.forward(self, x)  # torch's would raise on CPU
        self._check_input_dim(x)
        dims, shape = [0, *range(2, x.dim())], (1, -1) + (1,) * (x.dim() - 2)
        # Two passes (mean, then squared deviations) keep the variance as exact as one process's.
        count = x.new_full((1,), x.numel() // x.size(1))
        stats = AllReduceSum.apply(torch.cat([x.sum(dims), count]), group)
        n = stats[-1]
        mean = stats[:-1] / n
        centered = x - mean.view(shape)
        var = AllReduceSum.apply(centered.square().sum(dims), group) / n
        y = centered * torch.rsqrt(var + self.eps).view(shape)
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                momentum = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
                self.running_mean.lerp_(mean.detach(), momentum)
                self.running_var.lerp_(var.detach() * n / (n - 1), momentum)  # unbiased, as torch stores it
        return y


def convert_sync_batchnorm(model: nn.Module) -> tuple[nn.Module, int]:
    """Every BatchNorm layer becomes a SyncBatchNorm (this module's); returns the model and the count."""
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    converted = 0
    for module in model.modules():
        if type(module) is nn.SyncBatchNorm:
            module.__class__ = SyncBatchNorm  # torch's converter hard-codes its class; ours adds only forward
            converted += 1
    return model, converted


class SyncBatchNormPlugin(TorchSyncBatchNorm):
    """Lightning's `sync_batchnorm=True` with the SyncBatchNorm above, saying how many layers it converted."""

    def apply(self, model: nn.Module) -> nn.Module:
        model, converted = convert_sync_batchnorm(model)
        if converted:
            log.info(f"sync_batchnorm: converted {converted} BatchNorm layer(s) to SyncBatchNorm")
        else:
            log.warning("sync_batchnorm=true but the model has no BatchNorm layer; nothing to synchronise")
        return model
