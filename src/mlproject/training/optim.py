"""AdamW with decay on weights only at an LR scaled to the effective batch, and a linear-warmup + cosine
schedule per optimizer step. Shared by models."""

from __future__ import annotations

import math

import torch
from torch import nn

from mlproject.core.errors import ConfigError
from mlproject.utils.rank_logging import get_logger

log = get_logger(__name__)


def adamw(module: nn.Module, lr: float, weight_decay: float = 0.0, betas=(0.9, 0.999)) -> torch.optim.AdamW:
    """Biases and norm scales (1-D tensors) get no weight decay: decaying them only hurts.

    On CUDA the fused kernel (a few launches for the whole model), unless Lightning would refuse to clip its
    gradients; elsewhere the multi-tensor (foreach) one, which torch picks by default only on CUDA. Either
    computes what the per-parameter loop does. Both need one tensor type: tensor parallelism leaves embeddings
    and norms plain tensors beside its DTensors, so such a mix takes the per-parameter loop."""
    from torch.distributed.tensor import DTensor

    params = [p for p in module.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    cuda = bool(params) and all(p.device.type == "cuda" for p in params) and not clips_mixed_precision(module)
    if len({isinstance(p, DTensor) for p in params}) > 1:
        return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), foreach=False)
    return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), fused=cuda or None, foreach=not cuda or None)


def clips_mixed_precision(module: nn.Module) -> bool:
    """Lightning's mixed-precision plugin refuses to clip a fused optimizer's gradients (under 16-mixed it unscales
    them itself; under bf16-mixed nothing is scaled, but the check does not tell the two apart): such a run keeps the
    multi-tensor kernel."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    trainer = getattr(module, "_trainer", None)
    return bool(trainer and trainer.gradient_clip_val and isinstance(trainer.precision_plugin, MixedPrecision))


def warmup_cosine(optimizer, total_steps: int, warmup_steps: int = 0, min_lr_ratio: float = 0.0):
    """LambdaLR: 0 -> lr linearly over warmup_steps, then cosine down to min_lr_ratio * lr at total_steps."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def scaled_lr(lr: float, batch_size: int, lr_scaling: str = "none", base_batch_size: int | None = None) -> float:
    """The peak LR for an effective batch of `batch_size`, given `lr` tuned at `base_batch_size`.

    linear: lr x batch/base (Goyal et al., SGD and Adam up to ~512); sqrt: lr x sqrt(batch/base) (Adam at
    larger batches, Malladi et al.); none: lr as given. Past a few thousand, keep the LR and lengthen warmup.
    """
    if lr_scaling == "none":
        return lr
    if lr_scaling not in ("linear", "sqrt") or not base_batch_size:
        raise ConfigError(
            f"model.optimizer.lr_scaling={lr_scaling} with base_batch_size={base_batch_size}: use none, or linear "
            "or sqrt with model.optimizer.base_batch_size set to the batch size the lr was tuned for"
        )
    ratio = batch_size / base_batch_size
    return lr * (ratio if lr_scaling == "linear" else math.sqrt(ratio))


def effective_batch(trainer) -> tuple[int, str]:
    """Samples per optimizer step, and how: micro-batch x data-parallel ranks x accumulation (ask after
    trainer.estimated_stepping_batches, which loads the train dataloader)."""
    loader = trainer.train_dataloader
    micro = loader.batch_size or loader.batch_sampler.batch_size  # overfit_batches rebuilds it with a batch sampler
    replicas = (trainer.distributed_sampler_kwargs or {}).get("num_replicas", 1)  # data-parallel: not TP ranks
    accumulate = trainer.accumulate_grad_batches
    return micro * replicas * accumulate, f"{micro} per device x {replicas} data-parallel rank(s) x {accumulate}"


def configure(module, optimizer: dict, scheduler: dict) -> dict:
    """configure_optimizers of both models: AdamW at the LR scaled to the effective batch, and warmup-cosine
    stepped once per optimizer step (not per micro-batch); warmup_fraction, if set, is a share of all of them."""
    total = int(module.trainer.estimated_stepping_batches)  # optimizer steps: accumulation is counted
    batch, how = effective_batch(module.trainer)
    optimizer = dict(optimizer)
    rule, base = optimizer.pop("lr_scaling", "none"), optimizer.pop("base_batch_size", None)
    base_lr = optimizer.pop("lr")
    lr = scaled_lr(base_lr, batch, rule, base)
    scheduler = dict(scheduler)
    fraction = scheduler.pop("warmup_fraction", None)
    if fraction is not None:
        scheduler["warmup_steps"] = round(fraction * total)
    rule_text = "" if rule == "none" else f" = {base_lr} x {'' if rule == 'linear' else 'sqrt'}({batch}/{base})"
    log.info(
        f"effective batch {batch} ({how} accumulation); lr {lr:.6g}{rule_text}; "
        f"warmup {scheduler.get('warmup_steps', 0)} of {total} optimizer steps"
    )
    opt = adamw(module, lr, **optimizer)
    return {"optimizer": opt, "lr_scheduler": {"scheduler": warmup_cosine(opt, total, **scheduler), "interval": "step"}}
