"""AdamW with decay on weights only, and a per-step linear-warmup + cosine schedule. Shared by models."""

from __future__ import annotations

import math

import torch
from torch import nn


def adamw(module: nn.Module, lr: float, weight_decay: float = 0.0, betas=(0.9, 0.999)) -> torch.optim.AdamW:
    """Biases and norm scales (1-D tensors) get no weight decay: decaying them only hurts.

    On CUDA the fused kernel (a few launches for the whole model); elsewhere the multi-tensor (foreach)
    one, which torch picks by default only on CUDA. Either computes what the per-parameter loop does."""
    params = [p for p in module.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    cuda = bool(params) and all(p.device.type == "cuda" for p in params)
    return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), fused=cuda or None, foreach=not cuda or None)


def warmup_cosine(optimizer, total_steps: int, warmup_steps: int = 0, min_lr_ratio: float = 0.0):
    """LambdaLR: 0 -> lr linearly over warmup_steps, then cosine down to min_lr_ratio * lr at total_steps."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
