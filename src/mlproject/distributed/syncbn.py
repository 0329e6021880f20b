"""SyncBatchNorm that also runs on CPU, so that `trainer.sync_batchnorm=true` is tested for real in CI.

torch.nn.SyncBatchNorm refuses CPU tensors. On CPU, CPUSyncBatchNorm computes the batch mean and variance
over all ranks with autograd-aware all-reduces over gloo, which gives the same
outputs, gradients and running statistics as one process seeing the whole batch; on GPU it is torch's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.plugins.layer_sync import TorchSyncBatchNorm
from torch import nn

from mlproject.utils import compat
from mlproject.utils.rank_logging import get_logger

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


class CPUSyncBatchNorm(compat.BatchNormBase):
    """BatchNorm whose training statistics cover the global batch, on CPU. Not an nn.SyncBatchNorm subclass:
    DDP refuses those on CPU. Made from the nn.SyncBatchNorm that torch's converter built, by swapping its class
    (same attributes)."""

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {x.dim()}D input)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        synced = self.training and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        if not synced:
            return super().forward(x)
        self._check_input_dim(x)
        dims, shape = [0, *range(2, x.dim())], (1, -1) + (1,) * (x.dim() - 2)
        # Statistics in fp32 whatever the input's dtype (as torch's BatchNorm under bf16): in bf16 the count
        # rounds (1001 -> 1000) and sums of a large batch lose their low bits. Two passes (mean, then squared
        # deviations) keep the variance as exact as one process's.
        xf = x.float()
        count = xf.new_full((1,), x.numel() // x.size(1))  # exact in fp32 up to 2**24 values per channel
        stats = AllReduceSum.apply(torch.cat([xf.sum(dims), count]), None)
        n = stats[-1]
        mean = stats[:-1] / n
        centered = xf - mean.view(shape)
        var = AllReduceSum.apply(centered.square().sum(dims), None) / n
        y = centered * torch.rsqrt(var + self.eps).view(shape)
        if self.affine:
            y = y * self.weight.float().view(shape) + self.bias.float().view(shape)
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                momentum = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
                stored = self.running_mean.dtype  # fp32, or bf16 under trainer.precision=bf16-true
                self.running_mean.lerp_(mean.detach().to(stored), momentum)
                self.running_var.lerp_((var.detach() * n / (n - 1)).to(stored), momentum)  # unbiased, as torch
        return y.to(x.dtype)


def convert_sync_batchnorm(model: nn.Module, cpu: bool) -> tuple[nn.Module, int]:
    """Every BatchNorm layer synchronises over all ranks; returns the count. Both paths build new modules with
    torch's converter (on CPU they then compute as CPUSyncBatchNorm), so a CPU run proves what the GPU's does,
    down to which module objects hold the parameters."""
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    layers = [m for m in model.modules() if isinstance(m, nn.SyncBatchNorm)]
    if cpu:
        for layer in layers:
            layer.__class__ = CPUSyncBatchNorm
    return model, len(layers)


class SyncBatchNormPlugin(TorchSyncBatchNorm):
    """Lightning's `sync_batchnorm=True`, with a CPU path, saying how many layers it converted."""

    def apply(self, model: nn.Module) -> nn.Module:
        trainer = getattr(model, "_trainer", None)
        cpu = trainer is None or isinstance(trainer.accelerator, CPUAccelerator)
        model, converted = convert_sync_batchnorm(model, cpu)
        if converted:
            log.info(f"sync_batchnorm: converted {converted} BatchNorm layer(s) to SyncBatchNorm")
        else:
            log.warning("sync_batchnorm=true but the model has no BatchNorm layer; nothing to synchronise")
        return model

    def revert(self, model: nn.Module) -> nn.Module:
        for layer in model.modules():
            if isinstance(layer, CPUSyncBatchNorm):
                layer.__class__ = nn.SyncBatchNorm  # what the conversion made: Lightning's revert undoes that
        return super().revert(model)
